"""`GRPOTrainer` and `PPOTrainer`: two named loops joined by a staleness-bounded buffer.

::

                 rollout pool                                training pool
   ┌──────────────── rollout loop ────────────────┐   ┌──────────────── train loop ─────────────────┐
   │ wait: version >= t - max_staleness            │   │ get batch t (drop if too stale)              │
   │ load_weights(export[v])  (if newer)           │   │ old_log_prob ─► ref_log_prob ─► values        │
   │ generate(prompts t) ─► score                  │   │ ─► advantages ─► critic_update ─► actor_update│
   │ await scores (small)                          │   │ ─► export_weights  => version t+1 published   │
   │ put RolloutBatch(t, v, futures) ──────────────┼──►│ await update metrics (small)                  │
   └───────────────────────────────────────────────┘   └───────────────────────────────────────────────┘
            ▲                                StalenessBuffer(capacity = max_staleness + 1)     │
            └──────────── exported weight futures (version -> GroupFuture) ◄───────────────────┘

* The **rollout loop** consumes prompt batches and exported weights; produces
  ``RolloutBatch`` items (futures of the generated batch and its scores); waits for
  the version gate and for buffer space.
* The **train loop** consumes ``RolloutBatch`` items; produces one policy version per
  step (an ``export_weights`` future) and metrics; waits for the buffer.

With ``trainer.precompute_log_probs`` (``max_staleness >= 1``, two pools) the train loop's first
three stages of step t+1 are issued early, on batch t+1's generate future, as soon as that
generate is issued and step t's export is (:meth:`Trainer._precompute_next`): they run on the
training workers right behind that export, with the weights step t+1 trains from, without
waiting for the batch's scores; step t+1 uses them if batch, future and version match.

Batch t is generated with weights ``max(0, t - max_staleness)`` (``fixed_lag``) or the
newest exported (``latest``, never older), so ``max_staleness=0`` is the synchronous
loop and ``k`` lets rollout run up to k versions ahead. Per batch the stages keep the
canonical order (DESIGN C8); the train loop is the only producer of versions, so
updates apply in version order. Payloads move worker to worker as futures; the
controller awaits scores, metrics and weight-sync receipts only.

Both loops run in an anyio task group: the first failure cancels the other.
**Supervision** (``trainer.restart``, docs/reliability.md): a worker that dies, or a stage
that misses ``trainer.stage_timeout_s``, fails its futures with a typed error; without a
restart policy that error is raised as itself. With one, the trainer closes every group,
starts new ones, restores the last checkpoint this run wrote (or the run's start) and
replays the steps after it -- deterministic, so they recompute the same weights.
**Shutdown order** (every path): (1) the loops end or are cancelled; (2) the tracer
stops; (3) on success the final checkpoint is written; (4) metrics, trace and plot
are flushed; (5) the rollout pool's workers close, then the training pool's; (6) the
placement groups are released.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import anyio
import anyio.to_thread
import structlog
import torch

import asyncrl
from asyncrl import GroupFuture, GroupMethod, ResourcePool, WorkerDiedError
from asyncrl import colocate
from asyncrl.pipelines import checkpoint as ckpt
from asyncrl.pipelines import stages
from asyncrl.pipelines.buffer import StalenessBuffer
from asyncrl.pipelines.config import ConfigError, JobConfig, config_fingerprint, fingerprint_diff
from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.data import PromptLoader, make_loader, task_pairs
from asyncrl.pipelines.evaluation import Evaluator
from asyncrl.pipelines.interrupt import Interruption, RunAbandoned, handle_signals
from asyncrl.pipelines.journal import Journal, JournalData, JournalError, read_journal
from asyncrl.pipelines.recovery import describe, fault_origin, fault_record, is_worker_fault, root_cause
from asyncrl.pipelines.metrics import MetricsWriter
from asyncrl.pipelines.stages import AdvantageWorker, Groups
from asyncrl.pipelines.trace import Tracer

__all__ = ["RolloutBatch", "Trainer", "GRPOTrainer", "PPOTrainer", "make_trainer", "build_groups", "build_rollout_part",
           "is_worker_fault", "weights_digest"]

log = structlog.get_logger("asyncrl.pipelines")


@dataclass
class RolloutBatch:
    """One generated batch waiting to be trained on."""

    step: int
    """The train step it is for (its prompt batch index)."""
    version: int
    """Policy version of the weights that generated every row."""
    batch: Any
    """Future (or concrete TensorDict) of the generated batch."""
    scores: Any
    """Future of ``TD{scores}``."""
    reward_mean: float
    """Mean score (awaited by the rollout loop: the batch is fully generated and scored)."""
    gen_time: float = 0.0
    """Seconds from issuing generate to the scores being known."""


@dataclass
class _Precomputed:
    """The next step's ``old_log_prob`` / ``ref_log_prob`` / ``values``, issued before its batch left
    the buffer (``trainer.precompute_log_probs``). Used only by the step it was issued for, on the
    batch it read, with the policy version it was computed with; otherwise discarded."""

    step: int
    """The train step it is for, which is also the policy version it was computed with."""
    batch_index: int
    """The batch it read (its prompt batch index)."""
    batch: Any
    """The generate future it read (identity is what counts: a regenerated batch is another future)."""
    old: GroupFuture[Any] | None
    ref: GroupFuture[Any] | None
    vals: GroupFuture[Any] | None

    def matches(self, item: RolloutBatch, version: int) -> bool:
        """True when step `version` trains `item` and this read exactly `item`'s batch future."""
        return self.step == version and self.batch_index == item.step and self.batch is item.batch

    def discard(self) -> None:
        """Cancel what has not run yet (a call waiting for its batch or its turn leaves the training
        worker's ordered lane at once). Nothing is awaited, so nothing is fetched or logged."""
        for f in (self.old, self.ref, self.vals):
            if f is not None:
                with contextlib.suppress(Exception):  # a closed group: the call is over already
                    f.cancel()


def needs_reference(cfg: JobConfig) -> bool:
    """True when a KL term needs reference log-probs."""
    return cfg.actor.kl_coef > 0 or (cfg.algorithm.name == "ppo" and cfg.algorithm.kl_in_reward_coef > 0)


