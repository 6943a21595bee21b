"""The stages of one RL step, each a group call that returns a `GroupFuture`.

A stage function issues its call and returns at once; the future it returns is
passed into the next stage, so the batch flows worker to worker and the controller
holds only descriptors. The controller awaits small things: reward scores, update
metrics, weight-sync receipts. The canonical order of one batch::

    generate ─► score ─► old_log_prob ─► ref_log_prob ─► values ─► advantages
                         (skipped under rollout_correction.bypass_mode)
      (rollout pool)       (training pool ..................................)
          ─► critic_update ─► actor_update ─► export_weights ─► load_weights
                                                              (rollout pool)

``advantages`` runs on a small pipelines-owned :class:`AdvantageWorker` colocated with
the policy: it merges the stage outputs into the training batch and applies the pure
functions of ``asyncrl.roles.functional`` (GRPO group normalisation, or GAE), so no
advantage math and no batch bytes touch the controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from tensordict import TensorDict, TensorDictBase

from asyncrl import Broadcast, Dispatch, DispatchMode, Execute, GroupFuture, Worker, WorkerGroup, register
from asyncrl.dispatch import Sharded, World, collect_dp
from asyncrl.errors import DispatchError
from asyncrl.roles import functional as F
from asyncrl.pipelines.journaling.ledger import row_facts
from asyncrl.pipelines.observe.samples import pick_rows, trajectory_rows
from asyncrl.pipelines.loop.stream_batch import concat_groups, version_stats
from asyncrl.roles import PolicyWorker
from asyncrl.roles.modeling.parallel import DataParallel

__all__ = [
    "AdvantageWorker",
    "Groups",
    "SHARDS",
    "concat_sharded",
    "generate",
    "score",
    "old_log_prob",
    "ref_log_prob",
    "values",
    "advantages",
    "critic_update",
    "actor_update",
    "export_weights",
    "load_weights",
    "sample_trajectories",
]


@dataclass
class Groups:
    """The worker groups one trainer drives (colocated or in two pools)."""

    rollout: WorkerGroup[Any]
    """RolloutWorker group (rollout pool)."""
    reward: WorkerGroup[Any]
    """RewardWorker group (rollout pool)."""
    policy: WorkerGroup[Any]
    """PolicyWorker group (training pool)."""
    advantage: WorkerGroup[Any]
    """AdvantageWorker group (training pool)."""
    reference: WorkerGroup[Any] | None = None
    """What serves ``compute_ref_log_prob`` when a KL term needs it: the ReferenceWorker group, or with LoRA the
    policy group itself (its adapters disabled)."""
    critic: WorkerGroup[Any] | None = None
    """CriticWorker group (PPO)."""


def _dispatch_shards(world: World, parts: list[list[Any]], scores: list[list[Any]], *, pad_id: int,
                     uid_base: list[int], width: int) -> Sharded:
    """Rank r gets ``parts[r]``, ``scores[r]`` (its chunk of groups) and ``uid_base[r]``."""
    n = world.world_size
    if not (len(parts) == len(scores) == len(uid_base) == n):
        raise DispatchError(f"concat_shard takes one chunk of groups per rank ({n}), got {len(parts)}, "
                            f"{len(scores)} and {len(uid_base)}")
    return Sharded((list(parts), list(scores)), {"pad_id": [pad_id] * n, "uid_base": list(uid_base),
                                                  "width": [width] * n})


SHARDS = DispatchMode("SHARDS", _dispatch_shards, collect_dp, data_parallel=True)
"""Each rank gets its own arguments (one list per rank, as ``ALL_TO_ALL``) and returns its shard of one batch:
the collected result is their concatenation, and a data-parallel consumer of the same world size reads rank
r's shard on rank r (streaming's step batch, :func:`concat_sharded`)."""


class AdvantageWorker(Worker):
    """Merges the stage outputs of one batch and computes advantages (pure functions).

    With several ranks, whitening (PPO) takes the mean and variance of *every* rank's valid
    tokens: each rank sums its shard's moments and the ranks all-reduce them (gloo), so two
    ranks give the advantages one rank gives for the same batch."""

    _dp: Any = None

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._dp is None:  # created on first use: every rank reaches this call together
            self._dp = DataParallel(self.rank, self.world_size)
        return self._dp.all_reduce(t)

    @register(Dispatch.DP_COMPUTE)
    def compute_advantages(self, batch: TensorDictBase, scores: TensorDictBase,
                           log_probs: TensorDictBase | None = None, ref: TensorDictBase | None = None,
                           values: TensorDictBase | None = None, *, algo: Mapping[str, Any]) -> TensorDict:
        """The training batch: `batch` plus the fields of the other inputs, ``advantages``
        and ``returns``. `algo` holds the :class:`~asyncrl.pipelines.job.config.AlgorithmConfig`
        fields as a dict (workers do not import the trainer's config). `log_probs` None is the
        bypass (``rollout_correction.bypass_mode``): ``old_log_probs`` are the batch's
        ``rollout_log_probs``, the very tensor."""
        out = batch.clone(recurse=False)
        if log_probs is None:
            if "rollout_log_probs" not in batch.keys():
                raise KeyError(f"the old_log_prob bypass takes old_log_probs from the rollout's rollout_log_probs, "
                               f"but the batch has only {sorted(map(str, batch.keys()))}; use a rollout that returns "
                               "them, or rollout_correction.bypass_mode='off'")
            out.set("old_log_probs", batch["rollout_log_probs"])
        for part in (scores, log_probs, ref, values):
            if part is not None:
                out.update(part)
        adv, ret = compute_advantages(out, algo, all_reduce=self._all_reduce)
        out.set("advantages", adv)
        out.set("returns", ret)
        return out

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def concat_groups(self, parts: list[TensorDictBase], scores: list[TensorDictBase | None], *, pad_id: int,
                      uid_base: int) -> TensorDict:
        """Streaming rollout: one step's batch from its finished groups' ``generate`` and ``score``
        results (pass their futures: they are fetched here, worker to worker); see
        :func:`asyncrl.pipelines.loop.stream_batch.concat_groups`."""
        return concat_groups(parts, scores, pad_id=pad_id, uid_base=uid_base)

    @register(SHARDS, summary=row_facts)
    def concat_shard(self, parts: list[TensorDictBase], scores: list[TensorDictBase | None], *, pad_id: int,
                     uid_base: int, width: int) -> TensorDict:
        """Streaming rollout: this rank's shard of one step's batch, the groups of its chunk (their futures,
        fetched here) as :meth:`concat_groups` makes them, prompts padded to the step's `width`; the shards of
        all ranks are one data-parallel batch (call it through :func:`concat_sharded`). Its rows' ledger facts
        (:meth:`ledger_rows`) ride in the call's reply (``GroupFuture.summary``): the journal reads them there,
        without a call of its own to every rank."""
        return concat_groups(parts, scores, pad_id=pad_id, uid_base=uid_base, width=width)

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def version_stats(self, batch: TensorDictBase, step: int, max_staleness: int) -> dict[str, float]:
        """Streaming rollout: the per-trajectory version metrics of a step's batch (small); see
        :func:`asyncrl.pipelines.loop.stream_batch.version_stats`."""
        return version_stats(batch, step, max_staleness)

    @register(Dispatch.DP_COMPUTE)
    def ledger_rows(self, batch: TensorDictBase) -> TensorDict:
        """Per row of a step's batch, how it was generated: ``replica``, ``lo`` / ``hi`` (its model tokens' oldest
        and newest weight version) and ``tokens`` (small: four int32 per row); see
        :func:`asyncrl.pipelines.journaling.ledger.row_facts`."""
        return row_facts(batch)

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def sample_trajectories(self, batch: TensorDictBase, n: int, seed: int,
                            policy_version: int) -> list[dict[str, Any]]:
        """`n` trajectories of a merged training batch, whole prompt groups drawn with `seed`, as small
        dicts for ``samples.jsonl`` (see :mod:`asyncrl.pipelines.observe.samples`)."""
        return trajectory_rows(batch, pick_rows(batch["uid"], n, seed), policy_version)

    @register(Dispatch.DP_COMPUTE)
    def echo(self, batch: TensorDictBase) -> TensorDictBase:
        """`batch` unchanged: puts a concrete batch (a restored checkpoint's) into the object
        store so later stages can take it as a future, like a freshly generated one."""
        return batch


def compute_advantages(batch: TensorDictBase, algo: Mapping[str, Any], *,
                       all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of a merged batch: GRPO group-relative, or GAE over token rewards
    (whitened with verl's Bessel-corrected ``masked_whiten`` when ``whiten_advantages``).

    `batch` may be one data-parallel shard: `all_reduce` (a sum across the shards) then turns the
    shard's whitening moments into the whole batch's. GRPO groups never span shards (the trainer
    keeps every prompt's responses on one rank)."""
    mask = batch["response_mask"]
    scores = batch["scores"].to(torch.float32)
    if algo["name"] == "grpo":
        adv = F.grpo_advantages(scores, batch["uid"], mask, norm_std=algo["norm_adv_by_std"])
        return adv, adv.clone()
    rewards = terminal_rewards(scores, mask)
    if algo["kl_in_reward_coef"] > 0:
        kl = F.kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], algo["kl_penalty"]) * mask
        rewards = rewards - algo["kl_in_reward_coef"] * kl
    adv, ret = F.gae(rewards, batch["values"], mask, algo["gamma"], algo["lam"])
    if algo["whiten_advantages"]:
        moments = F.masked_moments(adv, mask)
        adv = F.masked_whiten(adv, mask, moments=all_reduce(moments) if all_reduce is not None else moments)
    return adv, ret


