"""The run report: reward curve and the rollout/training overlap timeline (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.pipelines.trace import Tracer

__all__ = ["plot_report"]


def plot_report(history: list[dict[str, Any]], tracer: Tracer, path: str | Path) -> Path | None:
    """Write a PNG with the mean reward per step and a timeline of the stage spans per group.

    Returns None (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), gridspec_kw={"height_ratios": [1, 1]})
    steps = [h["step"] for h in history]
    ax1.plot(steps, [h["reward/mean"] for h in history], marker="o", ms=3, label="mean reward")
    ax1.set_xlabel("step")
    ax1.set_ylabel("reward")
    ax1.set_ylim(-0.02, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right")
    spans = [s for s in tracer.spans if s.track != "controller"]
    rows = sorted({(s.track, s.name) for s in spans})  # one row per group and stage: queued calls stay visible
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    tracks = sorted({t for t, _ in rows})
    color = {t: colors[i % len(colors)] for i, t in enumerate(tracks)}
    for y, (track, name) in enumerate(rows):
        for s in (s for s in spans if s.track == track and s.name == name):
            ax2.barh(y, s.end - s.start, left=s.start, color=color[track], height=0.7)
    ax2.set_yticks(range(len(rows)), [f"{t}: {n}" for t, n in rows], fontsize=7)
    ax2.set_xlabel("seconds since start (span = call issued -> all ranks done)")
    ax2.set_title("stage spans per worker group (rollout and training rows overlapping in time = overlap)")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p
