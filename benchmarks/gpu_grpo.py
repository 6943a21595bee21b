"""GRPO on one GPU: synchronous vs asynchronous, with a model built from a config (~76 M parameters).

Three runs of the real trainer (``asyncrl.pipelines.GRPOTrainer``, the ``char_class`` toy
task, tiny tokenizer), each with fresh Ray pools and workers, same seeds:

============  ==========================================================================================
split-sync    two pools sharing the GPU (rollout 0.5 GPU, training 0.5 GPU), ``max_staleness=0``: the
              synchronous schedule (each batch waits for the newest weights)
split-async   the same pools, ``max_staleness=1``: rollout of batch k+1 overlaps training of batch k
colocated     one process holds every role on the GPU, weights handed over in-process (``local``),
              the rollout sleeps (level 1: weights to the CPU) while the policy trains, ``max_staleness=1``
============  ==========================================================================================

Precision is the roles' ``auto``: the policy keeps float32 master weights and computes under bf16
autocast, the rollout holds bf16 weights; the split runs sync over the collective weight channel
(gloo, since both pools share one GPU: NCCL refuses two ranks on one device).

Per run: steady-state step time (mean over the steps after the first ``--warmup``), the step
time's parts (generate, train), generated response tokens per second (tokens / loop wall time),
peak GPU memory of each worker process (``torch.cuda.max_memory_allocated`` / ``_reserved``),
reward of the first and last steps. Speedup = split-sync ms/step / split-async ms/step.

    python benchmarks/gpu_grpo.py --out-dir OUT        # on a GPU machine (about 3 minutes on an H200)
    python benchmarks/gpu_grpo.py --dry-run --out-dir OUT   # the same runs on the CPU, tiny sizes (logic check)

Writes ``OUT/gpu_grpo.md`` (tables) and ``OUT/gpu_grpo.json`` (every number, per-step history).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import asyncrl  # noqa: E402
from asyncrl import Dispatch, Execute, register  # noqa: E402
from asyncrl.pipelines.job.config import JobConfig  # noqa: E402
from asyncrl.pipelines.job.presets import grpo_toy  # noqa: E402
from asyncrl.pipelines.trainers.trainer import GRPOTrainer  # noqa: E402
from asyncrl.roles import ModelConfig, PolicyWorker, RewardWorker, RolloutWorker  # noqa: E402


# ---- measuring workers (the roles plus a probe; classes in __main__ travel to the workers by value)


def _memory() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"pid": os.getpid(), "device": "cpu", "peak_allocated_mib": 0.0, "peak_reserved_mib": 0.0}
    return {"pid": os.getpid(), "device": torch.cuda.get_device_name(0),
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20}


class MeasuredPolicy(PolicyWorker):
    @register(Dispatch.ONE_TO_ALL)
    def gpu_memory(self) -> dict[str, Any]:
        """This process's peak GPU memory."""
        return _memory()

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


class MeasuredRollout(RolloutWorker):
    @register(Dispatch.ONE_TO_ALL)
    def gpu_memory(self) -> dict[str, Any]:
        return _memory()


class CountingReward(RewardWorker):
    """The reward worker, counting the response tokens it scores (= tokens generated)."""

    tokens = 0

    @register(Dispatch.DP_COMPUTE)
    def compute_reward(self, batch):  # type: ignore[override]
        self.tokens += int(batch["response_mask"].sum())
        return super().compute_reward(batch)

    @register(Dispatch.ONE_TO_ALL)
    def tokens_seen(self) -> int:
        return self.tokens


OVERRIDES = {"policy": MeasuredPolicy, "rollout": MeasuredRollout, "reward": CountingReward}


# ---- the runs


