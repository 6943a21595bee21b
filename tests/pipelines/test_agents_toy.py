"""The tiny model learns the multi-turn toy environment (guess, then correct with feedback) on CPU,
through the unchanged batch trainer on Ray: ``rollout.episode=char_class_retry`` makes the rollout
stage run one episode per row, and every later stage trains on the masked trajectories."""

from __future__ import annotations

import importlib

from asyncrl.pipelines.cli import main
from asyncrl.pipelines.metrics import read_jsonl

AGENTS_TOY = ["rollout.episode=char_class_retry", "rollout.max_new_tokens=19", "trainer.steps=30",
              "trainer.batch_size=32", "algorithm.group_size=4", "actor.lr=0.01", "trainer.progress=false"]
"""The README's run (``asyncrl train`` with these overrides)."""


def test_the_trainer_learns_to_guess_then_correct_with_feedback(ray_cluster, tmp_path):
    out = tmp_path / "run"
    assert main(["train", f"trainer.output_dir={out}", *AGENTS_TOY]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(30))
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.25 and last > 0.6, [round(r, 3) for r in rewards]  # random ~0.15; learned ~0.95


async def test_the_in_process_example_runs_episodes_with_feedback_turns():
    ex = importlib.import_module("examples.agents_toy")
    history = await ex.main(ex.Args(steps=2, prompts_per_step=2, group_size=2))
    assert [r["step"] for r in history] == [0, 1]
    assert all(r["env_tokens"] > 0 and 0.0 <= r["reward"] <= 1.0 for r in history)
