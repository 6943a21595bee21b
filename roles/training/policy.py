"""`PolicyWorker` (the actor) and `ReferenceWorker` (the frozen reference policy).

``update`` runs verl's PPO actor loss, off-policy corrected, with an optional KL loss
against ``ref_log_probs`` and an entropy bonus::

    check every row's weight version against max_staleness (all ranks agree, else StaleBatchError)
    w = importance_weights(old_log_probs, rollout_log_probs)    # pi_old / pi_behaviour: tis or decoupled
    for epoch in ppo_epochs:                      # no shuffling: deterministic given the seed
      for mini-batch (mini_batch_size rows, global; strided: rows j, j+k, ...):   # one optimizer step each
        num_tokens, num_seqs = all-reduce(loss_denominators(mini-batch))
        for micro-batch (micro_batch_size rows per rank):   # gradient accumulation
          loss = agg(w * ppo_clip) - entropy_coef * agg(entropy) + kl_coef * agg(kl)
                 # agg = agg_loss(loss_agg_mode, global num_tokens/num_seqs): this shard's share
        sum grads over ranks (actor.strategy: DDP, or FSDP2's reduce-scatter), clip to max_grad_norm, step
    version += 1

Because every share is normalised by the *global* token (or sequence) count, summing the
gradients of all micro-batches on all ranks gives exactly the gradient of the loss of the
whole mini-batch: two ranks with unequal token counts train like one (tested). Metrics are
reduced across ranks too, so every rank reports the values of the whole batch.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Iterator, Literal, Mapping

import torch
from tensordict import TensorDict, TensorDictBase

from asyncrl import Dispatch, Execute, Worker, register

from asyncrl.roles import functional as F
from asyncrl.roles.modeling.parallel import DataParallel
from asyncrl.roles._util import mini_batches, require, require_token_budget, response_log_probs, split_micro_batches, with_fields
from asyncrl.roles.modeling.device import Placement, place_model, resolve_placement
from asyncrl.roles.errors import CheckpointFormatError, StaleBatchError
from asyncrl.roles.fields import MAX_ROWS, Range, Section, check_bounds
from asyncrl.roles.modeling.lora import LoraConfig, LoraDelta, adapter_delta, apply_lora, base_digest, merged_state
from asyncrl.roles.modeling.models import ModelConfig, load_model, set_gradient_checkpointing, set_torch_threads, tensor_checksum
from asyncrl.roles.modeling.strategy import EVERY_RANK_GIVES_RANK_ZEROS, STRATEGIES, TrainStrategy, full_tensor
from asyncrl.roles.modeling.threads import computing, core_share_for, release_core_share
from asyncrl.roles.weights.transfer import STAGE, WeightHandle, WeightSource
from asyncrl.roles.weights.weight_channel import _cast
from asyncrl.roles.agentic.episodes import episode_metrics

__all__ = ["LoraConfig", "OptimConfig", "PolicyWorker", "ReferenceWorker", "RolloutCorrectionConfig"]


@dataclass(kw_only=True)
class RolloutCorrectionConfig(Section):
    """Off-policy correction of the actor loss for rows sampled by an older policy (verl's
    ``algorithm.rollout_correction``; AReaL's decoupled PPO). See ``functional.importance_weights``."""

    mode: Literal["auto", "none", "tis", "decoupled"] = "auto"
    """``tis``: truncated importance sampling, loss x ``min(pi_old / pi_behaviour, threshold)`` (verl's
    ``rollout_is``); ``decoupled``: AReaL's decoupled PPO, tokens whose weight exceeds the threshold are
    dropped (``behav_imp_weight_cap``); ``none``: no correction; ``auto``: ``tis`` when the trainer's
    ``max_staleness >= 1`` (a PolicyWorker built with ``max_staleness >= 1``), else ``none``."""
    rollout_is: Literal["token", "sequence"] = "token"
    """Weight per token, or one weight per row (the product of its token ratios), as verl's ``rollout_is``."""
    rollout_is_threshold: Annotated[float, Range(gt=0)] = 2.0
    """Cap of the weights (verl's ``rollout_is_threshold``, default 2.0); must be > 0 (> 1 for ``decoupled``)."""
    bypass_mode: Literal["off", "on_policy", "behaviour"] = "off"
    """verl's ``bypass_mode``: use the rollout's log-probs as ``old_log_probs`` and skip the policy's
    ``old_log_prob`` forward pass. ``on_policy``: only where that changes nothing, on-policy
    (``max_staleness=0``) with exact rollout log-probs (the HF engine with ``exact_log_probs``, the
    policy's precision and temperature): pi_rollout is pi_old. ``behaviour`` (opt-in, verl's
    ``ppo_is_bypass``): pi_old := pi_rollout whatever the staleness or engine, so the PPO ratio and
    its clip are taken against the behaviour policy (two policies; no importance weights, ``mode``
    resolves to ``none``). ``off``: the policy recomputes ``old_log_probs`` (three policies when a
    correction is on). The trainer checks the conditions (``JobConfig.validate``)."""

    def resolve(self, max_staleness: int | None) -> str:
        """The effective mode (``none``, ``tis`` or ``decoupled``) for a run with `max_staleness`
        (``none`` under a bypass: pi_old is pi_rollout, every weight would be 1)."""
        if self.bypass_mode != "off":
            return "none"
        if self.mode == "auto":
            return "tis" if (max_staleness or 0) >= 1 else "none"
        return self.mode

    def validate(self) -> None:
        """Raise ValueError for an unknown mode or level, or a threshold out of range."""
        if self.mode not in ("auto", "none", *F.CORRECTION_MODES):
            raise ValueError(f"rollout_correction.mode must be one of ['auto', 'none', 'tis', 'decoupled'], "
                             f"got {self.mode!r}")
        if self.rollout_is not in F.IS_LEVELS:
            raise ValueError(f"rollout_correction.rollout_is must be 'token' or 'sequence', got {self.rollout_is!r}")
        if self.bypass_mode not in ("off", "on_policy", "behaviour"):
            raise ValueError(f"rollout_correction.bypass_mode must be 'off', 'on_policy' or 'behaviour', "
                             f"got {self.bypass_mode!r}")
        if self.bypass_mode != "off" and self.mode in F.CORRECTION_MODES:
            raise ValueError(f"rollout_correction.bypass_mode={self.bypass_mode!r} takes the rollout's log-probs as "
                             f"old_log_probs (pi_old = pi_rollout), so the {self.mode!r} importance weights "
                             "pi_old / pi_rollout are all 1 and correct nothing; set rollout_correction.mode to "
                             "'auto' or 'none', or bypass_mode='off' for a three-policy correction")
        check_bounds(self, "rollout_correction")
        t = self.rollout_is_threshold
        if self.mode == "decoupled" and not t > 1:
            raise ValueError(f"rollout_correction.rollout_is_threshold must be > 1 for mode='decoupled' (AReaL's "
                             f"behav_imp_weight_cap: weights above it are dropped), got {t}")


@dataclass(kw_only=True)
class OptimConfig(Section):
    """Optimizer and loss settings of a trained role (policy or critic).

    Names follow verl where they differ only in spelling: ``clip_eps`` is verl's ``clip_ratio``
    (and the critic's ``cliprange_value``), ``kl_coef`` its ``kl_loss_coef``, ``entropy_coef`` its
    ``entropy_coeff``, ``mini_batch_size`` its ``ppo_mini_batch_size`` (in rows, global) and
    ``micro_batch_size`` its ``ppo_micro_batch_size_per_gpu``.
    """

    lr: Annotated[float, Range(ge=0)] = 1e-3
    """AdamW learning rate (0 keeps the weights: a probe of the gradients)."""
    betas: Annotated[tuple[float, float], Range(ge=0, lt=1)] = (0.9, 0.999)
    """Adam betas."""
    eps: Annotated[float, Range(gt=0)] = 1e-8
    """Adam epsilon."""
    weight_decay: Annotated[float, Range(ge=0)] = 0.0
    """AdamW weight decay."""
    optimizer_impl: Literal["foreach", "fused"] = "foreach"
    """How torch's AdamW runs its step (torchtitan's ``optimizer.implementation``): ``foreach`` (torch's default,
    and verl's: a kernel per operation over lists of tensors) or ``fused`` (one fused kernel; on CPU and GPU
    several times faster, the weights differing from ``foreach`` in the last bits of fp32)."""
    max_grad_norm: Annotated[float, Range(gt=0)] | None = 1.0
    """Clip the global gradient norm to this (None: no clipping; the norm is still reported)."""
    micro_batch_size: Annotated[int, Range(ge=1, le=MAX_ROWS)] = 8
    """Rows per forward/backward on each rank (gradient accumulation over a mini-batch); unused when
    `max_tokens_per_micro_batch` is set."""
    max_tokens_per_micro_batch: Annotated[int, Range(ge=1, le=1 << 30)] | None = None
    """Token budget of a forward/backward on each rank (verl's ``use_dynamic_bsz`` with
    ``ppo_max_token_len_per_gpu``): rows of similar length are grouped so that each micro-batch's
    padded tokens (rows x its own longest prompt + longest response) stay within it, and each
    micro-batch is cut to its own width. Same gradients as fixed micro-batches; must be at least the
    longest row. None: micro-batches of `micro_batch_size` rows, padded to the batch's longest row."""
    mini_batch_size: Annotated[int, Range(ge=1, le=MAX_ROWS)] | None = None
    """Rows per optimizer step over all ranks together (each rank takes mini_batch_size / ranks of its
    shard, so it must divide by the number of ranks); None uses the whole batch for one step per epoch."""
    ppo_epochs: Annotated[int, Range(ge=1, le=1000)] = 1
    """Passes over the batch per ``update`` call."""
    clip_eps: Annotated[float, Range(ge=0)] = 0.2
    """PPO ratio clip (verl's ``clip_ratio``; policy) or value clip (critic)."""
    clip_ratio_low: Annotated[float, Range(ge=0)] | None = None
    """Lower ratio clip: ratio >= 1 - clip_ratio_low (None = ``clip_eps``)."""
    clip_ratio_high: Annotated[float, Range(ge=0)] | None = None
    """Upper ratio clip: ratio <= 1 + clip_ratio_high (None = ``clip_eps``; e.g. 0.28 for DAPO's clip-higher)."""
    clip_ratio_c: Annotated[float, Range(gt=1)] | None = 3.0
    """Dual-clip PPO bound for negative advantages (verl's default 3.0; must be > 1; None = off)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become one number (verl's ``loss_agg_mode``), over the global mini-batch:
    every rank and micro-batch contributes its share of the same global denominator."""
    loss_scale_factor: Annotated[float, Range(gt=0)] | None = None
    """``seq-mean-token-sum-norm``'s constant normaliser (None = the response width R)."""
    kl_coef: Annotated[float, Range(ge=0)] = 0.0
    """Weight of the KL loss against ``ref_log_probs`` (verl's ``kl_loss_coef``; 0 = off, the batch then
    needs no reference)."""
    kl_loss_type: str = "k3"
    """KL estimator of the loss: ``k1``/``kl``, ``abs``, ``k2``/``mse``, ``k3``/``low_var_kl`` (verl's clamps),
    optionally ending in ``+`` (straight-through k2 gradient)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    temperature: Annotated[float, Range(gt=0)] | None = None
    """Logit temperature of the recomputed log-probs. None: the rollout's (the trainer fills it in; a
    PolicyWorker used alone takes 1.0); a value that differs from ``rollout.temperature`` is a config error."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy correction of the actor loss (unused by the critic)."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """How the model is spread over several training ranks (verl's ``strategy``; asyncrl.roles.modeling.strategy):
    ``ddp`` replicates it (torch's DistributedDataParallel, ~16 bytes per parameter on every rank);
    ``fsdp2`` shards parameters, gradients and optimizer state over the ranks (torch's ``fully_shard`` per
    decoder layer). The same math either way; one rank is the plain model. The reference follows the actor's."""
    fsdp_offload: bool = False
    """``fsdp2`` only: keep the shards and the optimizer state in CPU memory (verl's ``offload_policy``)."""
    fsdp_reshard_after_forward: bool = True
    """``fsdp2`` only: free each layer's gathered parameters after its forward and gather them again for the
    backward (verl's and torchtitan's ``reshard_after_forward``); false keeps them until the backward: one
    all-gather per layer fewer, the whole model's parameters held during a micro-batch."""
    fsdp_reduce_every_micro_batch: bool = False
    """``fsdp2`` only: reduce-scatter each micro-batch's gradient in its own backward. False (default, as DDP's
    ``no_sync``): once per optimizer step, in the last micro-batch's backward, each rank keeping every layer's whole
    gradient until then (a replica's gradient bytes, 4 per parameter in fp32); true keeps gradient shards only, at
    one reduce-scatter per layer and micro-batch. The same math either way."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (policy only; ``lora.rank > 0``, needs ``peft``): only the adapters train, the
    reference log-probs are the base model's (the adapter disabled, no reference worker), the rollout gets
    the merged weights. See asyncrl.roles.modeling.lora."""

    def validate(self, world_size: int = 1) -> None:
        """Raise ValueError for settings no update can run with (`world_size`: ranks of the group)."""
        check_bounds(self)
        if self.mini_batch_size is not None:
            if self.mini_batch_size % world_size:
                raise ValueError(
                    f"mini_batch_size={self.mini_batch_size} must be a positive multiple of the {world_size} training "
                    "rank(s): it counts the rows of one optimizer step over all ranks together (None = whole batch)"
                )
        if self.optimizer_impl not in ("foreach", "fused"):
            raise ValueError(f"optimizer_impl must be 'foreach' or 'fused', got {self.optimizer_impl!r}")
        if self.loss_agg_mode not in F.LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {list(F.LOSS_AGG_MODES)}, got {self.loss_agg_mode!r}")
        base = self.kl_loss_type[:-1] if self.kl_loss_type.endswith("+") else self.kl_loss_type
        if base not in F.KL_ESTIMATORS:
            raise ValueError(f"kl_loss_type must be one of {list(F.KL_ESTIMATORS)} (optionally ending in '+'), "
                             f"got {self.kl_loss_type!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {self.strategy!r}")
        if self.fsdp_offload and self.strategy != "fsdp2":
            raise ValueError("fsdp_offload=true keeps FSDP2 shards in CPU memory: it needs strategy=fsdp2")
        self.rollout_correction.validate()
        self.lora.validate()