def base_config(args: argparse.Namespace) -> JobConfig:
    cfg = grpo_toy()
    if args.dry_run:
        cfg.model = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                seed=0, num_threads=1)
        cfg.rollout.max_new_tokens = 8
        cfg.trainer.batch_size, cfg.algorithm.group_size = 16, 4
        cfg.data.num_prompts = 16
    else:
        cfg.model = ModelConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                                num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                                max_position_embeddings=512, seed=0, attn_implementation="sdpa")
        cfg.rollout.max_new_tokens = args.max_new_tokens
        cfg.trainer.batch_size, cfg.algorithm.group_size = args.batch_size, 8
        cfg.data.num_prompts = 64
    cfg.rollout.engine_kwargs = {"max_batch_size": cfg.trainer.batch_size}
    cfg.actor.lr = args.lr
    cfg.actor.micro_batch_size = cfg.trainer.batch_size
    cfg.trainer.steps = args.steps
    cfg.trainer.cpus_per_worker = args.cpus_per_worker
    cfg.trainer.gpus_per_worker = 0.0 if args.dry_run else 0.5
    cfg.trainer.progress = cfg.trainer.plot = cfg.trainer.tensorboard = False
    cfg.trainer.checkpoint_at_end = False
    cfg.trainer.trace = False
    return cfg


def run_configs(args: argparse.Namespace) -> dict[str, JobConfig]:
    base = base_config(args)
    runs = {}
    for name, staleness in (("split-sync", 0), ("split-async", 1)):
        c = copy.deepcopy(base)
        c.trainer.max_staleness = staleness
        c.trainer.weight_sync = "collective"
        runs[name] = c
    c = copy.deepcopy(base)
    c.trainer.colocated = True
    c.trainer.max_staleness = 1
    c.trainer.gpus_per_worker = 0.0 if args.dry_run else 1.0
    c.rollout.sleep_level = 1
    runs["colocated"] = c
    return {k: v for k, v in runs.items() if k in args.runs}


async def one_run(name: str, cfg: JobConfig, out_dir: str, warmup: int) -> dict[str, Any]:
    cfg.trainer.output_dir = os.path.join(out_dir, "runs", name)
    t_setup = time.perf_counter()
    async with GRPOTrainer(cfg, worker_overrides=OVERRIDES) as trainer:
        setup_s = time.perf_counter() - t_setup
        g = trainer.groups
        assert g is not None
        params = await g.policy.num_params()
        placement = await g.policy.placement_info()
        t0 = time.perf_counter()
        history = await trainer.fit()
        loop_s = time.perf_counter() - t0
        tokens = sum(await g.reward.tokens_seen())
        mem = await g.policy.gpu_memory() + await g.rollout.gpu_memory()
    steady = history[warmup:] or history
    mean = lambda k: statistics.fmean(float(r[k]) for r in steady)  # noqa: E731
    per_process = {m["pid"]: m for m in mem}  # colocated roles share one process
    return {
        "run": name, "steps": len(history), "params": params, "placement": placement,
        "transport": trainer.weights.transport, "max_staleness": cfg.trainer.max_staleness,
        "setup_s": setup_s, "loop_s": loop_s, "ms_per_step": 1000 * mean("time/step"),
        "generate_ms": 1000 * mean("time/generate"), "train_ms": 1000 * mean("time/train"),
        "tokens": tokens, "tokens_per_s": tokens / loop_s,
        "peak_allocated_mib": [round(m["peak_allocated_mib"], 1) for m in per_process.values()],
        "peak_reserved_mib": [round(m["peak_reserved_mib"], 1) for m in per_process.values()],
        "gpu": next(iter(per_process.values()))["device"],
        "reward_first": statistics.fmean(r["reward/mean"] for r in history[:3]),
        "reward_last": statistics.fmean(r["reward/mean"] for r in history[-3:]),
        "history": [{k: v for k, v in r.items() if isinstance(v, int | float)} for r in history],
    }


