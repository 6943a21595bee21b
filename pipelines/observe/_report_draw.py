"""Draws the run report (matplotlib) from plain data; also runnable as a script by its path.

Kept free of asyncrl imports so that ``python path/to/_report_draw.py DATA.json OUT.png`` starts in
a fraction of a second: the trainer draws the report in a child process that way
(:func:`asyncrl.pipelines.observe.report.draw_report`), because matplotlib's Agg renderer holds the GIL
for hundreds of milliseconds at a time and, in a thread of the controller, stalled the app's
event loop by up to 0.5 s at the end of ``fit()``. The data is ``{"history", "spans", "evals"}``
where each span is ``{"track", "name", "parts": [[kind, start, end], ...]}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

NO_MATPLOTLIB = 3
"""The script's exit status when matplotlib is not installed (nothing is written)."""


def draw(data: dict[str, Any], path: str | Path) -> Path | None:
    """Write the report PNG to `path`; None (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    history, shown = data["history"], [s for s in data["spans"] if s["track"] != "controller"]
    evals = [e for e in (data.get("evals") or []) if "eval/version" in e]
    n = 3 if evals else 2
    fig = Figure(figsize=(10, 3.5 * n))
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, gridspec_kw={"height_ratios": [1] * n})
    ax1, ax2 = axes[0], axes[-1]
    ax1.plot([h["step"] for h in history], [h["reward/mean"] for h in history], marker="o", ms=3,
             label="mean reward")
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
    rows = sorted({(s["track"], s["name"]) for s in shown})  # one row per group and stage: queued calls stay visible
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    tracks = sorted({t for t, _ in rows})
    color = {t: colors[i % len(colors)] for i, t in enumerate(tracks)}
    for y, (track, name) in enumerate(rows):
        for s in (s for s in shown if s["track"] == track and s["name"] == name):
            for kind, a, b in s["parts"]:  # the workers' execution solid; queued / waiting lighter
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


def main(argv: list[str]) -> int:
    """``DATA.json OUT.png``: draw; exit 0, or :data:`NO_MATPLOTLIB`."""
    data_path, out = argv
    return 0 if draw(json.loads(Path(data_path).read_text()), out) is not None else NO_MATPLOTLIB


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
