"""Stage spans of a training run, written as Chrome/Perfetto trace JSON.

The controller records two kinds of spans:

* **controller spans** (``tracer.span("train.step", step=3)``): a block of controller
  code, measured exactly;
* **group spans** (``tracer.watch(future, stage="old_log_prob", step=3)``): a group
  call from the moment it was issued until every rank finished. The controller does
  not await pipelined futures, so one watcher task polls ``GroupFuture.done()``
  every ``poll_s`` seconds (it never blocks: the backend watches the ranks off the
  loop, without fetching): the end of a group span is exact to that resolution, and
  no payload bytes move.

Each group is a track (``pid`` = the group, ``tid`` = its ranks), so opening
``trace.json`` in https://ui.perfetto.dev shows rollout and training side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

__all__ = ["Span", "Tracer"]


@dataclass
class Span:
    """One finished span, times in seconds since the tracer started."""

    name: str
    track: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)


def _done_flags(futures: list[Any]) -> list[bool]:
    """Whether each watched call has finished. ``GroupFuture.done()`` never blocks: its
    first call starts the backend watching the call's ranks off the loop (Ray: one
    watcher thread, non-fetching ``ray.wait``), later calls read what it saw."""
    flags = []
    for f in futures:
        try:
            flags.append(bool(f.done()))
        except Exception:  # a closed group: the call is over one way or another
            flags.append(True)
    return flags


class Tracer:
    """Collects spans; :meth:`write` produces a Perfetto-openable JSON file.

    Args:
        enabled: when false every method is a no-op (no watcher task, no memory).
        poll_s: how often pending group calls are checked for completion.
    """

    def __init__(self, *, enabled: bool = True, poll_s: float = 0.005) -> None:
        self.enabled = enabled
        self.poll_s = poll_s
        self.spans: list[Span] = []
        self._t0 = time.perf_counter()
        self._pending: list[tuple[Any, str, str, float, dict[str, Any]]] = []
        self._wake: asyncio.Event | None = None
        self._closed = False

    def now(self) -> float:
        """Seconds since the tracer was created."""
        return time.perf_counter() - self._t0

    @contextlib.contextmanager
    def span(self, name: str, track: str = "controller", **args: Any) -> Iterator[None]:
        """Record the enclosed block as one span on `track`."""
        if not self.enabled:
            yield
            return
        start = self.now()
        try:
            yield
        finally:
            self.spans.append(Span(name, track, start, self.now(), args))

    def watch(self, future: Any, stage: str, **args: Any) -> Any:
        """Record a group call from now until it completes; returns `future` unchanged."""
        if self.enabled and not self._closed:
            track = f"{future.group}"
            self._pending.append((future, stage, track, self.now(), args))
            if self._wake is not None:
                self._wake.set()
        return future

    async def run(self) -> None:
        """The watcher loop: run it in the trainer's task group; it returns after :meth:`close`."""
        if not self.enabled:
            return
        self._wake = asyncio.Event()
        while True:
            self._sweep()
            if self._closed and not self._pending:
                return
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            else:
                await asyncio.sleep(self.poll_s)

    def _sweep(self) -> None:
        still = []
        t = self.now()
        flags = _done_flags([p[0] for p in self._pending])
        for (fut, stage, track, start, args), done in zip(self._pending, flags):
            if done:
                self.spans.append(Span(stage, track, start, t, args))
            else:
                still.append((fut, stage, track, start, args))
        self._pending = still

    def close(self) -> None:
        """Stop watching: pending calls are closed at the current time, then :meth:`run` returns."""
        self._sweep()
        t = self.now()
        for fut, stage, track, start, args in self._pending:
            self.spans.append(Span(stage, track, start, t, {**args, "unfinished": True}))
        self._pending = []
        self._closed = True
        if self._wake is not None:
            self._wake.set()

    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome trace-event object (``{"traceEvents": [...]}``)."""
        tracks = sorted({s.track for s in self.spans}, key=lambda t: (t != "controller", t))
        pid = {t: i + 1 for i, t in enumerate(tracks)}
        events: list[dict[str, Any]] = []
        for t, p in pid.items():
            events.append({"name": "process_name", "ph": "M", "pid": p, "tid": 0, "args": {"name": t}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": p, "tid": 0, "args": {"sort_index": p}})
        lanes: dict[str, list[float]] = {t: [] for t in tracks}  # overlapping spans go to separate lanes
        for s in sorted(self.spans, key=lambda s: (s.start, -s.end)):
            ends = lanes[s.track]
            lane = next((i for i, e in enumerate(ends) if e <= s.start), len(ends))
            if lane == len(ends):
                ends.append(s.end)
            else:
                ends[lane] = s.end
            events.append({
                "name": s.name, "cat": "stage", "ph": "X", "pid": pid[s.track], "tid": lane,
                "ts": round(s.start * 1e6, 1), "dur": round(max(s.end - s.start, 0.0) * 1e6, 1),
                "args": {k: v for k, v in s.args.items() if isinstance(v, (int, float, str, bool))},
            })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the Perfetto-openable JSON to `path`."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_chrome()))
        return p
