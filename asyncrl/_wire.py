"""The wire format of a call's arguments: :class:`Payload`, and how it crosses to a worker.

:class:`Builder` makes every executing rank's :class:`Payload` of one call (knowing the
call's number on each rank's lane), with :class:`Inputs` deciding how each pipelined input
travels (nested, top-level or handed over in the worker's process), and packs it as the
backend sends it (for Ray, :meth:`Payload.wire`: plain values as msgpack lists in
:attr:`Payload.sent`, anything else as the Payload, one nested pickle stream whose
unpickling on the worker never raises: unpickling-never-raises of ``docs/protocol.md``); the worker host
rebuilds it with :func:`arrived`.
"""

from __future__ import annotations

import io
import pickle
import threading
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from asyncrl._deferred import DeferredShard, DeferredValue, LocalShard, TopShard, has_deferred

if TYPE_CHECKING:
    from asyncrl.dispatch import Sharded

__all__ = ["CallMsg", "Payload", "Builder", "Inputs", "arrived"]


@dataclass(slots=True, eq=False)
class CallMsg:
    """One rank's call as it crosses to its worker host: everything the host needs to run it.

    The controller's :class:`~asyncrl._call.Sequencer` makes one per executing rank; the
    backend stamps `after` and sends it (Ray: as the plain list :meth:`wire`, which Ray
    encodes with msgpack, so a call with plain arguments crosses without pickling; the
    local backend: as it is); the host rebuilds it with :meth:`from_wire` and runs it.
    """

    role: str
    """The worker object (one per role in a process: colocated groups share the process)."""
    method: str
    """The registered method to run."""
    seq: int | None
    """Its number on the process's ordered lane; None for a concurrent call."""
    call_id: int
    """Unique per controller: what the one cancel message names."""
    payload: "Payload | list[Any]"
    """The arguments: a :class:`Payload`, or its plain lists (:meth:`Payload.wire`)."""
    in_pad: int | None
    """Padding rows of a data-parallel input the controller split (None: the host works it
    out from the pipelined inputs' producers, or the call is not data-parallel)."""
    want_meta: bool
    """Return ``(result, metadata)``: the rows and padding of a data-parallel result, and the times."""
    keep: bool
    """Return the result (False: a mesh rank whose result is not collected returns None)."""
    after: int = 0
    """How many control messages (cancel, unfence) the controller had sent this process
    before this call: the host runs it only after handling them (control-before-call)."""

    def wire(self) -> list[Any]:
        """The message as one plain list, in field order (one Ray argument, not nine); its
        payload as the plain lists the builder packed (:attr:`Payload.sent`), if it did."""
        payload = self.payload
        if type(payload) is Payload and payload.sent is not None:
            payload = payload.sent
        return [self.role, self.method, self.seq, self.call_id, payload, self.in_pad, self.want_meta, self.keep,
                self.after]

    @classmethod
    def from_wire(cls, packed: list[Any]) -> "CallMsg":
        """The message :meth:`wire` packed."""
        return cls(*packed)


