"""Pipelined inputs on the worker: the values a call resolves in its worker process, not in the controller.

When a :class:`~asyncrl.GroupFuture` is passed into another group's call, the
controller sends a small descriptor (the markers of :mod:`asyncrl._wire`) holding the
producer's per-rank ObjectRefs or its place in the process; the worker that receives it
takes the value here. Three ways (the controller chooses: ``asyncrl._call.Inputs``):

* *nested* (:class:`~asyncrl._wire.DeferredShard`, :class:`~asyncrl._wire.DeferredValue`):
  the refs ride inside the call's pickled :class:`~asyncrl._wire.Payload`; the host fetches
  them itself, through their owner (the controller): an async host while the call waits for
  its turn, a threaded host on its pinned thread at the call's turn (pinned-thread of
  docs/protocol.md). Any producer outcome (a value, the producer's error, a dead producer, a
  lost object) reaches the host, which names the producer in an
  :class:`~asyncrl.UpstreamError` and releases the call's number.
* *top level* (:class:`~asyncrl._wire.TopShard`): on the Ray backend, a matched-layout shard
  (consumer rank r reads exactly producer rank r's output) of a producer the controller
  **knows finished successfully** goes as two top-level Ray arguments of the host's call (the
  shard and its ``(rows, pad)`` metadata); the payload holds only their indices. Ray
  resolves top-level arguments itself (a small finished value is inlined into the task,
  a larger one is read from the local object store before the task starts): the
  ``.remote()`` takes Ray's fast path (no nested refs to account for) and the host needs
  no fetch and no hand-off to its event loop. The whole value of a known-ok call to one rank
  (``options(rank=r)``: a streaming group's generate call), passed into a data-parallel call
  (an item of its per-rank list: ``concat_shard``), goes the same way
  (:class:`~asyncrl._wire.TopValue`: its output and ``(rows, pad)``, the padding stripped and the
  producer's collect applied on the host, as the nested path does).
* *local* (:class:`~asyncrl._wire.LocalShard`): a matched-layout shard of a producer that
  was an **ordered** call on the consumer rank's **own worker process** (colocated roles
  share one), consumed by an ordered call there. The data would otherwise go worker →
  controller → the same worker; instead the payload carries a marker of plain scalars
  (the producer's call id and number, its name, the field selection: Ray's msgpack fast
  path, no refs, no dependency wait at submission) and the host hands the consumer the
  producer's result from its own memory when the consumer's turn comes (the producer ran
  earlier in the same lane). Each host retains the outcomes of its process's last
  ``local_results`` ordered numbers (a window that moves with the lane, so nothing is
  ever released by message); the controller, which numbers the calls, uses the marker
  only when the producer's number is within that window of the consumer's, and so
  provably still retained at the consumer's turn (:meth:`asyncrl._lanes.Lane.outcome`);
  otherwise the input takes one of the two paths above, unchanged. The consumer gets a
  shallow copy of the producer's container (a TensorDict, dict or list: its own keys);
  tensor storage is shared, as with Ray's zero-copy read-only views (inputs are
  read-only). A failed, cancelled or never-run producer gives the consumer the same
  :class:`~asyncrl.UpstreamError` as the nested path.

Why only known-finished producers go top-level: Ray holds a call whose top-level argument
is still being produced, and with it every later call of the controller to that actor, in
every concurrency group (cancel messages included); and it fails a task whose top-level
argument is an error *before* the host method runs, so an async host would never see the
call's number and every later ordered call on that process would wait for it (a lane gap).
What the controller knows (see ``_Call.ok`` in :mod:`asyncrl._call`): a call it
awaited successfully, or one all of whose collected results were read by a consumer
call that then succeeded (through Ray, or handed over in the producer's process: the
consumer got the value, so the producer's host finished it). Such an input can still
fail before the host runs when its object is lost after it was read (its node died),
when Ray could not store it (a result it cannot serialize, which a consumer in the
producer's own process never noticed), or when it cannot be unpickled on the
consumer's worker; the Ray backend observes every call sent so to an async host and
releases the number of one that failed so (the one cancel message, cancelled-before-arrival of
docs/protocol.md; a threaded host waits for no number: one-thread-group-order), and the
call's future fails with an ``UpstreamError`` naming the producer.
"""

