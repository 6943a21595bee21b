"""`CriticWorker`: a value model (decoder backbone + scalar head) trained with the clipped value loss."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from asyncrl import Dispatch, register

from ._util import DataParallel, grad_norm_and_clip, micro_batches, require
from .functional import masked_mean, value_clip_loss
from .models import ModelConfig, build_value_model, set_torch_threads
from .policy import OptimConfig, _adam, _Trainable

__all__ = ["CriticWorker"]


class CriticWorker(_Trainable):
    """Values of the response positions and clipped value-loss updates.

    ``values[b, t]`` is the value of the state before response token t (the hidden
    state of the position that predicts it). ``optim.clip_eps`` is the value clip.

    Args:
        model: backbone config (a tiny model, or a local directory whose base model is used).
        optim: optimizer settings (``kl_coef``, ``entropy_coef`` and ``temperature`` are unused).
    """

    def __init__(self, model: ModelConfig, optim: OptimConfig | None = None) -> None:
        self.model_config = model
        self.optim_config = optim or OptimConfig()
        set_torch_threads(self.context.num_cpus, model.num_threads)
        self.model, self.tokenizer = build_value_model(model)
        self.model.train()
        self.optimizer = _adam(self.model, self.optim_config)
        self.dp = DataParallel(self.rank, self.world_size)
        self._version = 0

    def _values(self, b: TensorDictBase) -> torch.Tensor:
        R = b["response_ids"].shape[1]
        v = self.model(b["input_ids"], b["attention_mask"])
        return v[:, -R - 1:-1].float()

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: TensorDictBase) -> TensorDict:
        """``TD{values [B, R]}`` (0 where ``response_mask`` is 0)."""
        require(batch, ["input_ids", "attention_mask", "response_ids", "response_mask"], "CriticWorker.compute_values")
        out = []
        self.model.eval()
        try:
            with torch.no_grad():
                for s in micro_batches(batch.batch_size[0], self.optim_config.micro_batch_size):
                    b = batch[s]
                    out.append(self._values(b) * b["response_mask"].float())
        finally:
            self.model.train()
        return TensorDict({"values": torch.cat(out)}, batch_size=batch.batch_size[:1])

    @register(Dispatch.DP_COMPUTE_METRIC)
    def update(self, batch: TensorDictBase) -> dict[str, float]:
        """Clipped value-loss update against ``returns`` (old values from ``values``); returns
        ``{vf_loss, vf_clip_frac, values_mean, grad_norm, lr, version}``."""
        cfg = self.optim_config
        require(batch, ["input_ids", "attention_mask", "response_ids", "response_mask", "values", "returns"],
                "CriticWorker.update")
        params = [p for p in self.model.parameters() if p.requires_grad]
        sums: dict[str, list[float]] = {}
        n = batch.batch_size[0]
        for _ in range(cfg.ppo_epochs):
            for mini in micro_batches(n, cfg.mini_batch_size):
                mb = batch[mini]
                tokens = float(mb["response_mask"].sum().clamp(min=1))
                self.optimizer.zero_grad(set_to_none=True)
                for micro in micro_batches(mb.batch_size[0], cfg.micro_batch_size):
                    b = mb[micro]
                    mask = b["response_mask"]
                    v = self._values(b)
                    loss = value_clip_loss(v, b["values"], b["returns"], mask, cfg.clip_eps)
                    (loss * float(mask.sum()) / tokens).backward()
                    with torch.no_grad():
                        clipped = ((v - b["values"]).abs() > cfg.clip_eps).float()
                        sums.setdefault("vf_loss", []).append(float(loss))
                        sums.setdefault("vf_clip_frac", []).append(float(masked_mean(clipped, mask)))
                        sums.setdefault("values_mean", []).append(float(masked_mean(v, mask)))
                self.dp.all_reduce_grads(params)
                sums.setdefault("grad_norm", []).append(grad_norm_and_clip(params, cfg.max_grad_norm))
                self.optimizer.step()
        self._version += 1
        metrics = {k: sum(v) / len(v) for k, v in sums.items()}
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["version"] = float(self._version)
        return metrics
