"""`LoopLag`: how long the event loop was unable to run a task, measured with a heartbeat.

A task sleeps `interval` seconds over and over; each time it wakes, the delay past its
deadline is time during which the loop was busy with something else (a blocking call, a
long callback). Request latency of an HTTP endpoint includes network and handler time;
this measures only what the controller's own work costs everything else on the loop::

    async with LoopLag(interval=0.01) as lag:
        await trainer.fit()
    print(lag.statistics())   # {"samples": ..., "max_s": ..., "p99_s": ..., "over_100ms": ...}
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["LoopLag"]


class LoopLag:
    """A heartbeat task that records the event loop's lag while the ``async with`` block runs.

    Args:
        interval: seconds between heartbeats.
    """

    def __init__(self, interval: float = 0.01) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        self.interval = interval
        self.lags: list[float] = []
        """Lag of each heartbeat (seconds past its deadline), in order."""
        self.worst_at: float | None = None
        """``time.monotonic()`` of the worst heartbeat."""
        self._task: asyncio.Task[None] | None = None
        self._due: float | None = None

    def _record(self, lag: float) -> None:
        if not self.lags or lag > max(self.lags):
            self.worst_at = time.monotonic()
        self.lags.append(lag)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self._record(max(0.0, loop.time() - self._due))
            self._due = None

    async def __aenter__(self) -> "LoopLag":
        self._task = asyncio.create_task(self._run(), name="loop-lag heartbeat")
        return self

    async def __aexit__(self, *exc: object) -> None:
        # A stall at the very end of the block delays the heartbeat that is due now: count it.
        if self._due is not None and asyncio.get_running_loop().time() > self._due:
            self._record(asyncio.get_running_loop().time() - self._due)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    @property
    def max(self) -> float:
        """The worst lag seen (0 before any heartbeat)."""
        return max(self.lags, default=0.0)

    def statistics(self) -> dict[str, Any]:
        """``samples``, ``max_s``, ``p50_s``, ``p99_s`` and ``over_100ms`` (heartbeats that late)."""
        s = sorted(self.lags)
        pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] if s else 0.0  # noqa: E731
        return {"samples": len(s), "max_s": self.max, "p50_s": pick(0.5), "p99_s": pick(0.99),
                "over_100ms": sum(1 for x in s if x > 0.1)}
