"""Pure RL math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.roles import functional as F


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_masked_mean_ignores_masked_positions():
    x = t([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    m = t([[1, 1, 0], [1, 0, 0]])
    assert F.masked_mean(x, m).item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    assert F.masked_mean(x, m, dim=1).tolist() == pytest.approx([1.5, 3.0])
    assert F.masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_gae_matches_hand_computation():
    # one row, 3 tokens, last one padding; gamma=0.5, lam=0.5
    r, v, m = t([[0.0, 1.0, 9.0]]), t([[0.5, 0.25, 7.0]]), t([[1, 1, 0]])
    adv, ret = F.gae(r, v, m, gamma=0.5, lam=0.5)
    # t=1: delta = 1 + 0 - 0.25 = 0.75 (next is terminal) ; A1 = 0.75
    # t=0: delta = 0 + 0.5*0.25 - 0.5 = -0.375 ; A0 = -0.375 + 0.25*0.75 = -0.1875
    torch.testing.assert_close(adv, t([[-0.1875, 0.75, 0.0]]))
    torch.testing.assert_close(ret, t([[0.3125, 1.0, 0.0]]))


def test_gae_gamma_one_lambda_one_is_reward_to_go_minus_value():
    r, v, m = t([[1.0, 2.0, 3.0]]), t([[0.5, 0.5, 0.5]]), t([[1, 1, 1]])
    adv, ret = F.gae(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, t([[5.5, 4.5, 2.5]]))
    torch.testing.assert_close(ret, t([[6.0, 5.0, 3.0]]))


def test_grpo_advantages_normalise_within_each_uid_group():
    scores = t([1.0, 0.0, 2.0, 5.0, 7.0])
    uid = torch.tensor([0, 0, 0, 1, 2])
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1], [0, 0]])
    adv = F.grpo_advantages(scores, uid, mask, eps=0.0)
    # group 0: mean 1, unbiased std 1 -> [0, -1, 1]; group 1 and 2 are singletons: mean 0, std 1
    torch.testing.assert_close(adv, t([[0.0, 0.0], [-1.0, 0.0], [1.0, 1.0], [5.0, 5.0], [0.0, 0.0]]))
    adv2 = F.grpo_advantages(scores, uid, mask, norm_std=False)
    assert adv2[:3, 0].tolist() == pytest.approx([0.0, -1.0, 1.0])


def test_ppo_clip_loss_takes_the_pessimistic_term():
    lp = t([[math.log(1.5), math.log(0.5)]])
    old = t([[0.0, 0.0]])
    adv = t([[1.0, -1.0]])
    m = t([[1, 1]])
    # token 0: ratio 1.5, A=1: max(-1.5, -1.2) = -1.2 ; token 1: ratio 0.5, A=-1: max(0.5, 0.8) = 0.8
    assert F.ppo_clip_loss(lp, old, adv, m, clip_eps=0.2).item() == pytest.approx((-1.2 + 0.8) / 2)
    assert F.ppo_clip_fraction(lp, old, adv, m, 0.2).item() == pytest.approx(1.0)
    # inside the clip range nothing is clipped: loss = -mean(ratio * A)
    lp2 = t([[math.log(1.1), 0.0]])
    assert F.ppo_clip_loss(lp2, old, adv, m, 0.2).item() == pytest.approx((-1.1 + 1.0) / 2)
    assert F.ppo_clip_fraction(lp2, old, adv, m, 0.2).item() == 0.0


def test_value_clip_loss():
    v, old, ret, m = t([[1.0, 0.0]]), t([[0.0, 0.0]]), t([[2.0, 1.0]]), t([[1, 0]])
    # token 0: unclipped (1-2)^2 = 1, clipped v=0.5 -> (0.5-2)^2 = 2.25; max = 2.25; 0.5 * 2.25
    assert F.value_clip_loss(v, old, ret, m, clip_eps=0.5).item() == pytest.approx(1.125)
    _, clipped = F.value_clip_losses(v, old, ret, 0.5)
    assert clipped.tolist() == [[True, False]]  # verl's vf_clipfrac: the clipped term is the larger one


def test_kl_estimators():
    lp, ref = t([0.0, math.log(2.0)]), t([math.log(2.0), 0.0])
    d = [-math.log(2.0), math.log(2.0)]
    assert F.kl_penalty(lp, ref, "k1").tolist() == pytest.approx(d)
    assert F.kl_penalty(lp, ref, "kl").tolist() == pytest.approx(d)
    assert F.kl_penalty(lp, ref, "abs").tolist() == pytest.approx([abs(x) for x in d])
    for k2 in ("k2", "mse"):
        assert F.kl_penalty(lp, ref, k2).tolist() == pytest.approx([0.5 * x * x for x in d])
    for k3 in ("k3", "low_var_kl"):
        assert F.kl_penalty(lp, ref, k3).tolist() == pytest.approx([math.exp(-x) + x - 1 for x in d])
    assert F.kl_penalty(lp, ref, "k3").tolist() == pytest.approx([0.3068528, 0.1931472], abs=1e-6)
    with pytest.raises(ValueError, match="k1"):
        F.kl_penalty(lp, ref, "k4")


def test_k3_is_clamped_as_verl_clamps_it():
    # d = lp - ref. verl: kl = clamp(ref - lp, -20, 20); k3 = exp(kl) - kl - 1, clamped to [-10, 10]
    lp, ref = t([30.0, -30.0, -3.0, 0.5]), t([0.0, 0.0, 0.0, 0.0])
    out = F.kl_penalty(lp, ref, "k3").tolist()
    assert out[0] == pytest.approx(10.0)   # kl = -20: exp(-20) + 20 - 1 = 19.000000002 -> clamp 10
    assert out[1] == pytest.approx(10.0)   # kl = +20: exp(20) - 21 = 4.85e8 -> clamp 10 (unclamped: inf-ish)
    assert out[2] == pytest.approx(10.0)   # kl = 3: exp(3) - 4 = 16.0855 -> 10
    assert out[3] == pytest.approx(math.exp(-0.5) + 0.5 - 1)  # inside the clamps: the plain k3
    # without verl's clamps the estimator would explode: exp(30) - 31
    assert math.exp(30.0) - 31 > 1e12


def test_straight_through_kl_keeps_the_value_and_takes_the_k2_gradient():
    lp = t([0.3, -0.2]).requires_grad_(True)
    ref = t([0.0, 0.0])
    v = F.kl_penalty(lp, ref, "k3+")
    assert v.tolist() == pytest.approx(F.kl_penalty(lp.detach(), ref, "k3").tolist())
    v.sum().backward()
    assert lp.grad.tolist() == pytest.approx([0.3, -0.2])  # d/dlp of 0.5 * d^2 = d


# ---------------------------------------------------------------- loss aggregation (verl's loss_agg_mode)

LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]])
MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 has no valid token: it counts nowhere


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 4) / 3),
    ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
    ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
    ("seq-mean-token-sum-norm", ((1 + 2) + 4) / (2 * 3)),  # R = 3
])
def test_every_aggregation_mode_by_hand(mode, expected):
    assert F.agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_uses_a_constant_normaliser_when_given():
    assert F.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7).item() == pytest.approx(7 / 14)
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        F.agg_loss(LOSS, MASK, "token-sum")


@pytest.mark.parametrize("mode", F.LOSS_AGG_MODES)
def test_shares_with_global_denominators_add_up_to_the_whole_batch_loss(mode):
    # two "ranks" with unequal token counts: rows 0-1 hold 3 tokens, rows 2-3 hold 6
    loss = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [0.5, 1.5, 2.5]])
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    whole = F.agg_loss(loss, mask, mode).item()
    shards = [(loss[:2], mask[:2]), (loss[2:], mask[2:])]
    tokens, seqs = sum(F.loss_denominators(m) for _, m in shards).tolist()  # the all-reduce
    assert (tokens, seqs) == (9.0, 4.0)
    shares = [F.agg_loss(x, m, mode, num_tokens=tokens, num_seqs=seqs).item() for x, m in shards]
    assert sum(shares) == pytest.approx(whole)


def test_per_rank_token_mean_reweights_tokens_and_the_global_one_does_not():
    # the old per-rank token mean averaged over ranks: rank 0 has 3 tokens, rank 1 one token
    a, am = t([[1.0, 2.0, 4.0]]), t([[1, 1, 1]])
    b, bm = t([[10.0, 0.0, 0.0]]), t([[1, 0, 0]])
    per_rank = (F.agg_loss(a, am).item() + F.agg_loss(b, bm).item()) / 2
    assert per_rank == pytest.approx((7 / 3 + 10) / 2)  # 6.17: rank 1's single token weighs 3x
    n = 4.0
    assert F.agg_loss(a, am, num_tokens=n).item() + F.agg_loss(b, bm, num_tokens=n).item() == pytest.approx(17 / 4)


# ---------------------------------------------------------------- whitening


def test_masked_whiten_is_bessel_corrected_like_verl():
    x = t([[1.0, 2.0, 99.0], [3.0, 4.0, -99.0]])
    m = t([[1, 1, 0], [1, 1, 0]])
    std = math.sqrt(5 / 3)  # mean 2.5; unbiased var (2.25 + 0.25 + 0.25 + 2.25) / 3
    torch.testing.assert_close(F.masked_whiten(x, m), t([[-1.5 / std, -0.5 / std, 0.0], [0.5 / std, 1.5 / std, 0.0]]))
    assert F.masked_var(x, m).item() == pytest.approx(5 / 3)
    assert F.masked_var(x, m, unbiased=False).item() == pytest.approx(5 / 4)
    torch.testing.assert_close(F.masked_whiten(x, m, shift_mean=False),
                               t([[-1.5 / std + 2.5, -0.5 / std + 2.5, 0.0], [0.5 / std + 2.5, 1.5 / std + 2.5, 0.0]]))
    with pytest.raises(ValueError, match="at least 2 valid positions"):
        F.masked_whiten(x, t([[1, 0, 0], [0, 0, 0]]))


def test_whitening_unequal_shards_with_summed_moments_equals_whitening_the_whole_batch():
    x = t([[1.0, 0.0, 0.0], [2.0, 3.0, 4.0], [5.0, 6.0, 0.0]])
    m = t([[1, 0, 0], [1, 1, 1], [1, 1, 0]])  # shard 0: row 0 (1 token); shard 1: rows 1-2 (5 tokens)
    whole = F.masked_whiten(x, m)
    mean, var = 3.5, (6.25 + 2.25 + 0.25 + 0.25 + 2.25 + 6.25) / 5
    assert whole[0, 0].item() == pytest.approx((1 - mean) / math.sqrt(var))
    moments = F.masked_moments(x[:1], m[:1]) + F.masked_moments(x[1:], m[1:])  # the all-reduce
    assert moments.tolist() == [6.0, 21.0, 91.0]
    parts = torch.cat([F.masked_whiten(x[:1], m[:1], moments=moments), F.masked_whiten(x[1:], m[1:], moments=moments)])
    torch.testing.assert_close(parts, whole)
    # whitening each shard on its own (the old behaviour) is not the same thing
    with pytest.raises(ValueError):
        F.masked_whiten(x[:1], m[:1])  # one token: no unbiased variance at all


# ---------------------------------------------------------------- PPO clipping, dual-clip


def test_dual_clip_bounds_the_loss_of_negative_advantages_at_clip_ratio_c():
    lp = t([[math.log(5.0), math.log(2.0), math.log(5.0), math.log(1.5)]])
    old = torch.zeros_like(lp)
    adv = t([[-1.0, -1.0, 1.0, 1.0]])
    terms = F.ppo_policy_terms(lp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    # A=-1, ratio 5: max(5, 1.28) = 5, dual-clip min(5, 3) = 3
    # A=-1, ratio 2: max(2, 1.28) = 2 < 3
    # A=+1, ratio 5: max(-5, -1.28) = -1.28 (clip-higher 0.28), dual-clip does not apply to A > 0
    # A=+1, ratio 1.5: max(-1.5, -1.28) = -1.28
    torch.testing.assert_close(terms.losses, t([[3.0, 2.0, -1.28, -1.28]]))
    assert terms.clipped_lower.tolist() == [[True, False, False, False]]
    assert terms.clipped.tolist() == [[False, False, True, True]]
    no_dual = F.ppo_policy_terms(lp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    assert no_dual.losses[0, 0].item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        F.ppo_policy_terms(lp, old, adv, clip_ratio_c=1.0)


# ---------------------------------------------------------------- off-policy correction


def _stale_batch():
    """One stale row built by hand: the behaviour policy (rollout, version v-1) sampled 3 tokens;
    pi_old is the policy before this update; the current policy moved token 0 a little."""
    rollout = t([[math.log(0.4), math.log(0.2), math.log(0.1), 0.0]])
    old = t([[math.log(0.2), math.log(0.3), math.log(0.3), 0.0]])  # w = 0.5, 1.5, 3.0
    current = t([[math.log(0.22), math.log(0.3), math.log(0.3), 0.0]])  # ratio 1.1, 1, 1
    adv = t([[1.0, -1.0, 2.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    return rollout, old, current, adv, mask


def test_importance_weights_truncate_or_drop_by_hand():
    rollout, old, _, _, mask = _stale_batch()
    tis = F.importance_weights(old, rollout, mask, mode="tis", threshold=2.0)
    torch.testing.assert_close(tis.raw, t([[0.5, 1.5, 3.0, 0.0]]))
    torch.testing.assert_close(tis.weights, t([[0.5, 1.5, 2.0, 0.0]]))  # verl's rollout_is: min(w, 2)
    assert tis.over.tolist() == [[False, False, True, False]]
    dec = F.importance_weights(old, rollout, mask, mode="decoupled", threshold=2.0)
    torch.testing.assert_close(dec.weights, t([[0.5, 1.5, 0.0, 0.0]]))  # AReaL: w > cap is dropped
    seq = F.importance_weights(old, rollout, mask, mode="tis", level="sequence", threshold=2.0)
    torch.testing.assert_close(seq.raw, t([[2.25, 2.25, 2.25, 0.0]]))  # 0.5 * 1.5 * 3
    torch.testing.assert_close(seq.weights, t([[2.0, 2.0, 2.0, 0.0]]))
    seq_dec = F.importance_weights(old, rollout, mask, mode="decoupled", level="sequence", threshold=3.0)
    torch.testing.assert_close(seq_dec.weights, t([[2.25, 2.25, 2.25, 0.0]]))
    for kwargs, msg in [({"mode": "magic"}, "correction mode"), ({"level": "word"}, "level"),
                        ({"threshold": 0.0}, "threshold must be > 0"), ({"threshold": -1.0}, "threshold must be > 0")]:
        with pytest.raises(ValueError, match=msg):
            F.importance_weights(old, rollout, mask, **kwargs)


def test_importance_weighted_ppo_loss_and_gradient_on_a_stale_batch_by_hand():
    rollout, old, current, adv, mask = _stale_batch()
    lp = current.clone().requires_grad_(True)
    w = F.importance_weights(old, rollout, mask, mode="tis", threshold=2.0).weights
    loss = F.ppo_clip_loss(lp, old, adv, mask, 0.2, weights=w)
    # per token -A * ratio * w: -(1)(1.1)(0.5) = -0.55 ; -(-1)(1)(1.5) = 1.5 ; -(2)(1)(2.0) = -4 ; / 3 tokens
    assert loss.item() == pytest.approx((-0.55 + 1.5 - 4.0) / 3)
    loss.backward()
    # d/dlp (-A * exp(lp - old) * w) = -A * ratio * w: the weights are constants (detached)
    torch.testing.assert_close(lp.grad, t([[-0.55 / 3, 1.5 / 3, -4.0 / 3, 0.0]]))
    # uncorrected, the same stale batch is plain PPO on the behaviour policy's samples
    plain = F.ppo_clip_loss(current, old, adv, mask, 0.2)
    assert plain.item() == pytest.approx((-1.1 + 1.0 - 2.0) / 3)
    # decoupled drops the token whose weight (3) exceeds the cap; its token still counts in the mean
    dec = F.importance_weights(old, rollout, mask, mode="decoupled", threshold=2.0).weights
    assert F.ppo_clip_loss(current, old, adv, mask, 0.2, weights=dec).item() == pytest.approx((-0.55 + 1.5) / 3)


def test_entropy_from_logits():
    logits = t([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    assert F.entropy_from_logits(logits).tolist() == pytest.approx([math.log(4.0), 0.0], abs=1e-6)
    assert F.log_probs_from_logits(logits, torch.tensor([2, 0])).tolist() == pytest.approx([-math.log(4.0), 0.0])
