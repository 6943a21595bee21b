"""`PolicyWorker` (the actor) and `ReferenceWorker` (the frozen reference policy).

``update`` runs the PPO clipped objective with an optional KL penalty against
``ref_log_probs`` and an entropy bonus::

    for epoch in ppo_epochs:                      # no shuffling: deterministic given the seed
      for mini-batch (mini_batch_size rows):      # one optimizer step each
        for micro-batch (micro_batch_size rows):  # gradient accumulation
          loss = pg_loss + kl_coef * kl - entropy_coef * entropy   (token means, weighted by tokens)
        all-reduce grads (DP), clip to max_grad_norm, step
    version += 1

With several ranks each computes the token mean of its own shard and gradients are
averaged across ranks.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from tensordict import TensorDict, TensorDictBase

from asyncrl import Dispatch, Execute, Worker, register

from ._util import DataParallel, grad_norm_and_clip, micro_batches, require, response_log_probs
from .functional import kl_penalty, masked_mean, ppo_clip_fraction, ppo_clip_loss
from .models import ModelConfig, load_model, set_torch_threads, state_dict_checksums

__all__ = ["OptimConfig", "PolicyWorker", "ReferenceWorker"]


@dataclass(kw_only=True)
class OptimConfig:
    """Optimizer and loss settings of a trained role (policy or critic)."""

    lr: float = 1e-3
    """Adam learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping; the norm is still reported)."""
    micro_batch_size: int = 8
    """Rows per forward/backward (gradient accumulation over a mini-batch)."""
    mini_batch_size: int | None = None
    """Rows per optimizer step; None uses the whole batch for one step per epoch."""
    ppo_epochs: int = 1
    """Passes over the batch per ``update`` call."""
    clip_eps: float = 0.2
    """PPO ratio clip (policy) or value clip (critic)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against ``ref_log_probs`` (0 = off; the batch then needs no reference)."""
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of the penalty."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    temperature: float = 1.0
    """Logit temperature of the recomputed log-probs (match the rollout's sampling temperature)."""


def _adam(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


class _Trainable(Worker):
    """Shared save/load and optimizer plumbing of the policy and the critic."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    optim_config: OptimConfig
    _version: int

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def weights_checksum(self) -> dict[str, str]:
        """``{name: checksum}`` of the current weights (compare with the rollout's)."""
        return state_dict_checksums(self.model.state_dict().items())

    @register(Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> str:
        """Save model (safetensors), optimizer (torch.save of tensors and numbers) and version to
        directory `path` (rank 0 writes; every rank holds the same weights)."""
        from safetensors.torch import save_model

        if self.rank != 0:
            return path
        os.makedirs(path, exist_ok=True)
        save_model(self.model, os.path.join(path, "model.safetensors"))
        torch.save(self.optimizer.state_dict(), os.path.join(path, "optimizer.pt"))
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"version": self._version, "optim": asdict(self.optim_config)}, f)
        return path

    @register(Dispatch.ONE_TO_ALL)
    def load(self, path: str) -> int:
        """Load what :meth:`save` wrote (``torch.load(weights_only=True)``); returns the restored version."""
        from safetensors.torch import load_model

        files = [os.path.join(path, n) for n in ("model.safetensors", "optimizer.pt", "meta.json")]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise FileNotFoundError(f"checkpoint {path!r} is incomplete: missing {missing}; save one with save(path)")
        load_model(self.model, files[0], strict=True)
        self.optimizer.load_state_dict(torch.load(files[1], weights_only=True))
        with open(files[2]) as f:
            self._version = int(json.load(f)["version"])
        return self._version


class PolicyWorker(_Trainable):
    """The trained policy: recomputes log-probs, runs PPO updates, exports versioned weights.

    Args:
        model: the model to train (same config as the rollout's, so version 0 matches).
        optim: optimizer and loss settings.
    """

    def __init__(self, model: ModelConfig, optim: OptimConfig | None = None) -> None:
        self.model_config = model
        self.optim_config = optim or OptimConfig()
        set_torch_threads(self.context.num_cpus, model.num_threads)
        torch.manual_seed(model.seed)
        self.model, self.tokenizer = load_model(model)
        self.model.train()
        self.optimizer = _adam(self.model, self.optim_config)
        self.dp = DataParallel(self.rank, self.world_size)
        self._version = 0

    @property
    def version(self) -> int:
        """Number of updates applied (0 = initial weights)."""
        return self._version

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: TensorDictBase) -> TensorDict:
        """``TD{old_log_probs [B, R], entropy [B, R]}`` of the response tokens (0 where masked).

        Needs ``input_ids``, ``attention_mask``, ``response_ids``, ``response_mask``."""
        return _log_probs(self.model, batch, self.optim_config.micro_batch_size, self.optim_config.temperature,
                          "old_log_probs", with_entropy=True, who="PolicyWorker.compute_log_prob")

    @register(Dispatch.DP_COMPUTE_METRIC)
    def update(self, batch: TensorDictBase) -> dict[str, float]:
        """One PPO update over `batch`; returns mean metrics (floats) and the new ``version``.

        Needs ``input_ids``, ``attention_mask``, ``response_ids``, ``response_mask``,
        ``old_log_probs``, ``advantages``, and ``ref_log_probs`` when ``kl_coef > 0``.
        """
        cfg = self.optim_config
        need = ["input_ids", "attention_mask", "response_ids", "response_mask", "old_log_probs", "advantages"]
        if cfg.kl_coef > 0:
            need.append("ref_log_probs")
        require(batch, need, "PolicyWorker.update")
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        n = batch.batch_size[0]
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}

        def add(k: str, v: float) -> None:
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1

        for _ in range(cfg.ppo_epochs):
            for mini in micro_batches(n, cfg.mini_batch_size):
                mb = batch[mini]
                tokens = float(mb["response_mask"].sum().clamp(min=1))
                self.optimizer.zero_grad(set_to_none=True)
                for micro in micro_batches(mb.batch_size[0], cfg.micro_batch_size):
                    b = mb[micro]
                    mask = b["response_mask"]
                    lp, ent = response_log_probs(self.model, b["input_ids"], b["attention_mask"], b["response_ids"],
                                                 cfg.temperature, with_entropy=True)
                    pg = ppo_clip_loss(lp, b["old_log_probs"], b["advantages"], mask, cfg.clip_eps)
                    loss = pg
                    entropy = masked_mean(ent, mask)  # type: ignore[arg-type]
                    if cfg.entropy_coef:
                        loss = loss - cfg.entropy_coef * entropy
                    if cfg.kl_coef > 0:
                        kl = masked_mean(kl_penalty(lp, b["ref_log_probs"], cfg.kl_kind), mask)
                        loss = loss + cfg.kl_coef * kl
                        add("kl", float(kl.detach()))
                    weight = float(mask.sum()) / tokens  # token mean over the mini-batch
                    (loss * weight).backward()
                    with torch.no_grad():
                        add("pg_loss", float(pg))
                        add("entropy", float(entropy))
                        add("clip_frac", float(ppo_clip_fraction(lp, b["old_log_probs"], b["advantages"], mask,
                                                                 cfg.clip_eps)))
                        add("approx_kl", float(masked_mean(0.5 * (lp - b["old_log_probs"]) ** 2, mask)))
                        add("loss", float(loss))
                self.dp.all_reduce_grads(params)
                add("grad_norm", grad_norm_and_clip(params, cfg.max_grad_norm))
                self.optimizer.step()
        self._version += 1
        metrics = {k: sums[k] / counts[k] for k in sums}
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["version"] = float(self._version)
        return metrics

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def export_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, state_dict)`` (detached copies) for ``RolloutWorker.update_weights``."""
        return self._version, {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def get_version(self) -> int:
        """Number of updates applied."""
        return self._version



def _log_probs(model: torch.nn.Module, batch: TensorDictBase, micro: int, temperature: float, key: str,
               with_entropy: bool, who: str) -> TensorDict:
    require(batch, ["input_ids", "attention_mask", "response_ids", "response_mask"], who)
    was_training = model.training
    model.eval()
    lps, ents = [], []
    try:
        with torch.no_grad():
            for s in micro_batches(batch.batch_size[0], micro):
                b = batch[s]
                lp, ent = response_log_probs(model, b["input_ids"], b["attention_mask"], b["response_ids"],
                                             temperature, with_entropy)
                m = b["response_mask"].to(lp.dtype)
                lps.append(lp * m)
                if ent is not None:
                    ents.append(ent * m)
    finally:
        model.train(was_training)
    out = {key: torch.cat(lps)}
    if with_entropy:
        out["entropy"] = torch.cat(ents)
    return TensorDict(out, batch_size=batch.batch_size[:1])


class ReferenceWorker(Worker):
    """The frozen reference policy: log-probs for the KL penalty.

    Args:
        model: the reference model (usually the policy's initial config).
        micro_batch_size: rows per forward.
        temperature: logit temperature (match the policy's).
    """

    def __init__(self, model: ModelConfig, *, micro_batch_size: int = 16, temperature: float = 1.0) -> None:
        set_torch_threads(self.context.num_cpus, model.num_threads)
        self.model, self.tokenizer = load_model(model)
        self.model.eval().requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: TensorDictBase) -> TensorDict:
        """``TD{ref_log_probs [B, R]}`` (0 where masked)."""
        return _log_probs(self.model, batch, self.micro_batch_size, self.temperature, "ref_log_probs",
                          with_entropy=False, who="ReferenceWorker.compute_ref_log_prob")

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def weights_checksum(self) -> dict[str, str]:
        """``{name: checksum}`` of the (frozen) weights."""
        return state_dict_checksums(self.model.state_dict().items())
