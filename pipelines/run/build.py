"""Group and pool building: which workers a config needs, where they are placed, and its data.

Two pools (rollout + reward on the rollout bundles; policy + advantage + reference + critic
on the training bundles) or one colocated pool. By default both are carved out of one
placement-group pool on one node; with ``trainer.rollout_placement``/``train_placement`` each pool
has placement groups of its own (workers per node), so they can sit on different nodes and a
rollout pool whose node was lost can be placed again elsewhere. A recovery starts new actors in
the same bundles.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from asyncrl import ResourcePool, colocate
from asyncrl.pipelines.job.config import ConfigError, JobConfig
from asyncrl.pipelines.datasets.data import PromptLoader, make_loader, task_pairs
from asyncrl.pipelines.datasets.evaluation import Evaluator
from asyncrl.pipelines.loop.stages import AdvantageWorker, Groups
from asyncrl.pipelines.journaling.rounds import recording_rollout, records_rounds
from asyncrl.pipelines.twin.workers import twin_roles, twin_rollout
from asyncrl.roles import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker, RolloutWorker
from asyncrl.roles.modeling.models import model_context_length, tokenizer_for

__all__ = ["needs_reference", "reference_worker", "role_specs", "rollout_config", "main_pool", "run_pools",
           "build_rollout_part",
           "build_groups", "Workers", "build_data"]


def needs_reference(cfg: JobConfig) -> bool:
    """True when a KL term needs reference log-probs (from a ReferenceWorker, or with LoRA from the
    policy itself: :func:`reference_worker`)."""
    return cfg.actor.kl_coef > 0 or (cfg.algorithm.name == "ppo" and cfg.algorithm.kl_in_reward_coef > 0)


def reference_worker(cfg: JobConfig) -> bool:
    """True when the run builds a ReferenceWorker: a KL term needs reference log-probs and the policy cannot
    give them (with ``actor.lora.rank > 0`` the reference is the policy with its adapters disabled)."""
    return needs_reference(cfg) and not cfg.actor.lora.enabled


def rollout_config(cfg: JobConfig) -> Any:
    """The ``RolloutConfig`` the run's rollout workers get (:func:`recording_rollout`); an adapter sync into vLLM
    starts its engine serving LoRA adapters of the policy's rank (``max_lora_rank``, unless the config sets it)."""
    rollout = recording_rollout(cfg)
    if cfg.twin.enabled:
        rollout = twin_rollout(cfg, rollout)
    if cfg.trainer.weight_sync == "adapter" and rollout.engine == "vllm":
        rollout = replace(rollout, engine_kwargs={"max_lora_rank": cfg.actor.lora.rank, **rollout.engine_kwargs})
    return rollout


