"""The run report: reward curve, held-out evaluation (when the run evaluates) and the
rollout/training overlap timeline (matplotlib, optional).

Drawn with matplotlib's object API (a ``Figure`` on the Agg canvas, no ``pyplot`` state), so
the trainer can draw it in a worker thread while its event loop keeps running.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from asyncrl.pipelines.trace import Span, Tracer

__all__ = ["plot_report"]


def plot_report(history: list[dict[str, Any]], spans: Tracer | Sequence[Span], path: str | Path,
                evals: list[dict[str, Any]] | None = None) -> Path | None:
    """Write a PNG with the mean reward per step, the held-out evaluation per version (`evals`:
    rows with ``eval/version`` and ``eval/*`` metrics; the panel is drawn only when there are
    any) and a timeline of the stage spans per group (`spans`: a :class:`Tracer` or its spans).
    Blocking: the trainer calls it in a thread.

    Returns None (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    all_spans = spans.spans if isinstance(spans, Tracer) else list(spans)
    evals = [e for e in (evals or []) if "eval/version" in e]
    n = 3 if evals else 2
    fig = Figure(figsize=(10, 3.5 * n))
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, gridspec_kw={"height_ratios": [1] * n})
    ax1, ax2 = axes[0], axes[-1]
    steps = [h["step"] for h in history]
    ax1.plot(steps, [h["reward/mean"] for h in history], marker="o", ms=3, label="mean reward")
    ax1.set_xlabel("step")
    ax1.set_ylabel("reward")
    ax1.set_ylim(-0.02, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    if evals:
        ax3 = axes[1]
        evals = sorted(evals, key=lambda e: e["eval/version"])
        versions = [e["eval/version"] for e in evals]
        keys = [k for k in ("eval/accuracy_flexible", "eval/accuracy_strict", "eval/format", "eval/reward_mean")
                if all(k in e for e in evals)]
        for k in keys:
            ax3.plot(versions, [e[k] for e in evals], marker="s", ms=4, label=f"held-out {k.removeprefix('eval/')}")
        ax3.set_xlabel("steps trained (policy version)")
        ax3.set_ylabel("held-out (greedy)")
        ax3.set_ylim(-0.02, 1.02)
        ax3.grid(alpha=0.3)
        ax3.legend(loc="lower right", fontsize=8)
    shown = [s for s in all_spans if s.track != "controller"]
    rows = sorted({(s.track, s.name) for s in shown})  # one row per group and stage: queued calls stay visible
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    tracks = sorted({t for t, _ in rows})
    color = {t: colors[i % len(colors)] for i, t in enumerate(tracks)}
    for y, (track, name) in enumerate(rows):
        for s in (s for s in shown if s.track == track and s.name == name):
            for kind, a, b in s.parts():  # the workers' execution solid; queued / waiting lighter
                light = kind in ("queued", "waiting")
                ax2.barh(y, b - a, left=a, color=color[track], height=0.35 if light else 0.7,
                         alpha=0.3 if light else 1.0, hatch="//" if kind == "waiting" else None, linewidth=0)
    ax2.set_yticks(range(len(rows)), [f"{t}: {n}" for t, n in rows], fontsize=7)
    ax2.set_xlabel("seconds since start; solid: running on the workers (as they timed it), "
                   "light: queued, hatched: waiting for its turn or inputs")
    ax2.set_title("stage spans per worker group (rollout and training rows overlapping in time = overlap)")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=100)
    return p
