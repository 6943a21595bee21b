"""Precompute-ahead (``trainer.precompute_log_probs``): the next step's first stages, issued early.

With ``max_staleness >= 1`` and two pools, step t+1's ``old_log_prob``, ``ref_log_prob`` and
``values`` are issued on batch t+1's generate future as soon as that generate is issued and
step t's export is: they run on the training workers right behind that export, with the
weights step t+1 trains from, without waiting for the batch's scores. Step t+1 uses them if
batch, future and version match; otherwise they are cancelled and the step issues its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import structlog

from asyncrl import GroupFuture
from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.loop.deadlines import without_deadlines
from asyncrl.pipelines.loop.loop_state import Precomputed, RolloutBatch
from asyncrl.pipelines.loop.stages import Groups

if TYPE_CHECKING:
    from asyncrl.pipelines.job.config import JobConfig
    from asyncrl.pipelines.loop.loop_state import LoopState, Rollout

__all__ = ["Precomputed", "Precompute", "first_stages"]


log = structlog.get_logger("asyncrl.pipelines")

FirstStages = tuple[Any, Any, Any]


def first_stages(g: Groups, batch: Any, step: int, watch: Any, *, bypass: bool = False, **span: Any) -> FirstStages:
    """Issue ``old_log_prob``, ``ref_log_prob`` and ``values`` of `batch` (None for an absent role;
    ``old_log_prob`` is None under ``actor.rollout_correction.bypass_mode``: the rollout's log-probs serve)."""
    old = stages.old_log_prob(g, batch, bypass=bypass)
    old = watch(old, "old_log_prob", step=step, **span) if old is not None else None  # None: the bypass
    ref = stages.ref_log_prob(g, batch)
    ref = watch(ref, "ref_log_prob", step=step, **span) if ref is not None else None
    vals = stages.values(g, batch)
    vals = watch(vals, "values", step=step, **span) if vals is not None else None
    return old, ref, vals


class Precompute:
    """Issues the next step's first stages ahead (:meth:`issue_next`) and hands them to the step
    that trains that batch (:meth:`take`). The calls live in the loop state's ``precomputed``, so a
    recovery that replaces the loop state forgets them with the groups they ran on.

    Args:
        config: the run's configuration (whether to precompute, the steps, the bypass of ``old_log_prob``).
        watch: the tracer's ``watch`` (a span per call).
        stopping: True once the run was asked to stop after the step in progress (nothing more is issued).
    """

    def __init__(self, config: JobConfig, watch: Callable[..., Any], stopping: Callable[[], bool]) -> None:
        t = config.trainer
        self._watch, self._stopping, self._steps = watch, stopping, t.steps
        self._bypass = config.actor.rollout_correction.bypass_mode != "off"  # the rollout's log-probs serve
        self.enabled = t.precompute_log_probs and t.max_staleness >= 1 and not t.colocated
        """Whether this run precomputes at all (opt-in; two pools and some staleness needed)."""
        self.stats = {"issued": 0, "used": 0, "discarded": 0}
        """How many steps' first stages were issued ahead, used by their step, and discarded."""

    def take(self, g: Groups, s: LoopState, item: RolloutBatch, step: int) -> FirstStages:
        """The first stages of the step training `item` (loop state `s`): the precomputed ones when they read
        exactly this batch with this step's weights, else issued now."""
        version = s.policy_version
        pre, s.precomputed = s.precomputed, None
        if pre is not None and not pre.matches(item, version):
            log.debug("precompute.discarded", step=step, batch=item.step, precomputed_batch=pre.batch_index,
                      precomputed_step=pre.step)
            self._discard(pre)
            pre = None
        if pre is not None:
            self.stats["used"] += 1
            return pre.old, pre.ref, pre.vals
        return first_stages(g, item.batch, step, self._watch, bypass=self._bypass)

    def issue_next(self, s: LoopState, g: Groups | None, rollout: Rollout) -> None:
        """Issue the next step's first stages now on the groups `g`, if it is certain which batch it trains
        and with which weights.

        The next step is ``s.exported`` (its weights: the export issued last, so on each
        training worker the calls run right after it, in its ordered lane, with exactly the weights
        the step trains from); its batch is the one `rollout` names
        (:meth:`~asyncrl.pipelines.rollout.rollout_loop.BatchRollout.upcoming`), once its generate is
        issued (so nothing on the training workers waits for a generate that is not running). Not
        past the last step, not after a stop was requested, not once the train loop has taken that
        step's batch (it issues them itself then), not while restored batches are being buffered.
        Called when a step's export is published and when a generate is issued. The calls carry no
        stage deadline: they may wait a whole step for their turn; the step's ``advantages`` call,
        which waits for them, carries it."""
        if not self.enabled or self._stopping() or s.restored or g is None:
            return
        step = s.exported
        if step >= self._steps or s.taken >= step:
            return
        nxt = rollout.upcoming(step)
        if nxt is None:
            return
        index, batch = nxt
        pre = s.precomputed
        if pre is not None:
            if pre.step == step and pre.batch is batch:
                return  # issued already
            self.discard(s)  # another batch (regenerated after a replacement)
        old, ref, vals = first_stages(without_deadlines(g), batch, step, self._watch, bypass=self._bypass,
                                       precomputed=True)
        s.precomputed = Precomputed(step=step, batch_index=index, batch=batch, old=old, ref=ref, vals=vals)
        self.stats["issued"] += 1

    def discard(self, s: LoopState) -> None:
        """Cancel the precomputed calls in the loop state `s`, if any (the run stops, or their batch was
        regenerated)."""
        pre, s.precomputed = s.precomputed, None
        if pre is not None:
            self._discard(pre)

    def forget(self, s: LoopState) -> None:
        """Drop the precomputed calls of the loop state `s` without cancelling them (a run that failed trains no
        further step; they finish or fail with their batch's generate, or with the groups when they close)."""
        s.precomputed = None

    def _discard(self, pre: Precomputed) -> None:
        pre.discard()
        self.stats["discarded"] += 1
