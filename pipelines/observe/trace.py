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

  Calls are issued steps ahead, so issue-to-done says little about when a worker
  worked. The workers time each call themselves (``GroupFuture.worker_times()``: when
  the call reached the worker, when the method started, when it returned, as the
  worker's ``time.time()``, carried in the call's metadata that the task's reply holds
  anyway: no extra round-trip). A group span of a timed call has ``arrived`` (the
  last rank's arrival) and ``ran`` (the first rank's start to the last rank's end) in
  the tracer's clock, converted with one offset measured when the tracer starts
  (``time.time() - time.perf_counter()``: exact on one machine, where every process
  reads the same two clocks; across machines as good as their clock sync), and
  clamped into issue..done. :meth:`Span.parts` splits it into ``queued`` (issued,
  not yet on the worker: Ray's queue, the transfer), ``waiting`` (on the worker,
  waiting for its turn behind earlier calls and for its pipelined inputs) and
  ``exec`` (the method running): ``trace.json`` and ``report.png`` draw ``exec``
  solid and the two waits as separate, lighter spans. The tracer switches
  ``time_calls`` on for each group it watches (``DP_COMPUTE`` calls are timed
  anyway), so a group's first watched call of another mode keeps issue-to-done.

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

WAIT_LANES = 100
"""``tid`` of the first lane of waits (``queued``, ``waiting``) in ``trace.json``."""


@dataclass
class Span:
    """One finished span, times in seconds since the tracer started. A group span runs
    from the call's issue (`start`) to its last rank's end as the controller saw it
    (`end`); when the workers timed it, `arrived` is when the last rank had it and
    `ran` the first rank's start to the last rank's end, all within start..end."""

    name: str
    track: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)
    arrived: float | None = None
    ran: tuple[float, float] | None = None

    def parts(self) -> list[tuple[str, float, float]]:
        """``(kind, start, end)`` pieces to draw, in time order, never overlapping:
        ``call`` (the whole span, when the workers did not time it) or ``queued``,
        ``waiting`` (each only when longer than zero) and ``exec``."""
        if self.ran is None:
            return [("call", self.start, self.end)]
        arrived = self.start if self.arrived is None else self.arrived
        out = [("queued", self.start, arrived), ("waiting", arrived, self.ran[0])]
        return [p for p in out if p[2] > p[1]] + [("exec", self.ran[0], self.ran[1])]


class Tracer:
    """Collects spans; :meth:`write` produces a Perfetto-openable JSON file.

    Args:
        enabled: when false every method is a no-op (no callbacks, no memory).
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._spans: list[Span] = []
        self._t0 = time.perf_counter()
        self._wall0 = time.time() - self._t0  # a worker's time.time() minus this is on our clock
        self._pending: list[tuple[Any, str, str, float, dict[str, Any]]] = []  # watched calls not seen done yet
        self._sweep_at = 64  # watch() sweeps once this many are pending (twice as many as the last sweep left)
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
            if len(self._pending) >= self._sweep_at:  # amortised: a sweep per call walked every pending call
                self._sweep()
                self._sweep_at = 2 * len(self._pending) + 64
            start = self.now()
            try:
                future.done()  # starts the backend's watch of its ranks
                future.worker_times()  # starts reading the workers' times, if it carries them
            except Exception:  # a closed group: the call is over one way or another
                self._spans.append(Span(stage, f"{future.group}", start, start, args))
            else:
                self._pending.append((future, stage, f"{future.group}", start, args))
                group = getattr(future, "worker_group", None)
                if getattr(group, "time_calls", True) is False:
                    group.time_calls = True  # its later calls of every mode carry their workers' times
        return future

    def _timed(self, span: Span, times: list[Any] | None) -> Span:
        """`span` with the workers' times (see the module docstring), clamped into it."""
        got = [t for t in times or () if t is not None]
        if not got:
            return span
        def clamp(x: float, lo: float, hi: float) -> float:
            return min(max(x, lo), hi)
        off = self._wall0 + self._t0
        begin = clamp(min(t[1] for t in got) - off, span.start, span.end)
        finish = clamp(max(t[2] for t in got) - off, begin, span.end)
        arrived = clamp(max(t[0] for t in got) - off, span.start, begin)
        span.arrived, span.ran = arrived, (begin, finish)
        return span

    def _sweep(self) -> None:
        """Close the spans of the watched calls that are done, at their done time."""
        if not self._pending:
            return
        still = []
        for entry in self._pending:
            future, stage, track, start, args = entry
            t = future.done_time()
            times = future.worker_times() if t is not None and future.timed else None
            if t is None or (future.timed and times is None):  # (the times come with the replies)
                still.append(entry)
            else:
                self._spans.append(self._timed(Span(stage, track, start, max(start, t - self._t0), args), times))
        self._pending = still

    def close(self) -> None:
        """Stop watching: pending calls are closed at the current time (``unfinished``)."""
        self._sweep()
        t = self.now()
        for future, stage, track, start, args in self._pending:
            if future.done_time() is not None:  # done, its workers' times not read yet: drawn untimed
                self._spans.append(Span(stage, track, start, max(start, future.done_time() - self._t0), args))
                continue
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
        # Overlapping spans go to separate lanes (tid); the waits of timed calls to lanes
        # of their own (tid from WAIT_LANES), so a call's wait never shares a lane with
        # the execution of the call before it.
        lanes: dict[tuple[str, bool], list[float]] = {}
        parts = [(s, kind, a, b) for s in self.spans for kind, a, b in s.parts()]
        named: set[tuple[int, int]] = set()
        for s, kind, a, b in sorted(parts, key=lambda p: (p[2], -p[3])):
            wait = kind in ("queued", "waiting")
            ends = lanes.setdefault((s.track, wait), [])
            lane = next((i for i, e in enumerate(ends) if e <= a), len(ends))
            if lane == len(ends):
                ends.append(b)
            else:
                ends[lane] = b
            tid = lane + (WAIT_LANES if wait else 0)
            if wait and (pid[s.track], tid) not in named:
                named.add((pid[s.track], tid))
                events.append({"name": "thread_name", "ph": "M", "pid": pid[s.track], "tid": tid,
                               "args": {"name": f"waiting {lane}"}})
            args = {k: v for k, v in s.args.items() if isinstance(v, (int, float, str, bool))}
            if kind != "call":
                args["part"] = kind
            events.append({
                "name": s.name if not wait else f"{s.name} ({kind})", "cat": "wait" if wait else "stage", "ph": "X",
                "pid": pid[s.track], "tid": tid, "ts": round(a * 1e6, 1), "dur": round(max(b - a, 0.0) * 1e6, 1),
                "args": args, **({"cname": "grey"} if wait else {}),
            })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the Perfetto-openable JSON to `path`."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_chrome()))
        return p