class Payload:
    """A call's arguments on their way to a worker.

    Pickled as a nested pickle stream (with Ray's reducers and out-of-band buffers, so
    tensors still cross without copies) whose unpickling on the worker never raises: a
    failure (a class that is not importable there, a ``__setstate__`` that raises)
    arrives as `error` and the host reports it as the call's ``RemoteError``, releasing
    the call's number (unpickling-never-raises of docs/protocol.md).
    """

    __slots__ = ("args", "kwargs", "error", "top", "nested", "sent")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 error: tuple[str, str, str] | None = None, top: list[Any] | None = None,
                 nested: bool = False) -> None:
        self.sent: list[Any] | None = None
        """Its plain arguments packed as lists (:meth:`wire`), when every one is plain: set by
        :class:`Builder` for a backend that ``sends_plain_lists`` (Ray), which then sends
        this instead of the Payload. Not part of the pickled payload (and never the Payload
        itself: a reference cycle would keep its arguments alive until the collector runs)."""
        self.args = args
        self.kwargs = kwargs
        self.error = error
        self.top = top
        """Refs sent as top-level arguments of the host's call (the :class:`TopShard`
        placeholders in `args`/`kwargs` index them); not part of the pickled payload."""
        self.nested = nested
        """Set by the controller: some argument is resolved on the worker (:func:`has_deferred`);
        not part of the pickled payload."""

    def __reduce__(self) -> tuple[Any, ...]:
        data, buffers = _inner_pickler().dumps((self.args, self.kwargs))
        return (_UNPACK, (data, *buffers))

    def wire(self) -> "Payload | list[Any]":
        """What the Ray backend sends: when every argument is plain (a scalar — an int of
        64 bits, a float, a string, a bool, None — or a small list or string-keyed dict
        of plain values, such as a config dict: :func:`_plain`), a :class:`TopShard` (a
        pipelined input sent top-level) or a :class:`LocalShard` (one handed over in the
        worker's process): ints and strings, the list ``[args, kwargs]`` (plus, with
        TopShards, their places and fields), which Ray encodes with msgpack (no pickling on
        either side, and nothing that can fail to unpickle on the worker); otherwise the
        Payload itself. :func:`arrived` undoes it."""
        tops: list[Any] | None = None
        for i, x in enumerate(self.args):
            if not _plain(x):
                if type(x) not in _MARKERS:
                    return self
                tops = tops or []
                tops.append(_top_wire(i, x))
        for k, x in self.kwargs.items():
            if not _plain(x):
                if type(x) not in _MARKERS:
                    return self
                tops = tops or []
                tops.append(_top_wire(k, x))
        if tops is None:
            return [list(self.args), self.kwargs]
        return [[None if type(x) in _MARKERS else x for x in self.args],
                {k: (None if type(x) in _MARKERS else x) for k, x in self.kwargs.items()}, tops]

    def local_copy(self) -> "Payload":
        """What a worker process would receive, made in this process (the local backend):
        pickled and unpickled, deferred values passed through as they are."""
        from ray import cloudpickle

        kept: list[Any] = []

        class _Pickler(cloudpickle.CloudPickler):
            def persistent_id(self, obj: Any) -> Any:
                if isinstance(obj, (DeferredShard, DeferredValue)):
                    kept.append(obj)
                    return len(kept) - 1
                return None

        class _Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                return kept[pid]

        buf = io.BytesIO()
        _Pickler(buf, protocol=5).dump((self.args, self.kwargs))  # raises at submission, as Ray's would
        try:
            args, kwargs = _Unpickler(io.BytesIO(buf.getvalue())).load()
        except Exception as e:
            return Payload((), {}, _unpickling_error(e))
        return Payload(args, kwargs)


_PLAIN_ITEMS = 64  # list items and dict values, over all levels, that still count as plain
_PLAIN_DEPTH = 4  # levels of nested lists and dicts that still count as plain


def _scalar(x: Any) -> bool:
    t = type(x)
    return t is str or t is float or t is bool or x is None or (t is int and -(1 << 63) <= x < (1 << 63))


def _plain(x: Any) -> bool:
    """A value Ray encodes with msgpack and the worker decodes without unpickling anything
    (so it cannot fail there: unpickling-never-raises of docs/protocol.md): a scalar (an int of 64 bits,
    a float, a string, a bool, None), or lists and string-keyed dicts of such — a config
    dict — with at most ``_PLAIN_ITEMS`` items in all, nested at most ``_PLAIN_DEPTH``
    levels. Tuples, other key types, subclasses and anything larger take the pickled Payload."""
    if _scalar(x):
        return True
    t = type(x)
    if t is not dict and t is not list:
        return False
    budget = _PLAIN_ITEMS
    todo: list[tuple[Any, int]] = [(x, 1)]
    while todo:
        y, depth = todo.pop()
        if depth > _PLAIN_DEPTH:
            return False
        budget -= len(y)
        if budget < 0:
            return False
        if type(y) is dict:
            if any(type(k) is not str for k in y):
                return False
            items: Any = y.values()
        else:
            items = y
        for v in items:
            if not _scalar(v):
                if type(v) is not dict and type(v) is not list:
                    return False
                todo.append((v, depth + 1))
    return True


_MARKERS = (TopShard, LocalShard)


def _top_wire(place: int | str, x: "TopShard | LocalShard") -> list[Any]:
    select = list(x.select) if x.select is not None else None
    if type(x) is LocalShard:
        return [place, x.group, x.method, select, x.call_id, x.seq, True]
    return [place, x.group, x.method, select, x.value, x.meta]  # type: ignore[union-attr]


def arrived(payload: "Payload | list[Any]") -> Payload:
    """The Payload of a call as it arrived on the worker (see :meth:`Payload.wire`)."""
    if type(payload) is list:
        if len(payload) == 2:
            return Payload(tuple(payload[0]), payload[1])
        args, kwargs, tops = payload
        for place, group, method, select, a, b, *local in tops:
            sel = tuple(select) if select is not None else None
            shard = LocalShard(group, method, sel, a, b) if local else TopShard(group, method, sel, a, b)
            if type(place) is int:
                args[place] = shard
            else:
                kwargs[place] = shard
        return Payload(tuple(args), kwargs)
    return payload  # type: ignore[return-value]


