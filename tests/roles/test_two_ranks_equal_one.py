"""2 ranks == 1 rank on real Ray: the same batch, split over two training workers whose shards hold
very different token counts, gives the gradient (every loss_agg_mode, with the importance weights,
KL and entropy terms on), the metrics and the whitened PPO advantages of one worker, to fp32
tolerance. The two ranks are one colocated Ray group (policy, critic, advantage per process, as the
trainer places them); the one-rank reference runs in this process."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

import asyncrl
from asyncrl import Dispatch, register
from asyncrl.pipelines.loop.stages import AdvantageWorker, compute_advantages
from asyncrl.roles import (CriticWorker, OptimConfig, PolicyWorker, RolloutCorrectionConfig, StaleBatchError)
from asyncrl.roles._util import mini_batches
from asyncrl.roles.functional import LOSS_AGG_MODES


class PolicyProbe(PolicyWorker):
    """The policy plus a method that runs ``update`` under a given loss_agg_mode and returns the
    summed gradient it applied (lr=0: the weights do not move, so modes can be compared in turn)."""

    @register(Dispatch.DP_COMPUTE_METRIC)
    def update_and_grads(self, batch, loss_agg_mode: str) -> dict:
        self.optim_config.loss_agg_mode = loss_agg_mode
        metrics = self.update(batch)
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return {"metrics": metrics, "grads": grads}


    @register(Dispatch.DP_COMPUTE_METRIC)
    def grads_of_the_last_mini_batch(self, batch, mini_batch_size: int) -> dict:
        """``update`` in mini-batches of `mini_batch_size` rows (over all ranks); with lr=0 the
        gradient left behind is the last mini-batch's alone."""
        saved = self.optim_config.mini_batch_size
        self.optim_config.loss_agg_mode, self.optim_config.mini_batch_size = "token-mean", mini_batch_size
        try:
            metrics = self.update(batch)
        finally:
            self.optim_config.mini_batch_size = saved
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return {"metrics": metrics, "grads": grads}

    @register(Dispatch.DP_COMPUTE_METRIC)
    def grads_under_a_token_budget(self, batch, budget: int) -> dict:
        """``update`` with ``max_tokens_per_micro_batch=budget``: its gradient and this rank's forwards."""
        self.optim_config.loss_agg_mode, self.optim_config.max_tokens_per_micro_batch = "token-mean", budget
        shapes: list = []
        hook = self.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                    with_kwargs=True)
        try:
            metrics = self.update(batch)
        finally:
            self.optim_config.max_tokens_per_micro_batch = None
            hook.remove()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return {"metrics": metrics, "grads": grads, "shapes": shapes}

    @register(Dispatch.DP_COMPUTE_METRIC)
    def try_update(self, batch) -> dict:
        """``update``'s outcome on this rank: its error (type, message) or its metrics, and the version."""
        try:
            return {"ok": self.update(batch)["version"], "version": self._version}
        except (StaleBatchError, KeyError) as e:
            return {"error": type(e).__name__, "message": str(e), "version": self._version}


class CriticProbe(CriticWorker):
    @register(Dispatch.DP_COMPUTE_METRIC)
    def update_and_grads(self, batch) -> dict:
        metrics = self.update(batch)
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return {"metrics": metrics, "grads": grads}


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this test module is not importable by workers

OPTIM = OptimConfig(lr=0.0, micro_batch_size=3, max_grad_norm=None, kl_coef=0.1, kl_loss_type="low_var_kl",
                    entropy_coef=0.01, rollout_correction=RolloutCorrectionConfig(mode="tis", rollout_is_threshold=1.5))


@pytest.fixture(scope="module")
async def two_ranks(ray_cluster, model_config):
    """Policy, critic and advantage workers colocated on two Ray processes (gloo between them)."""
    critic_optim = OptimConfig(lr=0.0, micro_batch_size=3, max_grad_norm=None)
    col = asyncrl.colocate({"policy": (PolicyProbe, (model_config, OPTIM), {}),
                            "critic": (CriticProbe, (model_config, critic_optim), {}),
                            "advantage": AdvantageWorker,
                            "bounded": (PolicyProbe, (model_config, OptimConfig(micro_batch_size=3)),
                                        {"max_staleness": 0})}, world_size=2, name="two-ranks")
    await col.setup()
    try:
        yield col, critic_optim
    finally:
        await col.close()


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")