from __future__ import annotations

import asyncio
import traceback
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from asyncrl import batch as B
from asyncrl._backend import public_error
from asyncrl._lanes import shallow
from asyncrl._wire import (CallCancelled, DeferredShard, DeferredValue, LocalShard, Source, TopShard, TopValue,
                           select_fields)
from asyncrl.errors import AsyncRLError, CallCancelledError, DispatchError, RemoteError, UpstreamError

if TYPE_CHECKING:
    from asyncrl._lanes import Lane, Ticket


def take_local(x: LocalShard, result: Any, meta: tuple[int, int]) -> tuple[Any, int]:
    """A :class:`LocalShard`'s ``(shard, trailing padding rows in it)`` from the
    producer's retained result and its ``(rows, pad)``."""
    value = select_fields(result, x.select, x)
    return (value if x.select is not None else shallow(value)), int(meta[1])


def take_top(x: TopShard, top: Sequence[Any]) -> tuple[Any, int]:
    """A :class:`TopShard`'s ``(shard, trailing padding rows in it)`` from the call's
    top-level arguments (already resolved by Ray)."""
    return select_fields(top[x.value], x.select, x), int(top[x.meta][1])


def take_top_value(x: TopValue, top: Sequence[Any]) -> Any:
    """A :class:`TopValue`'s value from the call's top-level arguments (already resolved by Ray): what
    :func:`resolve_value` makes of the producer's one output and its ``(rows, pad)``."""
    out = B.strip_tail(top[x.value], int(top[x.meta][1]))
    return select_fields(x.collect(x.world, [out]), x.select, x)


Awaiter = Callable[[Any], Awaitable[Any]]


def _named(s: Source, wait: Awaiter) -> Awaiter:
    """`wait`, with a failure of the producer named after it (group, method, and the rank
    whose result or metadata failed)."""

    async def named_wait(ref: Any) -> Any:
        try:
            return await wait(ref)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise public_error(e, group=s.group, method=s.method, rank=_rank_of(s, ref)) from None

    return named_wait


def _rank_of(s: Source, ref: Any) -> int | None:
    if s.ranks is None:
        return None
    for refs in (s.refs, s.metas or ()):
        for i, r in enumerate(refs):
            if r is ref:
                return s.ranks[i]
    return None


async def resolve_value(d: DeferredValue, wait: Awaiter) -> Any:
    s = d.source
    wait = _named(s, wait)
    outs = await asyncio.gather(*(wait(r) for r in s.refs))
    if s.data_parallel:
        metas = await asyncio.gather(*(wait(m) for m in s.metas))  # type: ignore[union-attr]
        outs = [B.strip_tail(o, m[1]) for o, m in zip(outs, metas)]
    assert s.collect is not None  # a Source always carries its producer's collect
    return select_fields(s.collect(s.world, list(outs)), s.select, s)