def _adam(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    impl = {"fused": True} if cfg.optimizer_impl == "fused" else {}
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **impl)


class _Trainable(Worker):
    """Shared save/load and optimizer plumbing of the policy and the critic."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    optim_config: OptimConfig
    placement: Placement
    engine: TrainStrategy
    _version: int
    _lora: bool = False
    """``self.model`` is a peft model whose LoRA adapters alone train (a PolicyWorker with ``lora.rank > 0``)."""
    _base_digests: dict[str | None, str] | None = None

    def _distribute(self, model: torch.nn.Module, who: str) -> None:
        """Spread `model` over the group (``optim.strategy``) and build its optimizer over what each rank holds."""
        cfg = self.optim_config
        self.dp = DataParallel(self.rank, self.world_size, self.placement.device)
        self.engine = TrainStrategy(model, self.placement, self.dp, cfg.strategy, offload=cfg.fsdp_offload,
                                    reshard_after_forward=cfg.fsdp_reshard_after_forward,
                                    reduce_every_micro_batch=cfg.fsdp_reduce_every_micro_batch, who=who)
        self.model = self.engine.module
        self.model.train()
        self.optimizer = _adam(self.model, cfg)

    def _full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole tensor)`` of the state dict, one tensor at a time (every rank must iterate it whole)."""
        return self.engine.full_tensors(self.model.state_dict())

    @register(EVERY_RANK_GIVES_RANK_ZEROS)
    def weights_checksum(self, dtype: str | None = None) -> dict[str, str]:
        """``{name: checksum}`` of the current weights (compare with the rollout's); `dtype` casts
        floating tensors first, as ``export_weights(dtype=...)`` does."""
        dt = getattr(torch, dtype) if dtype is not None else None
        return {k: tensor_checksum(v.to(dt) if dt is not None and v.is_floating_point() else v)
                for k, v in self._full_state() if self.rank == 0}

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def placement_info(self) -> dict[str, str]:
        """``{"device", "param_dtype", "autocast"}`` this role resolved (see asyncrl.roles.modeling.device)."""
        return self.placement.describe()

    @register(Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> str:
        """Save model, optimizer and version to directory `path`.

        ``ddp`` (every rank holds the same weights): rank 0 writes ``model.safetensors`` and ``optimizer.pt``.
        ``fsdp2``: every rank writes its shards of both into ``dcp/`` (``torch.distributed.checkpoint``), which
        :meth:`load` reads back at any number of ranks. ``meta.json`` says which, at how many ranks."""
        os.makedirs(path, exist_ok=True)
        base = self._base_digest(None) if self._lora else None  # (FSDP2: a collective, so on every rank)
        if self._format == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._dcp_options())
            with _one_process_is_meant():
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "dcp"))
            if self._lora:
                self._save_lora(path)
        elif self._lora:
            if self.rank == 0:
                self._save_lora(path)
        elif self.rank == 0:
            from safetensors.torch import save_model

            save_model(self.model, os.path.join(path, "model.safetensors"))
            torch.save(self.optimizer.state_dict(), os.path.join(path, "optimizer.pt"))
        if self.rank == 0:
            meta = {"version": self._version, "optim": asdict(self.optim_config), "format": self._format,
                    "world_size": self.world_size}
            if self._lora:
                meta["lora_base_digest"] = base
            with open(os.path.join(path, "meta.json"), "w") as f:
                json.dump(meta, f)
        return path

    def _save_lora(self, path: str) -> None:
        """LoRA's files of :meth:`save` (only a :class:`PolicyWorker` trains adapters: it writes them)."""
        raise NotImplementedError(f"{type(self).__name__} trains no LoRA adapters")

    def _dcp_options(self) -> Any:
        """``torch.distributed.checkpoint`` state-dict options: with LoRA only the trainable adapters (the frozen
        base is rebuilt from the model config on load, its digest checked; ``dcp.load`` still refuses a
        checkpoint that lacks an adapter tensor, so the frozen names alone are let go)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self._lora, strict=not self._lora)

    def _base_digest(self, dtype: str | None) -> str:
        """LoRA: :func:`~asyncrl.roles.modeling.lora.base_digest` of the frozen base (in `dtype`), computed once per dtype."""
        if self._base_digests is None:
            self._base_digests = {}
        if dtype not in self._base_digests:
            self._base_digests[dtype] = base_digest(self.model, getattr(torch, dtype) if dtype is not None else None)
        return self._base_digests[dtype]

    def _check_lora_base(self, path: str, meta: dict[str, Any]) -> None:
        """Raise CheckpointFormatError unless this model's base (rebuilt from the model config) is the one the
        checkpoint's adapter trained on (FSDP2: a collective, every rank calls it)."""
        want, have = meta.get("lora_base_digest"), self._base_digest(None)
        if want != have:
            raise CheckpointFormatError(
                f"checkpoint {path!r} holds a LoRA adapter trained on other base weights than this model's (base "
                f"digest {str(want)[:12]} != {have[:12]}): resume with the model config the run started with")

    def _load_lora(self, path: str, meta: dict[str, Any]) -> None:
        """Load the adapter :meth:`_save_lora` wrote into this model, whose base was rebuilt from the model config
        and must be the one the adapter trained on."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        adapter = os.path.join(path, "adapter_model.safetensors")
        if not os.path.exists(adapter):
            raise FileNotFoundError(f"checkpoint {path!r} is incomplete: missing {adapter}; save one with save(path)")
        self._check_lora_base(path, meta)
        result = set_peft_model_state_dict(self.model, load_file(adapter))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise CheckpointFormatError(f"the adapter in {adapter!r} does not fit this model's LoRA layers: missing "
                                        f"{missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}")

    @property
    def _format(self) -> str:
        return "dcp" if self.optim_config.strategy == "fsdp2" else "full"

    @register(Dispatch.ONE_TO_ALL)
    def load(self, path: str) -> int:
        """Load what :meth:`save` wrote (``torch.load(weights_only=True)``); returns the restored version.

        Either format loads at any number of ranks (``dcp`` reshards on load); a checkpoint of the other
        strategy is refused (:class:`CheckpointFormatError`, naming both)."""
        meta_file = os.path.join(path, "meta.json")
        if not os.path.exists(meta_file):
            raise FileNotFoundError(f"checkpoint {path!r} is incomplete: missing {meta_file}; save one with save(path)")
        with open(meta_file) as f:
            meta = json.load(f)
        fmt = meta.get("format", "full")
        saved_lora = int(meta.get("optim", {}).get("lora", {}).get("rank", 0))
        if saved_lora != self.optim_config.lora.rank:
            raise CheckpointFormatError(
                f"checkpoint {path!r} was written with lora.rank={saved_lora} but this {type(self).__name__} runs "
                f"lora.rank={self.optim_config.lora.rank}; resume with lora.rank={saved_lora}, or export the weights "
                "(asyncrl export) and start a new run from them")
        if fmt != self._format:
            saved = meta.get("optim", {}).get("strategy", "ddp")
            raise CheckpointFormatError(
                f"checkpoint {path!r} was written with strategy={saved!r} ({'shards' if fmt == 'dcp' else 'whole weights'}"
                f", {meta.get('world_size', '?')} rank(s)) but this {type(self).__name__} runs "
                f"strategy={self.optim_config.strategy!r}; resume with strategy={saved!r} (any number of ranks), or "
                "export the weights (asyncrl export) and start a new run from them")
        if fmt == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            if self._lora:
                self._check_lora_base(path, meta)
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._dcp_options())
            state = {"model": model_sd, "optim": optim_sd}
            with _one_process_is_meant():
                dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=self._dcp_options())
        else:
            from safetensors.torch import load_model

            files = [os.path.join(path, n) for n in ("model.safetensors", "optimizer.pt")]
            missing = [f for f in files if not os.path.exists(f)]
            if missing:
                raise FileNotFoundError(f"checkpoint {path!r} is incomplete: missing {missing}; save one with save(path)")
            if self._lora:
                self._load_lora(path, meta)
            else:
                load_model(self.model, files[0], strict=True)
            self.optimizer.load_state_dict(torch.load(files[1], weights_only=True, map_location=self.placement.device))
        self._version = int(meta["version"])
        return self._version


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """Silence torch.distributed.checkpoint's warning that one rank saves or loads without a process group:
    a one-rank fsdp2 role does so on purpose."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


