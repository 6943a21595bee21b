"""LoRA beside full fine-tuning on SmolLM2 arithmetic: held-out accuracy against steps and wall clock, several seeds.

For each seed, runs ``asyncrl train --preset grpo_smollm_arith`` twice in a subprocess (its own embedded Ray): the
preset as is (full fine-tuning, whole-weight sync), and with LoRA (``actor.lora``, ``trainer.weight_sync=adapter``,
a larger learning rate: adapters start at zero and move little at full fine-tuning's). ``trainer.seed`` and
``model.seed`` take the seed (data order, sampling, the adapters' initial A). The table gives, per variant and
evaluated version, the mean held-out greedy accuracy over the seeds (and each seed's) and the median seconds
since the trainer started when that version was trained (``time/elapsed``: evaluation passes included, Ray start
and model load not).

    python benchmarks/lora_vs_full.py --seeds 0 1 2 --steps 8              # six runs of a few minutes each
    python benchmarks/lora_vs_full.py --seeds 0 --steps 1 --eval-prompts 4 --quick   # the plumbing
    python benchmarks/lora_vs_full.py --summarize-only ...                 # the table of the runs already made

Needs the smollm extra (``bash scripts/setup.sh smollm``) and peft (``asyncrl[lora]``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

LORA = ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.lr=0.0002", "trainer.weight_sync=adapter"]
"""The LoRA variant's overrides (rank 16 on every linear layer of the decoder; 10x full fine-tuning's lr)."""
QUICK = ["trainer.batch_size=4", "algorithm.group_size=2", "rollout.max_new_tokens=8"]


def _run(run_dir: Path, overrides: list[str]) -> float:
    """Train one run into `run_dir`; its wall-clock seconds (written beside it, for --summarize-only)."""
    cmd = [sys.executable, "-m", "asyncrl.pipelines.commands.cli", "train", "--preset", "grpo_smollm_arith",
           f"trainer.output_dir={run_dir}", "trainer.progress=false", "trainer.checkpoint_at_end=false", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"asyncrl train failed with status {proc.returncode}: {' '.join(cmd)}")
    (run_dir / "wall_s.txt").write_text(f"{wall:.1f}\n")
    return wall


def _curve(run_dir: Path) -> dict[int, tuple[float, float]]:
    """``{version: (held-out accuracy, seconds since the run started when it was trained)}`` of one run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    elapsed = {0: 0.0} | {int(r["step"]) + 1: float(r["time/elapsed"]) for r in rows if r.get("kind") != "eval"}
    evals = {int(r["eval/version"]): float(r["eval/accuracy_flexible"]) for r in rows if r.get("kind") == "eval"}
    return {v: (acc, elapsed.get(v, float("nan"))) for v, acc in evals.items()}


def table(runs: dict[str, dict[int, Path]]) -> list[str]:
    """Markdown rows: per variant and evaluated version, accuracy (mean, each seed) and median seconds."""
    lines = ["| variant | version | held-out accuracy, mean | per seed | seconds since start (median) "
             "| run wall s (median) |",
             "|---|---:|---:|---|---:|---:|"]
    for variant, by_seed in runs.items():
        curves = {s: _curve(d) for s, d in sorted(by_seed.items())}
        walls = [float((d / "wall_s.txt").read_text()) for d in by_seed.values() if (d / "wall_s.txt").exists()]
        versions = sorted(set.intersection(*(set(c) for c in curves.values()))) if curves else []
        for i, v in enumerate(versions):
            accs = [c[v][0] for c in curves.values()]
            secs = [c[v][1] for c in curves.values()]
            wall = f"{statistics.median(walls):.0f}" if walls and i == len(versions) - 1 else ""
            lines.append(f"| {variant} | {v} | {statistics.mean(accs):.3f} | "
                         f"{' / '.join(f'{a:.3f}' for a in accs)} | {statistics.median(secs):.0f} | {wall} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="a tiny batch and short responses (checks the plumbing)")
    p.add_argument("--runs", default="runs/lora_vs_full", help="folder of the run directories")
    p.add_argument("--out", default="benchmarks/results/lora_vs_full.md")
    p.add_argument("--summarize-only", action="store_true", help="tabulate the runs already in --runs")
    args = p.parse_args()
    common = [f"trainer.steps={args.steps}", f"evaluation.every={args.eval_every}",
              f"evaluation.num_prompts={args.eval_prompts}", *(QUICK if args.quick else [])]
    variants = {"full fine-tuning": [], "LoRA r16 (adapter sync)": LORA}
    runs: dict[str, dict[int, Path]] = {v: {} for v in variants}
    for seed in args.seeds:  # seed by seed, so that a cut-short benchmark still pairs its variants
        for i, (variant, extra) in enumerate(variants.items()):
            run_dir = Path(args.runs) / f"{'full' if i == 0 else 'lora'}_seed{seed}"
            if not args.summarize_only:
                _run(run_dir, [*common, f"trainer.seed={seed}", f"model.seed={seed}", *extra])
            if (run_dir / "metrics.jsonl").exists():
                runs[variant][seed] = run_dir
    command = f"python benchmarks/lora_vs_full.py {' '.join(a for a in sys.argv[1:] if a != '--summarize-only')}"
    text = "\n".join([
        "# LoRA beside full fine-tuning: SmolLM2-135M-Instruct, GRPO on arithmetic (CPU)", "",
        f"Command: `{command.strip()}`", "",
        f"Each run: `asyncrl train --preset grpo_smollm_arith {' '.join(common)} trainer.seed=S model.seed=S`; "
        f"LoRA adds `{' '.join(LORA)}`. Accuracy: greedy, on {args.eval_prompts} held-out problems.", "",
        *table({v: r for v, r in runs.items() if r}), ""])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
