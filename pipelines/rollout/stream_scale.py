"""Resizing a streaming run's rollout pool beside the groups in flight (``scale_rollout``, preemption, the
autoscaler).

::

    request (scale_rollout(n) / preempt_rollout(rank) / autoscaler)
      │ start n new workers in placement groups of their own       (old pool keeps generating; a failure
      │                                                             here fails the request, not the run)
      │ load the newest exported version into them, again while a newer one appears
      │ swap: admission issues new groups on the new pool from now   (epoch + 1; rollout_version = loaded)
      │ drain: the old pool's groups in flight finish there, up to the drain deadline
      │ hand over: the rest stop at their next decoding step and return what each row decoded (token ids,
      │            log-probs, versions: RolloutWorker.hand_over); they are issued again on the new pool with
      │            the same prompts and seeds, each row continuing from its tokens   (StreamRollout._group's retry)
      ▼ finished groups' futures re-homed on the training pool; the old pool's workers closed, its
        placement groups released

The staleness bound is admission's (a group keeps its admission version ``v0``; the new pool holds at least
the version admission uses next), so a resize trains nothing twice and keeps ``max_staleness``. A new pool
never takes work before it holds the newest weights. A handed-over row keeps its tokens and their versions (all
at least the group's ``v0``), so the bound holds for them too. A preemption is a resize that hands over at once
(``drain_s=0``): the pool loses the preempted worker, or keeps its size on other capacity when that would
fall below the range's minimum.

The autoscaler (``trainer.rollout_autoscale``) grows the pool by one worker when the last ``BUSY_STEPS`` steps
spent more than ``BUSY_SHARE`` of their time waiting for their groups to finish generating (training waits on
generation), and shrinks it by one when each of the last ``IDLE_STEPS`` steps waited less than ``IDLE_SHARE``
of its time (the engines are ahead of training); within the range, and a grow the cluster cannot place fails
alone (logged; the run goes on at its size).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from asyncrl.pipelines.loop.deadlines import unwrap, with_deadlines
from asyncrl.pipelines.loop.loop_state import batch_seed
from asyncrl.pipelines.loop.stages import Groups

if TYPE_CHECKING:
    from asyncrl.pipelines.rollout.rollout_loop import RolloutServices

__all__ = ["StreamScaler", "Resize", "BUSY_STEPS", "BUSY_SHARE", "IDLE_STEPS", "IDLE_SHARE", "HAND_OVER_S"]

log = structlog.get_logger("asyncrl.pipelines")

BUSY_STEPS = 2
"""The autoscaler grows the pool when the last this many steps spent more than ``BUSY_SHARE`` of their time
waiting for their groups to finish generating."""
BUSY_SHARE = 0.5
"""See ``BUSY_STEPS``."""
IDLE_STEPS = 4
"""The autoscaler shrinks the pool when each of the last this many steps waited less than ``IDLE_SHARE`` of its
time for its groups (the engines are ahead of training)."""
IDLE_SHARE = 0.05
"""See ``IDLE_STEPS``."""
HAND_OVER_S = 30.0
"""How long the old pool may take to hand its late groups over (their rows stop at the next decoding step);
past it, or when the call fails (a rank gone), those groups are cancelled and their rows generated again from
their seeds."""


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
    """Groups whose calls on the old pool ended (stopped past the drain deadline, or by a preemption notice) and
    were issued again on the new pool (a late group whose generation had already finished drained instead)."""
    kept_tokens: int = 0
    """Tokens the old pool's handed-over rows had decoded (from its hand-over call or its preemption notice's
    errors), continued on the new pool instead of generated again."""
    start_s: float = 0.0
    """Seconds to start and load the new pool."""
    drain_s: float = 0.0
    """Seconds from the swap until the old pool held no group."""


class StreamScaler:
    """Carries out resize requests of a streaming run (see the module).

    Args:
        services: the run's parts a resize uses (:class:`~asyncrl.pipelines.rollout.rollout_loop.RolloutServices`:
            its config, current groups, workers, weights, supervisor, tracer and journal).
        rollout: the :class:`~asyncrl.pipelines.rollout.stream_rollout.StreamRollout` whose attempts hold the groups in
            flight (its ``notify`` and ``rehome_flights``).
    """

    def __init__(self, services: RolloutServices, rollout: Any) -> None:
        self._services = services
        self._rollout = rollout
        self.resizes: list[Resize] = []
        """One record per resize carried out."""
        self.requests: list[tuple[int, int]] = []
        """``(size, requested size)`` of each resize the autoscaler asked for."""
        self._window: list[tuple[float, float]] = []  # (seconds waited for groups, seconds since the last take)
        self._last_take: float | None = None
        self._noticed: list[tuple[int, int]] = []  # (pool epoch, group) whose calls ended on a preemption notice

    async def run(self, a: Any) -> None:
        """Wait for resize requests (the supervisor's, or the autoscaler's after each take) and carry them out
        one at a time, until the rollout ends (it cancels this)."""
        sup, s = self._services.supervisor, a.state
        self._noticed = []  # a new attempt numbers its pools from 0 again
        while True:
            await s.wait_for(lambda: sup.pending_resize() is not None)
            req = sup.pending_resize()
            assert req is not None
            n, drain_s, reason, fut = req
            try:
                await self.resize(a, n, drain_s, reason)
            except Exception as e:  # noqa: BLE001 - the request failed (no capacity, a new worker died): run on
                log.warning("trainer.resize_failed", rollout_workers=n, reason=reason, error=f"{type(e).__name__}: {e}")
                sup.resize_done(fut, e)
            else:
                sup.resize_done(fut, None)
            await self._rollout.notify()  # a preemption waits for its resize

    def after_take(self, waited_s: float) -> None:
        """The autoscaler's observation of one step's take: `waited_s`, how long the step waited for its groups
        to finish generating. Over the last ``BUSY_STEPS`` steps, waiting more than ``BUSY_SHARE`` of the time
        grows the pool by one worker; over the last ``IDLE_STEPS``, each waiting less than ``IDLE_SHARE`` shrinks
        it. Files a resize request (one at a time; its failure is logged by :meth:`run`)."""
        sv = self._services
        t = sv.config.trainer
        now = time.perf_counter()
        span, self._last_take = now - self._last_take if self._last_take is not None else 0.0, now
        if not t.rollout_autoscale or span <= 0:
            return
        self._window = [*self._window, (waited_s, span)][-max(BUSY_STEPS, IDLE_STEPS):]
        if sv.supervisor.pending_resize() is not None:
            return
        busy = self._window[-BUSY_STEPS:]
        idle = self._window[-IDLE_STEPS:]
        r, n = t.rollout_range, self.size()
        to = None
        if len(busy) == BUSY_STEPS and sum(w for w, _ in busy) > BUSY_SHARE * sum(d for _, d in busy) and n < r.max:
            to = n + 1
        elif len(idle) == IDLE_STEPS and all(w < IDLE_SHARE * d for w, d in idle) and n > r.min:
            to = n - 1
        if to is not None:
            self._window = []  # judge the new size on its own steps
            self.requests.append((n, to))
            fut = sv.supervisor.request_resize(to, t.rollout_drain_s, "autoscale")
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it: run() logs a failure

    def preempting(self, epoch: int) -> bool:
        """True while a preemption notice of pool `epoch` is being handled: a fault of that pool then is the
        notice's consequence (the told-to-stop process exits, and the calls it still ran die with it)."""
        pending = self._services.supervisor.pending_resize()
        return any(e == epoch for e, _ in self._noticed) or (pending is not None and pending[2] == "preempt")

    async def preempted(self, a: Any, epoch: int, group: int | None = None) -> bool:
        """A rollout worker of pool `epoch` was told to stop (its calls raise ``PreemptedError``, or it exited on
        SIGTERM): file a resize that hands its groups over at once (one worker fewer, or as many elsewhere at the
        range's minimum) unless one is under way, and wait until the pool was replaced. False when that failed
        (no capacity): the caller treats the notice as a fault (``trainer.restart``). `group`: the prompt group
        whose call ended so (it is handed over)."""
        sv = self._services
        sup, s = sv.supervisor, a.state
        if group is not None:
            self._noticed.append((epoch, group))
        if a.epoch == epoch and sup.pending_resize() is None:
            n = max(self.size() - 1, sv.config.trainer.rollout_range.min)
            fut = sup.request_resize(n, 0.0, "preempt")
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # run() logs a failure
            await self._rollout.notify()
            log.warning("trainer.preempted", rollout_workers=n, detail="a rollout worker was told to stop; handing "
                        "its groups over to a new pool")
        pending = sup.pending_resize()
        fut = pending[3] if pending is not None else None
        await s.wait_for(lambda: a.epoch != epoch or (fut is not None and fut.done()))
        return a.epoch != epoch

    async def hand_over(self, a: Any, old_rollout: Any, late: list[int], epoch: int) -> None:
        """Hand the groups `late` over from `old_rollout` (pool `epoch`: a resize's late groups, or the rest of a
        group whose call a preemption notice of one rank ended): their rows stop at the next decoding step and what
        they decoded is kept for their retry (which waits for this). Each rank answers on its own: the rows of a
        rank that fails (gone, or a pool that takes no call) or does not answer within ``HAND_OVER_S`` are
        generated again from their seeds (their calls are cancelled); the other ranks' rows are kept."""
        cfg = self._services.config
        by_seed = {batch_seed(cfg, g): g for g in late}
        a.handing.update(late)
        rows: dict[int, dict[str, Any]] = {}
        failed: list[str] = []
        try:
            call = unwrap(old_rollout).hand_over(sorted(by_seed))  # (issued before any await)
            answered: set[int] = set()
            with anyio.move_on_after(HAND_OVER_S):
                async for rank, part in call.as_completed(return_exceptions=True):  # each rank on its own
                    answered.add(rank)
                    if isinstance(part, Exception):  # a rank gone (a preempted process): its rows start over
                        failed.append(f"rank {rank}: {type(part).__name__}: {part}"[:200])
                        continue
                    for seed, mine in part.items():  # a group's rows are split between the ranks
                        if int(seed) in by_seed:
                            rows.setdefault(by_seed[int(seed)], {}).update(mine)
            late_ranks = [r for r in call.ranks if r not in answered]
            if late_ranks:  # past HAND_OVER_S: those ranks' rows start over
                call.cancel()
                failed.append(f"ranks {late_ranks}: no answer within {HAND_OVER_S:g} s")
        except Exception as e:  # noqa: BLE001 - the call could not be issued (a broken pool): rows start over
            failed.append(f"{type(e).__name__}: {e}"[:300])
        finally:
            for g, got in sorted(rows.items()):
                self._rollout.keep_rows(a, g, got, epoch)
            if failed:
                log.warning("trainer.hand_over_failed", groups=late, errors=failed)
            a.handing.difference_update(late)
            for k in late:
                if k in a.running:
                    a.running[k][1].cancel()  # whatever the hand-over did not stop: _group issues it again
            await self._rollout.notify()

    def size(self) -> int:
        """Workers in the rollout pool now."""
        return int(self._services.workers.parts[0]["rollout"].world_size)

    async def resize(self, a: Any, n: int, drain_s: float, reason: str) -> Resize:
        """Replace the rollout pool by one of `n` workers beside the groups in flight (the module's steps)."""
        sv = self._services
        s, g = a.state, sv.current().groups
        assert g is not None
        rec = Resize(self.size(), n, reason)
        t0 = time.perf_counter()
        part, pool = await sv.workers.start_rollout_part(n)
        try:
            fresh = with_deadlines(Groups(rollout=part["rollout"], reward=part["reward"], policy=g.policy,
                                          advantage=g.advantage), sv.config.trainer)
            loaded = 0
            while s.exported > loaded:  # the newest version, again while a newer one is published meanwhile
                v = s.exported
                export = s.exports.get(v)
                assert export is not None, f"version {v} is exported but its weights are gone"
                with sv.tracer.span("weight_sync", track=fresh.rollout.name, version=v):
                    await sv.weights.load(fresh, export)
                loaded = v
        except BaseException:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):  # also when the run ends meanwhile
                await sv.workers.close_rollout_part(part, pool)
            raise
        rec.version, rec.start_s = loaded, time.perf_counter() - t0
        # the swap: no await from the check above to here, so no version is published in between
        old_rollout, old_epoch = g.rollout, a.epoch
        old_part, old_pool = sv.workers.adopt_rollout_part(part, pool, n)
        g.rollout, g.reward = fresh.rollout, fresh.reward
        a.epoch += 1  # a load into the old pool now does not count, and its failed groups are issued again
        sv.journal.resized(size_before=rec.size_before, size_after=n, reason=reason, version=loaded, epoch=a.epoch,
                           after_step=s.taken)
        sv.weights.loaded(s, loaded)
        sv.weights.drop_older(s, s.rollout_version)
        await self._rollout.notify()
        log.info("trainer.scaled", rollout_workers=n, reason=reason, version=loaded, seconds=round(rec.start_s, 2))
        t1 = time.perf_counter()
        on_old = {k for k, (site, _) in a.running.items() if site is old_rollout}
        with anyio.move_on_after(drain_s):
            await s.wait_for(lambda: not any(site is old_rollout for site, _ in a.running.values()))
        late = sorted(k for k, (site, _) in a.running.items() if site is old_rollout)
        if late:
            await self.hand_over(a, old_rollout, late, old_epoch)
        await s.wait_for(lambda: not any(site is old_rollout for site, _ in a.running.values()))
        rec.kept_tokens = a.carried.pop(old_epoch, 0)  # also the rows a preemption notice's errors carried
        self._noticed = [(e, k) for e, k in self._noticed if e > old_epoch]
        # what each group did, not what the deadline expected: a late group whose generation had finished is
        # scored there (drained); a preemption notice's groups were issued again before the swap
        again = a.reissued.pop(old_epoch, set())
        rec.drained, rec.handed_over = sorted(on_old - again), sorted(again)
        rec.drain_s = time.perf_counter() - t1
        # its last rounds (since the last step's fetch) go to the round log before they die with it; the rows
        # kept are those of the groups issued again (a call that returned while handed over drained)
        rows = {k: r for k, r in a.stopped.pop(old_epoch, {}).items() if k in again}
        await sv.journal.retired(old_rollout, epoch=old_epoch, drained=rec.drained, handed_over=rec.handed_over,
                                 after_step=s.taken, rows=rows)
        self._rollout.rehome_flights(a)
        with contextlib.suppress(Exception):
            await sv.workers.close_rollout_part(old_part, old_pool)
        self.resizes.append(rec)
        log.info("trainer.drained", handed_over=rec.handed_over, drained=rec.drained, kept_tokens=rec.kept_tokens,
                 seconds=round(rec.drain_s, 2))
        return rec