def role_specs(cfg: JobConfig, overrides: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(rollout-pool roles, training-pool roles)``: role -> worker class or (cls, args, kwargs)."""
    t = cfg.trainer
    rollout_roles: dict[str, Any] = {
        "rollout": (RolloutWorker, (cfg.model, rollout_config(cfg)), {}),
        "reward": (RewardWorker, (cfg.worker_reward(),), {}),
    }
    # the policy refuses rows older than the bound; streaming with bound=admitted trains a long group when it
    # finishes, older than max_staleness, so there it refuses only rows older than the run (or from the future)
    admitted = t.rollout_mode == "stream" and t.stream.bound == "admitted"
    train_roles: dict[str, Any] = {
        "policy": (PolicyWorker, (cfg.model, cfg.worker_actor()),
                   {"max_staleness": max(t.max_staleness, t.steps) if admitted else t.max_staleness}),
        "advantage": AdvantageWorker,
    }
    if reference_worker(cfg):
        train_roles["reference"] = (ReferenceWorker, (cfg.model,), {
            "temperature": cfg.rollout.temperature, "micro_batch_size": cfg.actor.micro_batch_size,
            "max_tokens_per_micro_batch": cfg.actor.max_tokens_per_micro_batch, "strategy": cfg.actor.strategy,
            "fsdp_offload": cfg.actor.fsdp_offload})
    if cfg.algorithm.name == "ppo":
        train_roles["critic"] = (CriticWorker, (cfg.model, cfg.critic), {})
    if cfg.twin.enabled:  # simulated GPU workers (asyncrl.pipelines.twin)
        twin_roles(cfg, rollout_roles, train_roles)
    for role, spec in (overrides or {}).items():
        roles = rollout_roles if role in rollout_roles else train_roles if role in train_roles else None
        if roles is None:
            raise ValueError(f"cannot override role {role!r}: this run has {sorted([*rollout_roles, *train_roles])}")
        cls, extra = spec if isinstance(spec, tuple) else (spec, {})
        base = roles[role]
        args, kwargs = (base[1], base[2]) if isinstance(base, tuple) else ((), {})
        roles[role] = (cls, args, {**kwargs, **extra})
    return rollout_roles, train_roles


def ranks_per_process(cfg: JobConfig) -> int:
    """Ranks each worker process hosts: the twin's ``replicas_per_process`` (simulated workers share processes),
    else 1."""
    return cfg.twin.replicas_per_process if cfg.twin.enabled else 1


def processes(cfg: JobConfig, ranks: int) -> int:
    """Worker processes (pool bundles) that host `ranks` ranks (:func:`ranks_per_process` each)."""
    return -(-ranks // ranks_per_process(cfg))


def main_pool(cfg: JobConfig) -> ResourcePool:
    """The run's one placement-group pool: rollout + training bundles, or the colocated ones."""
    t = cfg.trainer
    if t.colocated:
        return ResourcePool([t.train_workers], cpus_per_bundle=t.cpus_per_worker, gpus_per_bundle=t.gpus_per_worker,
                            name="asyncrl-colocated")
    return ResourcePool([processes(cfg, t.rollout_start) + processes(cfg, t.train_workers)],
                        cpus_per_bundle=t.cpus_per_worker, gpus_per_bundle=t.gpus_per_worker, name="asyncrl")


def own_pool(cfg: JobConfig, kind: str, *, placement: list[int] | None = None,
             wait_for_capacity: bool = False) -> ResourcePool:
    """The ``rollout`` or ``train`` pool's own placement groups (``trainer.<kind>_placement``, or
    `placement`: a rollout pool scaled by ``scale_rollout``); `wait_for_capacity`: a placement again
    after a lost node waits up to ``trainer.restart.placement_wait_s`` for the cluster to hold it."""
    t = cfg.trainer
    kw: dict[str, Any] = {"placement_timeout": t.restart.placement_wait_s} if wait_for_capacity else {}
    per_node = [processes(cfg, n) for n in placement or t.placements()[kind == "train"]]
    return ResourcePool(per_node, cpus_per_bundle=t.cpus_per_worker,
                        gpus_per_bundle=t.gpus_per_worker, resources_per_bundle=getattr(t, f"{kind}_resources"),
                        name=f"asyncrl-{kind}", wait_for_capacity=wait_for_capacity, **kw)


def run_pools(cfg: JobConfig, *, rollout_placement: list[int] | None = None,
              wait_for_capacity: bool = False) -> list[ResourcePool]:
    """The run's placement-group pools: the one :func:`main_pool`, or (``trainer.own_pools``) the
    rollout pool's (`rollout_placement` when scaled) and the training pool's, in that order
    (`wait_for_capacity`: see :func:`own_pool`)."""
    t = cfg.trainer
    if t.colocated or not t.own_pools:
        return [main_pool(cfg)]
    return [own_pool(cfg, "rollout", placement=rollout_placement, wait_for_capacity=wait_for_capacity),
            own_pool(cfg, "train", wait_for_capacity=wait_for_capacity)]


def _two_pools(cfg: JobConfig, pools: list[ResourcePool]) -> tuple[ResourcePool, ResourcePool]:
    """(rollout, training) pools: the run's own two, or the split of its main pool."""
    t = cfg.trainer
    if len(pools) == 2:
        return pools[0], pools[1]
    rpool, tpool = pools[0].split([processes(cfg, t.rollout_start), processes(cfg, t.train_workers)])
    return rpool, tpool


def rollout_restart(cfg: JobConfig) -> str:
    """The rollout pool's restart policy: ``"process"`` (a lost process breaks only its ranks, and the producer
    replaces it alone) where the rollout mode does that (``RolloutMode.replaces_processes``), the run records no
    engine rounds (an exact replay needs every rank's last rounds) and weights do not travel over a collective
    channel (its group would lose a member); ``"none"`` otherwise: a lost process breaks the whole group, failing
    every call in flight on it, and the pool is replaced."""
    if cfg.trainer.mode().replaces_processes and not records_rounds(cfg) and cfg.weight_transport() != "collective":
        return "process"
    return "none"


def build_rollout_part(cfg: JobConfig, overrides: Mapping[str, Any] | None, pools: list[ResourcePool],
                       ranks: int | None = None) -> Any:
    """A new, unstarted rollout-pool part (rollout and reward workers, colocated) on the rollout
    bundles of `pools` (:func:`run_pools` of a two-pool run, placed or not): what replaces the
    rollout pool's workers after one of them died. `ranks`: its workers (None: the config's starting size)."""
    return colocate(role_specs(cfg, overrides)[0], _two_pools(cfg, pools)[0], name="rollout",
                    world_size=ranks if ranks is not None else cfg.trainer.rollout_start,
                    ranks_per_process=ranks_per_process(cfg), restart=rollout_restart(cfg))


def build_groups(cfg: JobConfig, overrides: Mapping[str, Any] | None = None, *,
                 pools: list[ResourcePool] | None = None,
                 rollout_ranks: int | None = None) -> tuple[Groups, list[Any], list[ResourcePool]]:
    """Unstarted groups for `cfg`: two pools (rollout + reward; policy + advantage + reference +
    critic) or one colocated pool. Returns ``(groups, things to set up and close, pools)``.

    `overrides` maps a role (``rollout``, ``reward``, ``policy``, ``advantage``, ``reference``,
    ``critic``) to a worker class that replaces the default one with the same constructor
    arguments, or to ``(cls, extra_kwargs)`` (e.g. a subclass that injects faults in tests).
    `pools` reuses the pools of an earlier ``build_groups`` of the same config (their placement
    groups stay; new actors take the same bundles); `rollout_ranks`: the rollout workers of a resized pool
    (None: the config's starting size)."""
    t = cfg.trainer
    rollout_roles, train_roles = role_specs(cfg, overrides)
    pools = pools or run_pools(cfg)
    k = ranks_per_process(cfg)
    if t.colocated:
        col = colocate({**rollout_roles, **train_roles}, pools[0], name="colocated")
        parts, cols = [col], {**{r: col for r in rollout_roles}, **{r: col for r in train_roles}}
    else:
        rpool, tpool = _two_pools(cfg, pools)
        rcol = colocate(rollout_roles, rpool, name="rollout", world_size=rollout_ranks or t.rollout_start,
                        ranks_per_process=k, restart=rollout_restart(cfg))
        tcol = colocate(train_roles, tpool, name="train", world_size=t.train_workers, ranks_per_process=k)
        parts = [rcol, tcol]
        cols = {**{r: rcol for r in rollout_roles}, **{r: tcol for r in train_roles}}
    g = Groups(
        rollout=cols["rollout"]["rollout"], reward=cols["reward"]["reward"], policy=cols["policy"]["policy"],
        advantage=cols["advantage"]["advantage"],
        reference=(cols["reference"]["reference"] if "reference" in cols
                   else cols["policy"]["policy"] if needs_reference(cfg) else None),  # LoRA: the policy serves it
        critic=cols["critic"]["critic"] if "critic" in cols else None,
    )
    return g, parts, pools


def simulated_policy(overrides: Mapping[str, Any] | None, groups: Any = None) -> bool:
    """Whether the run's policy is not a ``PolicyWorker``: `overrides` (``worker_overrides``) replace it with
    another class, or the caller's started `groups` run one (a benchmark's simulated workers, which
    ``rollout.engine=sim`` may feed: ``JobConfig.validate(simulated_policy=...)``)."""
    spec = (overrides or {}).get("policy")
    cls = spec[0] if isinstance(spec, tuple) else spec
    if cls is None and groups is not None:
        cls = getattr(getattr(groups, "policy", None), "cls", None)
    return isinstance(cls, type) and not issubclass(cls, PolicyWorker)


class Workers:
    """The worker processes a trainer owns: the started parts (colocated group sets) and the
    placement-group pools they sit in, which outlive a restart so new actors take the same bundles.

    Args:
        config: the run's configuration.
        overrides: role -> worker class replacements (see :func:`build_groups`); kept across restarts.
    """

    def __init__(self, config: JobConfig, overrides: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.overrides = dict(overrides or {})
        self.simulated_policy = simulated_policy(overrides)
        """The overrides replace the policy with a class that is not a ``PolicyWorker``."""
        self.parts: list[Any] = []
        """The started parts: the rollout pool's first (when two pools), then the training pool's."""
        self.pools: list[ResourcePool] = []
        self._replaced = False  # pools placed again after a restart wait for capacity
        self.rollout_placement: list[int] | None = None
        """The rollout pool's workers per node once ``scale_rollout`` changed it (None: the config's)."""
        self.retiring: list[tuple[Any, ResourcePool]] = []
        """Former rollout-pool parts still draining after a streaming resize (closed with the rest, at the latest)."""

    async def start(self) -> Groups:
        """Build the groups (in the pools of an earlier start, if any) and start every process.
        On failure the caller closes them (:meth:`release`)."""
        pools = self.pools or run_pools(self.config, rollout_placement=self.rollout_placement,
                                        wait_for_capacity=self._replaced)
        ranks = sum(self.rollout_placement) if self.rollout_placement is not None else None
        groups, self.parts, self.pools = build_groups(self.config, self.overrides, pools=pools, rollout_ranks=ranks)
        await asyncio.gather(*(p.setup() for p in self.parts))
        return groups

    async def replace_rollout(self, size: int | None = None) -> Any:
        """Kill the rollout pool's processes and start new ones; returns the new part (its
        ``["rollout"]`` and ``["reward"]`` groups). In the same bundles, or, when the rollout pool has
        placement groups of its own (``trainer.own_pools``), in new ones placed on the capacity the
        cluster has now (its node may be gone), waiting up to ``trainer.restart.placement_wait_s``;
        `size`: that many workers on one node from now on (``scale_rollout``)."""
        dead = self.parts[0]
        with contextlib.suppress(Exception):
            await dead.close()
        if size is not None:
            self.rollout_placement = [size]
        if len(self.pools) == 2:
            old, self.pools[0] = self.pools[0], own_pool(self.config, "rollout", placement=self.rollout_placement,
                                                         wait_for_capacity=True)
            with contextlib.suppress(Exception):
                await old.release()
        new = build_rollout_part(self.config, self.overrides, self.pools,
                                 sum(self.rollout_placement) if self.rollout_placement is not None else None)
        self.parts = [new, *self.parts[1:]]  # closed with the rest on any later failure
        await new.setup()
        return new

    async def start_rollout_part(self, size: int) -> tuple[Any, ResourcePool]:
        """A started rollout-pool part of `size` workers on one node, in placement groups of its own (waiting
        up to ``trainer.restart.placement_wait_s`` for capacity), beside the current one: a streaming resize
        (:meth:`adopt_rollout_part` makes it the pool's). Closed again when it fails to start."""
        assert len(self.pools) == 2, "a resize needs a rollout pool of its own"
        pool = own_pool(self.config, "rollout", placement=[size], wait_for_capacity=True)
        part = build_rollout_part(self.config, self.overrides, [pool, self.pools[1]], size)
        try:
            await part.setup()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.close_rollout_part(part, pool)
            raise
        return part, pool

    def adopt_rollout_part(self, part: Any, pool: ResourcePool, size: int) -> tuple[Any, ResourcePool]:
        """Make `part` (in `pool`, `size` workers) the rollout pool's; returns the former ``(part, pool)``, which
        the caller closes (:meth:`close_rollout_part`) once its work is drained."""
        old = self.parts[0], self.pools[0]
        self.parts[0], self.pools[0] = part, pool
        self.rollout_placement = [size]
        self.retiring.append(old)
        return old

    async def close_rollout_part(self, part: Any, pool: ResourcePool) -> None:
        """Close a rollout-pool part's workers and release its placement groups."""
        if (part, pool) in self.retiring:
            self.retiring.remove((part, pool))
        with contextlib.suppress(Exception):
            await part.close()
        await pool.release()

    async def recycle(self) -> None:
        """Close the processes before a restart. The one shared pool keeps its placement groups (new actors
        take the same bundles); pools of their own are released and placed again by the next :meth:`start`,
        waiting for capacity, since a lost node may have taken their bundles with it."""
        own = len(self.pools) == 2
        await self.release(keep_pools=not own)
        self._replaced = own
    async def release(self, *, keep_pools: bool = False) -> None:
        """Close the processes (the rollout pool's first); release the placement groups unless `keep_pools`."""
        for part, pool in list(self.retiring):
            with contextlib.suppress(Exception):
                await self.close_rollout_part(part, pool)
        for part in self.parts:
            with contextlib.suppress(Exception):
                await part.close()
        self.parts = []
        if keep_pools:
            return
        for pool in self.pools:
            with contextlib.suppress(Exception):
                await pool.release()
        self.pools = []


def build_data(cfg: JobConfig, output_dir: Path) -> tuple[PromptLoader, Evaluator | None]:
    """The run's directory (created here: one that cannot be is a ``ConfigError`` before Ray starts), the
    prompt loader and the evaluator (blocking: tokenizer, prompt encoding; call it in a thread); prompts that
    cannot fit the model's context fail here, before step 0."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"trainer.output_dir={str(output_dir)!r} cannot be created: {e.strerror or e}; give a "
                          "directory this process can write") from None

    tokenizer = tokenizer_for(cfg.model)
    loader = make_loader(cfg.data, tokenizer, task_pairs(cfg.data, cfg.trainer.seed),
                         prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size, seed=cfg.trainer.seed)
    context = model_context_length(cfg.model)
    loader.check_fits(context, cfg.rollout.max_new_tokens)
    evaluator = None
    if cfg.evaluation.enabled:
        evaluator = Evaluator(cfg.evaluation, cfg.data, tokenizer, max_new_tokens=cfg.rollout.max_new_tokens,
                              output_dir=output_dir)
        evaluator.check_fits(context)
    return loader, evaluator