class _InnerPickler:
    """One cloudpickle pickler per thread, reused for every Payload (building a pickler
    costs several times more than pickling a few small arguments). It is Ray's
    cloudpickle, so Ray's reducers apply (zero-copy tensors, ObjectRef accounting)."""

    def __init__(self) -> None:
        from ray import cloudpickle

        self._file = io.BytesIO()
        self._buffers: list[pickle.PickleBuffer] = []
        self._pickler = cloudpickle.CloudPickler(self._file, protocol=5, buffer_callback=self._buffer)
        self._busy = False

    def _buffer(self, b: pickle.PickleBuffer) -> None:
        self._buffers.append(b)

    def dumps(self, obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
        if self._busy:  # a Payload inside a Payload's arguments: a one-off pickler
            from ray import cloudpickle

            buffers: list[pickle.PickleBuffer] = []
            return cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append), buffers
        self._busy = True
        f, self._buffers = self._file, []
        try:
            f.seek(0)
            f.truncate()
            self._pickler.clear_memo()
            self._pickler.globals_ref = {}  # cloudpickle's per-dump state: never shared between calls
            self._pickler.dump(obj)
            return f.getvalue(), self._buffers
        finally:
            self._busy = False


_INNER = threading.local()


def _inner_pickler() -> _InnerPickler:
    p = getattr(_INNER, "pickler", None)
    if p is None:
        p = _INNER.pickler = _InnerPickler()
    return p


class _Unpacker:
    """Rebuilds a Payload on the worker; unpickling failures become its `error`.

    An object, not a function: pickled as a plain global name (``__reduce__`` returns
    one), so Ray's cloudpickle does not inspect it on every call as it does functions.
    """

    def __call__(self, data: bytes, *buffers: Any) -> Payload:
        try:
            args, kwargs = pickle.loads(data, buffers=buffers)
        except Exception as e:
            return Payload((), {}, _unpickling_error(e))
        return Payload(args, kwargs)

    def __reduce__(self) -> str:
        return "_UNPACK"


_UNPACK = _Unpacker()


def _unpickling_error(e: BaseException) -> tuple[str, str, str]:
    return (f"{type(e).__module__}.{type(e).__qualname__}",
            f"the worker could not unpickle the call's arguments ({e}); an argument's class must be importable "
            "on the workers (put its module on their PYTHONPATH, or in runtime_env py_modules/working_dir)",
            traceback.format_exc())




# ---- the controller's side: each rank's Payload -------------------------------------------


class Inputs:
    """The pipelined inputs of one call, as its ranks' payloads are built: which of them
    are handed over inside the worker process or go top-level (see asyncrl._deferred),
    and which producers' results every executing rank together reads whole (a producer
    whose results a successful call read is known to have finished successfully:
    ``_Call.ok``)."""

    __slots__ = ("producers", "ok", "read", "top_from", "sent", "local", "window", "local_sent")

    def __init__(self, producers: "Sequence[Any]", top: bool, sequencer: Any = None) -> None:
        self.producers = producers
        # The producers known to have finished successfully, by their collected refs (the
        # same ref objects a Source holds): only their matched shards may go top-level.
        self.ok: dict[int, Any] = {id(ref): p for p in producers if p.ok and top for ref in p.collect_refs}
        # Same-process candidates, by collected ref: the producer's (rank, call id, number)
        # of an ordered data-parallel producer numbered by this call's own sequencer (the
        # same processes). `sequencer` is given for an ordered consumer only (of any
        # dispatch mode that makes matched shards: DP_COMPUTE, DP_COMPUTE_METRIC, meshes).
        self.local: dict[int, tuple[int, int, int]] = {}
        self.window = sequencer.keep_results if sequencer is not None else 0
        if self.window:
            for p in producers:
                if p.sequencer is sequencer and p.collect_metas is not None:
                    entries, index = p.entries, p.collect_index
                    for j, ref in enumerate(p.collect_refs):
                        entry = entries[index[j]]
                        if entry[2] is not None:
                            self.local[id(ref)] = entry
        self.read: set[int] = set()
        self.top_from: dict[tuple[str, str], None] = {}
        self.sent = 0  # TopShards made (one per rank and input)
        self.local_sent = 0  # LocalShards made

    def rank_args(self, x: Any, top: list[Any], rank: int, seq: int | None) -> Any:
        """One rank's argument (or an item of a list argument) for a call that will have
        number `seq` on `rank`'s lane: a matched shard of an ordered producer on the same
        process, whose outcome that lane provably still keeps at this call's turn (its
        number within the window: same-process-window of docs/protocol.md), becomes a
        :class:`LocalShard`; a matched shard of a known-ok producer a :class:`TopShard`
        whose refs are appended to `top`."""
        if isinstance(x, DeferredShard):
            s = x.source
            matched = x.count == 1 and len(s.refs) == 1 and s.data_parallel and s.metas is not None
            if matched and self.local and seq is not None:
                entry = self.local.get(id(s.refs[0]))
                if entry is not None and entry[0] == rank and 0 < seq - entry[2] <= self.window:
                    # Counted as a read: a consumer that succeeded got the producer's value,
                    # so the producer's host finished it. Ray's object of it could still have
                    # failed (a result Ray cannot serialize); a later top-level read of it then
                    # fails before its host runs, which the backend observes (input-failed-before-host of
                    # docs/protocol.md), as for an object lost after it was read.
                    self.read.update((id(s.refs[0]), id(s.metas[0])))  # type: ignore[index]
                    self.local_sent += 1
                    return LocalShard(s.group, s.method, s.select, entry[1], entry[2])
            if x.count == len(s.refs) or not s.data_parallel:
                self.read.update(map(id, s.refs))  # matched (rank r reads producer rank r), or the whole value
            if s.metas is not None:
                self.read.update(map(id, s.metas))
            if self.ok and matched and id(s.refs[0]) in self.ok:
                self.top_from[(s.group, s.method)] = None
                self.sent += 1
                top.extend((s.refs[0], s.metas[0]))  # type: ignore[index]  # (matched: metas is set)
                return TopShard(s.group, s.method, s.select, len(top) - 2, len(top) - 1)
        elif isinstance(x, DeferredValue):
            s = x.source
            self.read.update(map(id, s.refs))
            if s.metas is not None:
                self.read.update(map(id, s.metas))
        return x

    def fully_read(self) -> tuple[Any, ...]:
        """The producers (not yet known ok) whose every collected result (and padding
        metadata) some executing rank of this call reads."""
        read = self.read
        return tuple(p for p in self.producers if not p.ok
                     and all(id(r) in read for r in p.collect_refs)
                     and (p.collect_metas is None or all(id(m) in read for m in p.collect_metas)))


