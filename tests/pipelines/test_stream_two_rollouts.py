"""Stream mode with two rollout workers (``trainer.rollout_workers=2``) on real Ray: every group's rows are
split over both ranks, every group is trained exactly once within the bound, and both ranks hold the same
weights (checksums, bit for bit, and the policy's once the final version is loaded)."""

from __future__ import annotations

import pytest
from asyncrl.pipelines.trainers.trainer import GRPOTrainer

from tests.pipelines.test_stream import journal, stream_config


@pytest.mark.slow
async def test_stream_mode_with_two_rollout_workers_keeps_the_admission_invariants(ray_cluster, tmp_path):
    cfg = stream_config(tmp_path, steps=3)
    cfg.trainer.rollout_workers = 2
    cfg.rollout.partial_rollout = "recompute"  # updates reach the groups in flight on both ranks
    cfg = cfg.validate()
    B, G = cfg.prompts_per_step, cfg.group_size
    async with GRPOTrainer(cfg) as trainer:
        history = await trainer.fit()
        stats = await trainer.groups.rollout.statistics()
        held = await trainer.groups.rollout.weights_checksum()  # one dict per rank, as the stream loaded them
        policy = await trainer.groups.policy.weights_checksum()  # version 3
        if stats[0]["version"] != 3:  # the last version was still loading when the run ended: load it now
            await trainer.weights.load(trainer.groups, trainer.weights.export(trainer.groups))
            final = await trainer.groups.rollout.weights_checksum()
        else:
            final = held
    assert [h["step"] for h in history] == [0, 1, 2] and [h["version"] for h in history] == [1, 2, 3]
    assert all(0 <= h["staleness/max"] <= 1 and h["stream/dropped_groups"] == 0 for h in history)
    recs = journal(tmp_path)
    admitted = {r["index"]: r for r in recs if r["kind"] == "group"}
    steps = [r for r in recs if r["kind"] == "step"]
    assert sorted(g for s in steps for g in s["groups"]) == sorted(admitted) == list(range(3 * B))
    for s in steps:
        assert len(s["groups"]) == B and all(0 <= s["step"] - admitted[g]["version"] <= 1 for g in s["groups"])
    # each group call split its G rows over the two ranks: 3 * B groups * G / 2 requests on each
    assert len(stats) == 2 and [st["requests"] for st in stats] == [3 * B * G // 2] * 2
    assert stats[0]["version"] == stats[1]["version"] >= 2  # the last version may still be loading at the end
    # the same weights, bit for bit: both ranks hold what the stream loaded, and the policy's at version 3
    assert held[0] == held[1] and len(held[0]) == len(policy) > 0
    assert final == [policy, policy]
