"""Pure RL math: advantages, losses, KL, importance weights and entropy as functions of tensors.

No workers and no config objects. Shapes follow docs/roles_api.md: per-token tensors
are ``[B, R]`` over the response tokens, ``mask`` is 1 on generated tokens (EOS
included) and 0 on right padding.

Conventions and names follow verl (``verl/trainer/ppo/core_algos.py``,
``verl/utils/torch_functional.py``, ``verl/trainer/ppo/rollout_corr_helper.py``) and,
for decoupled PPO, AReaL; the README's "Correctness" section lists each one and where
it deviates. Quantities that must be taken over the *whole* batch -- the denominators
of a loss split over micro-batches and data-parallel ranks, the statistics of
whitening -- are additive: :func:`loss_denominators` and :func:`masked_moments` give a
shard's share, the caller sums the shares (an all-reduce across ranks) and passes the
totals back in (``num_tokens=``/``num_seqs=``, ``moments=``). With the totals, each
shard's :func:`agg_loss` is its share of the global loss, so the shares' gradients add
up (sum across micro-batches and ranks, never average) to the gradient of the loss of
the whole batch, whatever the split.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "CORRECTION_MODES",
    "IS_LEVELS",
    "masked_sum",
    "masked_mean",
    "masked_moments",
    "masked_var",
    "masked_whiten",
    "loss_denominators",
    "agg_loss",
    "gae",
    "grpo_advantages",
    "PolicyLossTerms",
    "ppo_policy_terms",
    "ppo_clip_loss",
    "ppo_clip_fraction",
    "ISWeights",
    "importance_weights",
    "value_clip_losses",
    "value_clip_loss",
    "kl_penalty",
    "entropy_from_logits",
    "log_probs_from_logits",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""verl's ``loss_agg_mode`` values (see :func:`agg_loss`)."""

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
"""verl's ``kl_loss_type`` values (see :func:`kl_penalty`); ``kl`` = k1, ``mse`` = k2, ``low_var_kl`` = k3.
Each may end in ``+`` (straight-through k2 gradient)."""

CORRECTION_MODES = ("tis", "decoupled")
"""Off-policy corrections of :func:`importance_weights`."""