def _role_specs(cfg: JobConfig, overrides: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(rollout-pool roles, training-pool roles)``: role -> worker class or (cls, args, kwargs)."""
    from asyncrl.roles import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker, RolloutWorker

    t = cfg.trainer
    rollout_roles: dict[str, Any] = {
        "rollout": (RolloutWorker, (cfg.model, cfg.rollout), {}),
        "reward": (RewardWorker, (cfg.reward,), {}),
    }
    train_roles: dict[str, Any] = {
        "policy": (PolicyWorker, (cfg.model, cfg.worker_actor()), {"max_staleness": t.max_staleness}),
        "advantage": AdvantageWorker,
    }
    if needs_reference(cfg):
        train_roles["reference"] = (ReferenceWorker, (cfg.model,), {"temperature": cfg.rollout.temperature,
                                                                   "micro_batch_size": cfg.actor.micro_batch_size})
    if cfg.algorithm.name == "ppo":
        train_roles["critic"] = (CriticWorker, (cfg.model, cfg.critic), {})
    for role, spec in (overrides or {}).items():
        roles = rollout_roles if role in rollout_roles else train_roles if role in train_roles else None
        if roles is None:
            raise ValueError(f"cannot override role {role!r}: this run has {sorted([*rollout_roles, *train_roles])}")
        cls, extra = spec if isinstance(spec, tuple) else (spec, {})
        base = roles[role]
        args, kwargs = (base[1], base[2]) if isinstance(base, tuple) else ((), {})
        roles[role] = (cls, args, {**kwargs, **extra})
    return rollout_roles, train_roles


def _main_pool(cfg: JobConfig) -> ResourcePool:
    t = cfg.trainer
    if t.colocated:
        return ResourcePool([t.train_workers], cpus_per_bundle=t.cpus_per_worker, gpus_per_bundle=t.gpus_per_worker,
                            name="asyncrl-colocated")
    return ResourcePool([t.rollout_workers + t.train_workers], cpus_per_bundle=t.cpus_per_worker,
                        gpus_per_bundle=t.gpus_per_worker, name="asyncrl")


def build_rollout_part(cfg: JobConfig, overrides: Mapping[str, Any] | None, pool: ResourcePool) -> Any:
    """A new, unstarted rollout-pool part (rollout and reward workers, colocated) on the rollout
    bundles of `pool` (the main pool of a two-pool run, placed or not): what replaces the
    rollout pool's workers after one of them died."""
    t = cfg.trainer
    rpool, _ = pool.split([t.rollout_workers, t.train_workers])
    return colocate(_role_specs(cfg, overrides)[0], rpool, name="rollout")


def build_groups(cfg: JobConfig, overrides: Mapping[str, Any] | None = None, *,
                 pools: list[ResourcePool] | None = None) -> tuple[Groups, list[Any], list[ResourcePool]]:
    """Unstarted groups for `cfg`: two pools (rollout + reward; policy + advantage + reference +
    critic) or one colocated pool. Returns ``(groups, things to set up and close, pools)``.

    `overrides` maps a role (``rollout``, ``reward``, ``policy``, ``advantage``, ``reference``,
    ``critic``) to a worker class that replaces the default one with the same constructor
    arguments, or to ``(cls, extra_kwargs)`` (e.g. a subclass that injects faults in tests).
    `pools` reuses the pools of an earlier ``build_groups`` of the same config (their placement
    groups stay; new actors take the same bundles)."""
    t = cfg.trainer
    rollout_roles, train_roles = _role_specs(cfg, overrides)
    pool = pools[0] if pools else _main_pool(cfg)
    if t.colocated:
        col = colocate({**rollout_roles, **train_roles}, pool, name="colocated")
        parts, cols = [col], {**{r: col for r in rollout_roles}, **{r: col for r in train_roles}}
    else:
        rpool, tpool = pool.split([t.rollout_workers, t.train_workers])
        rcol = colocate(rollout_roles, rpool, name="rollout")
        tcol = colocate(train_roles, tpool, name="train")
        parts = [rcol, tcol]
        cols = {**{r: rcol for r in rollout_roles}, **{r: tcol for r in train_roles}}
    g = Groups(
        rollout=cols["rollout"]["rollout"], reward=cols["reward"]["reward"], policy=cols["policy"]["policy"],
        advantage=cols["advantage"]["advantage"],
        reference=cols["reference"]["reference"] if "reference" in cols else None,
        critic=cols["critic"]["critic"] if "critic" in cols else None,
    )
    return g, parts, [pool]


class Trainer:
    """The asynchronous trainer (use :class:`GRPOTrainer` or :class:`PPOTrainer`).

    ``async with trainer: await trainer.fit()`` -- or ``trainer.fit_sync()`` from
    synchronous code. Construction only checks the config; ``setup()`` (or ``async
    with``) starts Ray, the pools and the workers, and restores `resume`.

    Args:
        config: the run's configuration (validated here, before any worker starts).
        resume: a checkpoint directory, or a run directory whose newest checkpoint is used.
        groups: pre-built, started groups to drive instead of building them (tests,
            custom pipelines); the trainer then neither starts nor closes workers.
        on_step: called as ``on_step(trainer, step, metrics)`` after each step (and its
            checkpoint); an exception it raises stops the run like any loop failure. After a
            restart the replayed steps call it again.
        worker_overrides: replace roles' worker classes (see :func:`build_groups`); kept
            across restarts.
        replay: a run journal (or a run directory holding ``journal.jsonl``) whose batches this
            run generates with exactly the recorded weight versions (see
            :mod:`asyncrl.pipelines.replay`); the config must be the journal's.
    """

    algorithm: ClassVar[str | None] = None

    def __init__(self, config: JobConfig, *, resume: str | Path | None = None, groups: Groups | None = None,
                 on_step: Callable[["Trainer", int, dict[str, Any]], None] | None = None,
                 worker_overrides: Mapping[str, Any] | None = None, replay: str | Path | None = None) -> None:
        if self.algorithm is not None and config.algorithm.name != self.algorithm:
            raise ConfigError(
                f"{type(self).__name__} runs algorithm.name={self.algorithm!r}, the config says "
                f"{config.algorithm.name!r}; use make_trainer(config) or fix algorithm.name"
            )
        self.config = config.validate()
        self._resume = ckpt.resolve_resume(resume) if resume is not None else None
        self._verified = False  # checkpoint file hashes checked
        if self._resume is not None:
            self._check_resume(self._resume)
        self._replay: JournalData | None = None
        if replay is not None:
            self._replay = read_journal(replay)
            header = self._replay.header or {}
            if header.get("fingerprint") != config_fingerprint(self.config):
                diff = fingerprint_diff(header.get("config") or {}, to_dict(self.config))
                raise JournalError(f"the journal {str(replay)!r} was written by a different config (differs in: "
                                   f"{', '.join(diff) or '?'}); replay with the run's own config")
        t = config.trainer
        if self.config.buffer_capacity < t.max_staleness + 1:
            raise ConfigError(
                f"trainer.buffer_capacity={self.config.buffer_capacity} cannot hold the {t.max_staleness + 1} "
                "batches rollout may run ahead; set it to at least max_staleness + 1"
            )
        self.groups = _with_deadlines(groups, t.stage_timeout_s) if groups is not None else None
        self._overrides = dict(worker_overrides or {})
        self._on_step = on_step
        self._owns_groups = groups is None
        self._parts: list[Any] = []
        self._pools: list[ResourcePool] = []
        self.buffer: StalenessBuffer[RolloutBatch] = self._new_buffer()
        self.tracer = Tracer(enabled=t.trace)
        self.history: list[dict[str, Any]] = []
        self.output_dir = Path(t.output_dir)
        self._algo = to_dict(config.algorithm)
        self._loader: PromptLoader | None = None
        self.evaluator: Evaluator | None = None
        """Held-out evaluation (``config.evaluation``); its ``records`` hold one row per evaluation."""
        self._metrics: MetricsWriter | None = None
        self._journal: Journal | None = None
        self._schedule: dict[int, int] = {}  # batch index -> weight version to follow (journal)
        self._cond: asyncio.Condition | None = None
        self._device: asyncio.Lock | None = None
        self._exports: dict[int, GroupFuture[Any] | None] = {0: None}
        self._exported = 0  # newest version whose export has been issued
        self._transport = config.weight_transport()
        self._sync_dtype: str | None = None  # the rollout's weight dtype (exports are cast to it)
        self._sleep = t.colocated and config.rollout.sleep_level > 0
        self._policy_version = 0
        self._rollout_version = 0
        self._next_gen = 0  # index of the next batch the rollout loop generates
        self._generating: tuple[int, int, Any] | None = None  # (index, version, generate future) not yet buffered
        self._taken = -1  # the last step whose batch the train loop took out of the buffer
        self._precomputed: _Precomputed | None = None
        self._precompute = t.precompute_log_probs and t.max_staleness >= 1 and not t.colocated
        self.precompute_stats = {"issued": 0, "used": 0, "discarded": 0}
        """``trainer.precompute_log_probs``: how many steps' first stages were issued ahead, used by
        their step, and discarded (their batch was regenerated or re-homed, or the run stopped)."""
        self._start_step = 0
        self._rollout_done = False
        self._restored: list[RolloutBatch] = []
        self._setup_done = False
        self._t_start = 0.0
        self._last_checkpoint: Path | None = None  # the newest checkpoint this trainer wrote
        self._initial_rng: dict[str, Any] | None = None
        self._stop: str | None = None
        self._pending_faults: list[dict[str, Any]] = []  # recoveries whose interruption is still being measured
        self.fitting = False
        """True while :meth:`fit` runs its loops."""
        self.interrupted: Interruption | None = None
        """Set when the run stopped early on :meth:`request_stop` (or SIGINT/SIGTERM in ``fit_sync``)."""
        self.abandoned: str | None = None
        """The signal that abandoned the step in progress (a second SIGINT/SIGTERM), if any."""
        self.event_loop: str | None = None
        """The controller's event loop the last ``fit()`` ran on (``"uvloop"`` or ``"asyncio"``)."""
        self.restarts: list[dict[str, Any]] = []
        """One record per recovery: ``{"kind": "replace" | "restart", "error_type", "error", "origin",
        "from_checkpoint", "from_step", "time_s", "interrupted_s"}`` (``time_s``: the recovery itself;
        ``interrupted_s``: how long training was held up by the fault, see docs/reliability.md)."""

    def _new_buffer(self) -> StalenessBuffer[RolloutBatch]:
        t = self.config.trainer

        def dropped(item: RolloutBatch, current: int) -> None:
            if self._journal is not None:
                self._journal.drop(item.step, version=item.version, at_version=current)

        return StalenessBuffer(self.config.buffer_capacity, t.max_staleness, on_drop=dropped)

    # ---- lifecycle ---------------------------------------------------------------------------

    def _check_resume(self, path: Path) -> None:
        state = ckpt.read_state(path)
        if state.get("fingerprint") != config_fingerprint(self.config):
            saved = state.get("config")
            diff = fingerprint_diff(saved if isinstance(saved, dict) else {}, to_dict(self.config))
            raise ckpt.CheckpointError(
                f"checkpoint {str(path)!r} was written by a different config (differs in: {', '.join(diff) or '?'}); "
                "resume with the same settings (only trainer.steps, output_dir, checkpointing and reporting may change)"
            )
        # Every file present with its recorded size, before any worker starts; the sha256 of each
        # is checked here too, unless an event loop is running (then setup() hashes in a thread).
        try:
            asyncio.get_running_loop()
            in_loop = True
        except RuntimeError:
            in_loop = False
        ckpt.verify(path, hashes=not in_loop)
        self._verified = not in_loop
        if state["step"] > self.config.trainer.steps:
            raise ckpt.CheckpointError(
                f"checkpoint {str(path)!r} is at step {state['step']}, past trainer.steps={self.config.trainer.steps}"
            )

    async def setup(self) -> "Trainer":
        """Start Ray (if needed), check the pools fit, start the workers, restore `resume`.

        The blocking parts (imports, checkpoint hashing, tokenizer, prompt encoding, sinks)
        run in threads, so the event loop keeps serving other tasks."""
        if self._setup_done:
            return self
        cfg = self.config
        self._cond = asyncio.Condition()
        self._device = asyncio.Lock()
        if self._resume is not None and not self._verified:
            await anyio.to_thread.run_sync(ckpt.verify, self._resume)
            self._verified = True
        # first: a missing model extra, a corrupt GGUF or a prompt that cannot fit fails before any worker starts
        # (and a GGUF model is converted once here, so the workers load the cached directory)
        self._loader, self.evaluator = await asyncio.to_thread(self._make_data)
        if self._owns_groups:
            await anyio.to_thread.run_sync(_import_ray)
            resources = await asyncrl.ainit(num_cpus=cfg.trainer.num_cpus)
            cfg.validate(cluster_cpus=float(resources.get("CPU", 0.0)), cluster_gpus=float(resources.get("GPU", 0.0)))
            await self._start_groups()
        else:
            await self._prepare_sync()
        self._initial_rng = ckpt.rng_state()
        if self._resume is not None:
            await self._restore(self._resume)
        self._metrics = await anyio.to_thread.run_sync(self._make_metrics)
        await anyio.to_thread.run_sync(self._start_journal)
        self._setup_done = True
        return self

    def _make_data(self) -> tuple[PromptLoader, Evaluator | None]:
        """The prompt loader and the evaluator; prompts that cannot fit the context fail here, before step 0."""
        from asyncrl.roles.models import model_context_length, tokenizer_for

        cfg = self.config
        tokenizer = tokenizer_for(cfg.model)
        loader = make_loader(cfg.data, tokenizer, task_pairs(cfg.data, cfg.trainer.seed),
                             prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size, seed=cfg.trainer.seed)
        context = model_context_length(cfg.model)
        loader.check_fits(context, cfg.rollout.max_new_tokens)
        evaluator = None
        if cfg.evaluation.enabled:
            evaluator = Evaluator(cfg.evaluation, cfg.data, tokenizer, max_new_tokens=cfg.rollout.max_new_tokens,
                                  output_dir=self.output_dir)
            evaluator.check_fits(context)
        return loader, evaluator

    async def _evaluate(self, version: int) -> None:
        """Evaluate the rollout group's weights (`version`) and record the row in the metrics sinks."""
        ev, g = self.evaluator, self.groups
        assert ev is not None and g is not None
        with self.tracer.span("evaluate", track=g.rollout.name, version=version):
            row = await ev.run(g, version, watch=self.tracer.watch)
        if self._metrics is not None:
            self._metrics.write(version, row)  # step = steps done = version

    async def _final_evaluation(self) -> None:
        """After the last step: evaluate the due versions the rollout loop never loaded (the last
        ``max_staleness`` ones) and, with ``evaluation.at_end``, the final weights."""
        ev, g = self.evaluator, self.groups
        final = self._policy_version
        if ev is None or g is None:
            return
        due = [v for v in sorted(x for x in self._exports if self._rollout_version < x <= final)
               if ev.due(v) or (v == final and ev.due_final(v))]
        if not due and not (ev.due_final(final) and self._rollout_version == final):
            return
        needs_weights = self._sleep and await self._wake(g)  # the rollout slept after its last batch
        for v in due:
            exported = self._exports[v]
            assert exported is not None
            with self.tracer.span("weight_sync", track=g.rollout.name, version=v):
                await self._load(g, exported)
            self._rollout_version, needs_weights = v, False
            await self._evaluate(v)
        if ev.due_final(final) and self._rollout_version == final:
            if needs_weights:
                await self._load(g, self._exports[final])  # level 2: the same version again
            await self._evaluate(final)

    async def _wake(self, g: Groups) -> bool:
        """Re-acquire the memory the rollout released; True when it must reload its weights (level 2)."""
        woke = await g.rollout.wake_up()
        return any(w["needs_weights"] for w in woke)

    def _make_metrics(self) -> MetricsWriter:
        return MetricsWriter(self.output_dir, tensorboard=self.config.trainer.tensorboard,
                             start_step=self._start_step)

    def _start_journal(self) -> None:
        """Open ``journal.jsonl``: continue the resumed run's (rewound to its checkpoint, following
        the versions it recorded after it), or follow a replayed run's, or start a new one."""
        header = {"fingerprint": config_fingerprint(self.config), "config": to_dict(self.config)}
        previous = None
        if self._resume is not None:
            source = self._resume.parent.parent / "journal.jsonl"
            if source.is_file():
                previous = read_journal(source)
        self._journal = Journal(self.output_dir / "journal.jsonl")
        schedule = self._journal.start(header, previous=previous, next_gen=self._next_gen,
                                       start_step=self._start_step)
        if self._replay is not None:
            schedule = self._replay.schedule()
            self._check_replay(self._replay)
        self._schedule = schedule

    def _check_replay(self, data: JournalData) -> None:
        assert self._loader is not None
        for i, b in sorted(data.batches.items()):
            if list(b["prompts"]) != self._loader.indices(i) or int(b["seed"]) != self._seed(i):
                raise JournalError(f"batch {i} of the journal has other prompts or another seed than this run "
                                   "would use; replay with the journal's config and data")

    async def _start_groups(self) -> None:
        groups, self._parts, self._pools = build_groups(self.config, self._overrides, pools=self._pools or None)
        self.groups = _with_deadlines(groups, self.config.trainer.stage_timeout_s)
        try:
            await asyncio.gather(*(p.setup() for p in self._parts))
            await self._prepare_sync()
        except BaseException:
            await self.close()
            raise

    async def _prepare_sync(self) -> None:
        """Learn the rollout's weight dtype and open the weight channel (``collective``); with
        sleep level 2, stage version 0 so the rollout can reload it after its first sleep."""
        from asyncrl.roles.sync import open_weight_channel, rollout_dtype

        g, t = self.groups, self.config.trainer
        assert g is not None
        if t.gpus_per_worker > 0 or self._transport != "object_store":
            self._sync_dtype = await rollout_dtype(g.rollout)
        if self._transport == "collective":
            await open_weight_channel(g.policy, g.rollout, timeout_s=t.weight_sync_timeout_s)
        if self._sleep and self.config.rollout.sleep_level == 2 and self._exports.get(0) is None:
            self._exports[0] = self._export(g)

    def _export(self, g: Groups) -> GroupFuture[Any]:
        return stages.export_weights(g, transport=self._transport, dtype=self._sync_dtype,
                                     keep=self.config.trainer.max_staleness + 3)

    async def _load(self, g: Groups, exported: GroupFuture[Any] | None) -> None:
        assert exported is not None, "version 0 has no export unless rollout.sleep_level=2 staged it at setup"
        await stages.load_weights(g, exported, transport=self._transport)

    async def close(self) -> None:
        """Release everything (idempotent): rollout workers, then training workers, then pools."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._journal is not None:
            self._journal.close()
        await self._release_groups()

    async def _release_groups(self, *, keep_pools: bool = False) -> None:
        for part in self._parts:
            with contextlib.suppress(Exception):
                await part.close()
        self._parts = []
        if keep_pools:
            return
        for pool in self._pools:
            with contextlib.suppress(Exception):
                await pool.release()
        self._pools = []

    async def __aenter__(self) -> "Trainer":
        try:
            return await self.setup()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.shield(self.close())

    def fit_sync(self) -> list[dict[str, Any]]:
        """Set up, fit and close from synchronous code (runs its own event loop: uvloop's by
        default, ``trainer.event_loop``).

        SIGINT and SIGTERM are handled while it runs (main thread): the first stops after the
        step in progress and writes a checkpoint (``trainer.interrupted`` says where); a second
        abandons the step and raises :class:`~asyncrl.pipelines.interrupt.RunAbandoned`."""

        async def main() -> list[dict[str, Any]]:
            with handle_signals(self) as route:
                async with self:
                    route.reinstall()  # over the handler Ray's driver installed when it started
                    return await self.fit()

        try:
            return asyncrl.run(main(), loop=self.config.trainer.event_loop)
        except (asyncio.CancelledError, KeyboardInterrupt):
            if self.abandoned is not None:
                raise RunAbandoned(self.abandoned, self.last_checkpoint) from None
            raise

    @property
    def last_checkpoint(self) -> Path | None:
        """The newest checkpoint of this run: the last one it wrote, else the one it resumed from."""
        return self._last_checkpoint or self._resume

    def request_stop(self, reason: str = "request") -> None:
        """Stop after the step in progress: finish it, write a checkpoint, and return from
        :meth:`fit` with :attr:`interrupted` set. Safe to call from the loop at any time."""
        if self._stop is None:
            self._stop = reason
            log.warning("trainer.stopping", reason=reason, step=self._policy_version,
                        detail="finishing the step in progress, then writing a checkpoint")

    # ---- the run -------------------------------------------------------------------------------

    async def fit(self) -> list[dict[str, Any]]:
        """Train for ``trainer.steps`` steps; returns the per-step metrics."""
        if not self._setup_done:
            raise RuntimeError("the trainer is not set up; use `async with trainer:` or `await trainer.setup()`")
        cfg = self.config.trainer
        self.event_loop = type(asyncio.get_running_loop()).__module__.partition(".")[0]
        self._t_start = time.perf_counter()
        bar = _progress(cfg.progress, cfg.steps, self._start_step)
        self._bar = bar
        ok = False
        self.fitting = True
        try:
            try:
                await self._supervise()
                if self.interrupted is None:
                    await self._final_evaluation()
                self.tracer.close()
            except BaseExceptionGroup as eg:
                raise _first_error(eg) from None
            ok = True
            if (self.interrupted is None and cfg.checkpoint_at_end
                    and (not self.history or self.history[-1]["step"] + 1 == cfg.steps)):
                last = cfg.steps
                if ckpt.latest_checkpoint(self.output_dir) != ckpt.checkpoint_dir(self.output_dir, last):
                    await self.save_checkpoint()
            await self._journal_end()
        finally:
            self.fitting = False
            self.tracer.close()
            if bar is not None:
                bar.close()
            await self._write_reports(ok)
        return self.history

    async def _journal_end(self) -> None:
        if self._journal is None or self.groups is None:
            return
        try:
            sums = await self.groups.policy.weights_checksum()
        except AttributeError:  # a custom policy without checksums
            digest = None
        else:
            digest = weights_digest(sums)
        self._journal.end(self._policy_version, digest)

    async def _run_loops(self) -> None:
        try:
            async with anyio.create_task_group() as loops:
                loops.start_soon(self._rollout_loop, name="rollout loop")
                loops.start_soon(self._train_loop, loops.cancel_scope, name="train loop")
        except BaseExceptionGroup as eg:
            raise _first_error(eg) from None
        finally:
            # A run that failed trains no further step; its last precomputed calls finish or fail with
            # their batch's generate (or with the groups, when they close), unawaited.
            self._precomputed = None

    async def _supervise(self) -> None:
        """Run the loops; on a worker fault, restart and run them again (``trainer.restart``).
        Stateless-role faults are handled inside the rollout loop (:meth:`_replace_rollout`)."""
        fault: Exception | None = None
        while True:
            try:
                if fault is not None:
                    await self._recover(fault)
                await self._run_loops()
                return
            except Exception as e:
                policy = self.config.trainer.restart
                if not (self._owns_groups and len(self.restarts) < policy.max_restarts
                        and is_worker_fault(e, timeouts=policy.on_timeout)):
                    raise
                fault = e

    async def _recover(self, fault: Exception) -> None:
        """Close every group, start new actors in the same placement groups and restore the newest
        state this run saved; the journal is rewound to it, and the batches it recorded after it
        are generated again with the same weight versions."""
        t0 = time.perf_counter()
        point = self._last_checkpoint or self._resume
        log.warning("trainer.restart", error=describe(fault), restart=len(self.restarts) + 1,
                    from_checkpoint=str(point) if point else "start")
        record = fault_record("restart", fault, from_checkpoint=str(point) if point else None)
        self.restarts.append(record)
        self._pending_faults.append({"kind": "restart", "at": self._policy_version, "t": t0, "record": record})
        await self._release_groups(keep_pools=True)
        t = self.config.trainer
        self.buffer = self._new_buffer()
        self._cond, self._device = asyncio.Condition(), asyncio.Lock()
        self._exports = {0: None}
        self._sync_dtype = None
        self._exported = self._policy_version = self._rollout_version = 0
        self._next_gen = self._start_step = 0
        self._rollout_done = False
        self._restored = []
        self._generating, self._taken, self._precomputed = None, -1, None  # their calls died with the groups
        await self._start_groups()
        if point is not None:
            await self._restore(point)
        else:
            self.history = []
            if self.evaluator is not None:
                self.evaluator.restore([], 0)
            if self._initial_rng is not None:
                ckpt.set_rng_state(self._initial_rng)
        if self._metrics is not None:
            self._metrics.close()
        self._metrics = await anyio.to_thread.run_sync(self._make_metrics)
        if self._journal is not None and self._replay is None:
            journal = self._journal
            self._schedule = await anyio.to_thread.run_sync(
                lambda: journal.rewind(next_gen=self._next_gen, start_step=self._start_step))
        bar = getattr(self, "_bar", None)
        if bar is not None:
            bar.n = self._start_step
            bar.refresh()
        record.update(from_step=self._start_step, time_s=time.perf_counter() - t0)
        log.warning("trainer.restarted", from_step=self._start_step, seconds=round(time.perf_counter() - t0, 2))

    def _can_replace(self, error: Exception) -> bool:
        """A fault of the rollout pool (rollout or reward worker) that a replacement can cure."""
        t = self.config.trainer
        policy = t.restart
        if not (self._owns_groups and policy.replace_stateless and not t.colocated and self.groups is not None
                and len(self.restarts) < policy.max_restarts and is_worker_fault(error, timeouts=policy.on_timeout)):
            return False
        origin = fault_origin(error)
        return origin is None or origin in (self.groups.rollout.name, self.groups.reward.name)

    async def _replace_rollout(self, error: Exception, batch: int) -> None:
        """Kill the rollout pool's processes and start new ones in the same bundles; the caller
        then loads the weight version it needs and issues its batch again."""
        g = self.groups
        assert g is not None
        t0 = time.perf_counter()
        record = fault_record("replace", error, from_step=self._policy_version)
        self.restarts.append(record)
        self._pending_faults.append({"kind": "replace", "at": batch, "t": t0, "record": record, "busy": 0.0})
        log.warning("trainer.replace", error=describe(error), batch=batch, replacement=len(self.restarts))
        old = (g.rollout.name, g.reward.name)
        # Buffered batches are futures of the dying groups: re-home them on the training pool
        # (their data lives in the object store, owned by this process) before those groups close.
        # No stage deadline: the echo waits in the training processes' ordered lane behind the step
        # in progress, which has deadlines of its own.
        advantage = getattr(g.advantage, "_group", g.advantage)
        for item in [*self.buffer.peek_all(), *self._restored]:
            if getattr(item.batch, "group", None) in old:
                item.batch = advantage.echo(item.batch)
            if getattr(item.scores, "group", None) in old:
                item.scores = advantage.echo(item.scores)
        dead = self._parts[0]
        new = build_rollout_part(self.config, self._overrides, self._pools[0])
        self._parts = [new, *self._parts[1:]]  # closed with the rest on any later failure
        with contextlib.suppress(Exception):
            await dead.close()  # kills the old processes; the placement group stays
        await new.setup()
        timeout = self.config.trainer.stage_timeout_s
        fresh = _with_deadlines(Groups(rollout=new["rollout"], reward=new["reward"], policy=g.policy,
                                       advantage=g.advantage), timeout)
        g.rollout, g.reward = fresh.rollout, fresh.reward
        self._rollout_version = 0  # new engines hold the initial weights
        await self._prepare_sync()  # the new engines' weight dtype; a collective weight channel is reopened
        record["time_s"] = time.perf_counter() - t0
        log.warning("trainer.replaced", batch=batch, seconds=round(record["time_s"], 2))

    async def _write_reports(self, ok: bool) -> None:
        cfg = self.config.trainer
        try:
            if cfg.trace:
                await anyio.to_thread.run_sync(self.tracer.write, self.output_dir / "trace.json")
            if cfg.plot and self.history:
                from asyncrl.pipelines.report import plot_report

                history, spans = list(self.history), list(self.tracer.spans)
                evals = list(self.evaluator.records) if self.evaluator is not None else None
                await anyio.to_thread.run_sync(
                    lambda: plot_report(history, spans, self.output_dir / "report.png", evals=evals))
        except Exception as e:  # reports never hide the run's own outcome
            log.warning("report.failed", error=repr(e))

    def _seed(self, step: int) -> int:
        return self.config.trainer.seed * 1_000_003 + step

    def _target_version(self, i: int) -> int:
        return max(0, i - self.config.trainer.max_staleness)

    async def _rollout_loop(self) -> None:
        """Consumes prompt batches and exported weights; produces RolloutBatch items."""
        assert self._cond is not None and self._device is not None and self._loader is not None
        cfg = self.config.trainer
        for item in self._restored:
            await self.buffer.put(item)
        self._restored = []
        i = self._next_gen
        while i < cfg.steps + self.buffer.statistics().dropped:
            version = await self._version_for(i)
            while True:
                try:
                    item = await self._produce(i, version)
                    break
                except Exception as e:
                    self._generating = None  # a failed batch is not trained; nothing precomputes from it
                    if not self._can_replace(e):
                        raise
                    await self._replace_rollout(e, i)  # then the same batch again: same prompts, seed, version
            if self._journal is not None:
                self._journal.batch(i, prompts=self._loader.indices(i), seed=self._seed(i), version=version,
                                    rows=self.config.trainer.batch_size)
            await self.buffer.put(item)
            self._generating = None  # in the buffer now
            async with self._cond:
                self._next_gen = i = i + 1
                self._cond.notify_all()
        async with self._cond:
            self._rollout_done = True
            self._cond.notify_all()

    async def _version_for(self, i: int) -> int:
        """The weight version batch `i` is generated with, once it is published: the journal's
        (replay, resume), else ``fixed_lag``'s or the newest (``latest``)."""
        assert self._cond is not None
        cfg = self.config.trainer
        planned = self._schedule.get(i)
        need = planned if planned is not None else self._target_version(i)
        async with self._cond:
            await self._cond.wait_for(lambda: self._exported >= need)
            if planned is not None:
                if planned >= self._rollout_version:
                    return planned
                log.warning("journal.diverged", batch=i, recorded=planned, loaded=self._rollout_version,
                            detail="the recorded version is older than the loaded weights; using the loaded ones")
                return self._rollout_version
            # fixed_lag: exactly `need`, except after a resume that extended a finished run, when
            # older weights are gone and the batch gets the (fresher) loaded ones
            return max(need, self._rollout_version) if cfg.rollout_weights == "fixed_lag" else self._exported

    async def _produce(self, i: int, version: int) -> RolloutBatch:
        """Load `version` if the engines are behind, evaluate it when due, generate batch `i` and
        score it."""
        assert self._device is not None and self._loader is not None
        g, cfg = self.groups, self.config.trainer
        assert g is not None
        async with self._device if cfg.colocated else _null():
            if self._sleep and await self._wake(g) and version == self._rollout_version:
                with self.tracer.span("weight_sync", track=g.rollout.name, version=version):
                    await self._load(g, self._exports[version])  # level 2: the same version again
            if version > self._rollout_version:
                with self.tracer.span("weight_sync", track=g.rollout.name, version=version):
                    await self._load(g, self._exports[version])  # weight sync (rollout side)
                self._rollout_version = version
                for v in [v for v in self._exports if v < version]:
                    del self._exports[v]  # older exports are never loaded again
            if self.evaluator is not None and self.evaluator.due(version):
                await self._evaluate(version)
            t0 = time.perf_counter()
            gen = self.tracer.watch(stages.generate(g, self._loader.batch(i), seed=self._seed(i)),
                                    "generate", step=i, version=version)
            self._generating = (i, version, gen)
            self._precompute_next()  # the train loop may be waiting for this very batch
            sc = self.tracer.watch(stages.score(g, gen), "score", step=i)
            scores = (await sc)["scores"]
            if self._sleep:  # release the rollout's memory while the policy trains
                await g.rollout.sleep()
        return RolloutBatch(step=i, version=version, batch=gen, scores=sc,
                            reward_mean=float(scores.float().mean()), gen_time=time.perf_counter() - t0)

    async def _train_loop(self, loops: anyio.CancelScope) -> None:
        """Consumes RolloutBatch items; produces one policy version per step and its metrics."""
        assert self._cond is not None and self._device is not None
        g, cfg = self.groups, self.config.trainer
        assert g is not None
        self._taken = self._start_step - 1
        for step in range(self._start_step, cfg.steps):
            t_wait = time.perf_counter()
            try:
                item = await self.buffer.get(self._policy_version)
            except anyio.EndOfStream:
                raise RuntimeError(f"the rollout loop ended before step {step}") from None
            self._taken = step
            t0 = time.perf_counter()
            self._note_resumed(step, item, t0)
            if self._journal is not None:
                self._journal.step(step, batch=item.step, version=item.version)
            async with self._device if cfg.colocated else _null():
                with self.tracer.span("train_step", step=step):
                    metrics = await self._train_step(g, item, step)
            t1 = time.perf_counter()
            self._note_trained(t0, t1)
            metrics.update({
                "time/step": t1 - t_wait, "time/train": t1 - t0, "time/wait_rollout": t0 - t_wait,
                "time/generate": item.gen_time, "time/elapsed": t1 - self._t_start,
            })
            self._record(step, metrics)
            saved = False
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                await self.save_checkpoint()
                saved = True
            if self._on_step is not None:
                self._on_step(self, step, metrics)
            if self._stop is not None and step + 1 < cfg.steps:
                self._discard_precomputed()  # no next step: free the training workers' lane for the save
                path = self._last_checkpoint if saved else await self.save_checkpoint()
                self.interrupted = Interruption(self._stop, step + 1, cfg.steps, path)
                log.warning("trainer.stopped", reason=self._stop, steps_done=step + 1, checkpoint=str(path))
                break
        loops.cancel()  # nothing else is needed from the rollout loop

    def _note_resumed(self, step: int, item: RolloutBatch, t_got: float) -> None:
        """Fill ``interrupted_s`` of the recoveries this step's batch ends. A replacement held
        training up for the time from the fault until the re-issued batch reached training, less
        the time training spent computing steps meanwhile (it waits in the buffer or in a
        checkpoint for the lost batch). A restart: from the fault until the first step not done
        before it got its batch (restart, restore and recomputed steps included)."""
        for entry in list(self._pending_faults):
            if entry["kind"] == "replace" and item.step == entry["at"]:
                entry["record"]["interrupted_s"] = max(0.0, t_got - entry["t"] - entry["busy"])
            elif entry["kind"] == "restart" and step >= entry["at"]:
                entry["record"]["interrupted_s"] = max(0.0, t_got - entry["t"])
            else:
                continue
            self._pending_faults.remove(entry)

    def _note_trained(self, t_start: float, t_end: float) -> None:
        """Count the training time after each pending replacement's fault (see :meth:`_note_resumed`)."""
        for entry in self._pending_faults:
            if entry["kind"] == "replace":
                entry["busy"] += max(0.0, t_end - max(t_start, entry["t"]))

    async def _train_step(self, g: Groups, item: RolloutBatch, step: int) -> dict[str, Any]:
        """The training-pool stages of one batch, in the canonical order (``old_log_prob``,
        ``ref_log_prob`` and ``values`` possibly issued already, see :meth:`_precompute_next`)."""
        w = self.tracer.watch
        pre, self._precomputed = self._precomputed, None
        if pre is not None and not pre.matches(item, self._policy_version):
            log.debug("precompute.discarded", step=step, batch=item.step, precomputed_batch=pre.batch_index,
                      precomputed_step=pre.step)
            self._discard(pre)
            pre = None
        if pre is not None:
            self.precompute_stats["used"] += 1
            old, ref, vals = pre.old, pre.ref, pre.vals
        else:
            old, ref, vals = self._first_stages(g, item.batch, step)
        adv = w(stages.advantages(g, item.batch, item.scores, old, ref, vals, self._algo), "advantages", step=step)
        crit = stages.critic_update(g, adv)
        crit = w(crit, "critic_update", step=step) if crit is not None else None
        act = w(stages.actor_update(g, adv), "actor_update", step=step)
        exported = w(self._export(g), "export_weights", step=step)
        staleness = self._policy_version - item.version
        async with self._cond:  # type: ignore[union-attr]
            self._exports[self._policy_version + 1] = exported  # weight sync (policy side): publish
            self._exported = self._policy_version + 1
            self._cond.notify_all()  # type: ignore[union-attr]
        self._precompute_next()  # the next step's first stages, right behind this export on the workers
        metrics: dict[str, Any] = {}
        if crit is not None:
            metrics.update(stages.mean_metrics(await crit, "critic"))
        metrics.update(stages.mean_metrics(await act, "actor"))
        self._policy_version += 1
        stats = self.buffer.statistics()
        metrics.update({
            "version": self._policy_version, "reward/mean": item.reward_mean,
            "staleness/mean": float(staleness), "staleness/max": staleness, "staleness/dropped": stats.dropped,
            "buffer/size": stats.size, "buffer/peak": stats.peak, "batch/version": item.version,
        })
        return metrics

    def _first_stages(self, g: Groups, batch: Any, step: int, **span: Any) -> tuple[Any, Any, Any]:
        """Issue ``old_log_prob``, ``ref_log_prob`` and ``values`` of `batch` (None for an absent role)."""
        w = self.tracer.watch
        old = stages.old_log_prob(g, batch, bypass=self.config.actor.rollout_correction.bypass_mode != "off")
        old = w(old, "old_log_prob", step=step, **span) if old is not None else None  # None: the bypass
        ref = stages.ref_log_prob(g, batch)
        ref = w(ref, "ref_log_prob", step=step, **span) if ref is not None else None
        vals = stages.values(g, batch)
        vals = w(vals, "values", step=step, **span) if vals is not None else None
        return old, ref, vals

    def _next_batch(self, step: int) -> tuple[int, Any] | None:
        """``(index, generate future)`` of the batch ``buffer.get(step)`` will return, when that is
        already decided: the first buffered batch within the staleness bound of `step` (older ones
        are dropped), else the batch whose generate is in flight if it is within the bound; None
        while that batch is not issued yet."""
        k = self.config.trainer.max_staleness
        for it in self.buffer.peek_all():
            if step - it.version <= k:
                return it.step, it.batch
        if self._generating is not None:
            i, version, gen = self._generating
            if step - version <= k:
                return i, gen
        return None

    def _precompute_next(self) -> None:
        """Issue the next step's ``old_log_prob``/``ref_log_prob``/``values`` now, if it is certain
        which batch it trains and with which weights (``trainer.precompute_log_probs``).

        The next step is ``self._exported`` (its weights: the export issued last, so on each
        training worker the calls run right after it, in its ordered lane, with exactly the weights
        the step trains from); its batch is the one :meth:`_next_batch` names, once its generate is
        issued (so nothing on the training workers waits for a generate that is not running). Not
        past the last step, not after a stop was requested, not once the train loop has taken that
        step's batch (it issues them itself then), not while restored batches are being buffered. Called when a
        step's export is published and when a generate is issued. The calls carry no stage deadline:
        they may wait a whole step for their turn; the step's ``advantages`` call, which waits for
        them, carries it."""
        if not self._precompute or self._stop is not None or self._restored or self.groups is None:
            return
        step = self._exported
        if step >= self.config.trainer.steps or self._taken >= step:
            return
        nxt = self._next_batch(step)
        if nxt is None:
            return
        index, batch = nxt
        pre = self._precomputed
        if pre is not None:
            if pre.step == step and pre.batch is batch:
                return  # issued already
            self._discard_precomputed()  # another batch (regenerated after a replacement)
        old, ref, vals = self._first_stages(_without_deadlines(self.groups), batch, step, precomputed=True)
        self._precomputed = _Precomputed(step=step, batch_index=index, batch=batch, old=old, ref=ref, vals=vals)
        self.precompute_stats["issued"] += 1

    def _discard_precomputed(self) -> None:
        pre, self._precomputed = self._precomputed, None
        if pre is not None:
            self._discard(pre)

    def _discard(self, pre: _Precomputed) -> None:
        pre.discard()
        self.precompute_stats["discarded"] += 1

    def _record(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **metrics}
        self.history.append(row)
        if self._metrics is not None:
            self._metrics.write(step, metrics)
        bar = getattr(self, "_bar", None)
        if bar is not None:
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", stale=metrics["staleness/max"],
                            step_s=f"{metrics['time/step']:.2f}", refresh=False)
            bar.update(1)
        if bar is not None and step % 10 and step + 1 != self.config.trainer.steps:
            return  # the bar shows every step; the log gets every 10th
        log.info("train.step", step=step, reward=round(metrics["reward/mean"], 4),
                 staleness=metrics["staleness/max"], step_s=round(metrics["time/step"], 3),
                 pg_loss=round(metrics.get("actor/pg_loss", math.nan), 4))

    # ---- checkpoints ---------------------------------------------------------------------------

    async def save_checkpoint(self) -> Path:
        """Write a checkpoint of the state after the last finished step (atomic; see
        :mod:`asyncrl.pipelines.checkpoint`). Waits until the rollout loop has generated
        every batch the current versions allow, so the saved buffer is complete."""
        g, t = self.groups, self.config.trainer
        assert g is not None and self._cond is not None
        step = self._policy_version  # steps done == versions
        ahead = min(step + 1 + t.max_staleness, t.steps + self.buffer.statistics().dropped)
        async with self._cond:
            await self._cond.wait_for(lambda: self._rollout_done or self._next_gen >= ahead or step >= t.steps)
        final = ckpt.checkpoint_dir(self.output_dir, step)
        tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
        await anyio.to_thread.run_sync(_fresh_dir, tmp)
        with self.tracer.span("checkpoint", step=step):
            saves = [g.policy.save(str(tmp / "policy"))]
            if g.critic is not None:
                saves.append(g.critic.save(str(tmp / "critic")))
            await asyncio.gather(*saves)
            items = self.buffer.peek_all()
            buffered = []
            for it in items:
                td = await it.batch
                td.update(await it.scores)
                buffered.append({"step": it.step, "version": it.version, "reward_mean": it.reward_mean,
                                 "gen_time": it.gen_time, "batch": ckpt.batch_to_plain(td)})
            state = {
                "step": step, "policy_version": self._policy_version, "rollout_version": self._rollout_version,
                "next_gen": self._next_gen, "dropped": self.buffer.statistics().dropped,
                "rng": ckpt.rng_state(), "config": to_dict(self.config),
                "fingerprint": config_fingerprint(self.config), "history": list(self.history),
                "evals": list(self.evaluator.records) if self.evaluator is not None else [],
            }

            def write() -> None:  # serialising, hashing, fsync: off the event loop
                torch.save(buffered, tmp / "buffer.pt")
                (tmp / "state.json").write_text(json.dumps(state))
                ckpt.commit(tmp, final)
                ckpt.prune(self.output_dir, t.keep_checkpoints)

            await anyio.to_thread.run_sync(write)
            self._last_checkpoint = final
        log.info("checkpoint.saved", step=step, path=str(final))
        return final

    async def _restore(self, path: Path) -> None:
        g = self.groups
        assert g is not None
        state = ckpt.read_state(path)
        loads = [g.policy.load(str(path / "policy"))]
        if g.critic is not None:
            loads.append(g.critic.load(str(path / "critic")))
        await asyncio.gather(*loads)
        step = int(state["step"])
        self._start_step = step
        self._policy_version = self._exported = step
        self._next_gen = int(state["next_gen"])
        ckpt.set_rng_state(state["rng"])
        self.history = [h for h in state.get("history", []) if h["step"] < step]
        if self.evaluator is not None:
            self.evaluator.restore(state.get("evals", []), step)
        if step > 0:  # the rollout engines start at version 0: give them the restored weights
            exported = self._export(g)
            await self._load(g, exported)
            self._exports = {step: exported}
            self._rollout_version = step
        buffered = await anyio.to_thread.run_sync(lambda: torch.load(path / "buffer.pt", weights_only=True))
        for b in buffered:
            td = ckpt.plain_to_batch(b["batch"])
            fut = g.advantage.echo(td)
            self._restored.append(RolloutBatch(step=b["step"], version=b["version"], batch=fut,
                                               scores=fut.select("scores"), reward_mean=b["reward_mean"],
                                               gen_time=b["gen_time"]))
        log.info("checkpoint.restored", step=step, path=str(path), buffered=len(buffered))


