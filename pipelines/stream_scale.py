"""Resizing a streaming run's rollout pool beside the groups in flight (``scale_rollout``, preemption, the
autoscaler).

::

    request (scale_rollout(n) / preempt_rollout(rank) / autoscaler)
      │ start n new workers in placement groups of their own       (old pool keeps generating; a failure
      │                                                             here fails the request, not the run)
      │ load the newest exported version into them, again while a newer one appears
      │ swap: admission issues new groups on the new pool from now   (epoch + 1; rollout_version = loaded)
      │ drain: the old pool's groups in flight finish there, up to the drain deadline
      │ hand over: the rest are cancelled (the engine drops them at its next decoding step) and issued again
      │            on the new pool with the same prompts and seeds   (StreamRollout._group's retry)
      ▼ finished groups' futures re-homed on the training pool; the old pool's workers closed, its
        placement groups released

The staleness bound is admission's (a group keeps its admission version ``v0``; the new pool holds at least
the version admission uses next), so a resize trains nothing twice and keeps ``max_staleness``. A new pool
never takes work before it holds the newest weights. A preemption is a resize that hands over at once
(``drain_s=0``): the pool loses the preempted worker, or keeps its size on other capacity when that would
fall below the range's minimum.

The autoscaler (``trainer.rollout_autoscale``) grows the pool by one worker after ``BUSY_STEPS`` steps in a
row that waited for their groups to finish generating (the trainer waits on generation), and shrinks it by
one after ``IDLE_STEPS`` steps in a row whose groups had all finished before the step asked (the engines are
ahead of training); within the range, and a grow the cluster cannot place fails alone (logged; the run goes
on at its size).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from asyncrl.pipelines.deadlines import with_deadlines
from asyncrl.pipelines.stages import Groups

__all__ = ["StreamScaler", "Resize", "BUSY_STEPS", "IDLE_STEPS"]

log = structlog.get_logger("asyncrl.pipelines")

BUSY_STEPS = 2
"""Steps in a row that waited for their groups to finish generating, before the autoscaler grows the pool."""
IDLE_STEPS = 2
"""Steps in a row whose groups all finished before the trainer asked for them, before the autoscaler shrinks."""


@dataclass
class Resize:
    """What a resize did (``trainer.rollout_resizes``)."""

    size_before: int
    size_after: int
    reason: str
    """``scale``, ``preempt`` or ``autoscale``."""
    version: int = 0
    """The weight version the new pool loaded before it took work."""
    drained: list[int] = field(default_factory=list)
    """Groups in flight on the old pool that finished there."""
    handed_over: list[int] = field(default_factory=list)
    """Groups in flight on the old pool past the drain deadline, or whose calls a preemption notice ended, issued
    again on the new pool."""
    start_s: float = 0.0
    """Seconds to start and load the new pool."""
    drain_s: float = 0.0
    """Seconds from the swap until the old pool held no group."""


class StreamScaler:
    """Carries out resize requests of a streaming run (see the module).

    Args:
        trainer: the :class:`~asyncrl.pipelines.trainer.Trainer` (its workers, groups, weights, supervisor and
            config).
        rollout: the :class:`~asyncrl.pipelines.stream_rollout.StreamRollout` whose attempts hold the groups in
            flight (its ``notify`` and ``rehome_flights``).
    """

    def __init__(self, trainer: Any, rollout: Any) -> None:
        self._trainer = trainer
        self._rollout = rollout
        self.resizes: list[Resize] = []
        """One record per resize carried out."""
        self._busy_steps = 0
        self._idle_steps = 0
        self._noticed: list[tuple[int, int]] = []  # (pool epoch, group) whose calls ended on a preemption notice

    async def run(self, a: Any) -> None:
        """Wait for resize requests (the supervisor's, or the autoscaler's after each take) and carry them out
        one at a time, until the rollout ends (it cancels this)."""
        sup, s = self._trainer.supervisor, a.state
        while True:
            await s.wait_for(lambda: sup.pending_resize() is not None)
            req = sup.pending_resize()
            assert req is not None
            n, drain_s, reason, fut = req
            try:
                await self.resize(a, n, drain_s, reason)
            except Exception as e:  # noqa: BLE001 - the request failed (no capacity, a new worker died): the run goes on
                log.warning("trainer.resize_failed", rollout_workers=n, reason=reason, error=f"{type(e).__name__}: {e}")
                sup.resize_done(fut, e)
            else:
                sup.resize_done(fut, None)
            await self._rollout.notify()  # a preemption waits for its resize

    def after_take(self, waited: bool, ahead: bool) -> None:
        """The autoscaler's observation of one step: `waited` (the step waited for groups to finish
        generating), `ahead` (the step's groups had all finished before it asked). Files a resize request when
        the pattern holds (one at a time; its failure is logged by :meth:`run`)."""
        tr = self._trainer
        t = tr.config.trainer
        if not t.rollout_autoscale or tr.supervisor.pending_resize() is not None:
            return
        self._busy_steps = self._busy_steps + 1 if waited else 0
        self._idle_steps = self._idle_steps + 1 if ahead else 0
        r, n = t.rollout_range, self.size()
        to = n + 1 if self._busy_steps >= BUSY_STEPS and n < r.max else \
            n - 1 if self._idle_steps >= IDLE_STEPS and n > r.min else None
        if to is not None:
            self._busy_steps = self._idle_steps = 0
            fut = tr.supervisor.request_resize(to, t.rollout_drain_s, "autoscale")
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it: run() logs a failure

    def preempting(self, epoch: int) -> bool:
        """True while a preemption notice of pool `epoch` is being handled: a fault of that pool then is the
        notice's consequence (the told-to-stop process exits, and the calls it still ran die with it)."""
        pending = self._trainer.supervisor.pending_resize()
        return any(e == epoch for e, _ in self._noticed) or (pending is not None and pending[2] == "preempt")

    async def preempted(self, a: Any, epoch: int, group: int | None = None) -> bool:
        """A rollout worker of pool `epoch` was told to stop (its calls raise ``PreemptedError``, or it exited on
        SIGTERM): file a resize that hands its groups over at once (one worker fewer, or as many elsewhere at the
        range's minimum) unless one is under way, and wait until the pool was replaced. False when that failed
        (no capacity): the caller treats the notice as a fault (``trainer.restart``). `group`: the prompt group
        whose call ended so (it is handed over)."""
        tr = self._trainer
        sup, s = tr.supervisor, a.state
        if group is not None:
            self._noticed.append((epoch, group))
        if a.epoch == epoch and sup.pending_resize() is None:
            n = max(self.size() - 1, tr.config.trainer.rollout_range.min)
            fut = sup.request_resize(n, 0.0, "preempt")
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # run() logs a failure
            await self._rollout.notify()
            log.warning("trainer.preempted", rollout_workers=n, detail="a rollout worker was told to stop; handing "
                        "its groups over to a new pool")
        pending = sup.pending_resize()
        fut = pending[3] if pending is not None else None
        await s.wait_for(lambda: a.epoch != epoch or (fut is not None and fut.done()))
        return a.epoch != epoch

    def size(self) -> int:
        """Workers in the rollout pool now."""
        return int(self._trainer.workers.parts[0]["rollout"].world_size)

    async def resize(self, a: Any, n: int, drain_s: float, reason: str) -> Resize:
        """Replace the rollout pool by one of `n` workers beside the groups in flight (the module's steps)."""
        tr = self._trainer
        s, g = a.state, tr.groups
        assert g is not None
        rec = Resize(self.size(), n, reason)
        t0 = time.perf_counter()
        part, pool = await tr.workers.start_rollout_part(n)
        try:
            fresh = with_deadlines(Groups(rollout=part["rollout"], reward=part["reward"], policy=g.policy,
                                          advantage=g.advantage), tr.config.trainer)
            loaded = 0
            while s.exported > loaded:  # the newest version, again while a newer one is published meanwhile
                v = s.exported
                export = s.exports.get(v)
                assert export is not None, f"version {v} is exported but its weights are gone"
                with tr.tracer.span("weight_sync", track=fresh.rollout.name, version=v):
                    await tr.weights.load(fresh, export)
                loaded = v
        except BaseException:
            with contextlib.suppress(Exception):
                await tr.workers.close_rollout_part(part, pool)
            raise
        rec.version, rec.start_s = loaded, time.perf_counter() - t0
        # the swap: no await from the check above to here, so no version is published in between
        old_rollout, old_epoch = g.rollout, a.epoch
        old_part, old_pool = tr.workers.adopt_rollout_part(part, pool, n)
        g.rollout, g.reward = fresh.rollout, fresh.reward
        a.epoch += 1  # a load into the old pool now does not count, and its failed groups are issued again
        s.rollout_version = max(s.rollout_version, loaded)
        for old in [x for x in s.exports if x < s.rollout_version]:
            del s.exports[old]
        await self._rollout.notify()
        log.info("trainer.scaled", rollout_workers=n, reason=reason, version=loaded, seconds=round(rec.start_s, 2))
        t1 = time.perf_counter()
        on_old = {k for k, (site, _) in a.running.items() if site is old_rollout}
        with anyio.move_on_after(drain_s):
            await s.wait_for(lambda: not any(site is old_rollout for site, _ in a.running.values()))
        late = sorted(k for k, (site, _) in a.running.items() if site is old_rollout)
        for k in late:
            a.running[k][1].cancel()  # the engine drops it at its next decoding step; _group issues it again
        await s.wait_for(lambda: not any(site is old_rollout for site, _ in a.running.values()))
        noticed = {k for e, k in self._noticed if e == old_epoch}
        self._noticed = [(e, k) for e, k in self._noticed if e > old_epoch]
        rec.drained, rec.handed_over = sorted(on_old - set(late)), sorted(set(late) | noticed)
        rec.drain_s = time.perf_counter() - t1
        self._rollout.rehome_flights(a)
        with contextlib.suppress(Exception):
            await tr.workers.close_rollout_part(old_part, old_pool)
        self.resizes.append(rec)
        log.info("trainer.drained", handed_over=rec.handed_over, drained=rec.drained, seconds=round(rec.drain_s, 2))
        return rec
