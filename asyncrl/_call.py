"""The state machine of one group call (`_Call`), shared by a :class:`~asyncrl.GroupFuture` and its field selections.

``pending`` → ``completed`` (every rank finished; the value or the error is fetched on
await) or ``failed`` by the controller: cancelled, timed out, or its group closed. The
first outcome wins and every holder sees the same one.

*One deadline.* ``wg.m.options(timeout=s)(...)`` gives the call a deadline, checked
against completion: when it passes, the controller asks the backend (off the event
loop) whether every rank has finished; if so the call completed in time and never
raises :class:`~asyncrl.CallTimeoutError`, however late it is awaited. Otherwise the
call fails with ``CallTimeoutError`` for every holder and its remote work is cancelled
through the one cancel path (:mod:`asyncrl._sequencer`, docs/protocol.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol, Sequence

from asyncrl import batch as B
from asyncrl._backend import Backend, InputFailed, input_error, public_error
from asyncrl.register import Execute
from asyncrl.errors import (
    CallCancelledError,
    CallTimeoutError,
    GroupClosedError,
    UpstreamError,
    WorkerDiedError,
)

if TYPE_CHECKING:
    from asyncrl._sequencer import Entry, Sequencer
    from asyncrl.dispatch import World
    from asyncrl.register import MethodSpec

__all__: list[str] = []  # internal: the public face is asyncrl.future.GroupFuture

_BACKGROUND: set[asyncio.Task[Any]] = set()  # deadline checks in flight (a task needs a strong reference)


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
        "_done_callbacks", "done_at",
        "site", "backend", "sequencer", "method", "ranks", "refs", "metas", "entries", "world",
        "data_parallel", "rank_zero", "collect_fn", "collect_index", "collect_refs", "collect_metas", "fetch_metas",
        "timeout", "deadline", "claims", "consumers", "cancel_requested", "ok", "reads", "top_from",
        "_producers", "_timer", "_fut", "_fetch", "_error", "_completed", "_watching", "_failure", "_loop",
        "timing", "times",
        "__weakref__",  # the sequencer remembers a pinned lane's calls weakly (case 15 of docs/protocol.md)
    )

    def __init__(self, site: _Site, backend: Backend, sequencer: "Sequencer", spec: "MethodSpec", world: "World",
                 ranks: Sequence[int], collect_index: Sequence[int], refs: list[Any], metas: list[Any] | None,
                 entries: "Sequence[Entry]", timeout: float | None, producers: "Sequence[_Call]",
                 pads: Sequence[int] | None = None) -> None:
        # Thousands of calls may be in flight at once, each holding its _Call: every
        # container here is one more object for the garbage collector's full passes to
        # walk (benchmarks/inflight.py), so the per-group parts (ranks, collect order)
        # are shared tuples and the collected refs are the refs themselves when the
        # order is the identity.
        self.site = site
        self.backend = backend
        self.sequencer = sequencer
        self.method = spec.name
        self.ranks = ranks
        self.refs = refs
        self.metas = metas
        self.timing = metas  # the metadata refs that carry the workers' times (GroupFuture.worker_times)
        self.times: Any = None  # None, then False while reading them, then the times per rank
        self.entries = entries
        self.world = world
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
        # consumers with another layout (C4), fetched or not.
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
        call that then succeeded (`reads`; a same-process hand-off counts). Only such a call's results are passed
        top-level into later calls (asyncrl._deferred says why). Never set on failure."""
        self.reads: "tuple[_Call, ...]" = ()  # producers whose every collected result this call reads
        self.top_from: tuple[tuple[str, str], ...] | None = None  # (group, method) of its top-level inputs' producers
        self._producers = producers
        for p in producers:
            p.consumers += 1
        self._fut: asyncio.Future[Any] | None = None
        self._fetch: Any = None  # the backend's fetch of the refs, while it is outstanding
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

    def state(self) -> str:
        """What the controller knows, without asking anyone (for repr)."""
        if self._error is not None:
            return "cancelled" if self.cancel_requested else f"failed ({type(self._error).__name__})"
        if self._fut is not None and self._fut.done():
            return "done" if self._fut.exception() is None else f"failed ({type(self._fut.exception()).__name__})"
        return "completed" if self._completed else "pending"

    def _mark_done_at(self) -> None:
        if self.done_at is None:
            self.done_at = time.perf_counter()

    def _mark_completed(self) -> None:  # may run on a backend thread
        self._mark_done_at()  # before `_completed`: whoever sees that also sees the time
        self._completed = True
        if self._done_callbacks is not None:
            self._done_soon()

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
        if self._failure is not None and not self._failure.done():
            self._failure.set_result(error)
        fetch, self._fetch = self._fetch, None
        if fetch is not None:
            fetch.cancel()  # its delivery, if it comes, is a no-op
        if cancel_remote:
            self.sequencer.cancel(self.entries, deadline=deadline)
        self._release_producers()
        return True

    def fail_from_thread(self, error: BaseException, *, cancel_remote: bool, deadline: bool = False) -> None:
        """`fail` from a thread that is not the loop's (the blocking `result()` path)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                loop.call_soon_threadsafe(lambda: self.fail(error, cancel_remote=cancel_remote, deadline=deadline))
                return
        self.fail(error, cancel_remote=cancel_remote, deadline=deadline)

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

    # ---- resolution ---------------------------------------------------------------------

    def outcome(self) -> asyncio.Future[Any]:
        """The future every awaiter shares; fetching starts on the first await."""
        if self._fut is None:
            loop = asyncio.get_running_loop()
            self._arm_deadline(loop)
            fut = self._fut = loop.create_future()
            fut.add_done_callback(_retrieve)  # a failure nobody awaits is not "never retrieved"
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                self._start_fetch()
        return self._fut

    def failure(self) -> asyncio.Future[BaseException]:
        """Resolves with the error when the controller fails the call (for streaming)."""
        if self._failure is None:
            loop = asyncio.get_running_loop()
            self._arm_deadline(loop)
            self._failure = loop.create_future()
            if self._error is not None:
                self._failure.set_result(self._error)
        return self._failure

    def _finish(self, fut: asyncio.Future[Any], value: Any = None, error: BaseException | None = None) -> None:
        self._mark_done_at()
        self._completed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not fut.done():
            if error is not None:
                fut.set_exception(error)
            else:
                self._succeeded()
                fut.set_result(value)
        self._release_producers()

    def _error_of(self, e: BaseException, rank: int | None) -> BaseException:
        """The one translation of a backend outcome for this call (see asyncrl._backend)."""
        if isinstance(e, InputFailed) and self.top_from:  # Ray failed it before its host ran: an input's fault
            (group, method), *more = self.top_from
            if more:  # Ray does not say which argument: name every producer passed top-level
                group = " / ".join(g for g, _ in self.top_from)
                method = " / ".join(m for _, m in self.top_from)
            return UpstreamError(self.group, self.method, rank, input_error(e.outcome, group=group, method=method))
        err = public_error(e, group=self.group, method=self.method, rank=rank, closed=self.site.closed)
        if isinstance(err, WorkerDiedError):
            self.site._mark_broken(rank, str(e))
        return err

    async def _wait(self, pos: int, ref: Any) -> Any:
        try:
            return await self.backend.wait(ref)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise self._error_of(e, self.ranks[pos]) from None

    # The fetch: no task, no coroutine, and one event-loop wake-up per call, not per
    # rank: the backend counts the refs down off the loop (Ray: on its own thread) and
    # delivers them together when the last one is done, or at once on the first error
    # (the other ranks are not waited for), which is translated once, with its rank.

    def _wait_order(self) -> list[int]:
        """The positions (in `refs`) of what `_start_fetch` fetches, in its order:
        the collected ranks, the non-collecting ones, then the padding metadata."""
        positions = list(self.collect_index)
        collected = set(positions)
        others = [i for i in range(len(self.refs)) if i not in collected]
        return positions + others + [positions[j] for j in self.fetch_metas]

    def _start_fetch(self) -> None:
        refs = self.collect_refs
        if len(self.collect_index) < len(self.refs):  # non-collecting ranks: their errors surface too
            collected = set(self.collect_index)
            refs = list(refs) + [self.refs[i] for i in range(len(self.refs)) if i not in collected]
        if self.fetch_metas:
            metas = self.collect_metas
            refs = list(refs) + [metas[j] for j in self.fetch_metas]  # type: ignore[index]
        self._fetch = self.backend.fetch(refs, self._delivered)

    def _delivered(self, got: list[Any], failed: int, at: float) -> None:
        """The backend's one delivery (on the loop): every outcome, or the first error."""
        fut = self._fut
        if fut is None or self._fetch is None or fut.done():
            return  # settled meanwhile by the controller (fail() cancels the fetch)
        self._fetch = None
        if self.done_at is None:
            self.done_at = at  # when the backend saw it, not when the loop got to it
        if failed >= 0:
            pos = self._wait_order()[failed]
            self._finish(fut, error=self._error_of(self.backend.translate(got[failed]), self.ranks[pos]))
            return
        try:
            values = got[:len(self.collect_index)]
            if self.fetch_metas:
                m = len(self.fetch_metas)
                for j, (_, pad, *_t) in zip(self.fetch_metas, got[len(got) - m:]):
                    values[j] = B.strip_tail(values[j], pad)
            value = self._collect(values)
        except BaseException as err:  # noqa: BLE001 - a collect function's error, handed to every awaiter
            self._finish(fut, error=err)
        else:
            self._finish(fut, value=value)

    def _collect(self, values: list[Any]) -> Any:
        stats = self.site.stats
        stats.results_fetched += len(values)
        stats.bytes_fetched += B.payload_nbytes(values)
        if self.rank_zero:
            return values[0]
        return self.collect_fn(self.world, values)

    def resolve_blocking(self, timeout: float | None) -> Any:
        """The one blocking path (`GroupFuture.result`), for a thread without a running loop."""
        fut = self._fut
        if fut is not None and fut.done():
            return fut.result()
        if self._error is not None:
            raise self._error
        now = time.monotonic()
        limits = [t for t in (None if timeout is None else now + timeout, self.deadline) if t is not None]
        until = min(limits) if limits else None
        metas = self.collect_metas
        refs = self.refs + [metas[j] for j in self.fetch_metas]  # type: ignore[index]
        outcomes = self.backend.get(refs, None if until is None else max(0.0, until - now))
        if outcomes is None:  # nothing failed, but not every rank finished in time
            if self.deadline is not None and time.monotonic() >= self.deadline - 1e-3:
                err = self._timeout_error()
                self.fail_from_thread(err, cancel_remote=True, deadline=True)
            else:
                err = self._timeout_error(timeout)
                # result()'s own limit is this waiter's: cancel only when nobody else waits
                self.fail_from_thread(err, cancel_remote=self.claims == 0 and self.consumers == 0)
            raise err
        self._mark_done_at()
        self._completed = True
        values = []
        for pos, (ok, value) in enumerate(outcomes):
            if not ok:
                rank = (self.ranks[pos] if pos < len(self.ranks)
                        else self.ranks[self.collect_index[self.fetch_metas[pos - len(self.ranks)]]])
                raise self._error_of(value, rank)
            values.append(value)
        n = len(self.refs)
        payloads = [values[i] for i in self.collect_index]
        for j, (_, pad, *_t) in zip(self.fetch_metas, values[n:]):
            payloads[j] = B.strip_tail(payloads[j], pad)
        value = self._collect(payloads)
        self._succeeded()  # (from the caller's thread: plain flags, read later by issuing calls)
        return value

    async def stream(self) -> AsyncIterator[tuple[int, Any]]:
        async def one(i: int) -> tuple[int, Any]:
            value = await self._wait(self.collect_index[i], self.collect_refs[i])
            if i in self.fetch_metas:
                _, pad, *_t = await self._wait(self.collect_index[i], self.collect_metas[i])  # type: ignore[index]
                value = B.strip_tail(value, pad)
            self.site.stats.results_fetched += 1
            self.site.stats.bytes_fetched += B.payload_nbytes(value)
            return self.ranks[self.collect_index[i]], value

        failure: asyncio.Future[Any] = self.failure()
        pending: set[asyncio.Future[Any]] = {asyncio.ensure_future(one(i)) for i in range(len(self.collect_refs))}
        try:
            while pending:
                done, _ = await asyncio.wait(pending | {failure}, return_when=asyncio.FIRST_COMPLETED)
                if failure in done:
                    raise failure.result()
                for t in done:
                    pending.discard(t)
                    item: tuple[int, Any] = t.result()
                    yield item
        finally:
            for t in pending:
                t.cancel()


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
