"""`GroupFuture`: the one result type of every group call, and the call's state machine.

A future holds the per-rank references of a call that was dispatched when the method
was called. Await it for the collected result, pass it into another group's call to
pipeline the data worker to worker, or stream per-rank results as they complete.
``result(timeout)`` is the blocking path for synchronous scripts.

The call's state lives in :mod:`asyncrl._call` (`_Call`, shared by a future and its
field selections): one deadline, checked against completion; the first outcome wins.
Awaiting reads it with ``_Call.value``; this module also holds the other readers: the
blocking ``result()``, per-rank streaming and :func:`gather`.

*Cancelling a shared future.* A call runs as long as someone waits for it: a task
awaiting it, or a pending call it feeds (a pipelined consumer). Cancelling a task that
awaits it withdraws that task's claim; the remote work is cancelled only when the last
claim is withdrawn so. ``future.cancel()`` cancels it for everyone. Cancellation never
flows upstream: cancelling a consumer leaves its producers running for their other
holders. To stop waiting without ever cancelling, await ``asyncio.shield(future)``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, AsyncIterator, Callable, Generator, Generic, Sequence, TypeVar

from asyncrl import batch as B
from asyncrl._call import _Call
from asyncrl._wire import Source, select_fields
from asyncrl.errors import GroupClosedError

__all__ = ["GroupFuture", "gather"]

T = TypeVar("T")

_AWAIT_CHUNK = 64  # futures awaited per batch by gather(); keeps each event-loop iteration short


class GroupFuture(Generic[T]):
    """An awaitable over the per-rank results of one group call.

    Not constructed by users: a group call returns it. See the module docstring for
    what a deadline and cancelling a shared future mean.
    """

    __slots__ = ("_call", "_select")

    def __init__(self, call: _Call, select: tuple[str, ...] | None = None) -> None:
        self._call = call
        self._select = select

    # ---- identity --------------------------------------------------------------------

    @property
    def group(self) -> str:
        """Name of the group that runs the call."""
        return self._call.group

    @property
    def method(self) -> str:
        """Name of the called method."""
        return self._call.method

    @property
    def ranks(self) -> list[int]:
        """Ranks that run the call, in the order of :attr:`refs`."""
        return list(self._call.ranks)

    @property
    def refs(self) -> list[Any]:
        """Per-rank result references (Ray ObjectRefs on the Ray backend)."""
        return list(self._call.refs)

    def __repr__(self) -> str:
        return f"<GroupFuture {self.group}.{self.method} ranks={self.ranks} {self._call.state()}>"

    # ---- results ---------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, T]:
        return self._await().__await__()

    async def _await(self) -> T:
        return self._apply_select(await self._call.value())

    def result(self, timeout: float | None = None) -> T:
        """Block until the collected result is ready (for synchronous scripts).

        Raises :class:`RuntimeError` inside a running event loop (use ``await``), and
        :class:`CallTimeoutError` when `timeout` seconds (or the call's own deadline)
        pass first; the remote work is then cancelled unless a task is awaiting it.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                "GroupFuture.result() blocks and cannot run inside a running event loop; use `await future`"
            )
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        return self._apply_select(_resolve_blocking(self._call, timeout))

    def done(self) -> bool:
        """True when every rank has finished (successfully or not) or the call failed
        (cancelled, timed out). Never blocks: it reports what the controller has seen;
        the first call starts watching the ranks in the background, so a polling loop
        sees it turn true within milliseconds of the last rank finishing."""
        return self._call.is_done()

    def add_done_callback(self, fn: "Callable[[GroupFuture[T]], None]") -> None:
        """Call ``fn(future)`` on the event loop once :meth:`done` turns true: every rank
        finished (successfully or not), or the controller failed the call (cancelled,
        timed out, group closed). Like ``done()`` it fetches nothing and never blocks (the
        backend watches the ranks off the loop; Ray: its ``_on_ready`` callback, as the last
        rank's task finishes, no polling); if the
        call is done already, `fn` is scheduled at once. Call it from the event loop."""
        self._call.add_done_callback(lambda: fn(self))

    def done_time(self) -> float | None:
        """When :meth:`done` turned true, as ``time.perf_counter()`` (the same clock as
        ``time.monotonic()`` in any process of the machine, on Linux): the moment the
        backend saw the last rank finish (Ray: on its own thread, as the task ended) or
        the controller failed the call; None while not done. Like ``done()`` it starts
        watching the ranks, fetches nothing and never blocks; unlike a done callback it
        never wakes the event loop, so a tracer can read it later, at leisure."""
        call = self._call
        return call.done_at if call.is_done() else None

    @property
    def timed(self) -> bool:
        """Whether the workers' times of this call reach the controller
        (:meth:`worker_times`): every ``DP_COMPUTE`` call, and every call of a group
        with ``time_calls`` set."""
        return self._call.timing is not None

    def worker_times(self) -> "list[tuple[float, float, float] | None] | None":
        """Per executing rank, ``(arrived, started, ended)``: the worker's ``time.time()``
        when the call reached its host, when the method started (after its turn and
        its pipelined inputs) and when it returned; None for a rank whose call failed.
        None while the times have not reached the controller, or when the call is not
        :attr:`timed`. Never blocks and never wakes the event loop: the times travel in
        the call's metadata, which each task's reply carries (no extra round-trip): the
        first call starts reading those refs (the backend's ``peek``)."""
        call = self._call
        if call.timing is None:
            return None
        call.read_times()
        return call.times or None

    async def summary(self) -> dict[str, Any]:
        """The ``summary`` fields (``@register(..., summary=(...))``) of this data-parallel call's result, each
        concatenated over the collected ranks in collect order, padding rows left out: what the result's fields
        hold, without fetching the result (they ride in each rank's reply; the result stays in the object store
        for the calls it feeds). Raises the call's error when it failed, and :class:`TypeError` when its method
        registered no ``summary``."""
        call = self._call
        metas = call.collect_metas
        if metas is None:
            raise TypeError(f"{call.group}.{call.method} is not a data-parallel call: it has no summary")
        loop = asyncio.get_running_loop()
        got: asyncio.Future[list[Any] | None] = loop.create_future()

        def deliver(values: list[Any] | None) -> None:
            if not got.done():
                got.set_result(values)

        def arrived(values: list[Any]) -> None:  # any thread (Ray's)
            loop.call_soon_threadsafe(deliver, values)

        call.backend.peek(metas, arrived)
        call.add_done_callback(lambda: deliver(None) if call._error is not None else None)  # failed here
        values = await got
        if values is None or call._error is not None or not all(isinstance(m, tuple) and len(m) >= 5 for m in values):
            await self._call.value()  # a rank (or the controller) failed the call: raise its error
            raise AssertionError("a call whose metadata failed cannot succeed")  # pragma: no cover
        # Every collected rank's reply arrived: its task returned the result with it (one task's returns are
        # stored together), so the call is known to have finished successfully (``_Call.ok``): a later call
        # takes its results as top-level arguments (asyncrl._deferred).
        call.ok = True
        if not all(len(m) == 6 for m in values):
            raise TypeError(f"{call.group}.{call.method} was registered without summary fields "
                            "(@register(..., summary=('field', ...)))")
        out: dict[str, Any] = {}
        for name in values[0][5]:
            parts = [m[5][name][:m[0] - m[1]] if m[1] else m[5][name] for m in values]
            out[name] = parts[0] if len(parts) == 1 else B.concat(parts)
        return out

    @property
    def worker_group(self) -> Any:
        """The group that issued this call."""
        return self._call.site

    def cancel(self) -> bool:
        """Cancel the call for every holder: its remote work on every rank that has not
        finished. Returns False when the controller has already seen it finish."""
        return self._call.cancel()

    def cancelled(self) -> bool:
        """True when the call was cancelled (:meth:`cancel`, or its last awaiting task cancelled)."""
        return self._call.cancel_requested

    async def as_completed(self, *, return_exceptions: bool = False) -> AsyncIterator[tuple[int, Any]]:
        """Yield ``(rank, result)`` per rank as each completes (padding stripped for
        data-parallel calls; not collected). A rank's error is raised (the other ranks
        are not waited for), or with `return_exceptions` yielded as that rank's result
        (the public error, naming its rank), so the ranks that succeeded still arrive.
        Raises the call's error if the controller fails it meanwhile (deadline, cancel)."""
        async for item in _stream(self._call, return_exceptions):
            yield item

    # ---- pipelining ------------------------------------------------------------------

    def select(self, *fields: str) -> "GroupFuture[T]":
        """A view of this future that resolves to only `fields` of its TensorDict result.

        Passed into another call, the selection happens on the receiving worker.
        """
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise ValueError(f"select() needs one or more field names, got {fields!r}")
        return GroupFuture(self._call, tuple(fields))

    def __getitem__(self, fields: str | tuple[str, ...]) -> "GroupFuture[T]":
        return self.select(*((fields,) if isinstance(fields, str) else fields))

    def _apply_select(self, value: Any) -> Any:
        if self._select is None:
            return value
        return select_fields(value, self._select, self._as_source())

    def _as_source(self) -> Source:
        call = self._call
        if call.site.closed:
            raise GroupClosedError(
                f"a future of {call.group}.{call.method} was passed on after its group closed; "
                "its results are gone. Await it before closing the group"
            )
        return Source(
            group=call.group,
            method=call.method,
            refs=tuple(call.collect_refs),
            metas=tuple(call.collect_metas) if call.collect_metas is not None else None,
            collect=_first if call.rank_zero else call.collect_fn,
            world=call.world,
            data_parallel=call.data_parallel,
            select=self._select,
            ranks=tuple(call.ranks[i] for i in call.collect_index),
        )


