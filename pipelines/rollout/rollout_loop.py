"""The rollout side of the trainer: a producer of generated, scored batches.

The train loop consumes a rollout through four calls -- :meth:`~BatchRollout.run` (the
producer loop, in the trainer's task group), :meth:`~BatchRollout.take` (the batch a step
trains), :meth:`~BatchRollout.upcoming` (which batch that will be, when already decided) and
:meth:`~BatchRollout.finish` (after the last step) -- so another producer (a streaming
rollout that keeps many prompt groups in flight) can stand in for :class:`BatchRollout`
without touching the train loop.

``BatchRollout``: batch t is generated with weights ``max(0, t - max_staleness)``
(``fixed_lag``) or the newest exported (``latest``), or the version a journal recorded
(resume, replay)::

    for i in batches:
        wait: version >= i - max_staleness
        load_weights(export[v])  (if newer)      # weight sync, rollout side
        generate(prompts i) -> score             # await the scores (small)
        put RolloutBatch(i, v, futures) into the staleness buffer
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import anyio
import structlog

from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.rollout.sampling import fill_batch
from asyncrl.pipelines.job.config import JobConfig
from asyncrl.pipelines.loop.loop_state import Generating, LoopState, ModeCheckpoint, Rollout, RolloutBatch, batch_seed
from asyncrl.pipelines.job.modes import RolloutMode, register_rollout_mode

if TYPE_CHECKING:
    from asyncrl.pipelines.run.build import Workers
    from asyncrl.pipelines.datasets.data import PromptLoader
    from asyncrl.pipelines.datasets.evaluation import Evaluator
    from asyncrl.pipelines.loop.precompute import Precompute
    from asyncrl.pipelines.run.reporting import RunReport
    from asyncrl.pipelines.run.run_journal import RunJournal
    from asyncrl.pipelines.run.run import Run
    from asyncrl.pipelines.supervision.supervisor import Supervisor
    from asyncrl.pipelines.observe.trace import Tracer
    from asyncrl.pipelines.loop.weights import WeightSync

__all__ = ["Rollout", "RolloutServices", "BatchRollout", "BatchMode", "batch_seed", "evaluate", "evaluate_rest"]


@dataclass(frozen=True, kw_only=True)
class RolloutServices:
    """What a rollout producer is built with (:meth:`~asyncrl.pipelines.job.modes.RolloutMode.build`): the
    run's parts it reports to or waits on, built once by the trainer (not the trainer). The attempt's groups and
    loop state are read through :attr:`current` at each use: a restart starts a new
    :class:`~asyncrl.pipelines.run.run.Run` and keeps the producer."""

    config: JobConfig
    """The run's configuration."""
    current: Callable[[], Run]
    """The attempt the loops run now (its groups and loop state)."""
    loader: Callable[[], PromptLoader | None]
    """The prompt loader (None until the trainer's setup builds it)."""
    evaluator: Callable[[], Evaluator | None]
    """The held-out evaluation (None until setup, or without ``config.evaluation``)."""
    tracer: Tracer
    """Spans and watched calls (``trace.json``)."""
    weights: WeightSync
    """Weight sync, the rollout side (loads into the engines, the versions they hold)."""
    journal: RunJournal
    """The run journal (what was generated with which version; a replay's plan)."""
    supervisor: Supervisor
    """Replaces or resizes the rollout pool after a fault or on request."""
    precompute: Precompute
    """Precompute-ahead (batch mode issues the next step's first stages behind a batch's generate)."""
    report: RunReport
    """The metrics sinks (an evaluation's row)."""
    workers: Workers
    """The run's workers (a streaming resize starts and closes rollout pools through them)."""


log = structlog.get_logger("asyncrl.pipelines")


