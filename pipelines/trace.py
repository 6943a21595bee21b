"""Stage spans of a training run, written as Chrome/Perfetto trace JSON.

The controller records two kinds of spans:

* **controller spans** (``tracer.span("train.step", step=3)``): a block of controller
  code, measured exactly;
* **group spans** (``tracer.watch(future, stage="old_log_prob", step=3)``): a group
  call from the moment it was issued until every rank finished. The controller does
  not await pipelined futures, so the span's end is the time the backend saw the last
  rank finish (``GroupFuture.done_time()``: Ray records it on its own thread as the
  task ends, without fetching). The tracer reads it later — at its next ``watch``,
  when ``spans`` is read, at ``close`` — so tracing never wakes the event loop: no
  callback, no polling, and no payload bytes move.

Each group is a track (``pid`` = the group, ``tid`` = its ranks), so opening
``trace.json`` in https://ui.perfetto.dev shows rollout and training side by side.
"""

from __future__ import annotations

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


class Tracer:
    """Collects spans; :meth:`write` produces a Perfetto-openable JSON file.

    Args:
        enabled: when false every method is a no-op (no callbacks, no memory).
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._spans: list[Span] = []
        self._t0 = time.perf_counter()
        self._pending: list[tuple[Any, str, str, float, dict[str, Any]]] = []  # watched calls not seen done yet
        self._closed = False

    @property
    def spans(self) -> list[Span]:
        """The finished spans, a watched call's as soon as it is done."""
        self._sweep()
        return self._spans

    @spans.setter
    def spans(self, spans: list[Span]) -> None:
        self._spans = spans

    def now(self) -> float:
        """Seconds since the tracer was created."""
        return time.perf_counter() - self._t0

    @property
    def origin(self) -> float:
        """``time.perf_counter()`` when the tracer was created: span times are relative to it
        (on Linux the same clock as ``time.monotonic()`` in any process of the machine)."""
        return self._t0

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
            self._spans.append(Span(name, track, start, self.now(), args))

    def watch(self, future: Any, stage: str, **args: Any) -> Any:
        """Record a group call from now until it completes; returns `future` unchanged."""
        if self.enabled and not self._closed:
            self._sweep()
            start = self.now()
            try:
                future.done()  # starts the backend's watch of its ranks
            except Exception:  # a closed group: the call is over one way or another
                self._spans.append(Span(stage, f"{future.group}", start, start, args))
            else:
                self._pending.append((future, stage, f"{future.group}", start, args))
        return future

    def _sweep(self) -> None:
        """Close the spans of the watched calls that are done, at their done time."""
        if not self._pending:
            return
        still = []
        for entry in self._pending:
            future, stage, track, start, args = entry
            t = future.done_time()
            if t is None:
                still.append(entry)
            else:
                self._spans.append(Span(stage, track, start, max(start, t - self._t0), args))
        self._pending = still

    def close(self) -> None:
        """Stop watching: pending calls are closed at the current time (``unfinished``)."""
        self._sweep()
        t = self.now()
        for _, stage, track, start, args in self._pending:
            self._spans.append(Span(stage, track, start, t, {**args, "unfinished": True}))
        self._pending = []
        self._closed = True

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
