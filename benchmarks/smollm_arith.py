"""SmolLM2-135M-Instruct learns arithmetic with async GRPO on CPU: held-out accuracy before and
after, the wall-clock, time per step, and the reward/accuracy curve.

Runs ``asyncrl train --preset grpo_smollm_arith [key=value ...]`` in a subprocess (its own
embedded Ray), timing it end to end, then summarizes the run directory into a markdown table
and a plot. ``--from-run DIR --wall-s S`` summarizes a run made earlier with the same command.
A training result, not a speed comparison: the machine is shared, so times hold for its load.

    python benchmarks/smollm_arith.py                       # the preset as is (about an hour on 2 busy cores)
    python benchmarks/smollm_arith.py trainer.steps=40      # overrides go to `asyncrl train`
    python benchmarks/smollm_arith.py --quick               # 1 step, tiny batch (checks the plumbing)

Needs the smollm extra (``bash scripts/setup.sh smollm``).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_note, run_header, write_result  # noqa: E402

QUICK = ["trainer.steps=1", "trainer.batch_size=4", "algorithm.group_size=2", "rollout.max_new_tokens=8",
         "evaluation.num_prompts=3", "trainer.checkpoint_at_end=false"]
METRICS = ("eval/accuracy_flexible", "eval/accuracy_strict", "eval/format", "eval/reward_mean",
           "eval/response_length", "eval/truncated")


def _rows(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = sorted((r for r in rows if r.get("kind") != "eval"), key=lambda r: r["step"])
    evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: r["eval/version"])
    return train, evals


def _plot(train: list[dict], evals: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 7))
    steps = [r["step"] for r in train]
    rewards = [r["reward/mean"] for r in train]
    a.plot(steps, rewards, marker="o", ms=3, alpha=0.5, label="mean reward of the step's samples (T=0.7)")
    k = 5
    if len(rewards) >= k:
        avg = [sum(rewards[i - k + 1:i + 1]) / k for i in range(k - 1, len(rewards))]
        a.plot(steps[k - 1:], avg, lw=2, label=f"moving average ({k} steps)")
    a.set_xlabel("step")
    a.set_ylabel("training reward")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    versions = [e["eval/version"] for e in evals]
    for key, label in (("eval/accuracy_flexible", "accuracy (last number = answer)"),
                       ("eval/accuracy_strict", "accuracy (number after 'Answer:')"),
                       ("eval/format", "gives 'Answer: <n>'")):
        b.plot(versions, [e[key] for e in evals], marker="s", label=label)
    b.set_xlabel("steps trained (policy version)")
    b.set_ylabel(f"held-out, greedy ({evals[0]['eval/num_prompts']} problems)")
    b.set_ylim(-0.02, 1.02)
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, async GRPO on arithmetic word problems (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summarize(run_dir: Path, wall_s: float, command: str, header: str) -> str:
    """The markdown result of the run in `run_dir`."""
    train, evals = _rows(run_dir)
    if not train or not evals:
        raise SystemExit(f"{run_dir} has no training or evaluation rows in metrics.jsonl")
    step_s = [r["time/step"] for r in train]
    k = min(5, len(train))
    first, last = evals[0], evals[-1]
    lines = [
        "# SmolLM2-135M-Instruct learns arithmetic with async GRPO (CPU)", "", header, "",
        f"Job: `{command}` (output `{run_dir}`)", "",
        f"- wall-clock: **{wall_s:.0f} s** for {len(train)} steps (Ray start, model load and every evaluation "
        f"included); time per step: median **{statistics.median(step_s):.0f} s**, mean {statistics.mean(step_s):.0f} s, "
        f"min {min(step_s):.0f} s, max {max(step_s):.0f} s",
        f"- held-out accuracy (greedy, {first['eval/num_prompts']} problems never trained on): "
        f"**{first['eval/accuracy_flexible']:.3f} at version {first['eval/version']} -> "
        f"{last['eval/accuracy_flexible']:.3f} at version {last['eval/version']}** (last number of the response); "
        f"strict (number after `Answer:`) {first['eval/accuracy_strict']:.3f} -> {last['eval/accuracy_strict']:.3f}; "
        f"format {first['eval/format']:.3f} -> {last['eval/format']:.3f}",
        f"- training reward (mean of the step's samples): first {k} steps "
        f"{sum(r['reward/mean'] for r in train[:k]) / k:.3f}, last {k} steps "
        f"{sum(r['reward/mean'] for r in train[-k:]) / k:.3f}", "",
        "| version | " + " | ".join(m.removeprefix("eval/") for m in METRICS) + " | eval s |",
        "|---:|" + "---:|" * (len(METRICS) + 1),
    ]
    for e in evals:
        lines.append(f"| {e['eval/version']} | " + " | ".join(f"{e[m]:.3f}" for m in METRICS)
                     + f" | {e['eval/time']:.0f} |")
    lines += ["", "| step | reward | staleness | step s | pg_loss | entropy | grad_norm |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in train:
        lines.append(f"| {r['step']} | {r['reward/mean']:.3f} | {r['staleness/max']} | {r['time/step']:.0f} | "
                     f"{r.get('actor/pg_loss', float('nan')):.4f} | {r.get('actor/entropy', float('nan')):.3f} | "
                     f"{r.get('actor/grad_norm', float('nan')):.3f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 step with a tiny batch")
    p.add_argument("--out", default="benchmarks/results/smollm_arith.md", help="markdown result (plot beside it)")
    p.add_argument("--run-dir", default=None, help="the run's output directory (default: runs/smollm_arith; with "
                   "--quick a folder beside --out)")
    p.add_argument("--from-run", default=None, help="summarize this existing run directory instead of training")
    p.add_argument("--wall-s", type=float, default=None, help="with --from-run: the run's measured wall-clock")
    p.add_argument("--job", default=None, help="with --from-run: the command that made the run")
    p.add_argument("--note", default="", help="a paragraph printed under the header (what differed, what it shows)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for asyncrl train")
    args = p.parse_args()
    load0 = os.getloadavg()[0]
    overrides = (QUICK if args.quick else []) + list(args.overrides)
    if args.from_run:
        run_dir = Path(args.from_run)
        wall = args.wall_s if args.wall_s is not None else float("nan")
    else:
        default = Path(args.out).parent / "smollm_arith_quick_run" if args.quick else Path("runs/smollm_arith")
        run_dir = Path(args.run_dir) if args.run_dir else default
        cmd = [sys.executable, "-m", "asyncrl.pipelines.commands.cli", "train", "--preset", "grpo_smollm_arith",
               f"trainer.output_dir={run_dir}", "trainer.progress=false", *overrides]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"asyncrl train failed with status {proc.returncode}")
    command = args.job or " ".join(["asyncrl train --preset grpo_smollm_arith", *overrides])
    note = (load_note(load0, os.getloadavg()[0]) if not args.from_run
            else "shared with other jobs; summarized from an earlier run, whose load is not recorded here")
    header = run_header("smollm_arith.py", note)
    out = Path(args.out)
    text = summarize(run_dir, wall, command, header + (f"\n\n{args.note}" if args.note else ""))
    png = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    train, evals = _rows(run_dir)
    _plot(train, evals, png)
    write_result(str(out), text + f"\n![reward and held-out accuracy]({png.name})\n")


if __name__ == "__main__":
    main()
