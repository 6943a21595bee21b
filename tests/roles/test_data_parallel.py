"""A policy trained data-parallel on two Ray workers (gloo gradient averaging) stays in lockstep."""

from __future__ import annotations

import sys

import ray

import asyncrl
from asyncrl import Dispatch, register
from asyncrl.roles import OptimConfig, PolicyWorker, RolloutConfig, RolloutWorker
from asyncrl.roles.functional import grpo_advantages
from asyncrl.roles.modeling.models import state_dict_checksums


class CheckedPolicy(PolicyWorker):
    """The policy plus every rank's own weight checksums (the role exposes rank 0's only)."""

    @register(Dispatch.ONE_TO_ALL)
    def rank_checksums(self) -> dict[str, str]:
        return state_dict_checksums(self.model.state_dict().items())


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this test module is not importable by workers


async def test_two_rank_policy_update_keeps_ranks_identical(ray_cluster, model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=6))  # in-process, only to make a batch
    batch = await rollout.generate(prompt_batch(n=4, repeat=2))
    async with asyncrl.RayWorkerGroup(CheckedPolicy, world_size=2, name="dp-policy",
                                      kwargs={"model": model_config,
                                              "optim": OptimConfig(lr=1e-2, micro_batch_size=2)}) as policy:
        before = await policy.rank_checksums()
        assert before[0] == before[1]
        lp = await policy.compute_log_prob(batch)
        b = batch.clone(False)
        b.update(lp)
        b["scores"] = (b["response_ids"][:, 0] % 2).float()
        b["advantages"] = grpo_advantages(b["scores"], b["uid"], b["response_mask"])
        metrics = await policy.update(b)  # each rank trains on its 4 rows; gradients averaged with gloo
        assert [m["version"] for m in metrics] == [1.0, 1.0]
        assert metrics[0]["grad_norm"] == metrics[1]["grad_norm"]  # the averaged gradient is the same on both
        after = await policy.rank_checksums()
        assert after[0] == after[1] != before[0]