async def resolve_shard(d: DeferredShard, wait: Awaiter) -> tuple[Any, int]:
    """Returns ``(shard, trailing padding rows in it)``."""
    s = d.source
    wait = _named(s, wait)
    if not s.data_parallel:
        whole = await resolve_value(DeferredValue(s), wait)
        _, rows, pads = B.shard_plan(B.batch_len(whole), d.count)
        return B.take_rows(whole, rows[d.index]), pads[d.index]
    if len(s.refs) == d.count:
        out, meta = await asyncio.gather(wait(s.refs[d.index]), wait(s.metas[d.index]))  # type: ignore[index]
        return select_fields(out, s.select, s), int(meta[1])
    metas = await asyncio.gather(*(wait(m) for m in s.metas))  # type: ignore[union-attr]
    valid = [m[0] - m[1] for m in metas]
    total = sum(valid)
    _, plan, pads = B.shard_plan(total, d.count)
    wanted = plan[d.index]
    starts, acc = [], 0
    for v in valid:
        starts.append(acc)
        acc += v
    # global valid row -> (producer shard, row in it)
    loc = []
    for g in wanted:
        i = max(k for k in range(len(valid)) if starts[k] <= g and valid[k] > 0)
        loc.append((i, g - starts[i]))
    needed = sorted({i for i, _ in loc})
    fetched = await asyncio.gather(*(wait(s.refs[i]) for i in needed))
    by_shard = dict(zip(needed, fetched))
    pieces: list[Any] = []  # one take per run of consecutive rows from one shard
    run_shard, run_rows = loc[0][0], list[int]()
    for i, r in loc:
        if i != run_shard:
            pieces.append(B.take_rows(by_shard[run_shard], run_rows))
            run_shard, run_rows = i, []
        run_rows.append(r)
    pieces.append(B.take_rows(by_shard[run_shard], run_rows))
    return select_fields(B.concat(pieces), s.select, s), pads[d.index]


async def resolve_args(
    args: Sequence[Any], kwargs: dict[str, Any], wait: Awaiter
) -> tuple[list[Any], dict[str, Any], int | None]:
    """Replace deferred values in a call's arguments; also returns the input padding
    reported by deferred shards (None when there are none)."""
    pads: list[int] = []

    async def one(x: Any) -> Any:
        if isinstance(x, DeferredShard):
            value, pad = await resolve_shard(x, wait)
            pads.append(pad)
            return value
        if isinstance(x, DeferredValue):
            return await resolve_value(x, wait)
        if isinstance(x, list) and any(isinstance(i, (DeferredShard, DeferredValue)) for i in x):
            return list(await asyncio.gather(*(one(i) for i in x)))
        if isinstance(x, dict) and any(isinstance(i, (DeferredShard, DeferredValue)) for i in x.values()):
            vals = await asyncio.gather(*(one(v) for v in x.values()))
            return dict(zip(x.keys(), vals))
        return x

    new_args = list(await asyncio.gather(*(one(a) for a in args)))
    keys = list(kwargs)
    new_vals = await asyncio.gather(*(one(kwargs[k]) for k in keys))
    return new_args, dict(zip(keys, new_vals)), one_pad(pads)


def one_pad(pads: list[int]) -> int | None:
    """The one input padding that a call's pipelined inputs report (None for none); they
    must agree."""
    if not pads:
        return None
    if len(set(pads)) != 1:
        raise DispatchError(f"pipelined inputs disagree on padding ({pads}); pass futures of the same batch to one call")
    return pads[0]


def substitute(args: Any, kwargs: dict[str, Any], kind: type | tuple[type, ...],
                one: Callable[[Any], Any]) -> tuple[list[Any], dict[str, Any]]:
    """`args` and `kwargs` with `one` applied to each argument, or to each item of a list
    or dict argument that holds a `kind` (the levels :func:`asyncrl._wire.has_deferred` looks at)."""
    def arg(x: Any) -> Any:
        if isinstance(x, list) and any(isinstance(i, kind) for i in x):
            return [one(i) for i in x]
        if isinstance(x, dict) and any(isinstance(i, kind) for i in x.values()):
            return {k: one(v) for k, v in x.items()}
        return one(x)

    return [arg(a) for a in args], {k: arg(v) for k, v in kwargs.items()}


# ---- taking them on the worker (the host's call, asyncrl._host._run_call) ----------------------


async def resolve_on_worker(spec: Any, method: str, args: Any, kwargs: Any,
                   wait: Callable[[Any], Awaitable[Any]]) -> Any:
    try:
        return await resolve_args(args, kwargs, wait)
    except asyncio.CancelledError:
        raise
    except DispatchError as e:
        raise RemoteError(spec.group, method, spec.context.rank, "asyncrl.errors.DispatchError",
                          str(e), traceback.format_exc(), cause=e) from None
    except AsyncRLError as e:  # a producer's failure, already named by resolve_args
        raise UpstreamError(spec.group, method, spec.context.rank, upstream=e) from None


