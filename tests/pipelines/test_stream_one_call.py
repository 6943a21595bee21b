"""Streaming rollout issues one Ray call per prompt group: ``generate_requests(compute_reward=True)`` on one
replica, scored there by the reward worker of its process, the controller reading the scores from the call's
reply (no score call, no fetch of the rows); the scores are those of the former generate-then-score path, bit
for bit."""

from __future__ import annotations

import json

import torch

from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.pipelines.job.presets import tiny_test, twin
from asyncrl.pipelines.loop.deadlines import unwrap
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.pipelines.rollout import stream_rollout


async def test_each_prompt_group_is_one_call_to_one_replica_and_no_score_call(ray_cluster, tmp_path):
    assert stream_rollout.SCORE_IN_GENERATE
    cfg = twin()  # 4 simulated replicas in one process, 2 training ranks, the 7B profile at a time scale of 0.01
    t = cfg.trainer
    t.steps, t.batch_size, t.output_dir = 3, 32, str(tmp_path)
    cfg.validate()
    async with GRPOTrainer(cfg) as trainer:
        await trainer.fit()
        groups = trainer.groups
        reward_calls = unwrap(groups.reward).stats.calls
        generates = [s for s in trainer.tracer.spans if s.name == "generate"]
        scores = [s for s in trainer.tracer.spans if s.name == "score"]
    recs = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    admitted = sorted(r["index"] for r in recs if r["kind"] == "group")
    assert sorted(s.args["group"] for s in generates) == admitted  # one generate call per group, none repeated
    assert all(isinstance(s.args["rank"], int) for s in generates)  # each to one replica: one Ray task
    assert scores == [] and reward_calls == 0  # no score call at all
    ledger = check_ledger(tmp_path)
    assert ledger.ok and ledger.trained == 3 * t.batch_size, ledger.render()


async def test_scores_from_the_reply_equal_the_score_calls_bit_for_bit(ray_cluster, tmp_path):
    cfg = tiny_test()  # the real RolloutWorker (HF engine) and RewardWorker (char_class), colocated
    t = cfg.trainer
    t.rollout_mode, t.rollout_workers, t.max_staleness, t.output_dir = "stream", 2, 1, str(tmp_path)
    cfg.rollout.max_new_tokens = 8
    cfg.validate()
    async with GRPOTrainer(cfg) as trainer:
        g, G = trainer.groups, cfg.group_size
        prompts = trainer.loader.batch(0)[:G]
        for rank in (0, 1):
            for seed in (3, 11):
                generate = g.rollout.generate_requests.options(rank=rank)
                fused = generate(prompts, seed=seed, compute_reward=True)
                summary = await fused.summary()
                rows = await fused
                two = generate(prompts, seed=seed)  # the former path: generate, then score the rows on that rank
                old = await g.reward.compute_reward.options(rank=rank)(two)
                old_rows = await two
                assert torch.equal(rows["response_ids"], old_rows["response_ids"])  # same seed, same weights
                for key in ("scores", "response_length"):
                    assert summary[key].dtype == old[key].dtype and torch.equal(summary[key], old[key]), key
                    assert torch.equal(rows[key], old[key]), key  # the rows carry them to the training pool