def _first(world: Any, results: list[Any]) -> Any:
    """Collect of RANK_ZERO calls: the single result."""
    return results[0]


# ---- the readers besides await: the blocking result() and per-rank streaming ---------------


def _resolve_blocking(call: _Call, timeout: float | None) -> Any:
    """The one blocking path (`GroupFuture.result`), for a thread without a running loop."""
    fut = call._fut
    if fut is not None and fut.done():
        return call.result()
    if call._error is not None:
        raise call._error
    now = time.monotonic()
    limits = [t for t in (None if timeout is None else now + timeout, call.deadline) if t is not None]
    until = min(limits) if limits else None
    metas = call.collect_metas
    refs = call.refs + [metas[j] for j in call.fetch_metas]  # type: ignore[index]
    outcomes = call.backend.get(refs, None if until is None else max(0.0, until - now))
    if outcomes is None:  # nothing failed, but not every rank finished in time
        if call.deadline is not None and time.monotonic() >= call.deadline - 1e-3:
            err = call._timeout_error()
            _fail_from_thread(call, err, cancel_remote=True, deadline=True)
        else:
            err = call._timeout_error(timeout)
            # result()'s own limit is this waiter's: cancel only when nobody else waits
            _fail_from_thread(call, err, cancel_remote=call.claims == 0 and call.consumers == 0)
        raise err
    call._mark_done_at()
    call._completed = True
    values = []
    for pos, (ok, value) in enumerate(outcomes):
        if not ok:
            rank = (call.ranks[pos] if pos < len(call.ranks)
                    else call.ranks[call.collect_index[call.fetch_metas[pos - len(call.ranks)]]])
            raise call._error_of(value, rank)
        values.append(value)
    n = len(call.refs)
    payloads = [values[i] for i in call.collect_index]
    for j, (_, pad, *_t) in zip(call.fetch_metas, values[n:]):
        payloads[j] = B.strip_tail(payloads[j], pad)
    value = call._collect(payloads)
    call._succeeded()  # (from the caller's thread: plain flags, read later by issuing calls)
    return value


