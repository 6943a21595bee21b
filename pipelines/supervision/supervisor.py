"""Recovery: a supervisor around the loops (``trainer.restart``, docs/reliability.md).

The loops run inside :meth:`Supervisor.run`. Two recoveries (which faults qualify:
:mod:`asyncrl.pipelines.supervision.recovery`):

* **Replace** -- a rollout or reward worker died or hung. The rollout loop asks
  :meth:`Supervisor.can_replace` and calls :meth:`Supervisor.replace_rollout`: the rollout
  pool's processes are killed and new ones start in the same bundles; the loop then loads the
  version the batch needs and generates it again. Training goes on from the buffer.
* **Restart** -- any other worker fault ends the loops. The supervisor asks for a new attempt
  (:meth:`~asyncrl.pipelines.run.run.Attempts.restart`, a new :class:`~asyncrl.pipelines.run.run.Run`):
  every group closed, new actors in the same placement groups (pools of their own are placed again,
  waiting for capacity: a lost node took its bundles), a new loop state restored from the newest
  checkpoint this run saved (or the run's start), the journal rewound so the steps after the
  checkpoint recompute exactly what was lost; the trainer goes on from it and runs the loops again.

Each recovery adds a record to :attr:`Supervisor.restarts`; its ``interrupted_s`` is measured
as the train loop reports the steps after the fault (:meth:`note_resumed`, :meth:`note_trained`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio
import anyio.to_thread
import structlog

from asyncrl import WorkerDiedError
from asyncrl.pipelines.loop.deadlines import unwrap, with_deadlines
from asyncrl.pipelines.job.elastic import RolloutRangeError
from asyncrl.pipelines.loop.loop_state import RolloutBatch
from asyncrl.pipelines.supervision.recovery import describe, fault_origin, fault_record, is_worker_fault, root_cause
from asyncrl.pipelines.loop.stages import Groups

if TYPE_CHECKING:
    from pathlib import Path
    from asyncrl.pipelines.job.config import JobConfig
    from asyncrl.pipelines.run.build import Workers
    from asyncrl.pipelines.run.run import Run
    from asyncrl.pipelines.loop.weights import WeightSync

__all__ = ["Supervisor", "first_error"]


log = structlog.get_logger("asyncrl.pipelines")


def first_error(eg: BaseExceptionGroup) -> BaseException:
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


class Supervisor:
    """Runs the loops and recovers them from worker faults, within ``trainer.restart``'s limits.

    Args:
        config: the run's configuration (``trainer.restart``'s policy, the rollout pool's range).
        current: the attempt the loops run now (its groups and loop state).
        restart: starts a new attempt from a checkpoint (None: the run's start) after a fault
            (:meth:`~asyncrl.pipelines.run.run.Attempts.restart`).
        last_checkpoint: the newest checkpoint of this run (a restart goes on from it).
        workers: the run's workers (the rollout pool is replaced or resized through them).
        weights: the weight sync (a new rollout pool's engines are prepared through it).
        owns_groups: False when the caller passed started groups (nothing is then replaced or restarted).
        fitting: whether ``fit()`` runs its loops (a resize acts only then).
    """

    def __init__(self, config: JobConfig, *, current: Callable[[], Run],
                 restart: Callable[[Path | None], Awaitable[Run]], last_checkpoint: Callable[[], Path | None],
                 workers: Workers, weights: WeightSync, owns_groups: bool, fitting: Callable[[], bool]) -> None:
        self._config, self._current, self._new_run, self._last_checkpoint = config, current, restart, last_checkpoint
        self._workers, self._weights, self._owns_groups, self._fitting = workers, weights, owns_groups, fitting
        self.restarts: list[dict[str, Any]] = []
        """One record per recovery (see :attr:`~asyncrl.pipelines.trainers.trainer.Trainer.restarts`)."""
        self._pending: list[dict[str, Any]] = []  # recoveries whose interruption is still being measured
        self._scale: tuple[int, float, str, asyncio.Future[None]] | None = None  # a pending resize

    async def run(self, loops: Callable[[], Awaitable[None]], resume: Callable[[Run], Awaitable[None]]) -> None:
        """Run `loops`; on a worker fault, restart: :meth:`_restart` starts the attempt to go on from and
        `resume` (the trainer's) takes it before `loops` run again. Faults of the stateless rollout pool are
        handled inside the rollout loop (:meth:`replace_rollout`)."""
        fault: Exception | None = None
        while True:
            try:
                if fault is not None:
                    await resume(await self._restart(fault))
                await loops()
                self._fail_scale()
                return
            except Exception as e:
                self._fail_scale()
                policy = self._config.trainer.restart
                if not (self._owns_groups and self._recoveries() < policy.max_restarts
                        and is_worker_fault(e, timeouts=policy.on_timeout)):
                    raise
                fault = e

    async def _restart(self, fault: Exception) -> Run:
        """A new attempt from the newest state this run saved, which it returns (the current one is left alone):
        new actors in the same placement groups, a new loop state, the journal rewound to it (the batches it
        recorded after it are generated again with the same weight versions)."""
        t0 = time.perf_counter()
        point = self._last_checkpoint()
        log.warning("trainer.restart", error=describe(fault), restart=self._recoveries() + 1,
                    from_checkpoint=str(point) if point else "start")
        record = fault_record("restart", fault, from_checkpoint=str(point) if point else None)
        self.restarts.append(record)
        self._pending.append({"kind": "restart", "at": self._current().state.policy_version, "t": t0,
                              "record": record})
        run = await self._new_run(point)
        record.update(from_step=run.state.start_step, time_s=time.perf_counter() - t0)
        log.warning("trainer.restarted", from_step=run.state.start_step, seconds=round(time.perf_counter() - t0, 2))
        return run

    def replica_lost(self, error: Exception, rank: int) -> dict[str, Any]:
        """A rollout replica's engine died (``ReplicaLostError`` of `rank`) and is replaced alone, beside the
        others (streaming: :meth:`StreamRollout._replace_replica`); returns its ``restarts`` record (kind
        ``replace_replica``; the caller fills ``time_s`` once the new engine serves). It does not count against
        ``max_restarts``: the pool and the run go on."""
        record = fault_record("replace_replica", error, from_step=self._current().state.policy_version, rank=rank,
                              time_s=None)  # (None until the new engine serves: a run may end first)
        self.restarts.append(record)
        log.warning("trainer.replace_replica", error=describe(error), rank=rank)
        return record

    def process_lost(self, error: Exception, ranks: list[int]) -> dict[str, Any]:
        """A rollout-pool process died and is replaced alone, beside the others (streaming:
        :meth:`StreamRollout._replace_process`; its ranks `ranks`); returns its ``restarts`` record (kind
        ``replace_process``; the caller fills ``time_s`` once the new process serves, or ``failed`` when it did not
        start and the pool was replaced). It does not count against ``max_restarts``: the pool and the run go on."""
        record = fault_record("replace_process", error, from_step=self._current().state.policy_version,
                              rank=ranks[0], ranks=list(ranks), time_s=None)
        self.restarts.append(record)
        log.warning("trainer.replace_process", error=describe(error), ranks=ranks)
        return record

    def _recoveries(self) -> int:
        """Recoveries that count against ``trainer.restart.max_restarts`` (pool replacements and restarts)."""
        return sum(1 for r in self.restarts if r["kind"] in ("replace", "restart"))

    def can_replace(self, error: Exception) -> bool:
        """A fault of the rollout pool (rollout or reward worker) that a replacement can cure."""
        t, g = self._config.trainer, self._current().groups
        policy = t.restart
        if not (self._owns_groups and policy.replace_stateless and not t.colocated and g is not None
                and self._recoveries() < policy.max_restarts and is_worker_fault(error, timeouts=policy.on_timeout)):
            return False
        origin = fault_origin(error)
        return origin is None or origin in (g.rollout.name, g.reward.name)

    async def replace_rollout(self, error: Exception, batch: int) -> None:
        """Kill the rollout pool's processes and start new ones in the same bundles (or, for a pool with
        placement groups of its own, wherever the cluster holds it now); the caller then loads the
        weight version it needs and issues its batch again."""
        t0 = time.perf_counter()
        record = fault_record("replace", error, from_step=self._current().state.policy_version)
        self.restarts.append(record)
        self._pending.append({"kind": "replace", "at": batch, "t": t0, "record": record, "busy": 0.0})
        log.warning("trainer.replace", error=describe(error), batch=batch, replacement=len(self.restarts))
        await self._new_rollout()
        record["time_s"] = time.perf_counter() - t0
        log.warning("trainer.replaced", batch=batch, seconds=round(record["time_s"], 2))

    async def _new_rollout(self, size: int | None = None) -> None:
        """New rollout-pool processes (`size` workers, else as many as before) in place of the current ones."""
        run = self._current()
        g, s = run.groups, run.state
        assert g is not None
        old = (g.rollout.name, g.reward.name)
        # Buffered batches are futures of the dying groups: re-home them on the training pool
        # (their data lives in the object store, owned by this process) before those groups close.
        # No stage deadline: the echo waits in the training processes' ordered lane behind the step
        # in progress, which has deadlines of its own.
        advantage = unwrap(g.advantage)
        for item in [*s.buffer.peek_all(), *s.restored]:
            if getattr(item.batch, "group", None) in old:
                item.batch = advantage.echo(item.batch)
            if getattr(item.scores, "group", None) in old:
                item.scores = advantage.echo(item.scores)
        new = await self._workers.replace_rollout(size)
        fresh = with_deadlines(Groups(rollout=new["rollout"], reward=new["reward"], policy=g.policy,
                                      advantage=g.advantage), self._config.trainer)
        g.rollout, g.reward = fresh.rollout, fresh.reward
        await self._weights.prepare(g, s)  # new engines: version 0, their weight dtype; a collective channel reopened

    async def scale_rollout(self, n: int) -> None:
        """Resize the rollout pool to `n` workers on one node; returns once the new workers took over. Batch
        mode: between two batches (the batch in flight finishes first); the new workers load the next batch's
        weight version before they generate it. Streaming: beside the groups in flight, which drain or are
        handed over (:mod:`~asyncrl.pipelines.rollout.stream_scale`). Raises ``ValueError`` for a bad `n`,
        :class:`~asyncrl.pipelines.job.elastic.RolloutRangeError` for `n` outside ``trainer.rollout_workers``'s
        range, and ``RuntimeError`` where the run cannot scale (a shared or colocated pool, not generating)."""
        t = self._config.trainer
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"scale_rollout needs a positive number of rollout workers, got {n!r}")
        self._check_pool("scale_rollout")
        r = t.rollout_range
        if n not in r:
            raise RolloutRangeError(f"scale_rollout({n}) is outside trainer.rollout_workers={r}; ask for {r.min} to "
                                    f"{r.max} workers, or widen the range")
        self._check_running("scale_rollout")
        await self._submit(n, t.rollout_drain_s, "scale")

    async def preempt_rollout(self, rank: int, drain_s: float = 0.0) -> None:
        """A preemption notice for rollout worker `rank` (streaming): the pool is replaced by one without it
        (one worker fewer, or as many on other capacity where that would fall below the range's minimum); its
        groups in flight are handed over after `drain_s` (0: at once, at a decoding-step boundary) and issued
        again on the new pool with the same seeds. Returns once the new pool took over and the old one is
        closed."""
        t = self._config.trainer
        self._check_pool("preempt_rollout")
        if not t.mode().hands_over:
            raise RuntimeError("preempt_rollout hands generations in flight over to a new pool: it needs "
                               f"trainer.rollout_mode=stream (in {t.rollout_mode} mode a lost worker is replaced: "
                               "trainer.restart)")
        self._check_running("preempt_rollout")
        n = self._workers.parts[0]["rollout"].world_size if self._workers.parts else 0
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
            raise ValueError(f"preempt_rollout needs a rollout rank in 0..{n - 1}, got {rank!r}")
        await self._submit(max(n - 1, t.rollout_range.min), drain_s, "preempt")

    def _check_pool(self, what: str) -> None:
        t = self._config.trainer
        if not (self._owns_groups and t.own_pools and not t.colocated):
            raise RuntimeError(f"{what} needs a rollout pool of its own: set trainer.rollout_placement "
                               "(and trainer.colocated=false)")

    def _check_running(self, what: str) -> None:
        if not self._fitting() or self._current().state.rollout_done:
            raise RuntimeError(f"{what} acts while fit() generates batches; this run is not generating")
        if self._scale is not None:
            raise RuntimeError(f"a {self._scale[2]} to {self._scale[0]} rollout workers is still pending; await it "
                               "first")

    async def _submit(self, n: int, drain_s: float, reason: str) -> None:
        fut = self.request_resize(n, drain_s, reason)
        s = self._current().state
        async with s.cond:
            s.cond.notify_all()  # the streaming scaler waits on the loop state
        await fut

    def request_resize(self, n: int, drain_s: float, reason: str) -> asyncio.Future[None]:
        """File a resize to `n` workers (the caller wakes the loop state's waiters); its future resolves when
        it is done (or failed, or the run stopped generating)."""
        assert self._scale is None, "one resize at a time"
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._scale = (n, drain_s, reason, fut)
        return fut

    def pending_resize(self) -> tuple[int, float, str, asyncio.Future[None]] | None:
        """The resize filed and not done yet: ``(workers, drain_s, reason, future)``."""
        return self._scale

    def resize_done(self, fut: asyncio.Future[None], error: BaseException | None) -> None:
        """The pending resize ended (with `error`, or done)."""
        if self._scale is not None and self._scale[3] is fut:
            self._scale = None
        if not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

    async def apply_scale(self, batch: int) -> None:
        """The rollout loop's call before it generates `batch`: carry out a pending :meth:`scale_rollout`."""
        if self._scale is None:
            return
        n, _, _, fut = self._scale
        try:
            if n != self._workers.parts[0]["rollout"].world_size:
                t0 = time.perf_counter()
                await self._new_rollout(n)
                log.info("trainer.scaled", rollout_workers=n, batch=batch, seconds=round(time.perf_counter() - t0, 2))
        except BaseException as e:
            self.resize_done(fut, e)
            raise
        self.resize_done(fut, None)

    def _fail_scale(self) -> None:
        """The loops ended: a pending resize will not happen."""
        if self._scale is not None:
            n, _, reason, fut = self._scale
            self._scale = None
            if not fut.done():
                fut.set_exception(RuntimeError(f"{reason} to {n} rollout workers did not happen: the run stopped "
                                               "generating"))

    def note_resumed(self, step: int, item: RolloutBatch, t_got: float) -> None:
        """Fill ``interrupted_s`` of the recoveries this step's batch ends. A replacement held
        training up for the time from the fault until the re-issued batch reached training, less
        the time training spent computing steps meanwhile (it waits in the buffer or in a
        checkpoint for the lost batch). A restart: from the fault until the first step not done
        before it got its batch (restart, restore and recomputed steps included)."""
        for entry in list(self._pending):
            if entry["kind"] == "replace" and item.step == entry["at"]:
                entry["record"]["interrupted_s"] = max(0.0, t_got - entry["t"] - entry["busy"])
            elif entry["kind"] == "restart" and step >= entry["at"]:
                entry["record"]["interrupted_s"] = max(0.0, t_got - entry["t"])
            else:
                continue
            self._pending.remove(entry)

    def note_trained(self, t_start: float, t_end: float) -> None:
        """Count the training time after each pending replacement's fault (see :meth:`note_resumed`)."""
        for entry in self._pending:
            if entry["kind"] == "replace":
                entry["busy"] += max(0.0, t_end - max(t_start, entry["t"]))
