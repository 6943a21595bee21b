"""The twin's simulated workers: training ranks that sleep a cost model, a free reward, and the role specs.

* :class:`TwinPolicy` stands in for ``PolicyWorker``: ``compute_log_prob`` and ``update`` sleep what a GPU rank
  of the profile would spend on its shard of the batch (forward ``2 * params * tokens / (peak * mfu)``, backward
  twice that, the optimizer ``params * bytes / (ranks * bandwidth)``), times ``twin.time_scale``;
  ``export_weights`` sleeps the profile's gather-and-publish time and returns a **stand-in**: the tiny model's
  real weights (a few hundred KB, what the rollout workers check and load), not the profile's
  ``model.weight_gb``. With ``devices.kind=shared`` each of these costs is burned as CPU work on the rank's
  shared cores instead of slept (:class:`~asyncrl.roles.engines.sim.Burner`), so it contends with the rest of the
  run as a CPU worker's would. Its transfer through Ray's object store is real and timed; the time the real bytes
  would take is slept by each replica's engine when it loads them (``weight_gb / weight_pull_gb_per_s +
  weight_gb / weight_load_gb_per_s``, scaled). Its checkpoints hold the version only.
* :class:`TwinReward` scores a response without decoding it (a stand-in for a rule reward: its cost is a
  CPU's, not a GPU's): 1 when the sum of its ids is even, seeded.
* :func:`twin_roles` puts them, and the real ``RolloutWorker`` on the cost-model engine, into a run's roles.

Tokens: a batch carries ids; each response id stands for ``tokens_per_id`` simulated tokens and each prompt
for ``lengths.prompt_tokens`` (:func:`batch_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from asyncrl import Dispatch, Execute, Worker, register
from asyncrl.pipelines.twin.profile import Profile, TwinConfig, engine_kwargs, load_profile, max_new_ids, tokens_per_id
from asyncrl.roles.engines.sim import Burner
from asyncrl.roles.scoring.reward import scored
from asyncrl.roles.modeling.models import load_model

__all__ = ["TwinPolicy", "TwinReward", "twin_roles", "twin_rollout", "batch_tokens", "train_costs"]


def batch_tokens(batch: TensorDictBase, prompt_tokens: int, per_id: int) -> float:
    """Simulated tokens of `batch`: each row's prompt (`prompt_tokens`) plus its response ids times `per_id`."""
    rows = int(batch["response_mask"].shape[0])
    return float(rows * prompt_tokens + int(batch["response_mask"].sum()) * per_id)


def train_costs(profile: Profile, tokens: float, ranks: int) -> dict[str, float]:
    """Seconds (unscaled) one rank spends on `tokens` of its shard: ``forward``, ``backward`` and the ``optimizer``
    step of its share of the parameters (``ranks`` ranks)."""
    t = profile.training
    params = profile.model.params_b * 1e9
    flops_s = t.peak_tflops * 1e12 * t.mfu
    forward = 2 * params * tokens / flops_s
    return {"forward": forward, "backward": 2 * forward,
            "optimizer": params * t.optimizer_bytes_per_param / (ranks * t.hbm_gb_per_s * 1e9)}


