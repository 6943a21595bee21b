"""LoRA adapters on the trained policy, through ``peft``.

::

    base model (loaded, placed) --get_peft_model--> PeftModel: base frozen, lora_A/lora_B trainable
        update():               only the adapter's parameters get gradients and optimizer state
        compute_ref_log_prob(): the same model under ``disable_adapter()`` = the base model (no reference worker)
        export (rollout, checksums, checkpoint's model.safetensors): MergedWeights, under the base model's
            names, W + scaling * B @ A per adapted layer, computed beside the live model (never merged into it);
            under FSDP2 read one unit at a time while the unit is gathered (TrainStrategy.by_unit)
        checkpoint: the adapter (peft's adapter_model.safetensors + adapter_config.json) and the optimizer
            (fsdp2: the adapters and their optimizer state in torch.distributed.checkpoint shards); the base
            is rebuilt from the model config on resume (its digest is checked)
        adapter sync (``trainer.weight_sync=adapter``): only the factors travel (adapter_delta() -> LoraDelta);
            the HF rollout keeps a copy of the base weights of the adapted layers and merges each version
            into it (merge_delta()), the same W + scaling * B @ A: bit for bit the full sync's in float32;
            the vLLM rollout serves them as a LoRA adapter (save_adapter() -> a LoRARequest) on its base

``peft`` is imported only when a role trains with ``lora.rank > 0``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterator, Mapping

import torch
from torch import nn

from asyncrl.roles.fields import Range, Section, check_bounds
from asyncrl.roles.modeling.models import tensor_checksum
from asyncrl.roles.modeling.strategy import full_tensor

__all__ = ["LoraConfig", "LoraDelta", "MergedWeights", "adapter_delta", "apply_lora", "base_digest", "check_targets",
           "digest", "linear_layer_names", "merge_delta", "merged_state", "save_adapter"]


@dataclass(kw_only=True)
class LoraConfig(Section):
    """Low-rank adapters on the policy (``actor.lora``; peft's ``LoraConfig``): only the adapters train, the
    reference is the base model (the adapter disabled) and the rollout gets the merged weights."""

    rank: Annotated[int, Range(ge=0, le=1 << 16)] = 0
    """Rank r of each adapter (peft's ``r``); 0: no LoRA, the whole model trains."""
    alpha: Annotated[float, Range(gt=0)] = 16.0
    """Scale numerator (peft's ``lora_alpha``): an adapter adds ``alpha / rank * B @ A`` to its layer's weight."""
    target_modules: str | list[str] = "all-linear"
    """The linear layers to adapt: ``"all-linear"`` (every linear layer of the decoder, not the LM head), or
    module names matched as peft does (a full name or its last parts: ``["q_proj", "v_proj"]``)."""

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (``rank > 0``)."""
        return self.rank > 0

    def validate(self) -> None:
        """Raise ValueError naming the ``lora.*`` field that no adapter can be built with."""
        check_bounds(self, "lora")
        t = self.target_modules
        if isinstance(t, str):
            if t != "all-linear":
                raise ValueError(f"lora.target_modules must be 'all-linear' or a list of module names, got {t!r} "
                                 f"(a single name: [{t!r}])")
        elif not t or not all(isinstance(n, str) and n for n in t):
            raise ValueError(f"lora.target_modules must be 'all-linear' or a non-empty list of module names, got {t!r}")


def _output_layer(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def linear_layer_names(model: nn.Module) -> list[str]:
    """The full names of `model`'s ``nn.Linear`` layers, the LM head excluded (what ``all-linear`` adapts)."""
    head = _output_layer(model)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # peft's rule for a list of names


def check_targets(model: nn.Module, cfg: LoraConfig, key: str = "actor.lora.target_modules") -> None:
    """Raise ValueError when a name of ``cfg.target_modules`` matches none of `model`'s linear layers (the LM
    head excluded), listing the layer names it could take."""
    names = linear_layer_names(model)
    if cfg.target_modules == "all-linear":
        if not names:
            raise ValueError(f"{key}='all-linear': {type(model).__name__} has no linear layer besides the LM head")
        return
    unmatched = [t for t in cfg.target_modules if not any(_matches(n, t) for n in names)]
    if unmatched:
        short = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(f"{key}: {unmatched} match no linear layer of {type(model).__name__}; its linear layers "
                         f"are {short} (e.g. {names[0]!r}); set {key} to some of them, or 'all-linear'")


def apply_lora(model: nn.Module, cfg: LoraConfig, who: str = "PolicyWorker") -> nn.Module:
    """`model` wrapped in a peft ``PeftModel`` with adapters on ``cfg.target_modules``: the base's parameters
    frozen, the adapters' trainable (B starts at zero: the wrapped model computes what `model` did). The
    adapters' A is drawn from torch's global RNG: seed it alike on every rank."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError:
        raise ImportError(f"{who}: actor.lora.rank > 0 needs the peft package: pip install 'asyncrl[lora]'") from None
    check_targets(model, cfg)
    targets = cfg.target_modules
    if targets == "all-linear":  # peft's "all-linear" also skips the LM head; a list keeps it explicit
        targets = sorted({n.rsplit(".", 1)[-1] for n in linear_layer_names(model)})
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=targets, lora_dropout=0.0,
                              bias="none", task_type="CAUSAL_LM")
    import warnings

    with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for the user to do
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, peft_cfg)


def _lora_layers(peft_model: nn.Module) -> dict[str, Any]:
    """``{name in the base model: peft LoraLayer}``."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()  # type: ignore[operator]
    return {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}


def _owners(path: str, layers: Mapping[str, Any]) -> list[str]:
    """The adapted layers whose sub-module `path` is (at most one)."""
    parts = path.split(".")
    return [p for i in range(len(parts), 0, -1) if (p := ".".join(parts[:i])) in layers]


class MergedWeights:
    """The weights a peft model computes with, under the base model's ``state_dict`` names, read one name at a time
    from the modules' current tensors: an adapted layer's weight is ``W + scaling * B @ A`` (peft's
    ``get_delta_weight``, what ``merge_and_unload`` adds), a new tensor; every other name is the module's own
    (detached) tensor, tied names one tensor. The live model is not changed.

    :attr:`sources` names the tensor of the peft model each name reads (the adapted layers' base weight), so that a
    sharded model can gather the FSDP unit that holds it before :meth:`read` (``TrainStrategy.by_unit``)."""

    def __init__(self, peft_model: nn.Module) -> None:
        self.model = peft_model
        base = peft_model.get_base_model()  # type: ignore[operator]
        prefix = next(n for n, m in peft_model.named_modules() if m is base)
        layers = _lora_layers(peft_model)
        self.sources: dict[str, str] = {}
        """``{base name: the peft model's state name it reads}``, in the base's ``state_dict`` order."""
        self._adapted: dict[str, Any] = {}
        for key in base.state_dict(keep_vars=True):
            path, _, leaf = key.rpartition(".")
            owner = path.removesuffix(".base_layer")
            if path.endswith(".base_layer") and owner in layers:
                name = f"{owner}.{leaf}"
                if leaf == "weight":
                    self._adapted[name] = layers[owner]
            elif _owners(path, layers):
                continue  # an adapter's own parameter (lora_A / lora_B)
            else:
                name = key
            self.sources[name] = f"{prefix}.{key}" if prefix else key

    @property
    def names(self) -> list[str]:
        """The base model's ``state_dict`` names."""
        return list(self.sources)

    def _tensor(self, name: str) -> torch.Tensor:
        path, _, leaf = self.sources[name].rpartition(".")
        return getattr(self.model.get_submodule(path), leaf).detach()

    def read(self, name: str) -> torch.Tensor:
        """The merged tensor of `name` (whole only when the modules hold it whole: under FSDP2, inside its unit's
        gather)."""
        t = self._tensor(name)
        layer = self._adapted.get(name)
        if layer is not None:
            with torch.no_grad():
                for adapter in layer.active_adapters:
                    t = t + layer.get_delta_weight(adapter)
        return t

    def layout(self) -> dict[str, torch.Tensor]:
        """``{base name: the tensor it reads, unmerged}``: the names, shapes, dtypes and ties of the merged weights
        without computing them (under FSDP2, shards: a DTensor's shape is the whole tensor's)."""
        return {n: self._tensor(n) for n in self.sources}


def merged_state(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights the adapted model computes with, under the base model's ``state_dict`` names
    (:class:`MergedWeights`, every name read); the live model is not changed. Needs whole tensors (not FSDP2 shards)."""
    view = MergedWeights(peft_model)
    return {n: view.read(n) for n in view.names}


@dataclass(frozen=True)
class LoraDelta:
    """A policy version as its LoRA factors alone: what an adapter sync moves instead of the whole weights."""

    version: int
    """The policy version."""
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float, bool]]
    """``{base weight name: (A [r, in], B [out, r], scaling, fan_in_fan_out)}``, A and B in float32 on the CPU."""
    base_digest: str
    """:func:`digest` of the base weights under those names, in the rollout's dtype: the rollout checks that the
    base it merges into is the policy's."""

    @property
    def nbytes(self) -> int:
        """Bytes of the factors (what travels)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b, _, _ in self.factors.values())


def digest(named: Mapping[str, torch.Tensor]) -> str:
    """A sha256 over the names and the exact bytes of `named` (in name order)."""
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(f"{name}:{tensor_checksum(named[name])};".encode())
    return h.hexdigest()[:16]


def base_digest(peft_model: nn.Module, dtype: torch.dtype | None = None) -> str:
    """:func:`digest` of the frozen base weights of the adapted layers, under the base names (in `dtype` when
    given): what a resume (the base rebuilt from the config) and an adapter sync's rollout check their base by.
    FSDP2 shards are gathered one weight at a time: every rank must call it."""
    base = {}
    with torch.no_grad():
        for owner, layer in _lora_layers(peft_model).items():
            w = full_tensor(layer.get_base_layer().weight.detach())  # FSDP2: gathered, one weight at a time
            base[f"{owner}.weight"] = w if dtype is None or not w.is_floating_point() else w.to(dtype)
    return digest(base)


def adapter_delta(peft_model: nn.Module, version: int, base: str,
                  gather: Callable[[Mapping[str, torch.Tensor]], Iterator[dict[str, torch.Tensor]]] | None = None
                  ) -> LoraDelta:
    """`peft_model`'s current adapters as a :class:`LoraDelta` of `version`; `base`: its :func:`base_digest` in the
    rollout's dtype (computed once: the base never changes). `gather`: ``{state-dict name: parameter}`` to its whole
    tensors in groups (``TrainStrategy.gather_by_unit``: under FSDP2 one all-gather per unit of the unit's factors;
    every rank must call it); None: each factor alone (an FSDP2 shard gathered one tensor at a time)."""
    names = {id(p): n for n, p in peft_model.named_parameters()}
    owners: dict[str, tuple[str, str, float, bool]] = {}  # base weight name -> (A's name, B's name, scaling, fan)
    params: dict[str, torch.Tensor] = {}
    for owner, layer in _lora_layers(peft_model).items():
        (adapter,) = layer.active_adapters
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        params[names[id(a)]], params[names[id(b)]] = a, b
        owners[f"{owner}.weight"] = (names[id(a)], names[id(b)], float(layer.scaling[adapter]),
                                     bool(getattr(layer, "fan_in_fan_out", False)))
    whole: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        groups = gather(params) if gather is not None else ({n: full_tensor(p)} for n, p in params.items())
        for group in groups:
            whole.update({n: t.detach().to("cpu", torch.float32, copy=True) for n, t in group.items()})
    factors = {name: (whole[a], whole[b], scaling, fan) for name, (a, b, scaling, fan) in owners.items()}
    return LoraDelta(version=version, factors=factors, base_digest=base)


def merge_delta(base: Mapping[str, torch.Tensor], delta: LoraDelta) -> dict[str, torch.Tensor]:
    """``{name: base[name] + scaling * B @ A}`` for each adapted weight of `delta`, new tensors in the base's dtype
    and device (computed in float32: in float32 bit for bit what peft's merge gives)."""
    out = {}
    with torch.no_grad():
        for name, (a, b, scaling, fan_in_fan_out) in delta.factors.items():
            w = base[name]
            d = b.to(w.device) @ a.to(w.device)
            d = (d.T if fan_in_fan_out else d) * scaling
            out[name] = (w if w.dtype == torch.float32 else w.float()).add(d).to(w.dtype)
    return out


def save_adapter(delta: LoraDelta, path: str) -> str:
    """Write `delta` into directory `path` as a peft LoRA adapter (``adapter_config.json``,
    ``adapter_model.safetensors``: what ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` read); returns
    `path`. Every adapted weight must share one rank and one scaling (as ``actor.lora`` makes them)."""
    import json
    import os

    from safetensors.torch import save_file

    shapes = {(a.shape[0], scaling) for a, _, scaling, _ in delta.factors.values()}
    fan = {f for *_, f in delta.factors.values()}
    if len(shapes) != 1 or len(fan) != 1:
        raise ValueError(f"the adapter of version {delta.version} mixes ranks/scalings {sorted(shapes)}: a peft "
                         "adapter file holds one")
    ((rank, scaling),), (fan_in_fan_out,) = shapes, fan
    tensors: dict[str, torch.Tensor] = {}
    for name, (a, b, _, _) in delta.factors.items():
        module = name.removesuffix(".weight")
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    alpha = scaling * rank
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank),
              "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
              "target_modules": sorted({n.removesuffix(".weight").rsplit(".", 1)[-1] for n in delta.factors}),
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": fan_in_fan_out, "use_rslora": False,
              "use_dora": False, "modules_to_save": None, "init_lora_weights": True}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path
