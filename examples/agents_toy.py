"""GRPO on a multi-turn toy environment: a tiny model learns to guess, then correct with feedback (CPU).

The environment ``char_class_retry`` asks for digits or vowels; each turn of ``tokens_per_turn``
tokens is scored, and a turn that is not perfect gets the feedback ``" k/n, again:"`` (environment
tokens, ``response_mask`` 0) before the model retries. The reward is the mean turn score
(:class:`asyncrl.roles.agentic.environments.CharClassRetry`).

One step, top to bottom, with the real workers in this process (the trainer runs the same calls as
stages on Ray when ``rollout.episode=char_class_retry`` is set)::

    prompts x group_size ─► rollout.generate (episodes, all in flight) ─► reward (the episodes' own)
      ─► policy.compute_log_prob ─► GRPO advantages (groups = episodes of one sample)
      ─► policy.update ─► rollout.update_weights

Run: ``python examples/agents_toy.py`` (prints one line per step; ~1 s a step on 2 CPU cores).
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

import torch
from tensordict import NonTensorStack, TensorDict

from asyncrl.pipelines.loop.stages import AdvantageWorker
from asyncrl.roles import (ModelConfig, OptimConfig, PolicyWorker, RewardWorker, RolloutConfig, RolloutWorker,
                           tiny_tokenizer, toy_dataset)


@dataclass
class Args:
    """What one run trains."""

    steps: int = 30
    """Policy updates."""
    prompts_per_step: int = 8
    """Distinct samples per step."""
    group_size: int = 4
    """Episodes per sample (a GRPO group)."""
    max_turns: int = 2
    """Turns per episode (guess, then correct)."""
    tokens_per_turn: int = 4
    """Model tokens per turn."""
    lr: float = 1e-2
    """Adam learning rate of the policy."""
    seed: int = 0
    """Model and sampling seed."""


def prompt_batch(n: int, group_size: int, seed: int) -> TensorDict:
    """`n` char_class prompts, each repeated `group_size` times with the same ``uid``."""
    tok = tiny_tokenizer()
    rows = toy_dataset("char_class", n, seed=seed)
    enc = tok([r["prompt"] for r in rows], padding=True, return_tensors="pt")
    td = TensorDict({"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
                     "prompt": NonTensorStack(*[r["prompt"] for r in rows]),
                     "answer": NonTensorStack(*[r["answer"] for r in rows]), "uid": torch.arange(n)}, batch_size=[n])
    return td[torch.arange(n).repeat_interleave(group_size)]


async def main(args: Args) -> list[dict[str, float]]:
    """Train; returns one record per step (mean reward, turns, model and environment tokens)."""
    model = ModelConfig(seed=args.seed, device="cpu", dtype="float32", autocast="off")
    tok = tiny_tokenizer()
    feedback = max(len(tok.encode(f" {k}/{args.tokens_per_turn}, again:")) for k in range(args.tokens_per_turn + 1))
    width = args.max_turns * args.tokens_per_turn + (args.max_turns - 1) * feedback
    rollout = RolloutWorker(model, RolloutConfig(max_new_tokens=width, seed=args.seed, episode="char_class_retry",
                                                 episode_kwargs={"max_turns": args.max_turns,
                                                                 "tokens_per_turn": args.tokens_per_turn}))
    policy = PolicyWorker(model, OptimConfig(lr=args.lr, micro_batch_size=64, kl_coef=0.0))
    reward = RewardWorker()
    advantage = AdvantageWorker()
    history = []
    for step in range(args.steps):
        batch = await rollout.generate(prompt_batch(args.prompts_per_step, args.group_size, seed=step), seed=step)
        scores = reward.compute_reward(batch)  # the episodes' own rewards (episode_reward)
        log_probs = policy.compute_log_prob(batch)
        train = advantage.compute_advantages(batch, scores, log_probs, algo={"name": "grpo", "norm_adv_by_std": True})
        policy.update(train)
        await rollout.update_weights(policy.export_weights())
        mask = batch["response_mask"]
        history.append({"step": step, "reward": float(scores["scores"].mean()),
                        "turns": float(batch["num_turns"].float().mean()),
                        "model_tokens": float(mask.sum(1).float().mean()),
                        "env_tokens": float((batch["attention_mask"][:, -width:].sum(1) - mask.sum(1)).float().mean())})
    return history


if __name__ == "__main__":
    a = Args(steps=int(sys.argv[1]), lr=float(sys.argv[2])) if len(sys.argv) > 2 else Args()
    for rec in asyncio.run(main(a)):
        print(f"step {rec['step']:3d}  reward {rec['reward']:.3f}  turns {rec['turns']:.2f}  "
              f"model tokens {rec['model_tokens']:.1f}  env tokens {rec['env_tokens']:.1f}")