class TwinPolicy(Worker):
    """A simulated training rank (module docstring); the constructor takes ``PolicyWorker``'s arguments.

    Args:
        model: the (tiny) model whose real weights are the stand-in a version exports.
        actor: the actor config (unused: the costs follow the profile).
        max_staleness: unused.
        profile: the cost profile.
        twin: the twin's settings (time scale, tokens per id).
    """

    def __init__(self, model: Any, actor: Any = None, *, max_staleness: int = 0, profile: Profile,
                 twin: TwinConfig) -> None:
        self.model_config = model
        self.profile = profile
        self.scale = twin.time_scale
        self.per_id = tokens_per_id(profile, twin)
        self.version = 0
        self._weights: dict[str, torch.Tensor] | None = None
        self.slept_s = 0.0
        """Seconds slept (or burned) so far (scaled): what the GPU work would have taken times ``time_scale``."""
        d = profile.devices
        self.burner = Burner(d.threads, d.work_per_s) if d.shared else None
        """Shared devices: what burns the costs (None: they are slept)."""

    def _tokens(self, batch: TensorDictBase) -> float:
        return batch_tokens(batch, self.profile.lengths.prompt_tokens, self.per_id)

    async def _sleep(self, seconds: float) -> None:
        s = seconds * self.scale
        self.slept_s += s
        if s > 0 and self.burner is not None:
            await asyncio.to_thread(self.burner.burn, s)
        elif s > 0:
            await asyncio.sleep(s)

    @register(Dispatch.DP_COMPUTE)
    async def compute_log_prob(self, batch: TensorDictBase) -> TensorDict:
        """``TD{old_log_probs, entropy}`` after a forward pass's time: the rollout's own log-probs (the twin's
        policy is the rollout's, so every importance weight is 1)."""
        await self._sleep(train_costs(self.profile, self._tokens(batch), self.world_size)["forward"])
        return TensorDict({"old_log_probs": batch["rollout_log_probs"].clone(),
                           "entropy": torch.zeros(batch["response_mask"].shape)}, batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE_METRIC)
    async def update(self, batch: TensorDictBase) -> dict[str, float]:
        """One update after its time (forward, backward and the optimizer step of this rank's share); the version
        goes up by one. Metrics: ``tokens`` (simulated, this rank's shard), ``rows``, ``gpu_s`` (unscaled)."""
        tokens = self._tokens(batch)
        c = train_costs(self.profile, tokens, self.world_size)
        gpu_s = c["forward"] + c["backward"] + c["optimizer"]
        await self._sleep(gpu_s)
        self.version += 1
        return {"pg_loss": 0.0, "tokens": tokens, "rows": float(batch["response_mask"].shape[0]), "gpu_s": gpu_s}

    def _stand_in(self) -> dict[str, torch.Tensor]:
        if self._weights is None:
            built, _ = load_model(self.model_config)
            self._weights = {k: v.detach().clone() for k, v in built.state_dict().items()}
        return self._weights

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    async def export_weights(self, dtype: str | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, stand-in weights)`` after the profile's gather-and-publish time (module docstring)."""
        t = self.profile.training
        await self._sleep(self.profile.model.weight_gb / t.export_gb_per_s)
        return self.version, self._stand_in()

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def get_version(self) -> int:
        """Number of updates applied."""
        return self.version

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def weights_checksum(self) -> dict[str, str]:
        """One pseudo-checksum: the version (the stand-in weights never change)."""
        return {"twin/version": str(self.version)}

    @register(Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> str:
        """Write the version to ``path/meta.json`` (rank 0); a simulated rank has no other state."""
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "meta.json"), "w") as f:
                json.dump({"format": "twin", "version": self.version}, f)
        return path

    @register(Dispatch.ONE_TO_ALL)
    def load(self, path: str) -> int:
        """Read the version :meth:`save` wrote."""
        with open(os.path.join(path, "meta.json")) as f:
            self.version = int(json.load(f)["version"])
        return self.version


class TwinReward(Worker):
    """A free stand-in for a rule reward (module docstring); takes the reward config and the seed."""

    def __init__(self, reward: Any = None, *, seed: int = 0) -> None:
        self.seed = seed

    @register(Dispatch.DP_COMPUTE)
    def compute_reward(self, batch: TensorDictBase) -> TensorDict:
        ids = batch["response_ids"] * batch["response_mask"]
        scores = ((ids.sum(-1) + self.seed) % 2).float()
        return scored(batch, scores)


def twin_rollout(job: Any, rollout: Any) -> Any:
    """`rollout` (the run's ``RolloutConfig``) on the cost-model engine of ``job.twin``'s profile: ``engine=sim``,
    its costs, the response cap in ids; loads land at the next engine step (``round_steps`` 1), or at the
    running round's end when the profile's requests join at round ends (``rollout.join_round_steps``)."""
    tw = job.twin
    profile = load_profile(str(tw.profile))
    kwargs = {**engine_kwargs(profile, tw), "round_steps": profile.rollout.join_round_steps or 1}
    return replace(rollout, engine="sim", engine_kwargs=kwargs, max_new_tokens=max_new_ids(profile, tw),
                   model_dir=rollout.model_dir or "unused-by-the-sim-engine")


def twin_roles(job: Any, rollout_roles: dict[str, Any], train_roles: dict[str, Any]) -> None:
    """Make the roles of `job` (a ``JobConfig`` with ``twin.profile`` set) the twin's, in place: :class:`TwinReward`
    and :class:`TwinPolicy` (the rollout worker is the real one; its config is :func:`twin_rollout`'s)."""
    tw = job.twin
    profile = load_profile(str(tw.profile))
    rollout_roles["reward"] = (TwinReward, (job.reward,), {"seed": tw.seed})
    _, args, kwargs = train_roles["policy"]
    train_roles["policy"] = (TwinPolicy, args, {**kwargs, "profile": profile, "twin": tw})
