"""Weight sync between the pools: export a policy version, load it into the rollout engines.

The transport (``object_store``, ``collective``, ...) and the rollout's weight dtype are
decided once per set of groups (:meth:`WeightSync.prepare`); the exported versions
themselves live in the loop state (``exports``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Any

from asyncrl import GroupFuture
from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.loop.stages import Groups
from asyncrl.roles.weights.sync import open_weight_channel, rollout_dtype

if TYPE_CHECKING:
    from asyncrl.pipelines.job.config import JobConfig
    from asyncrl.pipelines.loop.loop_state import LoopState

__all__ = ["WeightSync"]


class WeightSyncOwner(Protocol):
    """What :class:`WeightSync` reads of the trainer that owns it."""

    config: JobConfig
    groups: Groups | None
    state: LoopState



class WeightSync:
    """Exports policy versions and loads them into the rollout engines (sleeping and waking them
    around training when ``rollout.sleep_level > 0`` on a colocated pool)."""

    def __init__(self, trainer: WeightSyncOwner) -> None:
        cfg = trainer.config
        self._trainer = trainer
        self.transport = cfg.weight_transport()
        """How weights travel from the policy to the rollout (``trainer.weight_transport``)."""
        self.sleep = cfg.trainer.colocated and cfg.rollout.sleep_level > 0
        """The rollout releases its memory while the policy trains."""

    async def prepare(self, s: LoopState) -> None:
        """Learn the rollout's weight dtype (into the loop state `s`) and open the weight channel
        (``collective``); with sleep level 2, stage version 0 so the rollout can reload it after its first sleep."""
        tr = self._trainer
        g, t = tr.groups, tr.config.trainer
        assert g is not None
        if t.gpus_per_worker > 0 or self.transport != "object_store":
            s.sync_dtype = await rollout_dtype(g.rollout)
        if self.transport == "collective":
            await open_weight_channel(g.policy, g.rollout, timeout_s=t.weight_sync_timeout_s)
        if self.sleep and tr.config.rollout.sleep_level == 2 and s.exports.get(0) is None:
            s.exports[0] = self.export(g)

    def export(self, g: Groups) -> GroupFuture[Any]:
        """Issue ``export_weights`` of the policy's current weights."""
        tr = self._trainer
        return stages.export_weights(g, transport=self.transport, dtype=tr.state.sync_dtype,
                                     keep=tr.config.trainer.max_staleness + 3)

    async def load(self, g: Groups, exported: GroupFuture[Any] | None) -> None:
        """Load an exported version into the rollout engines."""
        assert exported is not None, "version 0 has no export unless rollout.sleep_level=2 staged it at setup"
        await stages.load_weights(g, exported, transport=self.transport)

    async def wake(self, g: Groups) -> bool:
        """Re-acquire the memory the rollout released; True when it must reload its weights (level 2)."""
        woke = await g.rollout.wake_up()
        return any(w["needs_weights"] for w in woke)
