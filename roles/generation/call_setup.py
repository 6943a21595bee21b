"""What a rollout worker's two ways of generating share at the start and end of a call: :class:`CallSetup`, the
object a :class:`~asyncrl.roles.generation.rollout.RolloutWorker` holds as ``self.call_setup`` and gives its
:class:`~asyncrl.roles.generation.rollout_requests.RequestGeneration`.

Batch generation (``generate``, ``stream_generate``, ``submit``) and request-level generation (episodes,
``generate_requests``) both take a call's prompts out of its batch with the same checks (the worker is awake and
holds usable weights; each prompt plus ``max_new_tokens`` fits the model's context, never truncated), derive its
sampling parameters the same way (from the config, the call's seed, the weight version and the prompts) and mark
the rows they return with this replica. The gate a call waits at while weights change is the
:class:`~asyncrl.roles.generation.rollout_weights.RolloutWeights`' (``weights.gate()``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDictBase

from asyncrl.roles._util import require
from asyncrl.roles.engines import SamplingParams
from asyncrl.roles.errors import PromptTooLongError

if TYPE_CHECKING:
    from asyncrl.roles.generation.rollout_config import RolloutConfig
    from asyncrl.roles.generation.rollout_weights import RolloutWeights

__all__ = ["CallSetup"]


@dataclass(frozen=True)
class CallSetup:
    """The prompt check, sampling parameters and replica field of a rollout worker's generate calls, batch and
    request-level alike (module docstring).

    Args:
        config: the rollout's settings (the sampling defaults and the seed).
        weights: the worker's :class:`~asyncrl.roles.generation.rollout_weights.RolloutWeights` (asleep, usable
            weights, the version a call's seed derives from).
        rank: the rollout rank (the ``replica`` field; named in errors).
        context_length: the model's context (what a prompt plus ``max_new_tokens`` must fit).
    """

    config: RolloutConfig
    weights: RolloutWeights
    rank: int
    context_length: int

    def check_weights(self) -> None:
        """Raise while the engine holds no usable weights (a level-2 sleep discarded them, or a load failed
        part-way)."""
        if self.weights.needs_weights:
            raise RuntimeError(f"rollout rank {self.rank} has no usable weights (it discarded its weights in "
                               "sleep(level=2), or a weight load failed part-way); sync weights (update_weights, after "
                               "wake_up() if asleep) before generating")

    def prompts(self, batch: TensorDictBase, max_new_tokens: int) -> list[list[int]]:
        """The prompts of `batch` (``prompt_ids`` without the ``prompt_mask`` padding), once the worker is awake
        with usable weights and each prompt plus `max_new_tokens` fits the context."""
        if self.weights.asleep:
            raise RuntimeError(f"rollout rank {self.rank} is asleep (level {self.weights.asleep}); call wake_up() "
                               "before generating")
        self.check_weights()
        require(batch, ["prompt_ids", "prompt_mask"], "RolloutWorker.generate")
        ids, mask = batch["prompt_ids"], batch["prompt_mask"]
        prompts = [ids[b][mask[b].bool()].tolist() for b in range(ids.shape[0])]
        for b, p in enumerate(prompts):
            if not p:
                raise ValueError(f"row {b} has an empty prompt (prompt_mask is all 0)")
            if len(p) + max_new_tokens > self.context_length:
                raise PromptTooLongError(
                    f"row {b}: prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                    f"context of {self.context_length} positions; shorten or filter prompts longer than "
                    f"{self.context_length - max_new_tokens} tokens, lower max_new_tokens, or use a model with a "
                    "longer context (prompts are never truncated silently)"
                )
        return prompts

    def params(self, prompts: list[list[int]], max_new_tokens: int | None, temperature: float | None,
               seed: int | None) -> SamplingParams:
        """A call's sampling parameters: `max_new_tokens` and `temperature` override the config's; the seed
        derives from the config's seed, `seed`, the weight version and `prompts`."""
        c = self.config
        h = hashlib.sha256(f"{c.seed}|{seed}|{self.weights.version}|".encode())
        for p in prompts:
            h.update(torch.tensor(p, dtype=torch.int64).numpy().tobytes() + b"|")
        return SamplingParams(
            max_new_tokens=max_new_tokens if max_new_tokens is not None else c.max_new_tokens,
            temperature=temperature if temperature is not None else c.temperature,
            top_p=c.top_p, top_k=c.top_k, seed=int.from_bytes(h.digest()[:4], "little") & 0x3FFFFFFF,
        )

    def replica_field(self, n: int) -> torch.Tensor:
        """``replica`` of `n` rows: this rank, the replica that returned them (the run journal's per-sample
        ledger records it)."""
        return torch.full((n,), self.rank, dtype=torch.long)
