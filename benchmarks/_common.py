"""What every benchmark writes around its tables: the machine header and the results file; and the
reward-curve summaries the learning benchmarks share."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from typing import Any


def run_header(script: str, machine_note: str = "shared with other jobs", extra: str = "") -> str:
    """'Run <date> on <machine> (...); versions.' then the exact command that made the table."""
    import ray
    import tensordict
    import torch

    return (
        f"Run {datetime.datetime.now().isoformat(timespec='seconds')} on {platform.machine()} "
        f"({os.cpu_count()} CPUs visible, no GPU; {machine_note}); python {platform.python_version()}, "
        f"ray {ray.__version__}, torch {torch.__version__}, tensordict {tensordict.__version__}{extra}.\n\n"
        f"Command: `python benchmarks/{script} {' '.join(sys.argv[1:])}`".rstrip()
    )


def write_result(path: str, text: str) -> None:
    """Write the markdown result (creating its folder) and print it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(text)


def load_note(start: float, end: float | None = None) -> str:
    """The machine's 1-minute load average around a run (the machine is shared: say how busy it was)."""
    cores = os.cpu_count() or 1
    tail = f" at the start, {end:.1f} at the end" if end is not None else " at the start"
    return f"shared with other jobs: 1-minute load average {start:.1f}{tail} on {cores} cores"


def first_step(hist: list[dict[str, Any]], level: float, window: int = 5) -> tuple[int, float] | None:
    """(step, elapsed seconds) when the `window`-step mean reward of a run's history first reaches `level`."""
    rew = [h["reward/mean"] for h in hist]
    for i in range(window - 1, len(rew)):
        if statistics.mean(rew[i - window + 1:i + 1]) >= level:
            return i, float(hist[i]["time/elapsed"])
    return None


TOKEN_AGES = "stream/tokens_staleness_"


def token_ages(rows: list[dict[str, Any]], at_least: int = 0) -> list[float]:
    """Trained response tokens by age, summed over the steps `rows`: entry ``d`` holds ``stream/tokens_staleness_{d}``
    (tokens ``d`` versions old), up to the oldest any step recorded and at least up to `at_least`."""
    ages = [int(key[len(TOKEN_AGES):]) for h in rows for key in h if key.startswith(TOKEN_AGES)]
    return [sum(h.get(f"{TOKEN_AGES}{d}", 0.0) for h in rows) for d in range(max(ages + [at_least]) + 1)]


def mean_over_seeds(xs: list[float | None]) -> str:
    """Mean over seeds, or '-' when a seed never got there (then how many did, e.g. '- (1/2)')."""
    got = [x for x in xs if x is not None]
    if len(got) < len(xs):
        return "-" if not got else f"- ({len(got)}/{len(xs)})"
    return f"{statistics.mean(got):.1f}"


def learning_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-variant learning figures of `runs` (one variant, one run per seed, each with ``history`` and
    ``loop_s``), means over seeds: reward over the first 5 and last 10 steps, steps and seconds to reward
    0.5 and 0.9 (formatted by `mean_over_seeds`), loop seconds, ms per step and every row."""
    hs = [r["history"] for r in runs]
    hit = {lv: [first_step(hist, lv) for hist in hs] for lv in (0.5, 0.9)}
    return {
        "first5": statistics.mean(statistics.mean(h["reward/mean"] for h in hist[:5]) for hist in hs),
        "last10": statistics.mean(statistics.mean(h["reward/mean"] for h in hist[-10:]) for hist in hs),
        "steps": {lv: mean_over_seeds([None if x is None else float(x[0]) for x in hit[lv]]) for lv in hit},
        "secs": {lv: mean_over_seeds([None if x is None else x[1] for x in hit[lv]]) for lv in hit},
        "loop": statistics.mean(r["loop_s"] for r in runs),
        "ms": statistics.mean(1e3 * r["loop_s"] / len(r["history"]) for r in runs),
        "rows": [h for hist in hs for h in hist],
    }


def parse_variants(parser: Any, text: str, known: Any) -> tuple[str, ...]:
    """``--variants`` as a tuple, every name checked against `known` (an unknown one is a usage error)."""
    variants = tuple(text.split(","))
    if bad := [v for v in variants if v not in known]:
        parser.error(f"unknown variant(s) {bad}; choose from {', '.join(known)}")
    return variants
