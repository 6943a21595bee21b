"""Staleness and stage order under random stage delays: no consumed sample is older than the bound, stages run
in the canonical order per batch, and updates apply in version order.

Fake workers (tests/pipelines/fakes.py) on the in-process backend: the scheduling is
the trainer's real code; only the stage bodies are replaced by random delays.
"""

from __future__ import annotations

import pytest

from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer

from .fakes import Recorder, fake_groups

STEPS = 10


async def _run(k: int, mode: str, seed: int, tmp_path, precompute: bool = True):
    cfg = tiny_test()
    cfg.trainer.steps = STEPS
    cfg.trainer.max_staleness = k
    cfg.trainer.rollout_weights = mode
    cfg.trainer.checkpoint_at_end = False
    cfg.trainer.precompute_log_probs = precompute
    cfg.trainer.output_dir = str(tmp_path / f"{k}-{mode}-{seed}-{precompute}")
    rec = Recorder()
    async with fake_groups(rec, seed, cfg.prompts_per_step, 0.004, k) as groups:
        async with GRPOTrainer(cfg, groups=groups) as trainer:
            history = await trainer.fit()
    return history, rec.events


@pytest.mark.parametrize("mode", ["fixed_lag", "latest"])
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("seed", [0, 1])
async def test_no_consumed_sample_is_older_than_the_bound(k, mode, seed, tmp_path):
    history, events = await _run(k, mode, seed, tmp_path)
    assert len(history) == STEPS
    assert all(0 <= r["staleness/max"] <= k for r in history)
    assert [r["version"] for r in history] == list(range(1, STEPS + 1))
    if mode == "fixed_lag":  # exactly max(0, t - k): reproducible whatever the delays
        assert [r["batch/version"] for r in history] == [max(0, t - k) for t in range(STEPS)]
    assert all(r["staleness/dropped"] == 0 for r in history)  # the version gate keeps rollout within the bound


@pytest.mark.parametrize("k, precompute", [(0, True), (2, False), (2, True)])
async def test_stages_run_in_canonical_order_and_updates_in_version_order(k, precompute, tmp_path):
    """Canonical per batch at max_staleness=0 (and with trainer.precompute_log_probs off); with it
    on at k >= 1 a batch's old_log_prob may run before its score (it does not read the scores)."""
    _, events = await _run(k, "latest", seed=3, tmp_path=tmp_path, precompute=precompute)
    where = {(name, step): i for i, (name, step, _) in enumerate(events) if step >= 0}
    canonical = k == 0 or not precompute
    for t in range(STEPS):
        chains = [("generate", "score", "old_log_prob", "actor_update")] if canonical else [
            ("generate", "score", "actor_update"), ("generate", "old_log_prob", "actor_update")]
        for chain in chains:
            order = [where[(s, t)] for s in chain]
            assert order == sorted(order), f"step {t}: stages ran out of order"
    updates = [v for name, _, v in events if name == "actor_update"]
    assert updates == list(range(STEPS))
    exports = [v for name, _, v in events if name == "export_weights"]
    assert exports == list(range(1, STEPS + 1))
    syncs = [v for name, _, v in events if name == "weight_sync"]
    assert syncs == sorted(set(syncs))  # strictly increasing versions reach the rollout


async def test_rollout_runs_ahead_with_staleness(tmp_path):
    """With k=2 the rollout generates batch t+1 before step t's update finishes (overlap)."""
    _, events = await _run(2, "fixed_lag", seed=5, tmp_path=tmp_path)
    where = {(name, step): i for i, (name, step, _) in enumerate(events) if step >= 0}
    assert any(where[("generate", t + 1)] < where[("actor_update", t)] for t in range(STEPS - 1))
