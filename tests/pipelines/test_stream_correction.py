"""Per-token off-policy correction for streaming trajectories whose tokens come from two weight versions:
TIS and decoupled PPO (``roles.functional.importance_weights``, verl's ``rollout_is`` at token level)
weight each token by its own behaviour log-prob, whatever version produced it."""

from __future__ import annotations

import math

import torch
from asyncrl.roles import functional as F
from asyncrl.roles.training.policy import RolloutCorrectionConfig


def _two_version_row():
    # tokens 0-1 sampled under version 0, tokens 2-3 under version 1 (a weight update mid-generation),
    # the proximal policy (old_log_probs, version 2) is the same for all; the 5th position is padding
    token_versions = torch.tensor([[0, 0, 1, 1, -1]])
    rollout = torch.tensor([[-1.5, -0.2, -1.0, -2.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -3.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return token_versions, rollout, old, mask


def test_tis_weights_each_token_by_its_own_versions_log_prob():
    _, rollout, old, mask = _two_version_row()
    iw = F.importance_weights(old, rollout, mask, mode="tis", threshold=2.0)
    want = [math.exp(0.5), math.exp(-0.8), 1.0, 2.0, 0.0]  # exp(old - behaviour), truncated at 2
    torch.testing.assert_close(iw.weights[0], torch.tensor(want), atol=1e-6, rtol=0)
    assert iw.over.tolist() == [[False, False, False, True, False]]


def test_decoupled_drops_only_the_token_over_the_cap():
    _, rollout, old, mask = _two_version_row()
    iw = F.importance_weights(old, rollout, mask, mode="decoupled", threshold=2.0)
    want = [math.exp(0.5), math.exp(-0.8), 1.0, 0.0, 0.0]
    torch.testing.assert_close(iw.weights[0], torch.tensor(want), atol=1e-6, rtol=0)


def test_the_default_correction_is_per_token():
    assert RolloutCorrectionConfig().rollout_is == "token"