IS_LEVELS = ("token", "sequence")
"""Granularity of the importance weights (verl's ``rollout_is``)."""

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to ±20 before ``exp`` (verl's bound, e^20 ≈ 4.9e8)."""


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over the positions where `mask` is nonzero."""
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is nonzero (0 where the mask is empty)."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1.0)


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum, sum of squares]`` (float64) of `values` where `mask` is nonzero.

    The moments of disjoint shards add up: sum them (e.g. an all-reduce across
    data-parallel ranks) to get those of the whole batch, then pass the total to
    :func:`masked_var` / :func:`masked_whiten` as ``moments=``.
    """
    m = mask.to(torch.float64)
    v = values.detach().to(torch.float64) * m
    return torch.stack([m.sum(), v.sum(), (v * v).sum()])


def _mean_var(moments: torch.Tensor, unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, s, ss = moments.to(torch.float64).unbind()
    if unbiased and n < 2:
        raise ValueError(
            f"the unbiased (Bessel-corrected) variance needs at least 2 valid positions, the mask has {int(n)}; "
            "whiten a larger batch (more rows or tokens) or turn whitening off"
        )
    if n < 1:
        raise ValueError("the mask has no valid position: nothing to take a mean or variance of")
    mean = s / n
    var = ((ss - n * mean * mean) / (n - 1 if unbiased else n)).clamp(min=0.0)
    return mean, var


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, *,
               moments: torch.Tensor | None = None) -> torch.Tensor:
    """Variance of `values` over the masked positions, Bessel-corrected by default (verl's
    ``masked_var(unbiased=True)``). `moments` (from :func:`masked_moments`, summed over shards)
    gives the statistics of the whole batch when `values` is one shard of it.

    Raises ValueError with fewer than 2 valid positions when `unbiased` (as verl does).
    """
    _, var = _mean_var(moments if moments is not None else masked_moments(values, mask), unbiased)
    return var.to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8,
                  moments: torch.Tensor | None = None) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with the mean and the Bessel-corrected variance of
    the masked positions (verl's ``masked_whiten``); 0 where `mask` is 0.

    Args:
        values: ``[B, R]`` (e.g. GAE advantages).
        mask: ``[B, R]``.
        shift_mean: False adds the mean back after scaling (verl's option).
        eps: added to the variance.
        moments: :func:`masked_moments` summed over every shard of the batch, when `values`
            is one data-parallel shard: every shard is then whitened with the statistics of
            the whole batch (None: this tensor is the whole batch).
    """
    mean, var = _mean_var(moments if moments is not None else masked_moments(values, mask), unbiased=True)
    out = (values.to(torch.float64) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return (out * mask.to(torch.float64)).to(values.dtype)


def loss_denominators(mask: torch.Tensor) -> torch.Tensor:
    """``[valid tokens, sequences with at least one valid token]`` (float64) of `mask`.

    The denominators of :func:`agg_loss`. They add up over shards: sum them over the
    micro-batches of a mini-batch and all-reduce the sum across ranks to get the global
    ``num_tokens`` and ``num_seqs``.
    """
    m = mask.to(torch.float64)
    return torch.stack([m.sum(), (m.sum(-1) > 0).to(torch.float64).sum()])


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str = "token-mean", *,
             num_tokens: float | torch.Tensor | None = None, num_seqs: float | torch.Tensor | None = None,
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Aggregate a per-token loss ``[B, R]`` to a scalar, as verl's ``agg_loss`` names the modes.

    * ``token-mean``: ``sum(loss * mask) / num_tokens`` -- every valid token of the global batch
      weighs the same.
    * ``seq-mean-token-sum``: ``sum_b(sum_t loss * mask) / num_seqs``.
    * ``seq-mean-token-mean``: ``sum_b(mean_t over the row's valid tokens) / num_seqs`` -- every
      sequence weighs the same.
    * ``seq-mean-token-sum-norm``: ``sum_b(sum_t loss * mask) / (num_seqs * loss_scale_factor)``
      (Dr. GRPO: a constant normaliser, ``loss_scale_factor`` defaults to ``R``).

    `num_tokens` / `num_seqs` are the *global* counts (:func:`loss_denominators` summed over all
    micro-batches and ranks); None uses this tensor's own, i.e. it is the whole batch. With the
    global counts the result is this shard's share of the global loss: shares add up exactly.
    Sequences without a valid token count in no denominator (as in verl).
    """
    m = mask.to(loss_mat.dtype)
    own = loss_denominators(mask)
    if loss_agg_mode == "token-mean":
        denom = own[0] if num_tokens is None else num_tokens
        return (loss_mat * m).sum() / _clamp1(denom, loss_mat)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {list(LOSS_AGG_MODES)}, got {loss_agg_mode!r}")
    seqs = _clamp1(own[1] if num_seqs is None else num_seqs, loss_mat)
    seq_sums = (loss_mat * m).sum(-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.sum() / seqs
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sums / m.sum(-1).clamp(min=1.0)).sum() / seqs
    scale = float(mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    if scale <= 0:
        raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
    return seq_sums.sum() / (seqs * scale)


def _clamp1(denom: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(denom, dtype=like.dtype).clamp(min=1.0)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over right-padded responses.

    Args:
        rewards: ``[B, R]`` per-token rewards (a sequence reward usually sits on the last
            generated token).
        values: ``[B, R]`` critic values of each response position.
        mask: ``[B, R]`` 1 on generated tokens; the position after the last one is terminal
            (its value counts as 0). Zeros between model tokens (environment tokens of a multi-turn
            episode) are skipped: the advantage chain runs over the model tokens alone, as verl's
            ``compute_gae_advantage_return`` does for observation tokens.
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
    next_value = torch.zeros_like(carry)
    for t in reversed(range(R)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * carry
        # positions with mask 0 carry the value and advantage through unchanged (verl skips observation
        # tokens): a multi-turn row is the chain of its model tokens; right padding keeps them at 0
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        carry = step * m[:, t] + (1 - m[:, t]) * carry
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


class PolicyLossTerms(NamedTuple):
    """Per-token pieces of the PPO policy loss (``[B, R]`` each, not masked)."""

    losses: torch.Tensor
    """The per-token loss (to minimise) before any importance weight and aggregation."""
    ratio: torch.Tensor
    """``exp(clamp(log_probs - old_log_probs, ±20))``."""
    clipped: torch.Tensor
    """True where the clipped surrogate is the active (larger) term (verl's ``pg_clipfrac``)."""
    clipped_lower: torch.Tensor
    """True where the dual-clip bound ``-A * clip_ratio_c`` is active (A < 0; verl's ``pg_clipfrac_lower``)."""


def ppo_policy_terms(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, *,
                     clip_ratio_low: float = 0.2, clip_ratio_high: float | None = None,
                     clip_ratio_c: float | None = 3.0) -> PolicyLossTerms:
    """verl's vanilla PPO policy loss per token (``compute_policy_loss_vanilla``).

    ``ratio = exp(clamp(log_probs - old_log_probs, -20, 20))``;
    ``l = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))``; with
    dual-clip (Ye et al. 2020), for ``A < 0`` the loss is further bounded by ``-A * clip_ratio_c``:
    ``min(l, -A * clip_ratio_c)``. `clip_ratio_high` None = `clip_ratio_low`; `clip_ratio_c`
    None turns dual-clip off (verl always applies it, default 3.0; it must be > 1).
    """
    high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}")
    ratio = torch.exp(torch.clamp(log_probs - old_log_probs, -SAFETY_BOUND, SAFETY_BOUND))
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + high)
    loss = torch.maximum(l1, l2)
    clipped = l2 > l1
    if clip_ratio_c is None:
        return PolicyLossTerms(loss, ratio, clipped, torch.zeros_like(clipped))
    l3 = -advantages * clip_ratio_c
    negative = advantages < 0
    lower = (loss > l3) & negative
    return PolicyLossTerms(torch.where(negative, torch.minimum(loss, l3), loss), ratio, clipped, lower)


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    *,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """PPO clipped surrogate loss (to minimise), aggregated with :func:`agg_loss`.

    Per token :func:`ppo_policy_terms` (`clip_eps` is ``clip_ratio_low``), multiplied by
    `weights` when given (the off-policy importance weights of :func:`importance_weights`,
    as verl multiplies ``rollout_is_weights`` in), then aggregated.
    """
    terms = ppo_policy_terms(log_probs, old_log_probs, advantages, clip_ratio_low=clip_eps,
                             clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    losses = terms.losses if weights is None else terms.losses * weights
    return agg_loss(losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    loss_scale_factor=loss_scale_factor)


def ppo_clip_fraction(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float,
    *, clip_ratio_high: float | None = None,
) -> torch.Tensor:
    """Fraction of unmasked tokens where the clipped term is the active (larger) one."""
    terms = ppo_policy_terms(log_probs, old_log_probs, advantages, clip_ratio_low=clip_eps,
                             clip_ratio_high=clip_ratio_high, clip_ratio_c=None)
    return masked_mean(terms.clipped.to(log_probs.dtype), mask)


class ISWeights(NamedTuple):
    """Off-policy importance weights of one batch (``[B, R]`` each, 0 / False where masked)."""

    weights: torch.Tensor
    """What multiplies the per-token loss: truncated (``tis``) or filtered (``decoupled``); detached."""
    raw: torch.Tensor
    """``pi_old / pi_behaviour`` before truncation (token, or the row's product at sequence level)."""
    over: torch.Tensor
    """Valid positions whose raw weight exceeds the threshold (truncated by ``tis``, dropped by ``decoupled``)."""


def importance_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, *,
                       mode: str = "tis", level: str = "token", threshold: float = 2.0) -> ISWeights:
    """Importance weights that correct for samples drawn by an older (behaviour) policy.

    ``w = pi_old / pi_behaviour`` where ``pi_old`` is the policy just before this update
    (``old_log_probs``, recomputed by the trainer: the *proximal* policy) and
    ``pi_behaviour`` the one that sampled (``rollout_log_probs``, returned by the engine).
    At ``level="token"`` each token has its own ``exp(clamp(log ratio, ±20))``; at
    ``"sequence"`` every token of a row gets ``exp(clamp(sum of the row's log ratios, ±20))``.

    * ``mode="tis"`` -- truncated importance sampling, verl's ``rollout_is`` with
      ``rollout_is_threshold``: ``min(w, threshold)``.
    * ``mode="decoupled"`` -- AReaL's decoupled PPO with ``behav_imp_weight_cap``: ``w`` where
      ``w <= threshold``, 0 (the token is dropped from the loss, its denominator is kept)
      where it exceeds it.

    The PPO ratio is then taken against ``pi_old`` (:func:`ppo_policy_terms`) and its per-token
    loss multiplied by ``weights``. The weights are detached: they reweight the samples, they
    are not optimised.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"off-policy correction mode must be one of {list(CORRECTION_MODES)}, got {mode!r}")
    if level not in IS_LEVELS:
        raise ValueError(f"importance-weight level must be one of {list(IS_LEVELS)}, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"the importance-weight threshold must be > 0, got {threshold}")
    m = mask.to(old_log_probs.dtype)
    log_ratio = (old_log_probs - rollout_log_probs).detach()
    if level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True).expand_as(log_ratio)
    raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)) * m
    over = (raw > threshold) & mask.bool()
    weights = raw.clamp(max=threshold) if mode == "tis" else torch.where(over, torch.zeros_like(raw), raw)
    return ISWeights(weights, raw, over)


def value_clip_losses(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                      clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss ``max((v - R)^2, (clip(v, v_old ± eps) - R)^2)`` (no 0.5) and
    where the clipped term is the larger one (verl's ``compute_value_loss``, ``vf_clipfrac``)."""
    clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    l1, l2 = (values - returns) ** 2, (clipped - returns) ** 2
    return torch.maximum(l1, l2), l2 > l1


def value_clip_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip_eps: float, *,
    loss_agg_mode: str = "token-mean", num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Clipped value loss: ``0.5 * agg_loss(max((v - R)^2, (clip(v, v_old ± eps) - R)^2))`` (verl)."""
    losses, _ = value_clip_losses(values, old_values, returns, clip_eps)
    return 0.5 * agg_loss(losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference, as verl's ``kl_penalty``.

    With ``d = log_probs - ref_log_probs``: ``k1``/``kl`` = ``d``; ``abs`` = ``|d|``;
    ``k2``/``mse`` = ``d**2 / 2``; ``k3``/``low_var_kl`` = ``exp(-d') + d' - 1`` with
    ``d' = clamp(d, ±20)`` and the result clamped to ``[-10, 10]`` (verl's stability clamps).
    A trailing ``+`` (``k3+``, ``k1+``, ``abs+``) keeps that value but takes the gradient of
    ``k2`` (verl's straight-through trick: k2's gradient is unbiased for KL's).
    """
    straight_through = kind.endswith("+") and kind not in ("k2+", "mse+")
    base = kind[:-1] if kind.endswith("+") else kind
    d = log_probs - ref_log_probs
    if base in ("k1", "kl"):
        value = d
    elif base == "abs":
        value = d.abs()
    elif base in ("k2", "mse"):
        value = 0.5 * d * d
    elif base in ("k3", "low_var_kl"):
        kl = torch.clamp(-d, -SAFETY_BOUND, SAFETY_BOUND)
        value = torch.clamp(torch.exp(kl) - kl - 1.0, -10.0, 10.0)
    else:
        raise ValueError(f"kl_penalty kind must be one of {list(KL_ESTIMATORS)} (optionally ending in '+'), "
                         f"got {kind!r}")
    if not straight_through:
        return value
    k2 = 0.5 * d * d
    return k2 - k2.detach() + value.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def log_probs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` gathered at `tokens` (``logits [..., V]``, ``tokens [...]``)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
