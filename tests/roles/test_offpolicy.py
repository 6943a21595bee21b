"""Off-policy training in-process: behaviour log-probs of the distribution actually sampled,
one temperature, the importance-weighted update, and the worker-side staleness bound."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.roles import OptimConfig, PolicyWorker, RolloutConfig, RolloutCorrectionConfig, RolloutWorker, StaleBatchError
from asyncrl.roles.engines import SamplingParams
from asyncrl.roles.engines.hf import HFEngine
from asyncrl.roles import functional as F
from asyncrl.roles.functional import grpo_advantages

# ---------------------------------------------------------------- behaviour log-probs


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=1, top_p=0.6), SamplingParams(max_new_tokens=1, top_k=2)])
def test_behaviour_log_prob_is_that_of_the_filtered_distribution(params):
    # probs 0.5 / 0.3 / 0.2: top_p=0.6 keeps the tokens whose preceding mass is < 0.6 (0.5, 0.3), as
    # does top_k=2; the sampled token's log-prob is under the renormalised 0.625 / 0.375, never 0.2
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 200))
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    out = HFEngine._sample(logits, params, gens, [False] * 200)
    tokens, logps = out[:, 0].long(), out[:, 1]
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.where(tokens == 0, math.log(0.625), math.log(0.375)).double()
    torch.testing.assert_close(logps, expected)


async def test_top_k_one_samples_a_point_mass_and_reports_log_prob_zero(model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=5, top_k=1))
    out = await rollout.generate(prompt_batch(n=3))
    mask = out["response_mask"].bool()
    assert (out["rollout_log_probs"][mask] == 0).all()  # log 1: the behaviour policy is greedy here
    recomputed = PolicyWorker(model_config).compute_log_prob(out)["old_log_probs"]
    assert (recomputed[mask] < 0).all()  # the (unfiltered) policy differs, and the weights account for it


async def test_one_temperature_policy_log_probs_match_the_rollout_only_at_its_temperature(model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=8, temperature=0.7))
    out = await rollout.generate(prompt_batch(n=4))
    mask = out["response_mask"].bool()
    same = PolicyWorker(model_config, OptimConfig(temperature=0.7)).compute_log_prob(out)["old_log_probs"]
    other = PolicyWorker(model_config, OptimConfig(temperature=1.0)).compute_log_prob(out)["old_log_probs"]
    assert (same - out["rollout_log_probs"])[mask].abs().max() < 1e-5
    assert (other - out["rollout_log_probs"])[mask].abs().max() > 1e-2  # why a mismatch is a config error
    with pytest.raises(ValueError, match="temperature must be > 0"):
        PolicyWorker(model_config, OptimConfig(temperature=0.0))


# ---------------------------------------------------------------- importance-weighted update


async def _stale_batch(model_config, prompt_batch, policy):
    """A batch sampled by version 0, with old_log_probs recomputed by `policy` (the proximal policy)."""
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=6))
    b = (await rollout.generate(prompt_batch(n=4, repeat=2))).clone(False)
    b.update(policy.compute_log_prob(b))
    b["scores"] = (b["response_ids"][:, 0] % 3).float()
    b["advantages"] = grpo_advantages(b["scores"], b["uid"], b["response_mask"])
    return b


def _policies(model_config, mode):
    optim = OptimConfig(lr=5e-2, micro_batch_size=4, rollout_correction=RolloutCorrectionConfig(mode=mode))
    return PolicyWorker(model_config, optim, max_staleness=1)


async def test_stale_batch_is_importance_weighted_and_reported(model_config, prompt_batch):
    metrics, checksums = {}, {}
    for mode in ("tis", "none", "decoupled"):
        policy = _policies(model_config, mode)
        fresh = await _stale_batch(model_config, prompt_batch, policy)
        m0 = policy.update(fresh)  # version 0 -> 1; the batch was on-policy: weights ~ 1
        assert m0["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and m0["row_staleness/0"] == 8.0
        stale = await _stale_batch(model_config, prompt_batch, policy)  # sampled by v0, trained by v1
        metrics[mode] = policy.update(stale)
        if mode == "tis":  # one step, ratio 1 at the start: pg_loss = token-mean(-A * min(pi_old / pi_behaviour, 2))
            w = F.importance_weights(stale["old_log_probs"], stale["rollout_log_probs"], stale["response_mask"]).weights
            expected = F.agg_loss(-stale["advantages"] * w, stale["response_mask"]).item()
            assert metrics[mode]["pg_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
        checksums[mode] = policy.weights_checksum()
    m = metrics["tis"]
    assert policy.correction == "decoupled" and _policies(model_config, "auto").correction == "tis"
    assert m["row_staleness/0"] == 0.0 and m["row_staleness/1"] == 8.0 and m["row_staleness_mean"] == 1.0
    assert abs(m["is_weight_mean"] - 1.0) > 1e-3  # the policy moved: pi_old / pi_behaviour != 1
    assert m["is_weight_max"] >= m["is_weight_mean"] > 0 and 0 <= m["is_over_threshold_frac"] <= 1
    assert m["behaviour_kl"] != 0.0
    assert abs(metrics["none"]["is_weight_mean"] - 1.0) > 1e-3  # reported without correction too (not applied)
    assert len(set(map(str, checksums.values()))) == 3  # each correction trains differently


async def test_update_refuses_rows_outside_the_staleness_bound(model_config, prompt_batch):
    policy = _policies(model_config, "tis")
    batch = await _stale_batch(model_config, prompt_batch, policy)
    policy.update(batch)
    policy.update(batch)  # version 2 now; the batch's rows are version 0: two versions old, bound 1
    before = policy.weights_checksum()
    with pytest.raises(StaleBatchError, match="8 row.* generated 2 versions before the policy .*max_staleness=1"):
        policy.update(batch)
    future = batch.clone(False)
    future["version"] = torch.full_like(batch["version"], 5)
    with pytest.raises(StaleBatchError, match="from the future"):
        policy.update(future)
    assert policy.get_version() == 2 and policy.weights_checksum() == before  # nothing applied


async def test_update_without_behaviour_log_probs_names_the_field_when_correction_is_on(model_config, prompt_batch):
    policy = _policies(model_config, "tis")
    batch = await _stale_batch(model_config, prompt_batch, policy)
    del batch["rollout_log_probs"]
    with pytest.raises(KeyError, match="rollout_log_probs.*off-policy correction \\('tis'\\)"):
        policy.update(batch)
    del batch["version"]
    with pytest.raises(KeyError, match="version.*max_staleness=1"):
        policy.update(batch)
    uncorrected = PolicyWorker(policy.model_config, OptimConfig(rollout_correction=RolloutCorrectionConfig(mode="none")))
    assert uncorrected.update(batch)["version"] == 1.0  # no correction, no bound: neither field is needed