def take_top_inputs(spec: Any, method: str, args: Any, kwargs: Any,
                    top: tuple[Any, ...]) -> tuple[Any, Any, int | None]:
    """The call's arguments with its :class:`TopShard` and :class:`TopValue` inputs replaced by their values
    (at the levels :func:`has_deferred` looks at); also the padding the shards report."""
    if not top:
        return args, kwargs, None
    pads: list[int] = []

    def one(x: Any) -> Any:
        if isinstance(x, TopShard):
            value, pad = take_top(x, top)
            pads.append(pad)
            return value
        if isinstance(x, TopValue):
            return take_top_value(x, top)
        return x

    try:
        new_args, new_kwargs = substitute(args, kwargs, (TopShard, TopValue), one)
        return new_args, new_kwargs, one_pad(pads)
    except DispatchError as e:  # a field selection the producer's result lacks, or inputs disagreeing on padding
        raise RemoteError(spec.group, method, spec.context.rank, "asyncrl.errors.DispatchError",
                          str(e), traceback.format_exc(), cause=e) from None


def input_pad(spec: Any, method: str, top_pad: int | None, pipe_pad: int | None,
              local_pad: int | None = None) -> int:
    """The input padding reported by the call's pipelined inputs, top-level, nested and local."""
    try:
        return one_pad([p for p in (top_pad, pipe_pad, local_pad) if p is not None]) or 0
    except DispatchError as e:
        raise RemoteError(spec.group, method, spec.context.rank, "asyncrl.errors.DispatchError", str(e), "",
                          cause=e) from None


def upstream_error(group: str, method: str, e: BaseException) -> BaseException:
    """A kept producer failure as the nested path names it (see asyncrl._deferred._named):
    a cancellation as the producer's CallCancelledError, an asyncrl error as it is, any
    other error as the producer's RemoteError."""
    if isinstance(e, (asyncio.CancelledError, CallCancelled)):
        return CallCancelledError(f"{group}.{method} was cancelled")
    if isinstance(e, AsyncRLError):
        return e
    return RemoteError(group, method, None, f"{type(e).__module__}.{type(e).__qualname__}", str(e),
                       "".join(traceback.format_exception(e)))


def take_local_inputs(lane: "Lane", spec: Any, method: str, ticket: "Ticket", args: Any,
                      kwargs: Any) -> tuple[Any, Any, int | None]:
    """At the call's turn: its :class:`LocalShard` inputs replaced by the producers'
    kept results (shallow copies), and the padding they report. A producer that
    failed, was cancelled or never ran fails the call with the
    :class:`~asyncrl.UpstreamError` the nested path gives."""
    pads: list[int] = []

    def one(x: Any) -> Any:
        if type(x) is not LocalShard:
            return x
        got = lane.outcome(x.seq, x.call_id) if ticket.seq is not None else None
        if got is None:
            raise RemoteError(spec.group, method, spec.context.rank, "asyncrl.errors.DispatchError",
                              f"the result of {x.group}.{x.method} (call {x.call_id}, ordered #{x.seq}) is not "
                              "held by this worker process (it keeps the outcomes of its last "
                              f"{lane.keep_results} ordered calls); this is a bug of asyncrl, please report it",
                              "")
        if not got[0]:
            raise UpstreamError(spec.group, method, spec.context.rank,
                                upstream=upstream_error(x.group, x.method, got[1])) from None
        try:
            value, pad = take_local(x, got[1], got[2])
        except DispatchError as e:  # a field selection the producer's result lacks
            raise RemoteError(spec.group, method, spec.context.rank, "asyncrl.errors.DispatchError",
                              str(e), traceback.format_exc(), cause=e) from None
        pads.append(pad)
        return value

    new_args, new_kwargs = substitute(args, kwargs, LocalShard, one)
    try:
        return new_args, new_kwargs, one_pad(pads)
    except DispatchError as e:
        raise RemoteError(spec.group, method, spec.context.rank, "asyncrl.errors.DispatchError",
                          str(e), "", cause=e) from None