class Builder:
    """Every executing rank's ``(payload, input padding, keep result)`` of one call, built
    before anything is sent, knowing the number the call gets on each rank's lane (an error
    here leaves nothing sent and no number taken: build-before-send of docs/protocol.md). `producers`:
    the calls whose futures are among the arguments; `top`: matched shards of producers
    known to be ok may go as top-level arguments; `sequencer`: the consumer's own, for an
    ordered call (same-process inputs); `pack`: set each payload's :attr:`Payload.sent` to
    :meth:`Payload.wire` (the backend sends plain arguments as msgpack lists). After
    building, `inputs` says how the pipelined inputs travelled (None without producers) and
    `reads` which producers the call reads whole (:meth:`Inputs.fully_read`)."""

    __slots__ = ("sharded", "keep", "inputs", "pack", "reads")

    def __init__(self, sharded: "Sharded", keep: list[bool], producers: "Sequence[Any]", top: bool,
                 sequencer: Any, pack: bool) -> None:
        self.sharded, self.keep, self.pack = sharded, keep, pack
        self.inputs = Inputs(producers, top, sequencer) if producers else None
        self.reads: tuple[Any, ...] = ()

    def __call__(self, ranks: "Sequence[int]", numbers: "Sequence[int | None]") -> list[tuple[Payload, int | None, bool]]:
        built = [self.rank(r, seq) for r, seq in zip(ranks, numbers)]
        if self.inputs is not None:
            self.reads = self.inputs.fully_read()
        return built

    def rank(self, r: int, seq: int | None) -> tuple[Payload, int | None, bool]:
        """One rank's ``(payload, input padding, keep result)``, for a call numbered `seq` there."""
        sharded, inputs = self.sharded, self.inputs
        pads = sharded.pad
        a = tuple(_defer(x[r]) for x in sharded.args)
        k = {key: _defer(v[r]) for key, v in sharded.kwargs.items()}
        top: list[Any] | None = None
        nested = False
        if inputs is not None:  # (without producers no argument is resolved on the worker)
            top = []
            a = tuple(_each(inputs, x, top, r, seq) for x in a)
            k = {key: _each(inputs, v, top, r, seq) for key, v in k.items()}
            nested = has_deferred(a, k)
        payload = Payload(a, k, top=top or None, nested=nested)
        if self.pack:
            wire = payload.wire()
            if wire is not payload:
                payload.sent = wire  # type: ignore[assignment]
        return payload, (pads[r] if pads is not None else None), self.keep[r]


def _each(inputs: Inputs, x: Any, top: list[Any], rank: int, seq: int | None) -> Any:
    if isinstance(x, list):
        return [inputs.rank_args(i, top, rank, seq) for i in x]
    return inputs.rank_args(x, top, rank, seq)


def _defer(x: Any) -> Any:
    """A future left in a rank's arguments (by a non-DP or custom mode) is resolved
    whole on the worker."""
    src = getattr(x, "_as_source", None)
    if src is not None:
        return DeferredValue(src())
    if isinstance(x, list) and any(hasattr(i, "_as_source") for i in x):
        return [_defer(i) for i in x]
    return x