def _fail_from_thread(call: _Call, error: BaseException, *, cancel_remote: bool, deadline: bool = False) -> None:
    """`fail` from a thread that is not the loop's (the blocking `result()` path)."""
    loop = call._loop
    if loop is not None and not loop.is_closed():
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            loop.call_soon_threadsafe(lambda: call.fail(error, cancel_remote=cancel_remote, deadline=deadline))
            return
    call.fail(error, cancel_remote=cancel_remote, deadline=deadline)


async def _stream(call: _Call, return_exceptions: bool = False) -> AsyncIterator[tuple[int, Any]]:
    """`GroupFuture.as_completed`: ``(rank, result)`` per collected rank as each completes
    (a wait per rank; with `return_exceptions` a rank's error is its result); the call's
    error if the controller fails it meanwhile."""
    async def one(i: int) -> tuple[int, Any]:
        try:
            value = await _wait(call, call.collect_index[i], call.collect_refs[i])
        except Exception as e:
            if not return_exceptions:
                raise
            return call.ranks[call.collect_index[i]], e
        if i in call.fetch_metas:
            _, pad, *_t = await _wait(call, call.collect_index[i], call.collect_metas[i])  # type: ignore[index]
            value = B.strip_tail(value, pad)
        call.site.stats.results_fetched += 1
        call.site.stats.bytes_fetched += B.payload_nbytes(value)
        return call.ranks[call.collect_index[i]], value

    failure: asyncio.Future[Any] = _failure(call)
    pending: set[asyncio.Future[Any]] = {asyncio.ensure_future(one(i)) for i in range(len(call.collect_refs))}
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


