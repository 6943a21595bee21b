"""Pure RL math: advantages, losses, KL and entropy as functions of tensors.

No workers and no config objects. Shapes follow docs/roles_api.md: per-token tensors
are ``[B, R]`` over the response tokens, ``mask`` is 1 on generated tokens (EOS
included) and 0 on right padding. Every loss is a token mean over the whole batch
(``masked_mean`` over all unmasked tokens).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "masked_mean",
    "masked_whiten",
    "gae",
    "grpo_advantages",
    "ppo_clip_loss",
    "ppo_clip_fraction",
    "value_clip_loss",
    "kl_penalty",
    "entropy_from_logits",
    "log_probs_from_logits",
]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is nonzero (0 where the mask is empty)."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`x` shifted to mean 0 and scaled to (biased) std 1 over the masked positions; 0 elsewhere."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask.to(x.dtype)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over right-padded responses.

    Args:
        rewards: ``[B, R]`` per-token rewards (a sequence reward usually sits on the last
            generated token).
        values: ``[B, R]`` critic values of each response position.
        mask: ``[B, R]`` 1 on generated tokens; the position after the last one is terminal
            (its value counts as 0).
        gamma: discount.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[B, R]`` and 0 where ``mask`` is 0;
        ``returns = advantages + values``.
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must have the same [B, R] shape")
    m = mask.to(values.dtype)
    B, R = rewards.shape
    adv = torch.zeros_like(values)
    carry = torch.zeros(B, dtype=values.dtype, device=values.device)
    for t in reversed(range(R)):
        nxt = m[:, t + 1] if t + 1 < R else torch.zeros_like(carry)
        next_value = values[:, t + 1] * nxt if t + 1 < R else torch.zeros_like(carry)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        carry = delta + gamma * lam * nxt * carry
        adv[:, t] = carry * m[:, t]
    returns = (adv + values) * m
    return adv, returns


def grpo_advantages(
    scores: torch.Tensor, uid: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6, norm_std: bool = True
) -> torch.Tensor:
    """GRPO outcome advantages: each score normalised within its prompt group.

    Rows with the same ``uid`` form a group; the advantage of a row is
    ``(score - group mean) / (group std + eps)`` (``std`` unbiased, as ``torch.std``),
    or ``score - group mean`` when ``norm_std`` is false. A group of one row has mean 0
    and std 1 (its advantage is its score), as in verl. The per-row advantage is
    broadcast over the response tokens and zeroed where ``mask`` is 0.

    Args:
        scores: ``[B]`` sequence rewards.
        uid: ``[B]`` prompt ids (integers).
        mask: ``[B, R]`` response mask.
    """
    if scores.ndim != 1 or uid.shape != scores.shape or mask.shape[0] != scores.shape[0]:
        raise ValueError(f"grpo_advantages: scores {tuple(scores.shape)} and uid {tuple(uid.shape)} must be [B] "
                         f"and mask {tuple(mask.shape)} [B, R]")
    scores = scores.to(torch.float32) if not scores.is_floating_point() else scores
    out = torch.empty_like(scores)
    _, inverse = torch.unique(uid, return_inverse=True)
    for g in inverse.unique():
        rows = inverse == g
        s = scores[rows]
        if s.numel() == 1:
            mean, std = torch.zeros((), dtype=s.dtype), torch.ones((), dtype=s.dtype)
        else:
            mean, std = s.mean(), s.std()
        out[rows] = (s - mean) / (std + eps) if norm_std else s - mean
    return out[:, None] * mask.to(out.dtype)


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> torch.Tensor:
    """PPO clipped surrogate loss (to minimise), token mean over the batch.

    ``ratio = exp(log_probs - old_log_probs)``; per token
    ``max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps))``.
    """
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    return masked_mean(torch.maximum(unclipped, clipped), mask)


def ppo_clip_fraction(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float
) -> torch.Tensor:
    """Fraction of unmasked tokens where the clipped term is the active (larger) one."""
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    return masked_mean((clipped > -advantages * ratio).to(log_probs.dtype), mask)


def value_clip_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip_eps: float
) -> torch.Tensor:
    """Clipped value loss: ``0.5 * masked_mean(max((v - R)^2, (clip(v, v_old ± eps) - R)^2))``."""
    clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: Literal["k1", "k2", "k3"] = "k1"
) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1/k2/k3).

    With ``d = log_probs - ref_log_probs``: k1 = ``d``, k2 = ``d**2 / 2``,
    k3 = ``exp(-d) + d - 1`` (non-negative, unbiased for KL(policy || ref)).
    """
    d = log_probs - ref_log_probs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"kl_penalty kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def log_probs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` gathered at `tokens` (``logits [..., V]``, ``tokens [...]``)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
