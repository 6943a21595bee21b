"""The run report: reward curve, held-out evaluation (when the run evaluates) and the
rollout/training overlap timeline (matplotlib, optional).

The trainer draws it with :func:`draw_report`, in a child process: matplotlib's Agg renderer
holds the GIL for hundreds of milliseconds at a time, so in a thread of the controller it stalled
the app's event loop (up to 0.5 s at the end of ``fit()``, measured with
``examples/fit_in_app.py``). :func:`plot_report` draws in the calling process (blocking).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from asyncrl.pipelines.observe import _report_draw
from asyncrl.pipelines.observe.trace import Span, Tracer

__all__ = ["ReportError", "draw_report", "plot_report"]


class ReportError(RuntimeError):
    """The child process drawing the report failed (its exit status and stderr are in the message)."""


def _plain(history: list[dict[str, Any]], spans: Tracer | Sequence[Span],
           evals: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What the drawing reads, as JSON-safe data (metrics that are not finite numbers become None)."""
    def num(v: Any) -> Any:
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    all_spans = spans.spans if isinstance(spans, Tracer) else list(spans)
    return {
        "history": [{"step": h["step"], "reward/mean": num(h.get("reward/mean"))} for h in history],
        "evals": [{k: num(v) for k, v in e.items() if k.startswith("eval/")} for e in (evals or [])],
        "spans": [{"track": s.track, "name": s.name, "parts": [list(p) for p in s.parts()]} for s in all_spans],
    }


def plot_report(history: list[dict[str, Any]], spans: Tracer | Sequence[Span], path: str | Path,
                evals: list[dict[str, Any]] | None = None) -> Path | None:
    """Write a PNG with the mean reward per step, the held-out evaluation per version (`evals`:
    rows with ``eval/version`` and ``eval/*`` metrics; the panel is drawn only when there are
    any) and a timeline of the stage spans per group (`spans`: a :class:`Tracer` or its spans).
    Blocking, in this process (an app's event loop should use :func:`draw_report`).

    Returns None (and writes nothing) when matplotlib is not installed.
    """
    return _report_draw.draw(_plain(history, spans, evals), path)


async def draw_report(history: list[dict[str, Any]], spans: Tracer | Sequence[Span], path: str | Path,
                      evals: list[dict[str, Any]] | None = None, *, timeout_s: float = 300.0) -> Path | None:
    """:func:`plot_report` in a child process (``python .../_report_draw.py``, started and awaited
    with anyio), without blocking the event loop or holding the controller's GIL. Returns the
    path, or None when matplotlib is not installed. Raises :class:`ReportError` when the child
    fails or runs past `timeout_s`; a timeout or a cancel kills the child."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, data_path = tempfile.mkstemp(prefix=".report-", suffix=".json", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_plain(history, spans, evals), f)
        try:
            with anyio.fail_after(timeout_s):
                done = await anyio.run_process([sys.executable, _report_draw.__file__, data_path, str(p)],
                                               check=False, stdout=subprocess.DEVNULL)
        except TimeoutError:
            raise ReportError(f"drawing the report {p} took over {timeout_s:g} s; the drawing process was "
                              "killed (trainer.plot=false skips the report)") from None
        if done.returncode == _report_draw.NO_MATPLOTLIB:
            return None
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-5:]
            raise ReportError(f"drawing the report {p} failed (exit status {done.returncode}): " + " | ".join(tail))
        return p
    finally:
        with contextlib.suppress(OSError):
            os.unlink(data_path)
