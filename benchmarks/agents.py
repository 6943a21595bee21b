"""Multi-turn episodes on one rollout worker: 64 in flight vs one at a time.

One rollout worker (a Ray process, the tiny model on the CPU) runs the same 64 episodes of the
``char_class_retry`` environment (``--turns`` turns of ``--tokens-per-turn`` tokens, feedback between)
twice: one episode at a time (``max_in_flight=1``) and all 64 in flight, where the request-level
engine batches their pending ``generate`` requests into shared decoding rounds. Throughput counts
model tokens (``response_mask``) per second of the call. Meanwhile the controller's event loop lag
is measured with a 10 ms heartbeat (``LoopLag``), and the worker reports its peak RSS after each run.

    python benchmarks/agents.py                    # writes benchmarks/results/agents.md
    python benchmarks/agents.py --episodes 16 --reps 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import ray
import torch
from tensordict import NonTensorStack, TensorDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import asyncrl  # noqa: E402
from asyncrl import Dispatch, RayWorkerGroup, register  # noqa: E402
from asyncrl.pipelines.heartbeat import LoopLag  # noqa: E402
from asyncrl.roles import ModelConfig, RolloutConfig, RolloutWorker, tiny_tokenizer, toy_dataset  # noqa: E402
from benchmarks._common import load_note, run_header, write_result  # noqa: E402


@dataclass(kw_only=True)
class Args:
    """Benchmark settings."""

    episodes: int = 64
    """Episodes per call (rows of one batch)."""
    turns: int = 4
    """Turns per episode (an episode that gets a turn perfect ends early)."""
    tokens_per_turn: int = 16
    """Model tokens per turn."""
    reps: int = 3
    """Timed calls per mode (median reported), after one warm-up call."""
    output: str = "benchmarks/results/agents.md"
    """Where the markdown table goes."""


class BenchRollout(RolloutWorker):
    """The rollout worker plus its peak resident memory."""

    @register(Dispatch.ONE_TO_ALL)
    def peak_rss_mib(self) -> float:
        """``ru_maxrss`` of this process in MiB (Linux reports KiB)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def batch(n: int) -> TensorDict:
    """`n` char_class prompts (left-padded)."""
    tok = tiny_tokenizer()
    rows = toy_dataset("char_class", n, seed=0)
    enc = tok([r["prompt"] for r in rows], padding=True, return_tensors="pt")
    return TensorDict({"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
                       "prompt": NonTensorStack(*[r["prompt"] for r in rows]),
                       "answer": NonTensorStack(*[r["answer"] for r in rows]), "uid": torch.arange(n)}, batch_size=[n])


async def measure(args: Args) -> dict[str, dict[str, float]]:
    feedback = 12  # " k/n, again:" is at most 12 tiny-tokenizer tokens
    width = args.turns * args.tokens_per_turn + (args.turns - 1) * feedback
    cfg = RolloutConfig(max_new_tokens=width, episode="char_class_retry",
                        episode_kwargs={"max_turns": args.turns, "tokens_per_turn": args.tokens_per_turn})
    model = ModelConfig(seed=0, device="cpu", dtype="float32", autocast="off", num_threads=1)
    out: dict[str, dict[str, float]] = {}
    async with RayWorkerGroup(BenchRollout, world_size=1, args=(model, cfg), name="agents-bench") as g:
        prompts = batch(args.episodes)
        async with LoopLag(interval=0.01) as idle:  # the same heartbeat with no call in flight: the machine's share
            await asyncio.sleep(5.0)
        out["idle (no call)"] = {"loop_lag_max_ms": 1000 * idle.max}
        for mode, in_flight in (("one at a time", 1), (f"{args.episodes} in flight", args.episodes)):
            await g.generate_episodes(prompts[:2], seed=99, max_in_flight=in_flight)  # warm-up
            rates, lags = [], []
            for rep in range(args.reps):
                async with LoopLag(interval=0.01) as lag:
                    t0 = time.perf_counter()
                    res = await g.generate_episodes(prompts, seed=rep, max_in_flight=in_flight)
                    dt = time.perf_counter() - t0
                rates.append(float(res["response_mask"].sum()) / dt)
                lags.append(lag.max)
            (rss,) = await g.peak_rss_mib()
            out[mode] = {"tokens_per_s": statistics.median(rates), "loop_lag_max_ms": 1000 * max(lags),
                         "peak_rss_mib": rss, "turns": float(res["num_turns"].float().mean()),
                         "model_tokens": float(res["response_mask"].sum()),
                         "env_tokens": float((res["attention_mask"][:, -width:].sum() - res["response_mask"].sum()))}
    return out


def render(args: Args, res: dict[str, dict[str, float]], note: str) -> str:
    one, many = res["one at a time"], res[f"{args.episodes} in flight"]
    lines = [
        "# Multi-turn episodes: in flight together vs one at a time", "",
        run_header("agents.py", note), "",
        f"{args.episodes} episodes of `char_class_retry` ({args.turns} turns x {args.tokens_per_turn} tokens, "
        f"feedback between), tiny model on the CPU, one rollout worker on Ray; median of {args.reps} calls.", "",
        "| mode | model tokens/s | speed-up | controller loop lag, max | worker peak RSS | turns/episode |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, r in res.items():
        if "tokens_per_s" not in r:
            lines.append(f"| {mode} | | | {r['loop_lag_max_ms']:.1f} ms | | |")
            continue
        lines.append(f"| {mode} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / one['tokens_per_s']:.1f}x | "
                     f"{r['loop_lag_max_ms']:.1f} ms | {r['peak_rss_mib']:.0f} MiB | {r['turns']:.2f} |")
    lines += ["", f"Speed-up of {args.episodes} in flight: **{many['tokens_per_s'] / one['tokens_per_s']:.1f}x** "
              f"(target >= 4x); worst controller loop lag {max(one['loop_lag_max_ms'], many['loop_lag_max_ms']):.1f} ms "
              f"(target < 50 ms) against {res['idle (no call)']['loop_lag_max_ms']:.1f} ms for the same heartbeat with "
              "no call in flight: on a loaded machine the lag is the process waiting for a core, not the controller's "
              "work (the controller only awaits one call).", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f, d in Args.__dataclass_fields__.items():
        p.add_argument("--" + f.replace("_", "-"), type=type(d.default) if not isinstance(d.default, str) else str,
                       default=d.default)
    args = Args(**vars(p.parse_args()))
    load0 = os.getloadavg()[0]
    asyncrl.init(num_cpus=4)
    try:
        res = asyncio.run(measure(args))
    finally:
        asyncrl.shutdown()
    write_result(args.output, render(args, res, load_note(load0, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
