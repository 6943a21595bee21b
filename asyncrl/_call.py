"""One group call on the controller: issuing it (:class:`Sequencer`), its payloads (:class:`Builder`) and its state (`_Call`).

*Issuing.* The :class:`Sequencer` of a set of worker processes numbers the ordered calls
of each process (a *lane*, whose worker half is :mod:`asyncrl._lanes`), has every rank's
payload built (:class:`Builder`: how each pipelined input travels) and submits one call
per rank to the backend, in number order per process. The invariant: **every number
taken is released exactly once on the worker**, whatever fails, so the next number's call
always gets its turn. Cancellation has one path, :meth:`Sequencer.cancel` → the host's
``cancel_calls`` → :meth:`~asyncrl._lanes.Lane.cancel`; cancelling twice is harmless. A
lane whose call's deadline passed while its plain ``def`` method ran is *wedged*, and the
wedge is the sequencer's to keep. The failure cases of this protocol are named invariants
listed in ``docs/protocol.md``, each with the test that pins it; the code cites them by
name (``wedged-lane``, ``control-before-call``, ...).

*The state* (`_Call`, shared by a :class:`~asyncrl.GroupFuture` and its field
selections): ``pending`` → ``completed`` (every rank finished; the value or the error is
fetched on await) or ``failed`` by the controller: cancelled, timed out, or its group
closed. The first outcome wins and every holder sees the same one.

*One deadline.* ``wg.m.options(timeout=s)(...)`` gives the call a deadline, checked
against completion: when it passes, the controller asks the backend (off the event
loop) whether every rank has finished; if so the call completed in time and never
raises :class:`~asyncrl.CallTimeoutError`, however late it is awaited. Otherwise the
call fails with ``CallTimeoutError`` for every holder and its remote work is cancelled
through the one cancel path.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Protocol, Sequence

import structlog

from asyncrl import batch as B
from asyncrl._backend import Backend, InputFailed, input_error, public_error
from asyncrl._wire import CallMsg, DeferredShard, DeferredValue, LocalShard, Payload, TopShard, TopValue, has_deferred
from asyncrl.register import Execute, Mode
from asyncrl.errors import (
    CallCancelledError,
    CallTimeoutError,
    LaneWedgedError,
    UpstreamError,
    WorkerDiedError,
)

if TYPE_CHECKING:
    from asyncrl._backend import Wedge
    from asyncrl.dispatch import Sharded, World
    from asyncrl.register import MethodSpec

__all__ = ["Sequencer", "CallPlan", "Entry"]  # internal: the public face is asyncrl.future.GroupFuture

log = structlog.get_logger("asyncrl")

Entry = tuple[int, int, "int | None"]
"""``(rank, call id, number or None)`` of one submitted per-rank call."""

_call_ids = itertools.count()
_BACKGROUND: set[asyncio.Task[Any]] = set()  # deadline checks in flight (a task needs a strong reference)
_ISSUED_SWEEP = 1024  # remembered ordered calls per lane before the first sweep (wedged-lane)

TOP_VALUES = True
"""Pass the whole value of a known-ok call to one rank as top-level Ray arguments (:class:`~asyncrl._wire.TopValue`:
a streaming step's ``concat_shard`` takes its groups' results so). False: nested in the payload, as before (the
benchmarks' earlier variants)."""


class Sequencer:
    """Numbers the ordered calls of each worker process and issues every call.

    One per set of worker processes (a group, or colocated groups sharing processes):
    all ordered calls to one process share one numbering, whatever role they call. It
    also keeps each lane's wedge (wedged-lane): which call's deadline passed while its
    plain ``def`` method ran there, until that call's own result shows the method returned.
    """

    __slots__ = ("backend", "hosts", "keep_results", "_next", "_lock", "wedged", "_issued", "_sweep_at", "fresh")

    def __init__(self, backend: Backend, hosts: list[Any], world_size: int, keep_results: int = 0) -> None:
        self.backend = backend
        self.hosts = hosts  # filled in by the owner as the processes start
        self.keep_results = keep_results
        """How many of its latest ordered numbers each lane keeps the outcome of (same-process-window)."""
        self._next = [0] * world_size  # each lane's next number; only under the lock
        self._lock = threading.Lock()  # number order = submission order per host, from any thread (one-thread-group-order)
        self.wedged: dict[int, tuple[int, str, float]] = {}
        """Lane -> ``(call id, description, monotonic start)`` of the call wedging it, as its host reported."""
        # Each lane's ordered calls not known to be over: (number, call id, weak ref to the call).
        self._issued: list[collections.deque[tuple[int, int, Any]]] = [collections.deque() for _ in range(world_size)]
        self._sweep_at = [_ISSUED_SWEEP] * world_size
        self.fresh = [0] * world_size
        """Per lane: the first call id its current process has seen. A lane whose process was replaced
        (:meth:`reset_lanes`) neither cancels nor hands over the older calls' numbers there: they were the
        old process's."""

    def reset_lanes(self, ranks: Sequence[int]) -> None:
        """The processes of lanes `ranks` were replaced: their numbering starts again (a new host expects its
        first number) and what was issued to the old ones is forgotten here."""
        with self._lock:
            first = next(_call_ids)
            for rank in ranks:
                self._next[rank] = 0
                self._issued[rank] = collections.deque()
                self._sweep_at[rank] = _ISSUED_SWEEP
                self.wedged.pop(rank, None)
                self.fresh[rank] = first

    def issue(self, plan: "CallPlan") -> "_Call":
        """Issue the group call `plan`: build every executing rank's payload, number and
        submit them, and return the call's state."""
        backend = self.backend
        spec = plan.spec
        dp = spec.dispatch_mode.data_parallel
        ordered = spec.mode is Mode.ORDERED
        build = Builder(plan.sharded, plan.keep, plan.producers, dp and backend.top_level_inputs,
                        self if ordered else None, backend.sends_plain_lists)
        wedged = [r for r in plan.ranks if r in self.wedged] if ordered and self.wedged else ()
        refs, metas, entries = self.submit(plan.role, spec.name, ordered, dp or plan.time_calls, plan.ranks, build,
                                           refuse=wedged)
        plan.site.stats.calls += 1
        call = _Call(plan, self, refs, metas if dp else None, entries)
        if not dp and plan.time_calls:
            call.timing = metas
        inputs = build.inputs
        if inputs is not None:
            call.reads = build.reads
            call.top_from = tuple(inputs.top_from) or None
            plan.site.stats.inputs_top_level += inputs.sent
            plan.site.stats.inputs_local += inputs.local_sent
        if ordered:
            self._remember(call)
        if wedged:
            self._fail_wedged(call, wedged[0])
        return call

    def submit(self, role: str, method: str, ordered: bool, want_meta: bool, ranks: Sequence[int],
               build: Callable[[Sequence[int], Sequence[int | None]], list[tuple[Any, int | None, bool]]],
               refuse: Collection[int] = ()) -> tuple[list[Any], list[Any], tuple[Entry, ...]]:
        """Submit one call per rank of `ranks`. ``build(ranks, numbers)`` first makes every
        rank's ``(payload, input padding, keep result)`` knowing the number the call will
        have there (None for a concurrent call): same-process inputs depend on it
        (same-process-window); if it raises, nothing was sent and no number taken (build-before-send). Returns ``(result
        refs, meta refs, entries)``. A failed submission leaves nothing half-issued: the
        calls already submitted and the number taken for the failing one are cancelled,
        then the error is raised (failed-submission). `refuse`: ranks whose lane is wedged;
        their call is cancelled before it is sent, so it never runs (wedged-lane)."""
        backend, hosts, numbers = self.backend, self.hosts, self._next
        refs: list[Any] = []
        metas: list[Any] = []
        entries: list[Entry] = []
        try:
            with self._lock:
                built = build(ranks, [numbers[rank] for rank in ranks] if ordered else [None] * len(ranks))
                for rank, (payload, pad, keep) in zip(ranks, built):
                    call_id = next(_call_ids)
                    seq = None
                    if ordered:
                        seq = numbers[rank]
                        numbers[rank] = seq + 1
                    entries.append((rank, call_id, seq))
                    if rank in refuse:
                        self.cancel([(rank, call_id, seq)], deadline=False)
                    ref, meta = backend.submit(hosts[rank], CallMsg(role, method, seq, call_id, payload, pad, want_meta,
                                                                    keep))
                    refs.append(ref)
                    metas.append(meta)
        except BaseException:
            self.cancel(entries, deadline=False)
            raise
        return refs, metas, tuple(entries)  # a tuple of ints: the collector stops tracking it

    def cancel(self, entries: Iterable[Entry], *, deadline: bool, call: "_Call | None" = None) -> None:
        """The one cancel path: one message per worker process. `deadline`: the deadline of
        `call` (whose `entries` these are) passed; on a lane where it still runs its plain
        ``def`` method, the lane is wedged (wedged-lane)."""
        by_rank: dict[int, list[tuple[int, int | None]]] = {}
        fresh = self.fresh
        for rank, call_id, seq in entries:
            if call_id >= fresh[rank]:  # (else its process was replaced: the call went with it)
                by_rank.setdefault(rank, []).append((call_id, seq))
        for rank, items in by_rank.items():
            try:
                if deadline and call is not None and items[0][1] is not None:
                    self.backend.cancel_calls(self.hosts[rank], items, True, behind=self._after(rank, items[0][1]),
                                              replied=functools.partial(self._replied, rank, call,
                                                                        asyncio.get_running_loop()))
                else:
                    self.backend.cancel_calls(self.hosts[rank], items, False)
            except Exception as e:  # the process is gone (its lane with it) or Ray is shutting down
                log.warning("cancel.unsent", rank=rank, calls=len(items), error=repr(e))

    # ---- the wedge (wedged-lane), on the controller's loop: a deadline's cancel names the
    # calls issued after the timed-out one on its lane; the host's reply says whether its
    # plain def method still runs (then it cancelled those too). The controller then fails
    # every ordered call numbered after it there, and refuses every later one before it is
    # sent, until the timed-out call's own result shows the method returned ----------------

    def _remember(self, call: "_Call") -> None:
        """An ordered call was submitted: remember it per lane (weakly) until it is over."""
        ref = weakref.ref(call)
        for rank, call_id, seq in call.entries:
            assert seq is not None  # (an ordered call's)
            q = self._issued[rank]
            q.append((seq, call_id, ref))
            if len(q) >= self._sweep_at[rank]:
                self._sweep(rank)

    def _sweep(self, rank: int) -> None:
        """Forget the calls that are over (amortized: the bound doubles with what stays)."""
        q = self._issued[rank]
        self._issued[rank] = collections.deque(e for e in q if _pending(e[2]()))
        self._sweep_at[rank] = max(_ISSUED_SWEEP, 2 * len(self._issued[rank]))

    def _after(self, rank: int, seq: int) -> list[tuple[int, int]]:
        """``(call id, number)`` of the pending ordered calls numbered after `seq` on lane `rank`."""
        return [(call_id, s) for s, call_id, ref in self._issued[rank] if s > seq and _pending(ref())]

    def _replied(self, rank: int, call: "_Call", loop: asyncio.AbstractEventLoop, wedge: "Wedge | None",
                 verdict: Callable[[list[tuple[int, int]]], None]) -> None:
        """The host's reply to `call`'s deadline cancel on lane `rank`, and `verdict`: sends
        the control message the backend reserved for the answer, which every call sent to
        that process since the deadline's cancel waits for (control-before-call). Wedged: it
        refuses the calls numbered after the stuck one (some were sent while the reply was
        on its way), they fail now, and so does every later ordered call there until the
        stuck call's own result shows its method returned."""
        if wedge is None:
            verdict([])
            return
        call_id, seq, what, running = wedge
        followers = [(s, cid, ref()) for s, cid, ref in self._issued[rank] if s > seq]
        verdict([(cid, s) for s, cid, c in followers if _pending(c)])
        self.wedged[rank] = (call_id, what, time.monotonic() - running)
        for _, _, c in followers:
            if _pending(c):
                self._fail_wedged(c, rank)
        ref = call.refs[list(call.ranks).index(rank)]
        self.backend.watch([ref], functools.partial(_on_loop, loop, self._unwedged, rank, call_id))

    def _unwedged(self, rank: int, call_id: int) -> None:
        if self.wedged.get(rank, (None,))[0] == call_id:
            del self.wedged[rank]

    def _fail_wedged(self, call: Any, rank: int) -> None:
        _, stuck, since = self.wedged[rank]
        call.fail(LaneWedgedError(call.group, call.method, rank, stuck, time.monotonic() - since), cancel_remote=True)


def _pending(call: Any) -> bool:
    return call is not None and not call.settled() and not call._completed


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Run `fn(*args)` on `loop` (from a backend's thread)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop is closed: nobody issues calls there any more
        pass


@dataclass(slots=True, eq=False)
class CallPlan:
    """One group call as its group planned it, before it is issued
    (:meth:`Sequencer.issue`): what to run, where, with which per-rank arguments."""

    site: "_Site"
    """The group that issues it (its name, stats, and whether it is closed)."""
    role: str
    """The worker object the call runs on, in each process."""
    spec: "MethodSpec"
    """The registered method: dispatch mode, execute mode, ordered or concurrent."""
    world: "World"
    """The group's ranks and meshes (what the collect function gets)."""
    sharded: "Sharded"
    """The per-rank arguments the dispatch function made, and the padding of each rank."""
    ranks: Sequence[int]
    """The executing ranks (only rank 0 for ``Execute.RANK_ZERO``)."""
    order: Sequence[int]
    """Which executing ranks' results are collected, in collect (data-parallel) order."""
    keep: list[bool]
    """Per rank: return its result (False for a mesh rank that is not collected)."""
    producers: "Sequence[_Call]"
    """The calls whose futures are among the arguments (pipelined inputs)."""
    timeout: float | None
    """The call's deadline in seconds from now (one deadline), or None."""
    time_calls: bool
    """Every rank returns its times (arrived, started, ended), also for a non-DP mode."""


class _Site(Protocol):
    """What a call needs from the group that issued it."""

    name: str
    stats: Any

    @property
    def closed(self) -> bool: ...

    def _mark_broken(self, rank: int | None, detail: str) -> None: ...


class _Call:
    """One issued group call: the state its futures share (see the module docstring)."""

    __slots__ = (
        "site", "backend", "sequencer", "method", "ranks", "refs", "metas", "entries", "world",
        "data_parallel", "rank_zero", "collect_fn", "collect_index", "collect_refs", "collect_metas", "fetch_metas",
        "timeout", "deadline", "claims", "consumers", "cancel_requested", "ok", "reads", "top_from",
        "_producers", "_fut", "_fetch", "_result", "_error", "_failure",
        "timing", "times", "done_at", "_completed", "_watching", "_done_callbacks", "_loop", "_timer",
        "__weakref__",  # the sequencer remembers each lane's pending calls weakly (wedged-lane of docs/protocol.md)
    )

    def __init__(self, plan: CallPlan, sequencer: Sequencer, refs: list[Any], metas: list[Any] | None,
                 entries: Sequence[Entry]) -> None:
        """The state of `plan` once issued: `refs` (and, for a data-parallel call, `metas`:
        each rank's ``(rows, padding, times)``) per executing rank, and its `entries`.
        The plan itself is not kept (its arguments would stay alive with the call)."""
        # Thousands of calls may be in flight at once, each holding its _Call: every
        # container here is one more object for the garbage collector's full passes to
        # walk (benchmarks/inflight.py), so the per-group parts (ranks, collect order)
        # are shared tuples and the collected refs are the refs themselves when the
        # order is the identity.
        site, spec, ranks, collect_index = plan.site, plan.spec, plan.ranks, plan.order
        producers, timeout, pads = plan.producers, plan.timeout, plan.sharded.pad
        self.site = site
        self.backend = sequencer.backend
        self.sequencer = sequencer
        self.method = spec.name
        self.ranks = ranks
        self.refs = refs
        self.metas = metas
        self.timing = metas  # the metadata refs that carry the workers' times (GroupFuture.worker_times)
        self.times: Any = None  # None, then False while reading them, then the times per rank
        self.entries = entries
        self.world = plan.world
        mode = spec.dispatch_mode
        self.data_parallel = mode.data_parallel
        self.rank_zero = spec.execute_mode is Execute.RANK_ZERO
        self.collect_fn = mode.collect
        # Which of the executing ranks' results are collected, in collect (DP) order.
        self.collect_index = collect_index
        if len(collect_index) == len(refs) and all(i == j for j, i in enumerate(collect_index)):
            self.collect_refs = refs
            self.collect_metas = metas
        else:
            self.collect_refs = [refs[i] for i in collect_index]
            self.collect_metas = [metas[i] for i in collect_index] if metas is not None else None
        # The collected positions whose (rows, padding) metadata the controller fetches to
        # strip padding: a rank whose input the controller split itself with no padding rows
        # (`pads`, per executing rank) returns none, so its metadata need not be awaited
        # (the common case: none at all). Padding of pipelined inputs comes from their
        # producer, unknown here: fetched. The metas stay in the call for pipelined
        # consumers with another layout (their shards are re-split there), fetched or not.
        self.fetch_metas: Sequence[int] = ()
        if metas is not None:
            if pads is None:
                self.fetch_metas = range(len(collect_index))
            elif any(pads[ranks[i]] for i in collect_index):
                self.fetch_metas = tuple(j for j, i in enumerate(collect_index) if pads[ranks[i]])
        self.claims = 0  # tasks awaiting the call now
        self.consumers = 0  # issued calls that take this call's result as an argument
        self.cancel_requested = False
        self.ok = False
        """Known to have finished successfully: every collected result (and its padding
        metadata) was read without error, by this controller's await or by a consumer
        call that then succeeded (`reads`; a same-process hand-off counts), or every collected rank's reply
        arrived with its ``summary`` (``GroupFuture.summary``: the task returned its result with it). Only such a
        call's results are passed
        top-level into later calls (asyncrl._deferred says why). Never set on failure."""
        self.reads: "tuple[_Call, ...]" = ()  # producers whose every collected result this call reads
        self.top_from: tuple[tuple[str, str], ...] | None = None  # (group, method) of its top-level inputs' producers
        self._producers = producers
        for p in producers:
            p.consumers += 1
        self._fut: asyncio.Future[Any] | None = None
        self._fetch: Any = None  # the backend's fetch of the refs, while it is outstanding
        self._result: tuple[Any, BaseException | None] | None = None  # (value, error) once read from the fetch
        self._failure: asyncio.Future[BaseException] | None = None
        self._error: BaseException | None = None
        self._completed = False
        self.done_at: float | None = None  # time.perf_counter() when the controller learned the call is done
        self._watching = False
        # add_done_callback's: (its loop, callbacks), run on that loop
        self._done_callbacks: tuple[asyncio.AbstractEventLoop, list[Callable[[], None]]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.timeout = timeout
        self.deadline: float | None = None
        if timeout is not None:
            self.deadline = time.monotonic() + timeout
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # issued from a thread without a loop: checked on await or result()
                pass
            else:
                self._loop = loop
                self._timer = loop.call_later(timeout, self._on_deadline)

    # ---- state --------------------------------------------------------------------------

    @property
    def group(self) -> str:
        return self.site.name

    def settled(self) -> bool:
        """True once the outcome is known to the controller (value, error, or failure)."""
        return self._error is not None or (self._fut is not None and self._fut.done())

    def state(self) -> str:
        """What the controller knows, without asking anyone (for repr)."""
        if self._error is not None:
            return "cancelled" if self.cancel_requested else f"failed ({type(self._error).__name__})"
        if self._result is not None:
            return "done" if self._result[1] is None else f"failed ({type(self._result[1]).__name__})"
        return "completed" if self._completed or (self._fut is not None and self._fut.done()) else "pending"

    # ---- failing the call (cancel, deadline, withdrawal) ------------------------------------

    def fail(self, error: BaseException, *, cancel_remote: bool, deadline: bool = False) -> bool:
        """Settle the call with `error` for every holder (first outcome wins); cancel its
        remote work through the one cancel path. Runs on the loop (or with no loop at all)."""
        if self.settled():
            return False
        self._mark_done_at()
        self._error = error
        self._done_soon()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._fut is not None:
            self._fut.set_exception(error)
            self._fut.exception()  # retrieved: a failure nobody awaits is not logged as never retrieved
        if self._failure is not None and not self._failure.done():
            self._failure.set_result(error)
        fetch, self._fetch = self._fetch, None
        if fetch is not None:
            fetch.cancel()  # its delivery, if it comes, is a no-op
        if cancel_remote:
            self.sequencer.cancel(self.entries, deadline=deadline, call=self if deadline else None)
        self.read_times()  # (the ranks' errors, if they fail, are in their metadata too: retrieved)
        self._release_producers()
        return True

    def cancel(self) -> bool:
        if self._completed or self.settled():
            return False
        self.cancel_requested = True
        return self.fail(CallCancelledError(f"{self.group}.{self.method} was cancelled"), cancel_remote=True)

    def withdraw(self) -> None:
        """An awaiting task was cancelled: cancel the call if nobody else waits for it."""
        if self.claims == 0 and self.consumers == 0 and not self._completed and not self.settled():
            self.cancel_requested = True
            self.fail(CallCancelledError(f"{self.group}.{self.method} was cancelled: every task awaiting it "
                                         "was cancelled"), cancel_remote=True)

    def read_times(self) -> None:
        """Start reading the workers' times once (:meth:`GroupFuture.worker_times`): the metadata refs of a timed
        call, each rank's ``(arrived, started, ended)`` or None for a rank whose call failed. Never blocks (the
        backend's ``peek``, off the loop). A failed call reads them too: a rank's error is in its metadata ref as
        well as in its result ref, and an error nobody retrieves is reported by Ray as unhandled once the refs
        are dropped."""
        timing = self.timing
        if timing is None or self.times is not None:
            return
        self.times = False

        def got(values: list[Any]) -> None:  # any thread
            self.times = [tuple(m[2:5]) if isinstance(m, tuple) and len(m) >= 5 else None for m in values]

        try:
            self.backend.peek(timing, got)
        except Exception:  # noqa: BLE001 - a backend shut down: no times, ever
            self.times = [None] * len(timing)

    def _release_producers(self) -> None:
        producers, self._producers = self._producers, ()
        for p in producers:
            p.consumers -= 1
        self.reads = ()

    def _succeeded(self) -> None:
        """Every result was read without error: this call, and the producers whose every
        result it read, finished successfully (see `ok`)."""
        self.ok = True
        for p in self.reads:
            p.ok = True

    # ---- resolution ---------------------------------------------------------------------

    async def value(self) -> Any:
        """The collected result, for one awaiter (:class:`~asyncrl.GroupFuture`); raises the
        call's error. It waits for :meth:`outcome` and reads it with :meth:`result`; a
        cancelled awaiter withdraws its claim (the call is cancelled if it was the last)."""
        fut = self.outcome()
        if not fut.done():
            self.claims += 1
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                self.claims -= 1
                self.withdraw()  # this task's claim is gone; cancel if it was the last
                raise
            except BaseException:  # noqa: BLE001 - the outcome is in `fut`, raised below
                pass
            self.claims -= 1
        return self.result()

    def outcome(self) -> asyncio.Future[Any]:
        """The future every awaiter shares: the backend's fetch of every rank's outcome
        (resolved in one event-loop wake-up), or the error the controller failed the call
        with. The fetch starts on the first await."""
        if self._fut is None:
            loop = asyncio.get_running_loop()
            if self.deadline is not None and self._loop is None:  # issued without a running loop
                self._arm_deadline(loop)
            if self._error is not None:
                fut = loop.create_future()
                fut.set_exception(self._error)
                fut.exception()  # (retrieved, as in fail())
            else:
                self._fetch = self.backend.fetch(self._fetched_refs())
                fut = self._fetch.outcome
            self._fut = fut
        return self._fut

    def result(self) -> Any:
        """Once :meth:`outcome` is done: the collected result, or the call's error raised.
        The first reader settles the call from what the fetch delivered (:meth:`_delivered`);
        every reader gets the same outcome."""
        got = self._result
        if got is None:
            fut = self._fut
            assert fut is not None, "result() before outcome()"
            self._delivered(*fut.result())  # (raises the error the controller failed the call with)
            got = self._result
        value, error = got  # type: ignore[misc]
        if error is not None:
            raise error
        return value

    def _error_of(self, e: BaseException, rank: int | None) -> BaseException:
        """The one translation of a backend outcome for this call (see asyncrl._backend). A rank's error is in its
        metadata ref too (a timed call): it starts reading the times, which retrieves it (:meth:`read_times`)."""
        self.read_times()
        if isinstance(e, InputFailed) and self.top_from:  # Ray failed it before its host ran: an input's fault
            (group, method), *more = self.top_from
            if more:  # Ray does not say which argument: name every producer passed top-level
                group = " / ".join(g for g, _ in self.top_from)
                method = " / ".join(m for _, m in self.top_from)
            return UpstreamError(self.group, self.method, rank, input_error(e.outcome, group=group, method=method))
        err = public_error(e, group=self.group, method=self.method, rank=rank, closed=self.site.closed)
        if isinstance(err, WorkerDiedError) and not self._sent_before_replacement(rank):
            self.site._mark_broken(rank, str(e))
        return err

    def _sent_before_replacement(self, rank: int | None) -> bool:
        """Whether this call went to a process of `rank` that has been replaced since: its death is the old
        process's, not the new one's (``restart="process"``)."""
        if rank is None:
            return False
        fresh = self.sequencer.fresh[rank]
        return fresh > 0 and any(r == rank and call_id < fresh for r, call_id, _ in self.entries)

    # The fetch: no task, and one event-loop wake-up per call, not per rank: the backend
    # counts the refs down off the loop (Ray: on its own thread) and resolves the fetch's
    # future when the last one is done, or at once on the first error (the other ranks are
    # not waited for), which is translated once, with its rank.

    def _wait_order(self) -> list[int]:
        """The positions (in `refs`) of what `_fetched_refs` lists, in its order:
        the collected ranks, the non-collecting ones, then the padding metadata."""
        positions = list(self.collect_index)
        collected = set(positions)
        others = [i for i in range(len(self.refs)) if i not in collected]
        return positions + others + [positions[j] for j in self.fetch_metas]

    def _fetched_refs(self) -> list[Any]:
        refs = self.collect_refs
        if len(self.collect_index) < len(self.refs):  # non-collecting ranks: their errors surface too
            collected = set(self.collect_index)
            refs = list(refs) + [self.refs[i] for i in range(len(self.refs)) if i not in collected]
        if self.fetch_metas:
            metas = self.collect_metas
            refs = list(refs) + [metas[j] for j in self.fetch_metas]  # type: ignore[index]
        return refs

    def _delivered(self, got: list[Any], failed: int, at: float) -> None:
        """Settle the call from the fetch's one delivery (every outcome, or the first error),
        read by the first reader (:meth:`result`): the collected value, or the error."""
        self._fetch = None
        if self.done_at is None:
            self.done_at = at  # when the backend saw it, not when the loop got to it
        self._completed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if failed >= 0:
            pos = self._wait_order()[failed]
            self._result = (None, self._error_of(self.backend.translate(got[failed]), self.ranks[pos]))
        else:
            try:
                values = got[:len(self.collect_index)]
                if self.fetch_metas:
                    m = len(self.fetch_metas)
                    for j, (_, pad, *_t) in zip(self.fetch_metas, got[len(got) - m:]):
                        values[j] = B.strip_tail(values[j], pad)
                value = self._collect(values)
            except BaseException as err:  # noqa: BLE001 - a collect function's error, handed to every awaiter
                self._result = (None, err)
            else:
                self._succeeded()
                self._result = (value, None)
        self._release_producers()

    def _collect(self, values: list[Any]) -> Any:
        stats = self.site.stats
        stats.results_fetched += len(values)
        stats.bytes_fetched += B.payload_nbytes(values)
        if self.rank_zero:
            return values[0]
        return self.collect_fn(self.world, values)

    # ---- completion without fetching, and the deadline ---------------------------------------

    def is_done(self) -> bool:
        """Non-blocking: every rank finished, or the controller failed the call. The
        first call starts watching completion in the background (Ray: a completion
        callback per rank on Ray's own thread, no polling)."""
        if self._completed or self.settled():
            return True
        self._watch()
        return self._completed

    def _watch(self) -> None:
        if not self._watching:
            self._watching = True
            self.backend.watch(self.refs, self._mark_completed)

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call `fn()` on the running loop once `is_done()` turns true (see GroupFuture)."""
        loop = asyncio.get_running_loop()
        if self._done_callbacks is None:
            self._done_callbacks = (loop, [])
        self._done_callbacks[1].append(fn)
        if self._completed or self.settled():
            loop.call_soon(self._run_done_callbacks)
            return
        self._watch()
        if self._completed:  # the backend thread finished it between the two checks
            loop.call_soon(self._run_done_callbacks)

    def _run_done_callbacks(self) -> None:  # on the loop only: each callback runs once
        pending, self._done_callbacks = self._done_callbacks, None
        if pending is None:
            return
        loop, callbacks = pending
        for fn in callbacks:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - reported like asyncio's own callbacks
                loop.call_exception_handler({"message": f"done callback of {self.group}.{self.method} "
                                                   "raised", "exception": e})

    def _done_soon(self) -> None:
        """Schedule the done callbacks on the loop, from any thread."""
        pending = self._done_callbacks
        if pending is not None and not pending[0].is_closed():
            pending[0].call_soon_threadsafe(self._run_done_callbacks)

    def _mark_done_at(self) -> None:
        if self.done_at is None:
            self.done_at = time.perf_counter()

    def _mark_completed(self) -> None:  # may run on a backend thread
        self._mark_done_at()  # before `_completed`: whoever sees that also sees the time
        self._completed = True
        if self._done_callbacks is not None:
            self._done_soon()

    def _timeout_error(self, waited: float | None = None) -> CallTimeoutError:
        t = self.timeout if waited is None else waited
        return CallTimeoutError(
            f"{self.group}.{self.method} did not finish within its timeout of {t:g}s; the remote work was "
            "cancelled (a plain def method cannot be interrupted: while it runs, later ordered calls on its "
            "worker fail with LaneWedgedError)"
        )

    # ---- the deadline -----------------------------------------------------------------------

    def _on_deadline(self) -> None:
        self._timer = None
        if self._completed or self.settled():
            return
        task = asyncio.ensure_future(self._check_deadline())
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    async def _check_deadline(self) -> None:
        if not self._completed:
            try:
                done = await self.backend.all_done(self.refs)
            except Exception:  # the backend is gone (Ray shut down): let the fetch report it
                done = True
            if done:
                self._mark_done_at()
                self._completed = True
        if not self._completed:
            self.fail(self._timeout_error(), cancel_remote=True, deadline=True)

    def _arm_deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        """A call issued without a running loop gets its deadline timer on first await."""
        if self.deadline is None or self._timer is not None or self._loop is not None:
            return
        self._loop = loop
        self._timer = loop.call_later(max(0.0, self.deadline - time.monotonic()), self._on_deadline)


# ---- building every rank's Payload -------------------------------------------------------------


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
                        if entry[2] is not None and entry[1] >= sequencer.fresh[entry[0]]:
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
            # a known-ok call to one rank: its whole value, top-level
            if (TOP_VALUES and self.ok and len(s.refs) == 1 and s.data_parallel and s.metas is not None
                    and s.collect is not None and id(s.refs[0]) in self.ok):
                self.top_from[(s.group, s.method)] = None
                self.sent += 1
                top.extend((s.refs[0], s.metas[0]))
                return TopValue(s.group, s.method, s.select, s.collect, s.world, len(top) - 2, len(top) - 1)
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