class GRPOTrainer(Trainer):
    """GRPO: group-relative advantages from ``algorithm.group_size`` responses per prompt, no critic."""

    algorithm = "grpo"


class PPOTrainer(Trainer):
    """PPO: a critic, GAE advantages, optional KL penalty in the reward."""

    algorithm = "ppo"


def make_trainer(config: JobConfig, **kwargs: Any) -> Trainer:
    """The trainer class for ``config.algorithm.name``."""
    cls = GRPOTrainer if config.algorithm.name == "grpo" else PPOTrainer
    return cls(config, **kwargs)


@contextlib.asynccontextmanager
async def _null() -> Any:
    yield


def _progress(enabled: bool, total: int, initial: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def _first_error(eg: BaseExceptionGroup) -> BaseException:
    """The first real error of a task group (a lone error is raised as itself)."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            leaves.append(e)

    walk(eg)
    real = [e for e in leaves if not isinstance(e, (asyncio.CancelledError, anyio.get_cancelled_exc_class()))]
    # A worker's death is the cause; a broken group or a failed input elsewhere is its consequence.
    deaths = [e for e in real if isinstance(root_cause(e), WorkerDiedError)]
    return deaths[0] if deaths else real[0] if real else leaves[0]


def _fresh_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _import_ray() -> None:
    import ray  # noqa: F401  (a second of imports, kept off the event loop)


def weights_digest(checksums: Mapping[str, str]) -> str:
    """One sha256 over a ``{name: checksum}`` dict of weights (order-independent)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(dict(sorted(checksums.items()))).encode()).hexdigest()


class _Deadlined:
    """A worker group whose every call carries a deadline (``trainer.stage_timeout_s``)."""

    def __init__(self, group: Any, timeout: float) -> None:
        self._group = group
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._group, name)
        return attr.options(timeout=self._timeout) if isinstance(attr, GroupMethod) else attr

    def __repr__(self) -> str:
        return f"<{self._group!r} with a {self._timeout:g} s deadline per call>"


def _without_deadlines(g: Groups) -> Groups:
    unwrap = lambda x: x._group if isinstance(x, _Deadlined) else x  # noqa: E731
    return Groups(rollout=unwrap(g.rollout), reward=unwrap(g.reward), policy=unwrap(g.policy),
                  advantage=unwrap(g.advantage), reference=unwrap(g.reference), critic=unwrap(g.critic))


def _with_deadlines(g: Groups, timeout: float | None) -> Groups:
    if timeout is None:
        return g
    wrap = lambda x: _Deadlined(x, timeout) if x is not None else None  # noqa: E731
    return Groups(rollout=wrap(g.rollout), reward=wrap(g.reward), policy=wrap(g.policy),
                  advantage=wrap(g.advantage), reference=wrap(g.reference), critic=wrap(g.critic))
