"""`CriticWorker`: a value model (decoder backbone + scalar head) trained with the clipped value loss."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from asyncrl import Dispatch, register

from asyncrl.roles._util import mini_batches, require, require_token_budget, split_micro_batches
from asyncrl.roles import functional as F
from asyncrl.roles.modeling.device import place_model, resolve_placement
from asyncrl.roles.modeling.models import ModelConfig, build_value_model, set_gradient_checkpointing, set_torch_threads
from asyncrl.roles.modeling.threads import computing, core_share_for, release_core_share
from asyncrl.roles.training.policy import OptimConfig, _Trainable

__all__ = ["CriticWorker"]


class CriticWorker(_Trainable):
    """Values of the response positions and clipped value-loss updates.

    ``values[b, t]`` is the value of the state before response token t (the hidden
    state of the position that predicts it). ``optim.clip_eps`` is the value clip.

    Args:
        model: backbone config (a tiny model, or a local directory whose base model is used).
        optim: optimizer settings (``clip_eps`` is the value clip; ``loss_agg_mode`` and the batch
            sizes apply as for the policy; the actor-only loss settings are unused).
    """

    def __init__(self, model: ModelConfig, optim: OptimConfig | None = None) -> None:
        self.model_config = model
        self.optim_config = optim or OptimConfig()
        self.optim_config.validate(self.world_size)
        set_torch_threads(self.context.num_cpus, model.num_threads)
        self.placement = resolve_placement(model, self.context.num_gpus, trained=True, who="CriticWorker")
        built, self.tokenizer = build_value_model(model)
        placed = set_gradient_checkpointing(place_model(built, self.placement, trained=True, who="CriticWorker"),
                                            model.gradient_checkpointing)
        self.core_share = core_share_for(model.num_threads, self.placement.device, placed)
        self._distribute(placed, "CriticWorker")
        self._version = 0

    def _values(self, b: TensorDictBase, module: torch.nn.Module | None = None) -> torch.Tensor:
        R = b["response_ids"].shape[1]
        dev = self.placement.device
        with self.placement.autocast():
            v = (module or self.model)(b["input_ids"].to(dev), b["attention_mask"].to(dev))
        return v[:, -R - 1:-1].float()

    def on_close(self) -> None:
        """Release this worker's busy mark (``num_threads="follow"``)."""
        release_core_share(self)

    @register(Dispatch.DP_COMPUTE)
    @computing
    def compute_values(self, batch: TensorDictBase) -> TensorDict:
        """``TD{values [B, R]}`` (0 where ``response_mask`` is 0)."""
        require(batch, ["input_ids", "attention_mask", "response_ids", "response_mask"], "CriticWorker.compute_values")
        cfg = self.optim_config
        out = torch.zeros(batch["response_ids"].shape)
        self.model.eval()
        try:
            with torch.no_grad():
                for rows, b in split_micro_batches(batch, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch,
                                                   self.dp, "critic.max_tokens_per_micro_batch"):
                    v = self._values(b) * b["response_mask"].to(self.placement.device).float()
                    out[rows, :v.shape[1]] = v.cpu()
        finally:
            self.model.train()
        return TensorDict({"values": out}, batch_size=batch.batch_size[:1])

    @register(Dispatch.DP_COMPUTE_METRIC)
    @computing
    def update(self, batch: TensorDictBase) -> dict[str, float]:
        """Clipped value-loss update against ``returns`` (old values from ``values``); returns
        ``{vf_loss, vf_clip_frac, values_mean, grad_norm, lr, version}`` of the whole batch.

        As the policy's: ``mini_batch_size`` counts rows over all ranks, each micro-batch's loss is
        its share of the global ``loss_agg_mode`` aggregate, and gradients are summed across ranks,
        so several ranks train like one."""
        cfg = self.optim_config
        require(batch, ["input_ids", "attention_mask", "response_ids", "response_mask", "values", "returns"],
                "CriticWorker.update")
        require_token_budget(batch, cfg.max_tokens_per_micro_batch, self.dp, "critic.max_tokens_per_micro_batch")
        batch = batch.to(self.placement.device)
        n = batch.batch_size[0]
        mini = None if cfg.mini_batch_size is None else cfg.mini_batch_size // self.world_size
        vf_loss, tokens, clipped, values_sum = 0.0, 0.0, 0.0, 0.0
        grad_norms: list[float] = []
        for _ in range(cfg.ppo_epochs):
            for mini_rows in mini_batches(n, mini):
                mb = batch[mini_rows]
                denom = self.dp.all_reduce(F.loss_denominators(mb["response_mask"]))
                self.engine.zero_grad(self.optimizer)
                micros = split_micro_batches(mb, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, self.dp,
                                             "critic.max_tokens_per_micro_batch")
                for i, (_, b) in enumerate(micros):
                    mask = b["response_mask"]
                    with self.engine.micro_batch(last=i == len(micros) - 1):
                        v = self._values(b, self.engine.forward_module)
                        losses, clip = F.value_clip_losses(v, b["values"], b["returns"], cfg.clip_eps)
                        loss = 0.5 * F.agg_loss(losses, mask, cfg.loss_agg_mode, num_tokens=denom[0],
                                                num_seqs=denom[1],
                                                loss_scale_factor=cfg.loss_scale_factor or mb["response_mask"].shape[1])
                        loss.backward()
                    with torch.no_grad():
                        vf_loss += float(loss)
                        tokens += float(mask.sum())
                        clipped += float(F.masked_sum(clip.float(), mask))
                        values_sum += float(F.masked_sum(v, mask))
                grad_norms.append(self.engine.clip_grad_norm(cfg.max_grad_norm))
                self.optimizer.step()
        self._version += 1
        vf_loss, tokens, clipped, values_sum = self.dp.all_reduce(
            torch.tensor([vf_loss, tokens, clipped, values_sum], dtype=torch.float64)).tolist()
        steps, tok = max(len(grad_norms), 1), max(tokens, 1.0)
        return {"vf_loss": vf_loss / steps, "vf_clip_frac": clipped / tok, "values_mean": values_sum / tok,
                "grad_norm": sum(grad_norms) / steps, "lr": float(self.optimizer.param_groups[0]["lr"]),
                "version": float(self._version)}
