"""`GroupFuture`: the one result type of every group call.

A future holds the per-rank references of a call that was dispatched when the
method was called. Await it for the collected result, pass it into another group's
call to pipeline the data worker to worker, or stream per-rank results as they
complete. ``result(timeout)`` is the blocking path for synchronous scripts.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Generator, Generic, TypeVar

from asyncrl import batch as B
from asyncrl._deferred import Source
from asyncrl.errors import (
    AsyncRLError,
    CallCancelledError,
    CallTimeoutError,
    GroupClosedError,
    RemoteError,
    WorkerDiedError,
)

if TYPE_CHECKING:
    from asyncrl.worker_group import _Call

__all__ = ["GroupFuture", "gather"]

T = TypeVar("T")

_AWAIT_CHUNK = 64  # futures awaited per batch by gather(); keeps each event-loop iteration short


class GroupFuture(Generic[T]):
    """An awaitable over the per-rank results of one group call.

    Not constructed by users: a group call returns it.
    """

    def __init__(self, call: "_Call", select: tuple[str, ...] | None = None) -> None:
        self._call = call
        self._select = select

    # ---- identity --------------------------------------------------------------------

    @property
    def group(self) -> str:
        """Name of the group that runs the call."""
        return self._call.group.name

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
        state = "done" if self.done() else "pending"
        return f"<GroupFuture {self.group}.{self.method} ranks={self.ranks} {state}>"

    # ---- results ---------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, T]:
        return self._await().__await__()

    async def _await(self) -> T:
        try:
            value = await asyncio.shield(self._call.resolution())
        except asyncio.CancelledError:
            # The awaiting task was cancelled (not the call): cancel the remote work too.
            self.cancel()
            raise
        return self._apply_select(value)

    def result(self, timeout: float | None = None) -> T:
        """Block until the collected result is ready (for synchronous scripts).

        Raises :class:`RuntimeError` inside a running event loop (use ``await``), and
        :class:`CallTimeoutError` when `timeout` seconds pass first (the remote work is
        cancelled).
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
        """True when every rank has finished (successfully or not) or the call was cancelled."""
        return self._call.is_done()

    def cancel(self) -> bool:
        """Cancel the remote work of every rank that has not finished. Returns False
        when the call had already finished."""
        return self._call.cancel()

    def cancelled(self) -> bool:
        """True when :meth:`cancel` was called before the call finished."""
        return self._call.cancelled

    async def as_completed(self) -> AsyncIterator[tuple[int, Any]]:
        """Yield ``(rank, result)`` per rank as each completes (padding stripped for
        data-parallel calls; not collected)."""
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
        if call.group.closed:
            raise GroupClosedError(
                f"a future of {call.group.name}.{call.method} was passed on after its group closed; "
                "its results are gone. Await it before closing the group"
            )
        return Source(
            group=call.group.name,
            method=call.method,
            refs=tuple(call.collect_refs),
            metas=tuple(call.collect_metas) if call.collect_metas is not None else None,
            collect=_first if call.rank_zero else call.collect_fn,
            world=call.world,
            data_parallel=call.data_parallel,
            select=self._select,
        )


def _first(world: Any, results: list[Any]) -> Any:
    """Collect of RANK_ZERO calls: the single result."""
    return results[0]


async def gather(*futures: "GroupFuture[Any]", chunk: int = _AWAIT_CHUNK) -> list[Any]:
    """Await many futures, `chunk` at a time, and return their results in order.

    ``asyncio.gather`` over thousands of futures starts thousands of tasks in one
    event-loop iteration; this keeps every iteration short, so other tasks on the
    controller (heartbeats, HTTP handlers) stay responsive. All calls are already in
    flight, so awaiting them in chunks costs no throughput. The first error is raised.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    out: list[Any] = []
    for i in range(0, len(futures), chunk):
        out.extend(await asyncio.gather(*futures[i:i + chunk]))
    return out