def terminal_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` token rewards: each sequence's score on its last generated token (the last 1 of the
    mask: a multi-turn row has environment tokens, mask 0, between its model tokens)."""
    rewards = torch.zeros(mask.shape, dtype=torch.float32)
    last = mask.shape[-1] - 1 - mask.long().flip(-1).argmax(-1)
    has = mask.long().sum(-1) > 0
    rows = torch.arange(mask.shape[0])[has]
    rewards[rows, last[has]] = scores[has]
    return rewards


# ---- stage functions ---------------------------------------------------------------------------


def generate(g: Groups, prompts: TensorDictBase, *, seed: int) -> GroupFuture[TensorDict]:
    """Sample one response per row with the rollout's current weights (row versions are set by the worker)."""
    return g.rollout.generate(prompts, seed=seed)


def score(g: Groups, batch: GroupFuture[TensorDict] | TensorDictBase, *, rank: int | None = None
          ) -> GroupFuture[TensorDict]:
    """``TD{scores}`` of the generated batch (on reward rank `rank` alone: where a batch generated on that rollout
    rank already is)."""
    compute = g.reward.compute_reward
    return (compute if rank is None else compute.options(rank=rank))(batch)


def old_log_prob(g: Groups, batch: GroupFuture[TensorDict] | TensorDictBase, *,
                 bypass: bool = False) -> GroupFuture[TensorDict] | None:
    """``TD{old_log_probs, entropy}`` under the policy before this step's update; None with
    `bypass` (``rollout_correction.bypass_mode``): no call, ``advantages`` takes the rollout's
    log-probs as ``old_log_probs``."""
    return None if bypass else g.policy.compute_log_prob(batch)


def ref_log_prob(g: Groups, batch: GroupFuture[TensorDict] | TensorDictBase) -> GroupFuture[TensorDict] | None:
    """``TD{ref_log_probs}``, or None when the run has no reference."""
    return g.reference.compute_ref_log_prob(batch) if g.reference is not None else None


def values(g: Groups, batch: GroupFuture[TensorDict] | TensorDictBase) -> GroupFuture[TensorDict] | None:
    """``TD{values}``, or None without a critic."""
    return g.critic.compute_values(batch) if g.critic is not None else None


def advantages(g: Groups, batch: Any, scores: Any, log_probs: Any, ref: Any, vals: Any,
               algo: Mapping[str, Any]) -> GroupFuture[TensorDict]:
    """The merged training batch with ``advantages`` and ``returns`` (`log_probs` None: the
    bypass, ``old_log_probs`` are the rollout's)."""
    kwargs: dict[str, Any] = {}
    if log_probs is not None:
        kwargs["log_probs"] = log_probs
    if ref is not None:
        kwargs["ref"] = ref
    if vals is not None:
        kwargs["values"] = vals
    return g.advantage.compute_advantages(batch, scores, algo=Broadcast(dict(algo)), **kwargs)


def critic_update(g: Groups, train_batch: GroupFuture[TensorDict]) -> GroupFuture[list[dict[str, float]]] | None:
    """One critic update (per-rank metrics), or None without a critic."""
    return g.critic.update(train_batch) if g.critic is not None else None


def actor_update(g: Groups, train_batch: GroupFuture[TensorDict]) -> GroupFuture[list[dict[str, float]]]:
    """One policy update (per-rank metrics); the policy's version goes up by one."""
    return g.policy.update(train_batch)


def export_weights(g: Groups, *, transport: str = "object_store", dtype: str | None = None,
                   keep: int = 4) -> GroupFuture[Any]:
    """The policy's current version for the rollout, issued after its update (ordered on the worker):
    a ``WeightHandle`` to the version the policy put into the object store (``object_store``; a
    policy class that overrides ``export_weights`` gives its ``(version, state_dict)``), or to a
    snapshot kept by the policy (``local``: colocated; ``collective``: sent over the weight channel
    at load time; ``adapter``: a LoRA policy's factors, merged by the rollout).
    `dtype` is the rollout's weight dtype (floating tensors are cast to it)."""
    if transport == "object_store":
        if _stages_into_the_store(g.policy):  # the put inside the call is the one copy (roles/weights/transfer.py)
            return g.policy.stage_weights("object_store", dtype=dtype)
        # a policy class of one's own may take no dtype: pass it only when set
        return g.policy.export_weights(dtype=dtype) if dtype is not None else g.policy.export_weights()
    if transport == "local":
        return g.policy.stage_weights("local", dtype=dtype, keep=keep)
    if transport == "adapter":  # a LoRA policy's factors alone; the HF rollout merges them into its base
        return g.policy.export_adapter(dtype=dtype)
    return g.policy.stage_weights("collective", keep=keep)


def _stages_into_the_store(policy: WorkerGroup[Any]) -> bool:
    """Whether the policy's class exports as ``PolicyWorker`` does (then ``stage_weights("object_store")``
    gives the same weights with one copy fewer); a class that overrides ``export_weights`` keeps it."""
    cls = getattr(policy, "cls", None)
    return (isinstance(cls, type) and issubclass(cls, PolicyWorker)
            and getattr(cls, "export_weights", None) is PolicyWorker.export_weights
            and getattr(cls, "stage_weights", None) is PolicyWorker.stage_weights)


async def load_weights(g: Groups, exported: GroupFuture[Any], *, transport: str = "object_store") -> list[dict[str, Any]]:
    """Load an exported version into every rollout rank (rollout-side receipts). With the
    ``collective`` transport the policy sends while the rollout ranks receive; a failure of
    either side fails the sync (the rollout's error first: it says which rank and why)."""
    if transport != "collective":
        return await g.rollout.update_weights(exported)
    import asyncio

    outcome: tuple[Any, Any] = await asyncio.gather(g.rollout.update_weights(exported),
                                                    g.policy.send_weights(exported), return_exceptions=True)
    for r in outcome:
        if isinstance(r, BaseException):
            raise r
    return list(outcome[0])


def sample_trajectories(g: Groups, train_batch: GroupFuture[TensorDict], *, n: int, seed: int,
                        policy_version: int) -> GroupFuture[list[dict[str, Any]]]:
    """`n` trajectories of the merged training batch for ``samples.jsonl`` (small: cut on the advantage
    worker, behind this batch's ``advantages``)."""
    return g.advantage.sample_trajectories(train_batch, n, seed, policy_version)


def concat_sharded(g: Groups, gens: list[Any], scores: list[Any], *, pad_id: int, uid_base: int,
                   width: int) -> GroupFuture[TensorDict]:
    """One step's batch of finished groups (`gens`, `scores`: their futures, in order) built on the advantage
    ranks, each its contiguous chunk of groups (as equal as can be): a data-parallel batch whose shards the
    training calls of the same world size read in place, so no rank fetches the whole batch (with one rank
    building it, every training rank read all of it to take its rows: quadratic in the ranks)."""
    n = g.advantage.world_size
    k, extra = divmod(len(gens), n)
    bounds = [i * k + min(i, extra) for i in range(n + 1)]
    chunks = [(bounds[i], bounds[i + 1]) for i in range(n)]
    return g.advantage.concat_shard([gens[a:b] for a, b in chunks], [scores[a:b] for a, b in chunks], pad_id=pad_id,
                                    uid_base=[uid_base + a for a, _ in chunks], width=width)


def mean_metrics(per_rank: list[Mapping[str, float]] | None, prefix: str) -> dict[str, float]:
    """Average per-rank metric dicts and prefix their names."""
    if not per_rank:
        return {}
    keys = per_rank[0].keys()
    return {f"{prefix}/{k}": float(sum(m[k] for m in per_rank) / len(per_rank)) for k in keys}
