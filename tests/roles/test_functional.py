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


def test_kl_estimators():
    lp, ref = t([0.0, math.log(2.0)]), t([math.log(2.0), 0.0])
    d = [-math.log(2.0), math.log(2.0)]
    assert F.kl_penalty(lp, ref, "k1").tolist() == pytest.approx(d)
    assert F.kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.5 * x * x for x in d])
    assert F.kl_penalty(lp, ref, "k3").tolist() == pytest.approx([math.exp(-x) + x - 1 for x in d])
    assert F.kl_penalty(lp, ref, "k3").tolist() == pytest.approx([0.3068528, 0.1931472], abs=1e-6)
    with pytest.raises(ValueError, match="k1"):
        F.kl_penalty(lp, ref, "k4")  # type: ignore[arg-type]


def test_entropy_from_logits():
    logits = t([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    assert F.entropy_from_logits(logits).tolist() == pytest.approx([math.log(4.0), 0.0], abs=1e-6)
    assert F.log_probs_from_logits(logits, torch.tensor([2, 0])).tolist() == pytest.approx([-math.log(4.0), 0.0])
