"""The generation-engine interface shared by the HF and vLLM engines, and their registry.

An engine turns token-id prompts into completions: token ids, the log-prob of each
sampled token, and why it stopped. ``log_probs`` are those of the distribution each token
was actually sampled from -- ``log_softmax(logits / temperature)`` after top-k/top-p
filtering (renormalised) -- because off-policy correction divides by them (they are the
behaviour policy). Without top-k/top-p they equal the policy's recomputed log-probs at the
same temperature; with them, the policy (which is unfiltered) differs on purpose, and the
importance weights account for it.
Engines are picked by name with :func:`make_engine`; add one with :func:`register_engine`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Protocol, runtime_checkable

import torch

from asyncrl.roles.registry import Registry

__all__ = ["SamplingParams", "Completion", "fail_requests", "GenerationEngine", "make_engine", "register_engine", "engine_names",
           "engine_options", "partial_rollout_modes"]


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample one call's completions."""

    max_new_tokens: int
    """Most tokens generated per prompt (EOS included)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = -1
    """Sample among the k most likely tokens (-1 = off)."""
    seed: int | None = None
    """Seed of the call: prompt i samples with seed ``seed + i`` (reproducible whatever the batching);
    None draws from the engine's own generator."""


@dataclass
class Completion:
    """One prompt's generated tokens."""

    response_ids: list[int]
    """Generated token ids (EOS included when generation stopped on it)."""
    log_probs: list[float]
    """Log-prob of each generated token under the distribution it was sampled from (tempered, top-k/top-p
    filtered; same length as response_ids)."""
    finish_reason: str
    """``"stop"`` (EOS) or ``"length"`` (max_new_tokens reached)."""


def fail_requests(requests: Iterable[Any], error: BaseException) -> int:
    """Fail every request of `requests` (objects with a ``future``) that is still pending with `error`;
    returns how many. The request-level engines use it when a weight load failed mid-generation."""
    n = 0
    for r in requests:
        if not r.future.done():
            r.future.set_exception(error)
            n += 1
    return n


@runtime_checkable
class GenerationEngine(Protocol):
    """What the rollout worker needs from an inference engine."""

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions of every prompt, in prompt order."""
        ...

    def stream(self, prompts: list[list[int]], params: SamplingParams) -> AsyncIterator[tuple[int, Completion]]:
        """``(prompt index, completion)`` as each finishes."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the model's weights (names as in the policy's ``state_dict``)."""
        ...

    def weights_checksum(self) -> dict[str, str]:
        """``{name: checksum}`` of the loaded weights (see ``roles.models.tensor_checksum``)."""
        ...

    def close(self) -> None:
        """Release the engine's resources."""
        ...


EngineFactory = Callable[..., GenerationEngine]
_ENGINES: Registry[EngineFactory] = Registry(
    "generation engine", how_to_register="Register one with @asyncrl.roles.engines.register_engine(name)")
"""The engines by name; the package (``asyncrl.roles.engines``) names the modules of the built-in ones, imported
on first use (vLLM's only when asked for)."""


def register_engine(name: str, *, replace: bool = False) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator: make an engine class or factory available to :func:`make_engine` as `name`.

    The factory is called as ``factory(model=..., tokenizer=..., model_dir=..., **kwargs)``.
    """
    return _ENGINES.decorator(name, replace=replace)


def engine_names() -> list[str]:
    """Names :func:`make_engine` accepts."""
    return _ENGINES.names()


def engine_options(name: str) -> list[str] | None:
    """The keyword options (``RolloutConfig.engine_kwargs``) the engine registered as `name` takes besides
    ``model``, ``tokenizer`` and ``model_dir``, read from its signature; None when it takes any
    (``**kwargs``), when its signature cannot be read, or when no engine has that name."""
    factory = _ENGINES.find(name)
    if factory is None:
        return None
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return sorted(n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and n not in ("model", "tokenizer", "model_dir"))


def partial_rollout_modes(name: str) -> tuple[str, ...] | None:
    """The partial-rollout modes (``"keep"``, ``"recompute"``) the engine registered as `name` supports:
    the ``partial_rollout_modes`` attribute of its class or factory (none when absent); None when no
    engine of that name is registered (yet)."""
    factory = _ENGINES.find(name)
    if factory is None:
        return None
    return tuple(getattr(factory, "partial_rollout_modes", ()))


def make_engine(name: str, *, model: Any, tokenizer: Any, model_dir: str | None, **kwargs: Any) -> GenerationEngine:
    """Build the engine registered as `name` (``"hf"``, ``"vllm"`` or your own).

    `model` is the in-process torch model (the HF engine runs it), `model_dir` a
    Hugging Face directory holding the same weights (the vLLM engine loads it).
    """
    factory = _ENGINES.get(name)
    return factory(model=model, tokenizer=tokenizer, model_dir=model_dir, **kwargs)
