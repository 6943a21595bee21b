"""`GroupFuture`: the one result type of every group call, and the call's state machine.

A future holds the per-rank references of a call that was dispatched when the method
was called. Await it for the collected result, pass it into another group's call to
pipeline the data worker to worker, or stream per-rank results as they complete.
``result(timeout)`` is the blocking path for synchronous scripts.

The call's state lives in :mod:`asyncrl._call` (`_Call`, shared by a future and its
field selections): one deadline, checked against completion; the first outcome wins.

*Cancelling a shared future.* A call runs as long as someone waits for it: a task
awaiting it, or a pending call it feeds (a pipelined consumer). Cancelling a task that
awaits it withdraws that task's claim; the remote work is cancelled only when the last
claim is withdrawn so. ``future.cancel()`` cancels it for everyone. Cancellation never
flows upstream: cancelling a consumer leaves its producers running for their other
holders. To stop waiting without ever cancelling, await ``asyncio.shield(future)``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable, Generator, Generic, Sequence, TypeVar

from asyncrl._call import _Call
from asyncrl._deferred import Source
from asyncrl.errors import CallTimeoutError, GroupClosedError

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
        call = self._call
        fut = call.outcome()
        if not fut.done():
            call.claims += 1
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                call.claims -= 1
                call.withdraw()  # this task's claim is gone; cancel if it was the last
                raise
            except BaseException:  # noqa: BLE001 - the outcome is in `fut`, raised below
                pass
            call.claims -= 1
        return self._apply_select(fut.result())

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
        return self._apply_select(self._call.resolve_blocking(timeout))

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
        if call.times is None:
            call.times = False

            def got(values: list[Any]) -> None:  # any thread
                call.times = [tuple(m[2:5]) if isinstance(m, tuple) and len(m) >= 5 else None for m in values]

            try:
                call.backend.peek(call.timing, got)
            except Exception:  # noqa: BLE001 - a backend shut down: no times, ever
                call.times = [None] * len(call.timing)
        return call.times or None

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

    async def as_completed(self) -> AsyncIterator[tuple[int, Any]]:
        """Yield ``(rank, result)`` per rank as each completes (padding stripped for
        data-parallel calls; not collected). Raises the call's error if the controller
        fails it meanwhile (deadline, cancel)."""
        async for item in self._call.stream():
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
        from asyncrl._deferred import _select

        return _select(value, self._select, self._as_source())

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


def producers_of(args: Sequence[Any], kwargs: dict[str, Any]) -> Sequence[_Call]:
    """The calls whose futures are among a call's arguments (top level, or in a list)."""
    out: list[_Call] = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, GroupFuture):
            out.append(x._call)
        elif isinstance(x, (list, tuple)):
            out.extend(i._call for i in x if isinstance(i, GroupFuture))
    return out or ()  # (most calls have none: no list kept per call)


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
    outcomes = [f._call.outcome() for f in futures]
    failed = next((o for o in outcomes if o.done() and (o.cancelled() or o.exception() is not None)), None)
    pending = [(f._call, o) for f, o in zip(futures, outcomes) if not o.done()]
    if failed is None and pending:
        waiter: asyncio.Future[asyncio.Future[Any] | None] = asyncio.get_running_loop().create_future()
        left = len(pending)

        def one_done(o: asyncio.Future[Any]) -> None:
            nonlocal left
            left -= 1
            if waiter.done():
                return
            if o.cancelled() or o.exception() is not None:
                waiter.set_result(o)
            elif left == 0:
                waiter.set_result(None)

        for call, o in pending:
            call.claims += 1
            o.add_done_callback(one_done)
        try:
            try:
                failed = await waiter
            finally:
                for call, o in pending:
                    o.remove_done_callback(one_done)
                    call.claims -= 1
        except asyncio.CancelledError:
            for call, _ in pending:
                call.withdraw()  # this task's claim is gone; cancel the call if it was the last
            raise
    if failed is not None:
        failed.result()  # raises its error
    return [f._apply_select(o.result()) for f, o in zip(futures, outcomes)]