_MISSING, _STALE = 1, 2  # error codes ranks agree on before an update (DataParallel.agree)


class PolicyWorker(_Trainable):
    """The trained policy: recomputes log-probs, runs PPO updates, exports versioned weights.

    The sending side of the weight transports is a :class:`~asyncrl.roles.weights.transfer.WeightSource` it
    holds (``self.weights``); its registered transport methods (``stage_weights``, ``send_weights``, ...) delegate
    there.

    Args:
        model: the model to train (same config as the rollout's, so version 0 matches).
        optim: optimizer and loss settings (``temperature=None`` means 1.0 here; the trainer
            sets the rollout's).
        max_staleness: the trainer's bound: ``update`` refuses a batch holding a row whose
            ``version`` is more than this many versions behind the policy (``StaleBatchError``),
            and ``rollout_correction.mode="auto"`` corrects when it is >= 1. None (default):
            no bound is enforced and ``auto`` means no correction.
    """

    def __init__(self, model: ModelConfig, optim: OptimConfig | None = None, *,
                 max_staleness: int | None = None) -> None:
        self.model_config = model
        self.optim_config = optim or OptimConfig()
        self.optim_config.validate(self.world_size)
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        self.max_staleness = max_staleness
        self.correction = self.optim_config.rollout_correction.resolve(max_staleness)
        self.temperature = 1.0 if self.optim_config.temperature is None else self.optim_config.temperature
        set_torch_threads(self.context.num_cpus, model.num_threads)
        torch.manual_seed(model.seed)
        self.placement = resolve_placement(model, self.context.num_gpus, trained=True, who="PolicyWorker")
        built, self.tokenizer = load_model(model)
        placed = set_gradient_checkpointing(place_model(built, self.placement, trained=True, who="PolicyWorker"),
                                            model.gradient_checkpointing)
        self.core_share = core_share_for(model.num_threads, self.placement.device, placed)
        if self.optim_config.lora.enabled:  # the adapters' A from the RNG seeded above: alike on every rank
            placed = apply_lora(placed, self.optim_config.lora)
            self._lora = True
        self._distribute(placed, "PolicyWorker")
        self._version = 0
        self.weights = WeightSource(strategy=self.engine, rank=self.rank, device=self.placement.device,
                                    lora=self._lora, version=lambda: self._version)

    @property
    def version(self) -> int:
        """Number of updates applied (0 = initial weights)."""
        return self._version

    @register(Dispatch.DP_COMPUTE)
    @computing
    def compute_log_prob(self, batch: TensorDictBase) -> TensorDict:
        """``TD{old_log_probs [B, R], entropy [B, R]}`` of the response tokens (0 where masked).

        Needs ``input_ids``, ``attention_mask``, ``response_ids``, ``response_mask``."""
        cfg = self.optim_config
        return _log_probs(self.model, batch, cfg.micro_batch_size, self.temperature, "old_log_probs",
                          with_entropy=True, who="PolicyWorker.compute_log_prob", placement=self.placement,
                          max_tokens=(cfg.max_tokens_per_micro_batch, "actor.max_tokens_per_micro_batch"), dp=self.dp)

    @register(Dispatch.DP_COMPUTE)
    @computing
    def compute_ref_log_prob(self, batch: TensorDictBase) -> TensorDict:
        """``TD{ref_log_probs [B, R]}`` (0 where masked) of the base model: this model with its LoRA adapters
        disabled, so a LoRA run needs no ReferenceWorker (the same contract as ReferenceWorker's).

        Needs ``input_ids``, ``attention_mask``, ``response_ids``, ``response_mask``; LoRA (``lora.rank > 0``)."""
        if not self._lora:
            raise RuntimeError("PolicyWorker.compute_ref_log_prob gives the base model's log-probs by disabling the "
                               "LoRA adapters, but this policy trains without LoRA (actor.lora.rank=0): use a "
                               "ReferenceWorker for the reference log-probs")
        cfg = self.optim_config
        with self.model.disable_adapter():  # type: ignore[operator]
            return _log_probs(self.model, batch, cfg.micro_batch_size, self.temperature, "ref_log_probs",
                              with_entropy=False, who="PolicyWorker.compute_ref_log_prob", placement=self.placement,
                              max_tokens=(cfg.max_tokens_per_micro_batch, "actor.max_tokens_per_micro_batch"),
                              dp=self.dp)

    def _full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole tensor)`` of the weights as exported (``WeightSource.export_state``: LoRA merged; a
        sharded LoRA model merges each unit's weights while the unit is gathered)."""
        if self._lora and self.engine.sharded:  # copies: a unit's gathered storage is freed (resized) after it
            for whole in self.weights.whole_by_unit(list(self.weights.export_layout())):
                yield from ((n, t.clone()) for n, t in whole.items())
        else:
            yield from self.engine.full_tensors(self.weights.export_state())

    def _save_lora(self, path: str) -> None:
        """LoRA: the adapter as peft writes it (``adapter_config.json``, ``adapter_model.safetensors``: what a
        ``ddp`` resume loads and ``asyncrl export --adapter`` copies), the merged weights under the base names in
        ``model.safetensors`` (what ``asyncrl export`` reads), and for ``ddp`` the optimizer (``fsdp2`` keeps the
        adapters and the optimizer in ``dcp/``). Under FSDP2 every rank calls it: the merged weights are
        gathered one unit at a time into rank 0's host buffer (as a weight sync does), the adapters one tensor
        at a time; rank 0 writes."""
        from safetensors.torch import save_file

        adapter = None
        if self.engine.sharded:
            held = self.weights.gathered(None)
            adapter = {k: full_tensor(v) for k, v in self.model.state_dict().items() if "lora_" in k}
            if held is None:
                return
            merged = held.views()
        else:
            merged = merged_state(self.model)
        first: dict[tuple[int, int], str] = {}
        for name in sorted(merged):  # tied names share one tensor: stored once, as save_model does
            first.setdefault((merged[name].untyped_storage().data_ptr(), merged[name].storage_offset()), name)
        save_file({n: merged[n].contiguous() for n in first.values()}, os.path.join(path, "model.safetensors"))
        self.model.save_pretrained(path, state_dict=adapter)  # type: ignore[operator]
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, "README.md"))  # peft's model-card template: nothing of the run's
        if self._format != "dcp":
            torch.save(self.optimizer.state_dict(), os.path.join(path, "optimizer.pt"))

    def _check_batch(self, batch: TensorDictBase) -> tuple[int, str | None]:
        """What is wrong with this rank's shard: ``(0, None)``, ``(_MISSING, message)`` or ``(_STALE, message)``."""
        cfg = self.optim_config
        need = ["input_ids", "attention_mask", "response_ids", "response_mask", "old_log_probs", "advantages"]
        if cfg.kl_coef > 0:
            need.append("ref_log_probs")
        if self.correction != "none":
            need.append("rollout_log_probs")
        if self.max_staleness is not None:
            need.append("version")
        missing = [f for f in need if f not in batch.keys()]
        if missing:
            why = {"rollout_log_probs": f"off-policy correction ({self.correction!r}) needs the behaviour "
                                        "log-probs the rollout returns; keep the field or set "
                                        "rollout_correction.mode='none'",
                   "version": f"max_staleness={self.max_staleness} is enforced on every row's weight version",
                   "ref_log_probs": "kl_coef > 0 needs the reference's log-probs"}
            notes = "".join(f" {why[f]}." for f in missing if f in why)
            return _MISSING, (f"PolicyWorker.update needs batch field(s) {missing}; the batch has "
                              f"{sorted(map(str, batch.keys()))}.{notes} See docs/roles_api.md for which stage "
                              "writes each field")
        if self.max_staleness is not None:
            lag = self._version - batch["version"].long()
            versions = sorted(set(batch["version"].tolist()))
            if (lag < 0).any():
                return _STALE, (f"rows generated by weight version {max(versions)} reached the policy at version "
                                f"{self._version}: a batch cannot come from the future (a bookkeeping bug)")
            if (lag > self.max_staleness).any():
                return _STALE, (f"{int((lag > self.max_staleness).sum())} row(s) were generated {int(lag.max())} "
                                f"versions before the policy (version {self._version}, row versions {versions}), "
                                f"more than max_staleness={self.max_staleness}; regenerate them with newer weights "
                                "or raise the bound")
        return 0, None

    @register(Dispatch.DP_COMPUTE_METRIC)
    @computing
    def update(self, batch: TensorDictBase) -> dict[str, float]:
        """One PPO update over `batch`; returns metrics of the whole batch (reduced across ranks)
        and the new ``version``.

        Needs ``input_ids``, ``attention_mask``, ``response_ids``, ``response_mask``,
        ``old_log_probs``, ``advantages``; ``ref_log_probs`` when ``kl_coef > 0``;
        ``rollout_log_probs`` when off-policy correction is on; ``version`` when
        ``max_staleness`` is set. A missing field raises KeyError and a row outside the
        staleness bound :class:`StaleBatchError`, on every rank, before anything changes.
        """
        cfg = self.optim_config
        kind, problem = self.dp.agree(*self._check_batch(batch))
        if kind == _MISSING:
            raise KeyError(problem)
        if kind == _STALE:
            raise StaleBatchError(problem)
        require_token_budget(batch, cfg.max_tokens_per_micro_batch, self.dp, "actor.max_tokens_per_micro_batch")
        batch = batch.to(self.placement.device)
        self.model.train()
        n = batch.batch_size[0]
        mask_all = batch["response_mask"]
        # off-policy weights: fixed for the whole update (pi_old and pi_behaviour do not change)
        has_behaviour = "rollout_log_probs" in batch.keys()
        rc = cfg.rollout_correction
        iw = (F.importance_weights(batch["old_log_probs"], batch["rollout_log_probs"], mask_all,
                                   mode=self.correction if self.correction != "none" else "tis",
                                   level=rc.rollout_is, threshold=rc.rollout_is_threshold)
              if has_behaviour else None)
        weights = iw.weights if (iw is not None and self.correction != "none") else None
        if weights is not None:  # a field, so that micro-batches select and cut it with the rest
            batch = with_fields(batch, {"is_weights": weights})
        low = cfg.clip_eps if cfg.clip_ratio_low is None else cfg.clip_ratio_low
        high = cfg.clip_eps if cfg.clip_ratio_high is None else cfg.clip_ratio_high
        mini = None if cfg.mini_batch_size is None else cfg.mini_batch_size // self.world_size
        # per-step shares (sum over ranks = the global value) and token counts for fractions
        shares = dict.fromkeys(("pg_loss", "entropy", "kl", "loss"), 0.0)
        counts = dict.fromkeys(("tokens", "clipped", "clipped_lower", "ppo_kl"), 0.0)
        grad_norms: list[float] = []
        for _ in range(cfg.ppo_epochs):
            for mini_rows in mini_batches(n, mini):
                mb = batch[mini_rows]
                denom = self.dp.all_reduce(F.loss_denominators(mb["response_mask"]))
                agg = dict(loss_agg_mode=cfg.loss_agg_mode, num_tokens=denom[0], num_seqs=denom[1],
                           loss_scale_factor=cfg.loss_scale_factor or mb["response_mask"].shape[1])
                self.engine.zero_grad(self.optimizer)
                micros = split_micro_batches(mb, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, self.dp,
                                             "actor.max_tokens_per_micro_batch")
                for i, (_, b) in enumerate(micros):
                    with self.engine.micro_batch(last=i == len(micros) - 1):
                        self._accumulate(b, agg, (low, high), shares, counts)
                grad_norms.append(self.engine.clip_grad_norm(cfg.max_grad_norm))
                self.optimizer.step()
        self._version += 1
        metrics = self._metrics(batch, shares, counts, grad_norms, iw, has_behaviour)
        if "num_turns" in batch.keys():  # a batch of multi-turn episodes (asyncrl.roles.agentic.episodes)
            metrics.update(episode_metrics(batch, self.dp.all_reduce))
        return metrics

    def _accumulate(self, b: TensorDictBase, agg: dict[str, Any], clip: tuple[float, float],
                    shares: dict[str, float], counts: dict[str, float]) -> None:
        """Forward and backward of one micro-batch `b` (its loss: its share of the mini-batch's, `agg`'s global
        denominators), adding its gradient to ``.grad`` and its loss terms and token counts to `shares`/`counts`."""
        cfg = self.optim_config
        mask = b["response_mask"]
        lp, ent = response_log_probs(self.engine.forward_module, b["input_ids"], b["attention_mask"], b["response_ids"],
                                     self.temperature, with_entropy=True, placement=self.placement)
        terms = F.ppo_policy_terms(lp, b["old_log_probs"], b["advantages"], clip_ratio_low=clip[0],
                                   clip_ratio_high=clip[1], clip_ratio_c=cfg.clip_ratio_c)
        losses = terms.losses * b["is_weights"] if "is_weights" in b.keys() else terms.losses
        pg = F.agg_loss(losses, mask, **agg)
        entropy = F.agg_loss(ent, mask, **agg)  # type: ignore[arg-type]
        loss = pg - cfg.entropy_coef * entropy if cfg.entropy_coef else pg
        if cfg.kl_coef > 0:
            kl = F.agg_loss(F.kl_penalty(lp, b["ref_log_probs"], cfg.kl_loss_type), mask, **agg)
            loss = loss + cfg.kl_coef * kl
            shares["kl"] += float(kl.detach())
        loss.backward()
        with torch.no_grad():
            shares["pg_loss"] += float(pg)
            shares["entropy"] += float(entropy)
            shares["loss"] += float(loss)
            counts["tokens"] += float(mask.sum())
            counts["clipped"] += float(F.masked_sum(terms.clipped.float(), mask))
            counts["clipped_lower"] += float(F.masked_sum(terms.clipped_lower.float(), mask))
            counts["ppo_kl"] += float(F.masked_sum(b["old_log_probs"] - lp, mask))

    def _metrics(self, batch: TensorDictBase, shares: dict[str, float], counts: dict[str, float],
                 grad_norms: list[float], iw: F.ISWeights | None, has_behaviour: bool) -> dict[str, float]:
        """Metrics of the whole batch: local sums reduced across ranks in two collectives."""
        cfg = self.optim_config
        mask = batch["response_mask"]
        local = [*shares.values(), *counts.values()]
        maxes = [0.0]
        if has_behaviour and iw is not None:
            behav = F.masked_sum(batch["rollout_log_probs"] - batch["old_log_probs"], mask)
            local += [float(mask.sum()), float(iw.raw.sum()), float(iw.weights.sum()), float(iw.over.sum()),
                      float(behav)]
            maxes = [float(iw.raw.max()) if iw.raw.numel() else 0.0]
        lags: list[float] = []
        if "version" in batch.keys():
            lag = (self._version - 1 - batch["version"].long()).clamp(min=0)
            top = self.max_staleness if self.max_staleness is not None else int(lag.max()) if lag.numel() else 0
            hist = torch.bincount(lag.clamp(max=top), minlength=top + 1)[: top + 1]
            lags = [float(x) for x in hist]
            maxes.append(float(lag.max()) if lag.numel() else 0.0)
        if self.max_staleness is None and lags:
            # bins must match across ranks: pad every rank's histogram to the global max lag
            top = int(self.dp.all_reduce(torch.tensor([len(lags) - 1.0]), op="max")[0])
            lags += [0.0] * (top + 1 - len(lags))
        total = self.dp.all_reduce(torch.tensor(local + lags, dtype=torch.float64)).tolist()
        top_vals = self.dp.all_reduce(torch.tensor(maxes, dtype=torch.float64), op="max").tolist()
        steps = max(len(grad_norms), 1)
        out = {k: total[i] / steps for i, k in enumerate(shares)}
        if cfg.kl_coef <= 0:
            del out["kl"]
        c = dict(zip(counts, total[len(shares):len(shares) + len(counts)]))
        tok = max(c["tokens"], 1.0)
        out.update(clip_frac=c["clipped"] / tok, clip_frac_lower=c["clipped_lower"] / tok, ppo_kl=c["ppo_kl"] / tok)
        out["grad_norm"] = sum(grad_norms) / steps
        i = len(shares) + len(counts)
        if has_behaviour and iw is not None:
            ntok, raw, w, over, behav = total[i:i + 5]
            i += 5
            ntok = max(ntok, 1.0)
            out.update({"is_weight_mean": raw / ntok, "is_weight_max": top_vals[0], "is_weight_used_mean": w / ntok,
                        "is_over_threshold_frac": over / ntok, "behaviour_kl": behav / ntok})
        if lags:
            hist = total[i:]
            rows = max(sum(hist), 1.0)
            out.update({f"row_staleness/{k}": h for k, h in enumerate(hist)})
            out["row_staleness_mean"] = sum(k * h for k, h in enumerate(hist)) / rows
            out["row_staleness_max"] = top_vals[-1]
        out["lr"] = float(self.optimizer.param_groups[0]["lr"])
        out["version"] = float(self._version)
        return out

    @register(EVERY_RANK_GIVES_RANK_ZEROS)
    @computing
    def export_weights(self, dtype: str | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, state_dict)`` for ``RolloutWorker.update_weights`` through the object store:
        detached CPU copies, floating tensors cast to `dtype` when given (e.g. the rollout's
        ``"bfloat16"``, halving the bytes moved). See also ``stage_weights`` (local/collective).
        Every rank runs it (FSDP2 shards are gathered one tensor at a time); rank 0's copy is the result."""
        dt = getattr(torch, dtype) if dtype is not None else None
        with torch.no_grad():
            out = {k: _cast(v, dt, "cpu") for k, v in self._full_state() if self.rank == 0}
        return self._version, out

    @register(EVERY_RANK_GIVES_RANK_ZEROS)
    def export_adapter(self, dtype: str | None = None) -> LoraDelta:
        """The current version as its LoRA factors only (:class:`~asyncrl.roles.modeling.lora.LoraDelta`), for
        ``RolloutWorker.update_weights`` of an HF rollout that merges them into its copy of the base
        (``trainer.weight_sync=adapter``); `dtype`: the rollout's weight dtype (its base is checked in it)."""
        if not self._lora:
            raise RuntimeError("PolicyWorker.export_adapter needs LoRA (actor.lora.rank > 0); sync the whole "
                               "weights with stage_weights/export_weights")
        return adapter_delta(self.model, self._version, self._base_digest(dtype), self.engine.gather_by_unit)

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def get_version(self) -> int:
        """Number of updates applied."""
        return self._version

    # ---- weight transports: the registered face of self.weights (roles/weights/transfer.py) ----

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{name: (shape, dtype)}`` of the weights as they would be exported."""
        return self.weights.spec()

    @register(STAGE)
    @computing  # the copy (cast) is compute: with num_threads="follow" it takes the cores left idle
    def stage_weights(self, transport: Literal["local", "collective", "object_store"] = "local",
                      dtype: str | None = None, keep: int = 4) -> WeightHandle | None:
        """Snapshot the current version and return its :class:`~asyncrl.roles.weights.transfer.WeightHandle`
        (every rank takes part; the call resolves to rank 0's handle).

        ``local``/``collective``: on this worker's device; `dtype` casts floating tensors (e.g. the
        rollout's ``bfloat16``; a collective channel uses the dtypes the rollout announced when it
        opened). The `keep` newest snapshots are kept; older ones are dropped (a handle to a dropped
        version is refused). ``object_store``: put into Ray's object store (the handle holds the
        reference, `keep` does not apply). See ``WeightSource.stage``."""
        return self.weights.stage(transport, dtype, keep)

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def channel_member(self) -> dict[str, Any]:
        """This rank's process/device (``member_info``) and a free port to serve a channel's rendezvous."""
        return self.weights.member()

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO, concurrent=True)
    async def join_weight_channel(self, name: str, host: str, port: int, world_size: int, backend: str,
                                  layout: list[tuple[str, tuple[int, ...], str]], timeout_s: float = 120.0,
                                  bucket_bytes: int = 256 << 20, tied: Mapping[str, str] | None = None
                                  ) -> dict[str, Any]:
        """Join channel `name` as its rank 0 (the sender); `layout` is the rollout's weight layout
        (names must match this model's; floating dtypes may differ and are cast when staging), less
        the names in `tied` (the rollout's tied weights: sent once, under the name they are tied to)."""
        return await self.weights.join_channel(name, host, port, world_size, backend, layout, timeout_s,
                                               bucket_bytes, tied)

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO, concurrent=True)
    async def send_weights(self, handle: WeightHandle) -> dict[str, Any]:
        """Send the staged version `handle` over the open channel (the rollout ranks receive it in
        ``update_weights(handle)`` at the same time). Runs beside training: the snapshot is immutable."""
        return await self.weights.send(handle)

    def close_weight_channel(self) -> None:
        """Drop the channel and the staged snapshots (called on close)."""
        self.weights.close()

    def on_close(self) -> None:
        """Drop the weight channel and the staged snapshots, and this worker's busy mark."""
        self.weights.close()
        release_core_share(self)


def _log_probs(model: torch.nn.Module, batch: TensorDictBase, micro: int, temperature: float, key: str,
               with_entropy: bool, who: str, placement: Placement | None = None,
               max_tokens: tuple[int | None, str] = (None, ""), dp: DataParallel | None = None) -> TensorDict:
    """``TD{key [B, R], entropy [B, R]}`` in the batch's row order and width (0 where masked), computed
    in micro-batches (`max_tokens`: the token budget and the key that names it)."""
    require(batch, ["input_ids", "attention_mask", "response_ids", "response_mask"], who)
    was_training = model.training
    model.eval()
    shape = batch["response_ids"].shape
    out = {key: torch.zeros(shape)} | ({"entropy": torch.zeros(shape)} if with_entropy else {})
    try:
        with torch.no_grad():
            for rows, b in split_micro_batches(batch, micro, max_tokens[0], dp, max_tokens[1]):
                lp, ent = response_log_probs(model, b["input_ids"], b["attention_mask"], b["response_ids"],
                                             temperature, with_entropy, placement=placement)
                m = b["response_mask"].to(device=lp.device, dtype=lp.dtype)
                out[key][rows, :lp.shape[1]] = (lp * m).cpu()
                if ent is not None:
                    out["entropy"][rows, :lp.shape[1]] = (ent * m).cpu()
    finally:
        model.train(was_training)
    return TensorDict(out, batch_size=batch.batch_size[:1])


class ReferenceWorker(Worker):
    """The frozen reference policy: log-probs for the KL penalty.

    Args:
        model: the reference model (usually the policy's initial config).
        micro_batch_size: rows per forward.
        temperature: logit temperature (match the policy's).
        max_tokens_per_micro_batch: token budget of a forward instead of `micro_batch_size` rows (as
            ``OptimConfig.max_tokens_per_micro_batch``; the trainer passes the actor's).
    """

    def __init__(self, model: ModelConfig, *, micro_batch_size: int = 16, temperature: float = 1.0,
                 max_tokens_per_micro_batch: int | None = None, strategy: str = "ddp",
                 fsdp_offload: bool = False) -> None:
        set_torch_threads(self.context.num_cpus, model.num_threads)
        self.placement = resolve_placement(model, self.context.num_gpus, trained=False, who="ReferenceWorker")
        built, self.tokenizer = load_model(model)
        placed = place_model(built, self.placement, trained=False, who="ReferenceWorker")
        placed.eval().requires_grad_(False)
        self.core_share = core_share_for(model.num_threads, self.placement.device, placed)
        self.dp = DataParallel(self.rank, self.world_size, self.placement.device)
        self.engine = TrainStrategy(placed, self.placement, self.dp, strategy, offload=fsdp_offload, trainable=False,
                                    who="ReferenceWorker")
        self.model = self.engine.module
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.temperature = temperature

    def on_close(self) -> None:
        """Release this worker's busy mark (``num_threads="follow"``)."""
        release_core_share(self)

    @register(Dispatch.DP_COMPUTE)
    @computing
    def compute_ref_log_prob(self, batch: TensorDictBase) -> TensorDict:
        """``TD{ref_log_probs [B, R]}`` (0 where masked)."""
        return _log_probs(self.model, batch, self.micro_batch_size, self.temperature, "ref_log_probs",
                          with_entropy=False, who="ReferenceWorker.compute_ref_log_prob", placement=self.placement,
                          max_tokens=(self.max_tokens_per_micro_batch, "actor.max_tokens_per_micro_batch"))

    @register(EVERY_RANK_GIVES_RANK_ZEROS)
    def weights_checksum(self) -> dict[str, str]:
        """``{name: checksum}`` of the (frozen) weights."""
        whole = self.engine.full_tensors(self.model.state_dict())
        return {k: tensor_checksum(v) for k, v in whole if self.rank == 0}
