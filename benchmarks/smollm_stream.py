"""SmolLM2 arithmetic, batch vs stream rollout: held-out accuracy at equal steps, and against wall clock.

Runs ``asyncrl train --preset grpo_smollm_arith`` once per mode and seed (each in its own subprocess and
embedded Ray), all with the same steps and evaluation schedule, then prints one table of held-out greedy
accuracy per evaluated version (steps trained) and one of the wall clock at which each version existed.
A learning comparison, not a speed one: the machine is shared and the load is printed with the result.

    python benchmarks/smollm_stream.py                                 # batch and stream, seed 0, 24 steps
    python benchmarks/smollm_stream.py --seeds 0,1 --parallel          # each seed's modes side by side
    python benchmarks/smollm_stream.py --summarize                     # the runs already in --runs-dir
    python benchmarks/smollm_stream.py --quick                         # 2 steps, tiny batch (plumbing)

Modes: ``batch`` is the preset (one-step overlap, ``max_staleness=1``); ``stream`` adds
``trainer.rollout_mode=stream trainer.rollout_weights=latest rollout.partial_rollout=recompute``
(the same ``max_staleness=1``, per trajectory). Each run directory ``<runs-dir>/<mode>_s<seed>`` gets a
``bench.json`` (command, wall clock, load at start and end). Needs the smollm extra.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_note, run_header, write_result

BASE = ["trainer.steps=24", "evaluation.every=6", "trainer.progress=false"]
QUICK = ["trainer.steps=2", "evaluation.every=1", "trainer.batch_size=4", "algorithm.group_size=2",
         "rollout.max_new_tokens=8", "evaluation.num_prompts=3", "trainer.checkpoint_at_end=false"]
MODES = {
    "batch": [],
    "stream": ["trainer.rollout_mode=stream", "trainer.rollout_weights=latest", "rollout.partial_rollout=recompute"],
}
METRIC = "eval/accuracy_flexible"


def command(mode: str, seed: int, run_dir: Path, overrides: list[str]) -> list[str]:
    """The ``asyncrl train`` argument list of one run."""
    return ["train", "--preset", "grpo_smollm_arith", f"trainer.output_dir={run_dir}", f"trainer.seed={seed}",
            *MODES[mode], *overrides]


def start(mode: str, seed: int, run_dir: Path, overrides: list[str]) -> tuple[subprocess.Popen, float, float]:
    """Start one run; returns the process, its start time and the load then."""
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "asyncrl.pipelines.commands.cli", *command(mode, seed, run_dir, overrides)]
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), time.time(), os.getloadavg()[0]


def finish(proc: subprocess.Popen, t0: float, load0: float, mode: str, seed: int, run_dir: Path,
           overrides: list[str]) -> None:
    """Wait for one run and write its ``bench.json``."""
    if proc.wait() != 0:
        raise SystemExit(f"{mode} seed {seed} failed with status {proc.returncode}; see {run_dir}.log")
    info = {"mode": mode, "seed": seed, "wall_s": time.time() - t0, "load_start": load0,
            "load_end": os.getloadavg()[0], "command": "asyncrl " + " ".join(command(mode, seed, run_dir, overrides))}
    (run_dir / "bench.json").write_text(json.dumps(info) + "\n")


def read_run(run_dir: Path) -> dict[str, Any]:
    """A run's bench.json plus its train rows (by step) and eval rows (by version) from metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    info = json.loads((run_dir / "bench.json").read_text())
    info["train"] = sorted((r for r in rows if r.get("kind") != "eval"), key=lambda r: r["step"])
    info["evals"] = {int(r["eval/version"]): r for r in rows if r.get("kind") == "eval"}
    return info


def _elapsed(run: dict[str, Any], version: int) -> float:
    """Seconds from the start of training until `version` existed (the end of step version - 1)."""
    return 0.0 if version == 0 else float(run["train"][version - 1]["time/elapsed"])


