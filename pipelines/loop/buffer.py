"""`StalenessBuffer`: the bounded queue between the rollout loop and the train loop.

The producer ``await put(item)`` waits while the buffer is full (backpressure). The
consumer ``await get(current_version)`` receives items in FIFO order but never one
generated more than ``max_staleness`` policy versions before `current_version`:
older items are dropped and counted. ``statistics()`` reports the occupancy and the
counters at any moment, so backpressure is observable.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

import anyio

__all__ = ["StalenessBuffer", "BufferStatistics", "StaleSampleError"]

T = TypeVar("T")


class StaleSampleError(RuntimeError):
    """Raised when an item claims a policy version newer than the consumer's (a bookkeeping bug)."""


@dataclass(frozen=True)
class BufferStatistics:
    """A snapshot of a :class:`StalenessBuffer`."""

    size: int
    """Items waiting in the buffer now."""
    capacity: int
    """Most items the buffer holds before ``put`` waits."""
    max_staleness: int
    """Oldest allowed version lag of a delivered item."""
    put_waiters: int
    """Producers waiting for space."""
    get_waiters: int
    """Consumers waiting for an item."""
    peak: int
    """Largest size seen."""
    puts: int
    """Items accepted so far."""
    delivered: int
    """Items handed to consumers so far."""
    dropped: int
    """Items discarded for being too stale."""
    closed: bool
    """True after :meth:`StalenessBuffer.close` (the producer is done)."""


class StalenessBuffer(Generic[T]):
    """A bounded FIFO of versioned items with a staleness bound on delivery.

    Args:
        capacity: most items held; ``put`` waits while full.
        max_staleness: an item of version ``v`` is delivered to ``get(current)`` only
            when ``current - v <= max_staleness``; older ones are dropped and counted.
        version_of: how to read an item's policy version (default: ``item.version``).
        on_drop: called as ``on_drop(item, current_version)`` for each item dropped as too stale.
    """

    def __init__(self, capacity: int, max_staleness: int, *,
                 version_of: Callable[[T], int] = lambda item: item.version,  # type: ignore[attr-defined]
                 on_drop: Callable[[T, int], None] | None = None) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self._version_of = version_of
        self._on_drop = on_drop
        self._items: deque[T] = deque()
        self._cond: asyncio.Condition | None = None
        self._put_waiters = 0
        self._get_waiters = 0
        self._peak = 0
        self._puts = 0
        self._delivered = 0
        self._dropped = 0
        self._closed = False

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # created lazily: the buffer may be built outside a loop
            self._cond = asyncio.Condition()
        return self._cond

    def __len__(self) -> int:
        return len(self._items)

    def statistics(self) -> BufferStatistics:
        """The current occupancy and counters."""
        return BufferStatistics(
            size=len(self._items), capacity=self.capacity, max_staleness=self.max_staleness,
            put_waiters=self._put_waiters, get_waiters=self._get_waiters, peak=self._peak,
            puts=self._puts, delivered=self._delivered, dropped=self._dropped, closed=self._closed,
        )

    async def put(self, item: T) -> None:
        """Append `item`, waiting while the buffer is full.

        Raises :class:`anyio.ClosedResourceError` after :meth:`close`.
        """
        cond = self._condition()
        async with cond:
            self._put_waiters += 1
            try:
                await cond.wait_for(lambda: self._closed or len(self._items) < self.capacity)
            finally:
                self._put_waiters -= 1
            if self._closed:
                raise anyio.ClosedResourceError("the buffer is closed; the consumer stopped")
            self._items.append(item)
            self._puts += 1
            self._peak = max(self._peak, len(self._items))
            cond.notify_all()

    def put_nowait(self, item: T) -> None:
        """Append `item` now; :class:`anyio.WouldBlock` when full (for restoring a checkpoint)."""
        if self._closed:
            raise anyio.ClosedResourceError("the buffer is closed")
        if len(self._items) >= self.capacity:
            raise anyio.WouldBlock()
        self._items.append(item)
        self._puts += 1
        self._peak = max(self._peak, len(self._items))

    async def get(self, current_version: int) -> T:
        """The oldest item no more than ``max_staleness`` versions behind `current_version`.

        Stale items ahead of it are dropped. Raises :class:`anyio.EndOfStream` when
        the buffer is closed and empty.
        """
        cond = self._condition()
        async with cond:
            while True:
                while self._items:
                    item = self._items.popleft()
                    lag = current_version - self._version_of(item)
                    if lag < 0:
                        raise StaleSampleError(
                            f"an item of version {self._version_of(item)} reached a consumer at version "
                            f"{current_version}; versions must not run ahead of the policy"
                        )
                    cond.notify_all()  # space freed
                    if lag > self.max_staleness:
                        self._dropped += 1
                        if self._on_drop is not None:
                            self._on_drop(item, current_version)
                        continue
                    self._delivered += 1
                    return item
                if self._closed:
                    raise anyio.EndOfStream()
                self._get_waiters += 1
                try:
                    await cond.wait()
                finally:
                    self._get_waiters -= 1

    def peek_all(self) -> list[T]:
        """The items waiting now, oldest first (for checkpoints)."""
        return list(self._items)

    async def close(self) -> None:
        """Mark the producer done and wake every waiter: ``get`` drains what is left,
        then raises :class:`anyio.EndOfStream`; ``put`` raises :class:`anyio.ClosedResourceError`."""
        cond = self._condition()
        async with cond:
            self._closed = True
            cond.notify_all()