class BatchRollout:
    """Generates whole batches in order, one at a time, into the loop state's staleness buffer."""

    def __init__(self, services: RolloutServices) -> None:
        self._services = services
        self._putting: int | None = None  # the journaled batch waiting for buffer space

    async def run(self) -> None:
        """Consumes prompt batches and exported weights; produces RolloutBatch items."""
        sv = self._services
        s, steps = sv.current().state, sv.config.trainer.steps
        assert sv.loader() is not None
        self._putting = None  # (a restart's new attempt)
        for item in s.restored:
            await s.buffer.put(item)
        s.restored_buffered()
        i = s.next_gen
        while i < steps + s.buffer.statistics().dropped:
            await sv.supervisor.apply_scale(i)  # a pending scale_rollout, between two batches
            version = await self._version_for(i)
            while True:
                try:
                    item = await self._produce(i, version)
                    break
                except Exception as e:
                    s.generating = None  # a failed batch is not trained; nothing precomputes from it
                    if not sv.supervisor.can_replace(e):
                        raise
                    await sv.supervisor.replace_rollout(e, i)  # then the same batch again: same prompts, seed, version
            sv.journal.batch(i, version)
            self._putting = i
            await s.buffer.put(item)
            self._putting = None
            s.generating = None  # in the buffer now
            i += 1
            await s.generated(i)
        await s.rollout_finished()

    async def take(self, step: int) -> RolloutBatch:
        """The oldest buffered batch within the staleness bound of the policy (older ones are dropped)."""
        s = self._services.current().state
        try:
            item = await s.buffer.get(s.policy_version)
        except anyio.EndOfStream:
            raise RuntimeError(f"the rollout loop ended before step {step}") from None
        return item

    def upcoming(self, step: int) -> tuple[int, Any] | None:
        """``(index, generate future)`` of the batch ``buffer.get(step)`` will return, when that is
        already decided: the first buffered batch within the staleness bound of `step` (older ones
        are dropped), else the batch whose generate is in flight if it is within the bound; None
        while that batch is not issued yet."""
        sv = self._services
        k, s = sv.config.trainer.max_staleness, sv.current().state
        for it in s.buffer.peek_all():
            if step - it.version <= k:
                return it.step, it.batch
        if s.generating is not None and step - s.generating.version <= k:
            return s.generating.step, s.generating.batch
        return None

    async def _version_for(self, i: int) -> int:
        """The weight version batch `i` is generated with, once it is published: the journal's
        (replay, resume), else ``fixed_lag``'s or the newest (``latest``)."""
        sv = self._services
        s, cfg = sv.current().state, sv.config.trainer
        planned = sv.journal.planned(i)
        need = planned if planned is not None else max(0, i - cfg.max_staleness)
        await s.wait_for(lambda: s.exported >= need)
        if planned is not None:
            if planned >= s.rollout_version:
                return planned
            log.warning("journal.diverged", batch=i, recorded=planned, loaded=s.rollout_version,
                        detail="the recorded version is older than the loaded weights; using the loaded ones")
            return s.rollout_version
        # fixed_lag: exactly `need`, except after a resume that extended a finished run, when
        # older weights are gone and the batch gets the (fresher) loaded ones
        return max(need, s.rollout_version) if cfg.weights_choice() == "fixed_lag" else s.exported

    async def _produce(self, i: int, version: int) -> RolloutBatch:
        """Load `version` if the engines are behind, evaluate it when due, generate batch `i` and
        score it."""
        sv = self._services
        run, sync, loader, ev = sv.current(), sv.weights, sv.loader(), sv.evaluator()
        g, s = run.groups, run.state
        assert g is not None and loader is not None
        async with s.device if sv.config.trainer.colocated else contextlib.nullcontext():
            if sync.sleep and await sync.wake(g) and version == s.rollout_version:
                with sv.tracer.span("weight_sync", track=g.rollout.name, version=version):
                    await sync.load(g, s.exports[version])  # level 2: the same version again
            if version > s.rollout_version:
                with sv.tracer.span("weight_sync", track=g.rollout.name, version=version):
                    await sync.load(g, s.exports[version])  # weight sync (rollout side)
                sync.loaded(s, version)
                sync.drop_older(s, version)
            if ev is not None and ev.due(version):
                await evaluate(sv, version)
            t0 = time.perf_counter()
            prompts = await anyio.to_thread.run_sync(loader.batch, i)  # off the loop: it grows with the batch
            gen = sv.tracer.watch(stages.generate(g, prompts, seed=batch_seed(sv.config, i)),
                                  "generate", step=i, version=version)
            s.generating = Generating(i, version, gen)
            sv.precompute.issue_next(s, g, self)  # the train loop may be waiting for this very batch
            sc = sv.tracer.watch(stages.score(g, gen), "score", step=i)
            scores = (await sc)["scores"]
            sampling: dict[str, float] = {}
            fg = sv.config.algorithm.filter_groups
            if fg.enable:  # dynamic sampling: more prompts until every group has reward variance

                def again(prompts: Any, k: int) -> tuple[Any, Any]:
                    seed = batch_seed(sv.config, i) + k * 1_000_000_007
                    more = sv.tracer.watch(stages.generate(g, prompts, seed=seed), "generate", step=i,
                                           version=version, call=k)
                    return more, sv.tracer.watch(stages.score(g, more), "score", step=i, call=k)

                gen, sc, scores, sampling, picks = await fill_batch(
                    step=i, first=(gen, sc, scores), loader=loader, group_size=sv.config.group_size,
                    max_calls=fg.max_num_gen_batches, seed=sv.config.trainer.seed, generate=again,
                    echo=g.advantage.echo)
                if picks is not None:  # the per-sample ledger: which call's groups the batch holds
                    calls = int(sampling["sampling/gen_batches"])
                    sv.journal.filtered(i, seeds=[batch_seed(sv.config, i) + k * 1_000_000_007 for k in range(calls)],
                                        picks=picks)
            if sync.sleep:  # release the rollout's memory while the policy trains
                await g.rollout.sleep()
        return RolloutBatch(step=i, version=version, batch=gen, scores=sc,
                            reward_mean=float(scores.float().mean()), gen_time=time.perf_counter() - t0,
                            metrics=sampling)

    async def finish(self) -> None:
        """After the last step: the evaluations still due (:func:`evaluate_rest`)."""
        await evaluate_rest(self._services)

    def untrained(self) -> tuple[list[int], list[int]]:
        """``(batches, groups)`` generated and journaled but not trained (at the run's end: the buffer's, and one
        waiting for room in it); the groups are a streaming producer's."""
        s = self._services.current().state
        batches = [it.step for it in [*s.buffer.peek_all(), *s.restored]]
        return batches + ([self._putting] if self._putting is not None else []), []

    async def settle_for_checkpoint(self, step: int) -> None:
        """Wait until every batch versions up to `step` allow is generated (or the rollout is done), so the
        checkpoint's buffer is complete: a resume then generates no batch twice."""
        sv = self._services
        s, t = sv.current().state, sv.config.trainer
        ahead = min(step + 1 + t.max_staleness, t.steps + s.buffer.statistics().dropped)
        await s.wait_for(lambda: s.rollout_done or s.next_gen >= ahead or step >= t.steps)

    def checkpoint_state(self) -> ModeCheckpoint | None:
        """None: a checkpoint keeps the buffered batches (``buffer.pt``) and ``next_gen``, nothing more."""
        return None

    def restore(self, saved: ModeCheckpoint | None, state: LoopState) -> None:
        """Nothing beyond the buffered batches and ``next_gen`` (restored by the checkpointer)."""