def summarize(runs: list[dict[str, Any]]) -> str:
    """The two tables (accuracy per version; wall clock per version) and per-run lines, as markdown."""
    runs = sorted(runs, key=lambda r: (list(MODES).index(r["mode"]), r["seed"]))
    names = [f"{r['mode']} s{r['seed']}" for r in runs]
    modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    versions = sorted(set.intersection(*(set(r["evals"]) for r in runs)))
    n = {r["evals"][versions[0]]["eval/num_prompts"] for r in runs}.pop() if versions else 0
    lines = [(f"Held-out accuracy (`{METRIC}`: the last number of the greedy response is the answer; {n} problems "
              "never trained on) per version (= steps trained):"), "",
             "| version | " + " | ".join(names) + " | " + " | ".join(f"{m} mean" for m in modes) + " |",
             "|---:|" + "---:|" * (len(names) + len(modes))]
    for v in versions:
        accs = [r["evals"][v][METRIC] for r in runs]
        means = [statistics.mean(r["evals"][v][METRIC] for r in runs if r["mode"] == m) for m in modes]
        lines.append(f"| {v} | " + " | ".join(f"{a:.3f}" for a in accs) + " | "
                     + " | ".join(f"{a:.3f}" for a in means) + " |")
    lines += ["", "Wall clock (s from the start of training) when each version existed, and the accuracy then:", "",
              "| version | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for v in versions:
        lines.append(f"| {v} | " + " | ".join(f"{_elapsed(r, v):.0f} s: {r['evals'][v][METRIC]:.3f}" for r in runs)
                     + " |")
    lines += ["", ("| run | steps | wall s (whole job) | median step s | reward first 5 / last 5 | staleness mean "
                   "| load start / end |"), "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in zip(names, runs):
        tr = r["train"]
        k = min(5, len(tr))
        lines.append(
            f"| {name} | {len(tr)} | {r['wall_s']:.0f} | {statistics.median(x['time/step'] for x in tr):.0f} | "
            f"{statistics.mean(x['reward/mean'] for x in tr[:k]):.3f} / "
            f"{statistics.mean(x['reward/mean'] for x in tr[-k:]):.3f} | "
            f"{statistics.mean(x['staleness/mean'] for x in tr):.2f} | {r['load_start']:.1f} / {r['load_end']:.1f} |")
    lines += ["", "Commands:", ""] + [f"- {name}: `{r['command']}`" for name, r in zip(names, runs)]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="batch,stream", help="comma-separated: batch, stream")
    p.add_argument("--seeds", default="0", help="comma-separated trainer seeds")
    p.add_argument("--parallel", action="store_true", help="run each seed's modes at the same time (same load)")
    p.add_argument("--summarize", action="store_true", help="only summarize the runs already in --runs-dir")
    p.add_argument("--quick", action="store_true", help="2 steps with a tiny batch")
    p.add_argument("--runs-dir", default=None, help="where the runs go (default runs/smollm_stream)")
    p.add_argument("--out", default="benchmarks/results/smollm_stream.md", help="the markdown result")
    p.add_argument("--note", default="", help="a paragraph under the header")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = p.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs_dir = Path(args.runs_dir or (Path(args.out).parent / "smollm_stream_quick_runs" if args.quick
                                      else "runs/smollm_stream"))
    overrides = BASE + (QUICK if args.quick else []) + list(args.overrides)
    load0 = os.getloadavg()[0]
    if not args.summarize:
        for seed in seeds:
            jobs = [(m, seed, runs_dir / f"{m}_s{seed}") for m in modes]
            if args.parallel:
                started = [(start(m, s, d, overrides), m, s, d) for m, s, d in jobs]
                for (proc, t0, l0), m, s, d in started:
                    finish(proc, t0, l0, m, s, d, overrides)
            else:
                for m, s, d in jobs:
                    finish(*start(m, s, d, overrides), m, s, d, overrides)
    runs = [read_run(runs_dir / f"{m}_s{s}") for s in seeds for m in modes]
    note = load_note(load0, os.getloadavg()[0]) if not args.summarize else "shared with other jobs (load per run below)"
    if args.note:  # the header's command line, without the note's paragraph
        i = sys.argv.index("--note") if "--note" in sys.argv else None
        sys.argv = sys.argv[:i] + sys.argv[i + 2:] if i is not None else [a for a in sys.argv if not a.startswith("--note=")]
    header = run_header("smollm_stream.py", note)
    text = "# SmolLM2 arithmetic: batch vs stream rollout, held-out accuracy at equal steps\n\n" + header + "\n\n"
    write_result(args.out, text + (f"{args.note}\n\n" if args.note else "") + summarize(runs))


if __name__ == "__main__":
    main()