def _same_metrics(one: dict, two: dict, what: str) -> None:
    for k, v in one.items():
        assert two[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (what, k)


async def test_two_policy_ranks_give_the_gradient_of_one_for_every_aggregation_mode(two_ranks, model_config,
                                                                                    uneven_batch):
    col, _ = two_ranks
    one = PolicyProbe(model_config, OPTIM)
    for mode in LOSS_AGG_MODES:
        r1 = one.update_and_grads(uneven_batch, mode)
        r2a, r2b = await col["policy"].update_and_grads(uneven_batch, mode)
        _same(r2a["grads"], r2b["grads"])  # the summed gradient is the same on both ranks
        _same(r1["grads"], r2a["grads"])  # ... and it is the one-rank gradient
        assert r2a["metrics"] == r2b["metrics"]  # metrics are of the whole batch on every rank
        _same_metrics(r1["metrics"], r2a["metrics"], mode)
    m = r1["metrics"]
    assert m["is_over_threshold_frac"] > 0 and m["kl"] > 0 and m["entropy"] > 0  # every term was live


async def test_with_several_mini_batches_two_ranks_step_on_the_rows_of_one(two_ranks, model_config, uneven_batch):
    """Mini-batches are strided (rows j, j+k, ...), so mini-batch j of two ranks holding contiguous
    shards is the same rows as one rank's mini-batch j: the last one's gradient is one rank's.
    (Contiguous mini-batches gave rows 4-7 on one rank but rows 2, 3, 6, 7 on two.)"""
    col, _ = two_ranks
    r1 = PolicyProbe(model_config, OPTIM).grads_of_the_last_mini_batch(uneven_batch, 4)
    r2a, r2b = await col["policy"].grads_of_the_last_mini_batch(uneven_batch, 4)
    _same(r2a["grads"], r2b["grads"])
    _same(r1["grads"], r2a["grads"])
    fresh = {k: v for k, v in r1["metrics"].items() if not k.startswith(("row_staleness", "version"))}
    _same_metrics(fresh, r2a["metrics"], "two mini-batches")  # (the two-rank policy has stepped before)
    whole = PolicyProbe(model_config, OPTIM).grads_of_the_last_mini_batch(uneven_batch, 8)
    assert any((whole["grads"][n] - g).abs().max() > 1e-4 for n, g in r1["grads"].items())  # a real split


async def test_under_a_token_budget_two_ranks_run_as_many_micro_batches_and_give_the_gradient_of_one(
        two_ranks, model_config, uneven_batch):
    """Rank 0's rows are long and rank 1's one token: alone they would need different numbers of
    micro-batches; they agree on the larger (a sharded model's every forward is a collective)."""
    col, _ = two_ranks
    width = uneven_batch["input_ids"].shape[1]
    r1 = PolicyProbe(model_config, OPTIM).update_and_grads(uneven_batch, "token-mean")
    r2a, r2b = await col["policy"].grads_under_a_token_budget(uneven_batch, width + 1)
    _same(r2a["grads"], r2b["grads"])
    _same(r1["grads"], r2a["grads"])
    fresh = {k: v for k, v in r1["metrics"].items() if not k.startswith(("row_staleness", "version"))}
    _same_metrics(fresh, r2a["metrics"], "token budget")
    assert len(r2a["shapes"]) == len(r2b["shapes"]) == 4  # rank 0 needs one row per forward, rank 1 alone one
    assert max(c for _, c in r2b["shapes"]) < width  # rank 1's one-token responses are cut


def test_mini_batches_are_strided_and_cover_every_row_once():
    assert mini_batches(8, 4) == [slice(0, 8, 2), slice(1, 8, 2)]
    assert mini_batches(8, None) == mini_batches(8, 8) == mini_batches(8, 16) == [slice(0, 8)]
    rows = [sorted(range(10)[s]) for s in mini_batches(10, 4)]
    assert rows == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    # two ranks with contiguous shards of 8 rows, 2 rows each per step == one rank, 4 rows per step
    for j, s in enumerate(mini_batches(8, 4)):
        two = sorted([r for r in range(4)[mini_batches(4, 2)[j]]] + [4 + r for r in range(4)[mini_batches(4, 2)[j]]])
        assert two == sorted(range(8)[s])


async def test_two_critic_ranks_give_the_gradient_of_one(two_ranks, model_config, uneven_batch):
    col, critic_optim = two_ranks
    r1 = CriticProbe(model_config, critic_optim).update_and_grads(uneven_batch)
    r2a, r2b = await col["critic"].update_and_grads(uneven_batch)
    _same(r1["grads"], r2a["grads"])
    _same(r2a["grads"], r2b["grads"])
    _same_metrics(r1["metrics"], r2a["metrics"], "critic")


async def test_two_advantage_ranks_whiten_with_the_statistics_of_the_whole_batch(two_ranks, uneven_batch):
    col, _ = two_ranks
    algo = {"name": "ppo", "kl_in_reward_coef": 0.0, "kl_penalty": "k1", "gamma": 1.0, "lam": 0.95,
            "whiten_advantages": True}
    parts = uneven_batch.select("scores", "values", "response_mask", "old_log_probs")
    a1 = AdvantageWorker().compute_advantages(parts, parts.select("scores"), parts.select("old_log_probs"), algo=algo)
    a2 = await col["advantage"].compute_advantages(parts, parts.select("scores"), parts.select("old_log_probs"),
                                                   algo=asyncrl.Broadcast(algo))
    torch.testing.assert_close(a2["advantages"], a1["advantages"], rtol=1e-5, atol=1e-6)
    # whitening each shard with its own statistics (the old behaviour) moves advantages a lot
    per_shard = torch.cat([compute_advantages(parts[:4], algo)[0], compute_advantages(parts[4:], algo)[0]])
    assert (per_shard - a1["advantages"]).abs().max() > 0.1


async def test_a_shard_outside_the_bound_on_one_rank_fails_the_update_on_every_rank_and_applies_nothing(
        two_ranks, uneven_batch):
    """Before updating, the ranks agree on whether any shard is bad: a rank whose own rows are fine
    raises too (instead of waiting forever in the gradient all-reduce), and the group stays in step."""
    col, _ = two_ranks
    bad = uneven_batch.clone(False)
    bad["version"] = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])  # rank 1's rows claim a version the policy lacks
    r0, r1 = await col["bounded"].try_update(bad)
    assert r1["error"] == "StaleBatchError" and "from the future" in r1["message"]
    assert r0["error"] == "StaleBatchError" and "rank(s) [1] rejected their shard" in r0["message"]
    assert r0["version"] == r1["version"] == 0  # nothing applied anywhere
    missing = uneven_batch.exclude("rollout_log_probs")
    r0, r1 = await col["bounded"].try_update(missing)  # the default policy has no correction at max_staleness=0
    assert r0 == r1 == {"ok": 1.0, "version": 1}  # the collectives are still paired: a good update goes through
