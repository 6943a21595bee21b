"""The run report: reward curve, held-out evaluation (when the run evaluates) and the
rollout/training overlap timeline (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.pipelines.trace import Tracer

__all__ = ["plot_report"]


def plot_report(history: list[dict[str, Any]], tracer: Tracer, path: str | Path,
                evals: list[dict[str, Any]] | None = None) -> Path | None:
    """Write a PNG with the mean reward per step, the held-out evaluation per version (`evals`:
    rows with ``eval/version`` and ``eval/*`` metrics; the panel is drawn only when there are
    any) and a timeline of the stage spans per group.

    Returns None (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    evals = [e for e in (evals or []) if "eval/version" in e]
    n = 3 if evals else 2
    fig, axes = plt.subplots(n, 1, figsize=(10, 3.5 * n), gridspec_kw={"height_ratios": [1] * n})
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
