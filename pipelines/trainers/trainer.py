"""`GRPOTrainer` and `PPOTrainer`: two named loops joined by a staleness-bounded buffer.

The two loops and the buffer between them are drawn in docs/pipelines.md ("How the trainer works").

* The **rollout loop** (:class:`~asyncrl.pipelines.rollout.rollout_loop.BatchRollout`) consumes prompt
  batches and exported weights; produces ``RolloutBatch`` items; waits for the version gate and
  for buffer space. The train loop reaches it through ``take``/``upcoming`` only, so another producer
  (built by ``trainer.rollout_mode``'s mode, :mod:`asyncrl.pipelines.job.modes`) can replace it.
* The **train loop** (:meth:`Trainer._train_loop`, below) consumes ``RolloutBatch`` items;
  produces one policy version per step (an ``export_weights`` future) and metrics; waits for
  the buffer.

Batch t is generated with weights ``max(0, t - max_staleness)`` (``fixed_lag``) or the newest exported
(``latest``): ``max_staleness=0`` is the synchronous loop (``pipelines/trainers/sync.py``). Per batch the stages
keep the canonical order (generate, score, log-probs, advantages, updates, export); the train loop is the only
producer of versions. Payloads move worker to worker as futures; the controller awaits scores, metrics and
weight-sync receipts only.

An attempt's groups, loop state and history are one :class:`~asyncrl.pipelines.run.run.Run` (a restart starts
a new one and hands it back, :meth:`Trainer._resume`). The rest observes the loops from the side, one visible
line each: recovery, checkpoints, the journal, precompute-ahead, weight sync, group building and per-call
deadlines, each in its own module.

Both loops run in an anyio task group: the first failure cancels the other.
**Shutdown order** (every path): (1) the loops end or are cancelled; (2) the tracer
stops; (3) on success the final checkpoint is written; (4) metrics, trace and plot
are flushed; (5) the rollout pool's workers close, then the training pool's; (6) the
placement groups are released.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import anyio
import anyio.to_thread
import structlog

import asyncrl
from asyncrl.resources import AsyncResource
from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.loop.buffer import StalenessBuffer
from asyncrl.pipelines.run.build import Workers, build_data, build_groups, build_rollout_part, simulated_policy
from asyncrl.pipelines.checkpoints.checkpointing import Checkpointer
from asyncrl.pipelines.job.config import ConfigError, JobConfig
from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.datasets.data import PromptLoader
from asyncrl.pipelines.loop.deadlines import with_deadlines
from asyncrl.pipelines.datasets.evaluation import Evaluator
from asyncrl.pipelines.supervision.interrupt import Interruption, RunAbandoned, handle_signals
from asyncrl.pipelines.loop.loop_state import LoopState, Rollout, RolloutBatch
from asyncrl.pipelines.loop.precompute import Precompute
from asyncrl.pipelines.run.run import Attempts, Run
from asyncrl.pipelines.supervision.recovery import is_worker_fault
from asyncrl.pipelines.run.reporting import RunReport
from asyncrl.pipelines.rollout.rollout_loop import RolloutServices  # (its module registers rollout_mode=batch)
from asyncrl.pipelines.run.run_journal import RunJournal, weights_digest
from asyncrl.pipelines.rollout import stream_replay as _stream_mode  # noqa: F401  (registers rollout_mode=stream)
from asyncrl.pipelines.loop.stages import Groups
from asyncrl.pipelines.supervision.supervisor import Supervisor, first_error
from asyncrl.pipelines.observe.trace import Tracer
from asyncrl.pipelines.loop.weights import WeightSync

__all__ = ["RolloutBatch", "Trainer", "GRPOTrainer", "PPOTrainer", "make_trainer", "build_groups", "build_rollout_part",
           "is_worker_fault", "weights_digest"]

log = structlog.get_logger("asyncrl.pipelines")


class Trainer(AsyncResource):
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
            :mod:`asyncrl.pipelines.commands.replay`); the config must be the journal's.
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
        self.config = config.validate(simulated_policy=simulated_policy(worker_overrides, groups))
        t = config.trainer
        self.owns_groups = groups is None
        """False when the caller passed started groups (the trainer then neither starts nor closes them)."""
        self.weights = WeightSync(self.config)
        self.tracer = Tracer(enabled=t.trace)
        self.checkpoints = Checkpointer(self.config, ckpt.resolve_resume(resume) if resume is not None else None,
                                        groups=lambda: self.groups, rollout=lambda: self.rollout,
                                        evaluator=lambda: self.evaluator, weights=self.weights, tracer=self.tracer)
        self.journal = RunJournal(self.config, lambda: self.groups, replay)
        """The run journal (an observer of the loops)."""
        if self.config.buffer_capacity < t.max_staleness + 1:
            raise ConfigError(f"trainer.buffer_capacity={self.config.buffer_capacity} cannot hold the "
                              f"{t.max_staleness + 1} batches rollout may run ahead; set it to at least max_staleness + 1")
        self.workers = Workers(self.config, worker_overrides)
        self._on_step = on_step
        self.attempts = Attempts(self.config, workers=self.workers, weights=self.weights, checkpoints=self.checkpoints,
                                 journal=self.journal, evaluator=lambda: self.evaluator, close=self.close)
        self.run = Run(with_deadlines(groups, t) if groups is not None else None, self.attempts.new_state())
        """The current attempt (its groups, loop state and history); a restart replaces it whole."""
        self.precompute = Precompute(self.config, self.tracer.watch, lambda: self.stop_reason is not None)
        self.fitting = False
        """True while :meth:`fit` runs its loops."""
        self.supervisor = Supervisor(self.config, current=lambda: self.run, restart=self.attempts.restart,
                                     last_checkpoint=lambda: self.last_checkpoint, workers=self.workers,
                                     weights=self.weights, owns_groups=self.owns_groups, fitting=lambda: self.fitting)
        self.output_dir = Path(t.output_dir)
        self.loader: PromptLoader | None = None
        self.evaluator: Evaluator | None = None
        """Held-out evaluation (``config.evaluation``); its ``records`` hold one row per evaluation."""
        self.report = RunReport(self.config, self.tracer)
        self.rollout: Rollout = t.mode().build(RolloutServices(
            config=self.config, current=lambda: self.run, loader=lambda: self.loader, evaluator=lambda: self.evaluator,
            tracer=self.tracer, weights=self.weights, journal=self.journal, supervisor=self.supervisor,
            precompute=self.precompute, report=self.report, workers=self.workers))
        """The producer of batches the train loop consumes (built by ``trainer.rollout_mode``'s mode)."""
        self.stop_reason: str | None = None
        """Why the run was asked to stop after the step in progress (:meth:`request_stop`), if it was."""
        self._algo = to_dict(config.algorithm)
        self._setup_done = False
        self.started_at = 0.0  # perf_counter when fit() started its loops
        self.interrupted: Interruption | None = None
        """Set when the run stopped early on :meth:`request_stop` (or SIGINT/SIGTERM in ``fit_sync``)."""
        self.abandoned: str | None = None
        """The signal that abandoned the step in progress (a second SIGINT/SIGTERM), if any."""
        self.event_loop: str | None = None
        """The controller's event loop the last ``fit()`` ran on (``"uvloop"`` or ``"asyncio"``)."""

    @property
    def groups(self) -> Groups | None:
        """The current attempt's worker groups (None until the trainer's own are started)."""
        return self.run.groups

    @property
    def state(self) -> LoopState:
        """Everything the current attempt's loops share."""
        return self.run.state

    @property
    def history(self) -> list[dict[str, Any]]:
        """The per-step metrics (after a restart: those up to its checkpoint, then the steps trained again)."""
        return self.run.history

    @property
    def buffer(self) -> StalenessBuffer[RolloutBatch]:
        """The staleness buffer between the loops."""
        return self.state.buffer

    @property
    def restarts(self) -> list[dict[str, Any]]:
        """One record per recovery: ``{"kind": "replace" | "restart" | "replace_replica" | "replace_process",
        "error_type", "error", "origin", "from_checkpoint", "from_step", "time_s", "interrupted_s"}``, plus the
        lost ``rank``/``ranks`` and a failed replacement's ``failed`` (each field: docs/reliability.md)."""
        return self.supervisor.restarts

    @property
    def precompute_stats(self) -> dict[str, int]:
        """``trainer.precompute_log_probs``: how many steps' first stages were issued ahead, used by
        their step, and discarded (their batch was regenerated or re-homed, or the run stopped)."""
        return self.precompute.stats

    @property
    def last_checkpoint(self) -> Path | None:
        """The newest checkpoint of this run: the last one it wrote, else the one it resumed from."""
        return self.checkpoints.latest

    # ---- lifecycle ---------------------------------------------------------------------------

    async def setup(self) -> "Trainer":
        """Start Ray (if needed), check the pools fit, start the workers, restore `resume`.

        The blocking parts (imports, checkpoint hashing, tokenizer, prompt encoding, sinks)
        run in threads, so the event loop keeps serving other tasks."""
        if self._setup_done:
            return self
        cfg = self.config
        await self.checkpoints.verify_resume()
        # first: a missing model extra, a corrupt GGUF or a prompt that cannot fit fails before any worker starts
        # (and a GGUF model is converted once here, so the workers load the cached directory)
        self.loader, self.evaluator = await asyncio.to_thread(build_data, cfg, self.output_dir)
        if self.owns_groups:
            await anyio.to_thread.run_sync(_import_ray)
            resources = await asyncrl.ainit(num_cpus=cfg.trainer.num_cpus)
            cfg.validate(cluster_cpus=float(resources.get("CPU", 0.0)), cluster_gpus=float(resources.get("GPU", 0.0)),
                         simulated_policy=self.workers.simulated_policy)
        self.run = await self.attempts.first(self.run.groups)
        await self.report.open(self.state.start_step, self.history, self.evaluator)
        await anyio.to_thread.run_sync(self.journal.open, self.checkpoints.resume, self.state, self.loader)
        self._setup_done = True
        return self

    async def close(self) -> None:
        """Release everything (idempotent): rollout workers, then training workers, then pools."""
        self.report.close()
        self.journal.close()
        await self.workers.release()

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.shield(self.close())  # a second cancellation must not leave workers running

    def fit_sync(self) -> list[dict[str, Any]]:
        """Set up, fit and close from synchronous code (runs its own event loop: uvloop's by
        default, ``trainer.event_loop``).

        SIGINT and SIGTERM are handled while it runs (main thread): the first stops after the
        step in progress and writes a checkpoint (``trainer.interrupted`` says where); a second
        abandons the step and raises :class:`~asyncrl.pipelines.supervision.interrupt.RunAbandoned`."""

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

    def request_stop(self, reason: str = "request") -> None:
        """Stop after the step in progress: finish it, write a checkpoint, and return from
        :meth:`fit` with :attr:`interrupted` set. Safe to call from the loop at any time."""
        if self.stop_reason is None:
            self.stop_reason = reason
            log.warning("trainer.stopping", reason=reason, step=self.state.policy_version,
                        detail="finishing the step in progress, then writing a checkpoint")

    async def scale_rollout(self, n: int) -> None:
        """Resize the rollout pool to `n` workers within ``trainer.rollout_workers``'s range: between two batches
        in batch mode, beside the groups in flight in streaming mode (:meth:`Supervisor.scale_rollout`)."""
        await self.supervisor.scale_rollout(n)

    async def preempt_rollout(self, rank: int, drain_s: float = 0.0) -> None:
        """A preemption notice for rollout worker `rank` (streaming): its groups in flight are handed over to a
        pool without it (:meth:`Supervisor.preempt_rollout`)."""
        await self.supervisor.preempt_rollout(rank, drain_s)

    async def save_checkpoint(self) -> Path:
        """Write a checkpoint of the state after the last finished step (see
        :meth:`~asyncrl.pipelines.checkpoints.checkpointing.Checkpointer.save`)."""
        return await self.checkpoints.save(self.state, self.history)

    # ---- the run -------------------------------------------------------------------------------

    async def fit(self) -> list[dict[str, Any]]:
        """Train for ``trainer.steps`` steps; returns the per-step metrics."""
        if not self._setup_done:
            raise RuntimeError("the trainer is not set up; use `async with trainer:` or `await trainer.setup()`")
        cfg = self.config.trainer
        self.event_loop = type(asyncio.get_running_loop()).__module__.partition(".")[0]
        self.started_at = time.perf_counter()
        self.report.start(self.state.start_step)
        self.fitting = True
        try:
            try:
                await self.supervisor.run(self._run_loops, self._resume)
                if self.interrupted is None:
                    await self.rollout.finish()
                self.tracer.close()
            except BaseExceptionGroup as eg:
                raise first_error(eg) from None
            if (self.interrupted is None and cfg.checkpoint_at_end
                    and (not self.history or self.history[-1]["step"] + 1 == cfg.steps)):
                if ckpt.latest_checkpoint(self.output_dir) != ckpt.checkpoint_dir(self.output_dir, cfg.steps):
                    await self.save_checkpoint()
            await self.journal.end(self.state, self.rollout)
        finally:
            self.fitting = False
            self.tracer.close()
            await self.report.finish(self.history, self.evaluator)
        return self.history

    async def _resume(self, run: Run) -> None:
        """After a restart: go on from the attempt the supervisor started (its loop state and history)."""
        self.run = run
        await self.report.open(self.state.start_step, self.history, self.evaluator)
        self.report.rewind(self.state.start_step)

    async def _run_loops(self) -> None:
        try:
            async with anyio.create_task_group() as loops:
                loops.start_soon(self.rollout.run, name="rollout loop")
                loops.start_soon(self._train_loop, loops.cancel_scope, name="train loop")
        except BaseExceptionGroup as eg:
            raise first_error(eg) from None
        finally:
            self.precompute.forget(self.state)  # a run that failed trains no further step: unawaited

    async def _train_loop(self, loops: anyio.CancelScope) -> None:
        """Consumes RolloutBatch items; produces one policy version per step and its metrics."""
        s, cfg = self.state, self.config.trainer
        s.taken = s.start_step - 1
        for step in range(s.start_step, cfg.steps):
            t_wait = time.perf_counter()
            item = await self.rollout.take(step)
            s.taken = step
            t0 = time.perf_counter()
            self.supervisor.note_resumed(step, item, t0)
            self.journal.step(step, item)
            async with s.device if cfg.colocated else contextlib.nullcontext():
                with self.tracer.span("train_step", step=step):
                    metrics = await self._train_step(item, step)
            t1 = time.perf_counter()
            self.supervisor.note_trained(t0, t1)
            metrics.update({
                "time/step": t1 - t_wait, "time/train": t1 - t0, "time/wait_rollout": t0 - t_wait,
                "time/generate": item.gen_time, "time/elapsed": t1 - self.started_at,
            })
            self.history.append({"step": step, **metrics})
            self.report.step(step, metrics)
            saved = await self.checkpoints.after_step(step, s, self.history, self.started_at)
            if self._on_step is not None:
                self._on_step(self, step, metrics)
            if self.stop_reason is not None and step + 1 < cfg.steps:
                self.precompute.discard(s)  # no next step: free the training workers' lane for the save
                path = self.checkpoints.last_written if saved else await self.save_checkpoint()
                self.interrupted = Interruption(self.stop_reason, step + 1, cfg.steps, path)
                log.warning("trainer.stopped", reason=self.stop_reason, steps_done=step + 1, checkpoint=str(path))
                break
        loops.cancel()  # nothing else is needed from the rollout loop

    async def _train_step(self, item: RolloutBatch, step: int) -> dict[str, Any]:
        """The training-pool stages of one batch, in the canonical order (``old_log_prob``,
        ``ref_log_prob`` and ``values`` possibly issued already, see :mod:`~asyncrl.pipelines.loop.precompute`)."""
        g, s, w = self.groups, self.state, self.tracer.watch
        assert g is not None
        old, ref, vals = self.precompute.take(g, s, item, step)
        adv = w(stages.advantages(g, item.batch, item.scores, old, ref, vals, self._algo), "advantages", step=step)
        samples = self.report.sample(g, adv, step, s.policy_version)  # samples.jsonl, cut behind the advantages
        crit = stages.critic_update(g, adv)
        crit = w(crit, "critic_update", step=step) if crit is not None else None
        act = w(stages.actor_update(g, adv), "actor_update", step=step)
        exported = w(self.weights.export(g), "export_weights", step=step)
        staleness = s.policy_version - item.version
        await self.weights.publish(s, s.policy_version + 1, exported)  # weight sync (policy side)
        self.precompute.issue_next(s, g, self.rollout)  # the next step's first stages, behind this export
        metrics: dict[str, Any] = {}
        if crit is not None:
            metrics.update(stages.mean_metrics(await crit, "critic"))
        metrics.update(stages.mean_metrics(await act, "actor"))
        metrics.update(await self.report.samples(step, samples))  # done by now: cut before the update ran
        s.trained()
        stats = s.buffer.statistics()
        metrics.update({
            "version": s.policy_version, "reward/mean": item.reward_mean,
            "staleness/mean": float(staleness), "staleness/max": staleness, "staleness/dropped": stats.dropped,
            "buffer/size": stats.size, "buffer/peak": stats.peak, "batch/version": item.version,
        })
        metrics.update(item.metrics)  # algorithm.filter_groups
        return metrics


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


def _import_ray() -> None:
    import ray  # noqa: F401  (a second of imports, kept off the event loop)
