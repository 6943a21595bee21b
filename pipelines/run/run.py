"""A run's attempts: :class:`Run` (one attempt's groups, loop state and history) and :class:`Attempts`, which
starts them -- the first at setup, a new one per restart
(:class:`~asyncrl.pipelines.supervision.supervisor.Supervisor`).

An attempt is never mutated into the next: a restart closes the workers, starts new ones and restores the newest
checkpoint into a fresh loop state, and the trainer goes on from the :class:`Run` it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.checkpoints.checkpointing import Checkpointer
from asyncrl.pipelines.datasets.evaluation import Evaluator
from asyncrl.pipelines.job.config import JobConfig
from asyncrl.pipelines.run.run_journal import RunJournal
from asyncrl.pipelines.run.build import Workers
from asyncrl.pipelines.loop.deadlines import with_deadlines
from asyncrl.pipelines.loop.loop_state import LoopState
from asyncrl.pipelines.loop.stages import Groups
from asyncrl.pipelines.loop.weights import WeightSync

__all__ = ["Run", "Attempts"]


@dataclass(frozen=True)
class Run:
    """One attempt at running the loops: what the loops of this attempt share and read."""

    groups: Groups | None
    """The attempt's worker groups (None before the trainer's own are started)."""
    state: LoopState
    """Everything the loops share (a fresh one per attempt)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The per-step metrics: those restored up to the attempt's first step, then one per step it trains."""


class Attempts:
    """Starts a run's attempts: :meth:`first` at setup, :meth:`restart` after a worker fault.

    Args:
        config: the run's configuration (buffer capacity, staleness, per-call deadlines).
        workers: the run's workers (started here; closed before a restart).
        weights: the weight sync (new engines are prepared through it).
        checkpoints: restores a checkpoint into an attempt (the resumed one at setup, the newest one at a restart).
        journal: the run journal (a loop state's dropped batches go to it; a restart rewinds it).
        evaluator: the run's held-out evaluation, once set up (a restart from the start resets it).
        close: releases everything (called when new workers fail to start).
    """

    def __init__(self, config: JobConfig, *, workers: Workers, weights: WeightSync, checkpoints: Checkpointer,
                 journal: RunJournal, evaluator: Callable[[], Evaluator | None],
                 close: Callable[[], Awaitable[None]]) -> None:
        self._config, self._workers, self._weights = config, workers, weights
        self._checkpoints, self._journal, self._evaluator, self._close = checkpoints, journal, evaluator, close
        self.initial_rng: dict[str, Any] | None = None
        """The RNG states at setup (a restart with no checkpoint starts from them)."""

    def new_state(self) -> LoopState:
        """A fresh loop state (empty buffer, version 0)."""
        return LoopState.new(self._config.buffer_capacity, self._config.trainer.max_staleness,
                             on_drop=self._journal.drop)

    async def first(self, groups: Groups | None) -> Run:
        """The setup's attempt: on `groups` (the caller's, started) or on new workers, restored from the checkpoint
        the run resumes, if any."""
        state = self.new_state()
        if groups is None:
            groups = await self._start(state)
        else:
            await self._weights.prepare(groups, state)
        self.initial_rng = ckpt.rng_state()
        resume = self._checkpoints.resume
        history = await self._checkpoints.restore(resume, groups, state) if resume is not None else []
        return Run(groups, state, history)

    async def restart(self, point: Path | None) -> Run:
        """A new attempt after a worker fault: close every process, start new ones (in the same placement groups, or
        placed again) for a fresh loop state, restore checkpoint `point` into it (None: the run's start, its RNG
        states and no evaluations) and rewind the journal to it."""
        await self._workers.recycle()
        state = self.new_state()  # the old one's calls died with the groups
        groups = await self._start(state)
        if point is not None:
            history = await self._checkpoints.restore(point, groups, state)
        else:
            history = []
            evaluator = self._evaluator()
            if evaluator is not None:
                evaluator.restore([], 0)
            if self.initial_rng is not None:
                ckpt.set_rng_state(self.initial_rng)
        await self._journal.rewind(state)
        return Run(groups, state, history)

    async def _start(self, state: LoopState) -> Groups:
        """Start the workers (in the pools of an earlier start, if any) for `state`; close everything on failure."""
        try:
            groups = with_deadlines(await self._workers.start(), self._config.trainer)
            await self._weights.prepare(groups, state)
        except BaseException:
            await self._close()
            raise
        return groups
