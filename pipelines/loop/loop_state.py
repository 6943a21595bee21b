"""The loop state: everything the rollout and train loops share and change, in one object.

One per attempt (:class:`~asyncrl.pipelines.run.run.Run`): a restart (:mod:`asyncrl.pipelines.supervision.supervisor`)
starts a new attempt with a fresh one, a checkpoint restored into it, and hands it back to the trainer, which goes
on from it; nothing else in the trainer changes while the loops run.

Each field has one writing module (``tests/pipelines/test_loop_state_writers.py`` reads the source and holds
every module to it): the weight versions (``exports``, ``exported``, ``rollout_version``) are
:class:`~asyncrl.pipelines.loop.weights.WeightSync`'s; the train loop's progress (``taken``) the trainer's;
``generating`` the batch rollout's; ``precomputed`` precompute-ahead's; ``rollout_state`` the rollout
mode's (:meth:`Rollout.restore`); the counters the loops wait on and a checkpoint's resume point
(``policy_version``, ``start_step``, ``next_gen``, ``rollout_done``, ``restored``) this module's, through
the named transitions of :class:`LoopState`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol, TypedDict

from asyncrl import GroupFuture
from asyncrl.pipelines.loop.buffer import StalenessBuffer

__all__ = ["RolloutBatch", "Precomputed", "Generating", "ModeCheckpoint", "LoopState", "Rollout", "batch_seed"]


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
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-batch metrics of its sampling (``algorithm.filter_groups``: ``sampling/...``; streaming: ``stream/...``)."""
    groups: list[int] | None = None
    """Streaming rollout: the prompt groups it holds, in order (None: a whole prompt batch)."""
    row_groups: list[int] | None = None
    """Streaming rollout: the groups in the order of the batch's rows, where it is not `groups`' order
    (``trainer.balance_batch`` deals the groups out to the training ranks by their tokens)."""


@dataclass
class Precomputed:
    """The next step's ``old_log_prob`` / ``ref_log_prob`` / ``values``, issued before its batch left
    the buffer. Used only by the step it was issued for, on the batch it read, with the policy
    version it was computed with; otherwise discarded."""

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


class Generating(NamedTuple):
    """The batch the batch rollout is generating, issued and not yet buffered."""

    step: int
    """The train step it is for (its prompt batch index)."""
    version: int
    """The weight version it is generated with."""
    batch: Any
    """Its generate future."""


class ModeCheckpoint(TypedDict, total=False):
    """A rollout mode's part of a checkpoint (:meth:`Rollout.checkpoint_state`, JSON under the mode's name in
    ``state.json``). The keys below are those of a mode that journals prompt groups (streaming), which the
    journal's rewind reads; a mode of its own may keep other JSON-able keys beside them."""

    pending: list[int]
    """The admitted, untrained prompt groups (admitted again first, with the same seeds)."""
    next_group: int
    """The next new prompt group's index (the groups below it that are not pending were settled)."""


