"""The tiny model learns the multi-turn toy environment (guess, then correct with feedback) on CPU.

Default suite: the mechanism, in one process (examples/agents_toy.py: the real rollout, reward and
policy workers, 12 GRPO steps, ~4 s of CPU). ``-m slow``: the README's run through the unchanged batch
trainer on Ray, where ``rollout.episode=char_class_retry`` makes the rollout stage run one episode per
row and every later stage trains on the masked trajectories."""

from __future__ import annotations

import importlib

import pytest

from asyncrl.pipelines.commands.cli import main
from asyncrl.pipelines.observe.metrics import read_jsonl



@pytest.mark.slow
def test_the_trainer_learns_to_guess_then_correct_with_feedback(ray_cluster, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--preset", "grpo_agents_toy", f"trainer.output_dir={out}", "trainer.progress=false"]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(30))
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.25 and last > 0.6, [round(r, 3) for r in rewards]  # random ~0.15; learned ~0.95


async def test_the_tiny_model_learns_to_guess_then_correct_with_feedback_in_process():
    ex = importlib.import_module("examples.agents_toy")
    history = await ex.main(ex.Args(steps=12, lr=2e-2))
    rewards = [r["reward"] for r in history]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-3:]) / 3
    assert first < 0.2 and last > 0.28, [round(r, 3) for r in rewards]  # random ~0.15
    assert all(r["env_tokens"] > 0 and r["turns"] > 1 for r in history)  # feedback turns in every step


@pytest.mark.slow
def test_the_trainer_trains_an_openai_client_agent_through_the_gateway(ray_cluster, tmp_path):
    """``rollout.agent=FILE.py:FN``: each row's agent talks to its rollout worker's gateway over HTTP; the
    batch trainer trains the rows (2 steps, the Qwen2 tokenizer for its chat template)."""
    import os

    agent = os.path.join(os.path.dirname(__file__), "..", "roles", "gateway_agent.py")
    out = tmp_path / "run"
    assert main(["train", "--preset", "grpo_agents_toy", "rollout.episode=null", f"rollout.agent={agent}:two_turns",
                 "model.tokenizer=qwen2", "rollout.max_new_tokens=24", "trainer.steps=2", "trainer.batch_size=8",
                 f"trainer.output_dir={out}", "trainer.progress=false"]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and all(r["reward/mean"] == 1.0 for r in rows)
    assert all(r["actor/episode/turns_mean"] == 2.0 and r["actor/episode/env_tokens_mean"] > 0 for r in rows), rows
