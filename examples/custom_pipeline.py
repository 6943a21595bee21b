"""A custom reward stage in the async GRPO trainer, on placement you choose.

The trainer drives whatever groups you hand it, as long as each keeps the stage's
contract (here: ``compute_reward(batch) -> TD{scores}``, DP_COMPUTE). This file
defines its own reward worker -- "answer with short digit strings": the fraction of
digit tokens, with a bonus for stopping early -- puts it beside the rollout engine
in the rollout pool, puts the policy in the training pool, and trains.

    python examples/custom_pipeline.py --steps 40
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, fields

import torch
from tensordict import TensorDict

import asyncrl
from asyncrl import Dispatch, ResourcePool, Worker, colocate, register
from asyncrl.pipelines.job.presets import grpo_toy
from asyncrl.pipelines.loop.stages import AdvantageWorker, Groups
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles import PolicyWorker, RolloutWorker, load_tokenizer


@dataclass
class Args:
    """Settings of this example."""

    steps: int = 40
    """Training steps."""
    batch_size: int = 64
    """Responses per step (8 per prompt)."""
    max_staleness: int = 1
    """How far rollout may run ahead of training."""
    output_dir: str = "runs/custom_pipeline"
    """Where metrics, trace and checkpoints go."""
    progress: bool = True
    """Show the progress bar."""


class ShortDigitsReward(Worker):
    """Score = fraction of digit tokens among the response slots, + 0.5 if the response ended with EOS
    within 4 tokens (scaled to [0, 1])."""

    def __init__(self, tokenizer: str = "tiny") -> None:
        self.tok = load_tokenizer(tokenizer)

    @register(Dispatch.DP_COMPUTE)
    def compute_reward(self, batch) -> TensorDict:
        ids, mask = batch["response_ids"], batch["response_mask"]
        scores = []
        for row, m in zip(ids.tolist(), mask.tolist()):
            toks = [t for t, keep in zip(row, m) if keep]
            texts = [self.tok.decode([t], skip_special_tokens=True) for t in toks]
            digits = sum(1 for s in texts if s.strip() and s.strip().isdigit())
            stopped = bool(toks) and toks[-1] == self.tok.eos_token_id and len(toks) <= 4
            scores.append((digits / max(1, len(row)) + 0.5 * stopped) / 1.5)
        return TensorDict({"scores": torch.tensor(scores)}, batch_size=batch.batch_size[:1])


async def run(args: Args) -> list[dict]:
    cfg = grpo_toy()
    cfg.trainer.steps, cfg.trainer.batch_size = args.steps, args.batch_size
    cfg.trainer.max_staleness, cfg.trainer.output_dir = args.max_staleness, args.output_dir
    cfg.trainer.progress = args.progress
    asyncrl.init()
    pool = ResourcePool([2], name="custom")
    rollout_pool, train_pool = pool.split([1, 1])
    rollout = colocate({"rollout": (RolloutWorker, (cfg.model, cfg.rollout), {}),
                        "reward": ShortDigitsReward}, rollout_pool, name="rollout")
    train = colocate({"policy": (PolicyWorker, (cfg.model, cfg.actor), {}),
                      "advantage": AdvantageWorker}, train_pool, name="train")
    try:
        async with rollout, train:
            groups = Groups(rollout=rollout["rollout"], reward=rollout["reward"],
                            policy=train["policy"], advantage=train["advantage"])
            async with GRPOTrainer(cfg, groups=groups) as trainer:
                return await trainer.fit()
    finally:
        await pool.release()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Args):
        kind = (lambda s: s.lower() in ("1", "true", "yes")) if f.type in (bool, "bool") else type(f.default)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    history = asyncio.run(run(Args(**vars(parser.parse_args(argv)))))
    print(f"reward: first {history[0]['reward/mean']:.3f} -> last {history[-1]['reward/mean']:.3f}")
    return history


if __name__ == "__main__":
    main()