@dataclass(eq=False)
class LoopState:
    """The shared state of one attempt at running the loops (a recovery starts a new one).

    Versions: the train loop is the only producer (``policy_version``, ``exported``); the
    rollout loop follows (``rollout_version``). ``cond`` is notified whenever ``exported``,
    ``next_gen`` or ``rollout_done`` change."""

    buffer: StalenessBuffer[RolloutBatch]
    """Generated batches waiting for the train loop."""
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    """Guards and announces the version and progress counters."""
    device: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Taken around each generate and each train step when the pools are colocated."""
    exports: dict[int, GroupFuture[Any] | None] = field(default_factory=lambda: {0: None})
    """Version -> its ``export_weights`` future (version 0 has none unless staged at setup)."""
    exported: int = 0
    """The newest version whose export has been issued."""
    policy_version: int = 0
    """Steps done (the policy's version)."""
    rollout_version: int = 0
    """The version the rollout engines hold."""
    next_gen: int = 0
    """Index of the next batch the rollout loop generates."""
    start_step: int = 0
    """The first step this attempt trains (a restored checkpoint's step)."""
    rollout_done: bool = False
    """The rollout loop generated its last batch."""
    restored: list[RolloutBatch] = field(default_factory=list)
    """Batches a restored checkpoint held, put back in the buffer when the rollout loop starts."""
    generating: Generating | None = None
    """The batch being generated, not yet buffered (batch mode)."""
    taken: int = -1
    """The last step whose batch the train loop took out of the buffer."""
    precomputed: Precomputed | None = None
    """The next step's first stages, issued early (``trainer.precompute_log_probs``)."""
    rollout_state: ModeCheckpoint | None = None
    """The rollout mode's part of a restored checkpoint (its :meth:`Rollout.checkpoint_state`, put here by
    :meth:`Rollout.restore`; streaming: ``pending`` groups and ``next_group``, which also rewind the journal)."""

    @classmethod
    def new(cls, capacity: int, max_staleness: int,
            on_drop: Callable[[RolloutBatch, int], None] | None = None) -> "LoopState":
        """A fresh state with an empty buffer of `capacity` batches."""
        return cls(buffer=StalenessBuffer(capacity, max_staleness, on_drop=on_drop))

    def resume_at(self, step: int, next_gen: int, restored: list[RolloutBatch]) -> None:
        """A checkpoint's resume point, before the loops start: `step` steps done (the policy's version), the
        next batch to generate, and the batches it held (put back in the buffer when the rollout loop starts)."""
        self.start_step = self.policy_version = step
        self.next_gen = next_gen
        self.restored = restored

    def trained(self) -> None:
        """The train loop finished a step: the policy is one version newer."""
        self.policy_version += 1

    def restored_buffered(self) -> None:
        """The rollout loop put the restored batches back in the buffer."""
        self.restored = []

    async def generated(self, next_gen: int) -> None:
        """The rollout loop buffered the batches below `next_gen` (wakes every waiter)."""
        async with self.cond:
            self.next_gen = next_gen
            self.cond.notify_all()

    async def rollout_finished(self) -> None:
        """The rollout loop generated its last batch (wakes every waiter)."""
        async with self.cond:
            self.rollout_done = True
            self.cond.notify_all()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Until `predicate()` holds (checked whenever a counter changes)."""
        async with self.cond:
            await self.cond.wait_for(predicate)


def batch_seed(config: Any, index: int) -> int:
    """The sampling seed of batch `index` of a run of `config` (a ``JobConfig``)."""
    return config.trainer.seed * 1_000_003 + index


class Rollout(Protocol):
    """What the train loop, the checkpoints and precompute-ahead need from a rollout producer (what a
    :class:`~asyncrl.pipelines.job.modes.RolloutMode` builds)."""

    async def run(self) -> None:
        """Produce batches until the run has all it needs."""

    async def take(self, step: int) -> RolloutBatch:
        """The batch step `step` trains (waiting for it)."""

    def upcoming(self, step: int) -> tuple[int, Any] | None:
        """``(index, generate future)`` of the batch :meth:`take` will return for `step`, when decided."""

    async def finish(self) -> None:
        """After the last step: the work the rollout side still owes (final evaluations)."""

    async def settle_for_checkpoint(self, step: int) -> None:
        """Before a checkpoint of the state after `step` steps is written: wait until what it saves of the
        rollout (the buffered batches, :meth:`checkpoint_state`) is complete for it."""

    def checkpoint_state(self) -> ModeCheckpoint | None:
        """What a checkpoint keeps of the rollout besides the buffered batches (JSON-able, saved under the
        mode's name in ``state.json``); None: nothing."""

    def restore(self, saved: ModeCheckpoint | None, state: LoopState) -> None:
        """Put a checkpoint's :meth:`checkpoint_state` (None: it kept none) into the fresh loop state `state`
        the loops resume from (a resume, or a restart from that checkpoint)."""