def table(results: list[dict[str, Any]]) -> str:
    cols = ["run", "transport", "max_staleness", "steps", "ms/step", "generate ms", "train ms", "tokens/s",
            "speedup vs split-sync", "peak alloc MiB (per process)", "peak reserved MiB", "setup s",
            "reward first 3", "reward last 3"]
    sync = next((r["ms_per_step"] for r in results if r["run"] == "split-sync"), None)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        speed = f"{sync / r['ms_per_step']:.2f}x" if sync else "-"
        lines.append("| " + " | ".join([
            r["run"], r["transport"], str(r["max_staleness"]), str(r["steps"]), f"{r['ms_per_step']:.0f}",
            f"{r['generate_ms']:.0f}", f"{r['train_ms']:.0f}", f"{r['tokens_per_s']:.0f}", speed,
            ", ".join(f"{m:.0f}" for m in r["peak_allocated_mib"]), ", ".join(f"{m:.0f}" for m in r["peak_reserved_mib"]),
            f"{r['setup_s']:.1f}", f"{r['reward_first']:.3f}", f"{r['reward_last']:.3f}",
        ]) + " |")
    return "\n".join(lines)


def header(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    import ray
    import transformers

    gpu = results[0]["gpu"] if results else "?"
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    first = results[0] if results else {}
    return (
        f"Run {datetime.datetime.now().isoformat(timespec='seconds')} on {platform.machine()}, "
        f"{os.cpu_count()} CPUs, GPU: {gpu}; python {platform.python_version()}, torch {torch.__version__} "
        f"({cuda}), transformers {transformers.__version__}, ray {ray.__version__}."
        f"{' DRY RUN on the CPU with a tiny model: checks the logic, measures nothing about GPUs.' if args.dry_run else ''}"
        f"\n\nModel: Qwen2 built from a config, {first.get('params', 0) / 1e6:.2f} M parameters, "
        f"policy placement {first.get('placement')}; batch {args.batch_size if not args.dry_run else 16} responses "
        f"x {args.max_new_tokens if not args.dry_run else 8} new tokens per step.\n\n"
        f"Command: `python benchmarks/gpu_grpo.py {' '.join(sys.argv[1:])}`"
    )


async def main(args: argparse.Namespace) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    await asyncrl.ainit(num_cpus=args.num_cpus)
    results = []
    failed = []
    for name, cfg in run_configs(args).items():
        print(f"[gpu_grpo] {name}: starting", flush=True)
        try:
            r = await one_run(name, cfg, args.out_dir, args.warmup)
        except Exception as e:  # keep measuring the other runs; report the failure
            print(f"[gpu_grpo] {name}: FAILED {type(e).__name__}: {e}", flush=True)
            failed.append({"run": name, "error": f"{type(e).__name__}: {e}"})
            continue
        print(f"[gpu_grpo] {name}: {r['ms_per_step']:.0f} ms/step, {r['tokens_per_s']:.0f} tokens/s, "
              f"peak {r['peak_allocated_mib']} MiB", flush=True)
        results.append(r)
        _write(args, results, failed, echo=False)  # what is measured survives a later crash
    _write(args, results, failed)
    return 1 if failed or not results else 0


def _write(args: argparse.Namespace, results: list[dict[str, Any]], failed: list[dict[str, Any]],
           echo: bool = True) -> None:
    text = header(args, results) + "\n\n" + table(results) + "\n"
    for f in failed:
        text += f"\nFAILED {f['run']}: {f['error']}\n"
    with open(os.path.join(args.out_dir, "gpu_grpo.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out_dir, "gpu_grpo.json"), "w") as fh:
        json.dump({"results": results, "failed": failed, "args": vars(args)}, fh, indent=1, default=str)
    if echo:
        print(text, flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, few steps: check the logic")
    p.add_argument("--out-dir", default="benchmarks/results/gpu")
    p.add_argument("--runs", nargs="+", default=["split-sync", "split-async", "colocated"])
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 24; dry run 4)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the step-time means")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--cpus-per-worker", type=float, default=None)
    p.add_argument("--num-cpus", type=int, default=None)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.dry_run else 24
    if args.cpus_per_worker is None:
        args.cpus_per_worker = 1.0 if args.dry_run else 4.0
    if args.dry_run:
        args.warmup = min(args.warmup, 1)
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