@register_rollout_mode("batch")
class BatchMode(RolloutMode):
    """``trainer.rollout_mode=batch``: each step's prompts generated as one batch (:class:`BatchRollout`)."""

    def build(self, services: Any) -> BatchRollout:
        """A :class:`BatchRollout` (a replay follows the journal's versions through ``services.journal.planned``)."""
        return BatchRollout(services)


async def evaluate(sv: RolloutServices, version: int) -> None:
    """Evaluate the rollout group's weights (`version`) and record the row in the metrics sinks."""
    ev, g = sv.evaluator(), sv.current().groups
    assert ev is not None and g is not None
    with sv.tracer.span("evaluate", track=g.rollout.name, version=version):
        row = await ev.run(g, version, watch=sv.tracer.watch)
    sv.report.evaluation(version, row)


async def evaluate_rest(sv: RolloutServices) -> None:
    """After the last step: evaluate the due versions the rollout never loaded (the last
    ``max_staleness`` ones) and, with ``evaluation.at_end``, the final weights."""
    ev, run, sync = sv.evaluator(), sv.current(), sv.weights
    g, s = run.groups, run.state
    final = s.policy_version
    if ev is None or g is None:
        return
    due = [v for v in sorted(x for x in s.exports if s.rollout_version < x <= final)
           if ev.due(v) or (v == final and ev.due_final(v))]
    if not due and not (ev.due_final(final) and s.rollout_version == final):
        return
    needs_weights = sync.sleep and await sync.wake(g)  # the rollout slept after its last batch
    for v in due:
        exported = s.exports[v]
        assert exported is not None
        with sv.tracer.span("weight_sync", track=g.rollout.name, version=v):
            await sync.load(g, exported)
        sync.loaded(s, v)
        needs_weights = False
        await evaluate(sv, v)
    if ev.due_final(final) and s.rollout_version == final:
        if needs_weights:
            await sync.load(g, s.exports[final])  # level 2: the same version again
        await evaluate(sv, final)