def _failure(call: _Call) -> asyncio.Future[BaseException]:
    """Resolves with the error when the controller fails the call (for streaming)."""
    if call._failure is None:
        loop = asyncio.get_running_loop()
        call._arm_deadline(loop)
        call._failure = loop.create_future()
        if call._error is not None:
            call._failure.set_result(call._error)
    return call._failure


async def _wait(call: _Call, pos: int, ref: Any) -> Any:
    """One rank's result (position `pos` of the call's refs); its error as the call's."""
    try:
        return await call.backend.wait(ref)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise call._error_of(e, call.ranks[pos]) from None


async def gather(*futures: "GroupFuture[Any]", chunk: int = _AWAIT_CHUNK) -> list[Any]:
    """Await many futures, `chunk` at a time, and return their results in order.

    ``asyncio.gather`` over thousands of futures starts thousands of tasks in one
    event-loop iteration; this keeps every iteration short, so other tasks on the
    controller (heartbeats, HTTP handlers) stay responsive; GroupFutures are awaited
    without a task each. All calls are already in flight, so awaiting them in chunks
    costs no throughput. The first error is raised. Cancelling the awaiting task
    withdraws its claim on the futures it is waiting for, as cancelling ``await future``
    does (a call nobody else awaits is cancelled).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    out: list[Any] = []
    for i in range(0, len(futures), chunk):
        part = futures[i:i + chunk]
        if all(type(f) is GroupFuture for f in part):
            out.extend(await _await_all(part))
        else:  # other awaitables too: a task each, as asyncio.gather does
            out.extend(await asyncio.gather(*part))
    return out


async def _await_all(futures: "Sequence[GroupFuture[Any]]") -> list[Any]:
    """Await `futures` as ``await f`` would each, without a task per future: one waiter
    for all, woken by the calls' shared outcome futures (at the first error, or when the
    last one is done). Raises the first error, as ``asyncio.gather`` does."""
    calls = [f._call for f in futures]
    outcomes = [c.outcome() for c in calls]
    failed = next((c for c, o in zip(calls, outcomes) if o.done() and _fails(c)), None)
    pending = [(c, o) for c, o in zip(calls, outcomes) if not o.done()]
    if failed is None and pending:
        waiter: asyncio.Future[_Call | None] = asyncio.get_running_loop().create_future()
        left = len(pending)

        def one_done(call: _Call, _: asyncio.Future[Any]) -> None:
            nonlocal left
            left -= 1
            if waiter.done():
                return
            if _fails(call):
                waiter.set_result(call)
            elif left == 0:
                waiter.set_result(None)

        callbacks = [functools.partial(one_done, call) for call, _ in pending]
        for (call, o), cb in zip(pending, callbacks):
            call.claims += 1
            o.add_done_callback(cb)
        try:
            try:
                failed = await waiter
            finally:
                for (call, o), cb in zip(pending, callbacks):
                    o.remove_done_callback(cb)
                    call.claims -= 1
        except asyncio.CancelledError:
            for call, _ in pending:
                call.withdraw()  # this task's claim is gone; cancel the call if it was the last
            raise
    if failed is not None:
        failed.result()  # raises its error
    return [f._apply_select(c.result()) for f, c in zip(futures, calls)]


def _fails(call: _Call) -> bool:
    """Whether a call whose outcome is done failed (reading it settles it)."""
    try:
        call.result()
    except BaseException:  # noqa: BLE001 - its error, raised again to whoever reads it
        return True
    return False
