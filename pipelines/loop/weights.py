"""Weight sync between the pools: export a policy version, load it into the rollout engines.

The transport (``object_store``, ``collective``, ...) and the rollout's weight dtype are
decided once per set of groups (:meth:`WeightSync.prepare`, kept on the ``WeightSync``); the
exported versions themselves live in the loop state (``exports``, ``exported``, ``rollout_version``),
and this module is the only one that writes them: :meth:`WeightSync.publish` (policy side),
:meth:`WeightSync.loaded` and :meth:`WeightSync.drop_older` (rollout side), :meth:`WeightSync.prepare`
(new engines) and :meth:`WeightSync.restore` (a checkpoint's weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncrl import GroupFuture
from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.loop.stages import Groups
from asyncrl.roles.weights.sync import open_weight_channel, rollout_dtype

if TYPE_CHECKING:
    from asyncrl.pipelines.job.config import JobConfig
    from asyncrl.pipelines.loop.loop_state import LoopState

__all__ = ["WeightSync"]


class WeightSync:
    """Exports policy versions and loads them into the rollout engines (sleeping and waking them
    around training when ``rollout.sleep_level > 0`` on a colocated pool).

    Args:
        config: the run's configuration (the transport, sleep level, staleness and timeouts it reads).

    Each method acts on the groups it is given (a restart or a rollout replacement brings new ones).
    """

    def __init__(self, config: JobConfig) -> None:
        self._config = config
        self.transport = config.weight_transport()
        """How weights travel from the policy to the rollout (``trainer.weight_transport``)."""
        self.sleep = config.trainer.colocated and config.rollout.sleep_level > 0
        """The rollout releases its memory while the policy trains."""
        self.dtype: str | None = None
        """The rollout's weight dtype, which exports are cast to (learnt by :meth:`prepare`; None: as trained)."""

    async def prepare(self, g: Groups, s: LoopState) -> None:
        """The engines of `g` are new and hold the initial weights (version 0 in the loop state `s`): learn the
        rollout's weight dtype and open the weight channel (``collective``); with sleep level 2, stage version 0
        in `s` so the rollout can reload it after its first sleep."""
        cfg = self._config
        t = cfg.trainer
        s.rollout_version = 0
        if t.gpus_per_worker > 0 or self.transport != "object_store":
            self.dtype = await rollout_dtype(g.rollout)
        if self.transport == "collective":
            await open_weight_channel(g.policy, g.rollout, timeout_s=t.weight_sync_timeout_s)
        if self.sleep and cfg.rollout.sleep_level == 2 and s.exports.get(0) is None:
            s.exports[0] = self.export(g)

    async def publish(self, s: LoopState, version: int, exported: GroupFuture[Any]) -> None:
        """Policy side: `version` is exported (its future) and may be loaded (wakes every waiter of `s`)."""
        async with s.cond:
            s.exports[version] = exported
            s.exported = version
            s.cond.notify_all()

    def loaded(self, s: LoopState, version: int) -> None:
        """Rollout side: the engines hold `version` now (a load that completes after a newer one's moves nothing
        back)."""
        s.rollout_version = max(s.rollout_version, version)

    def drop_older(self, s: LoopState, version: int) -> None:
        """Forget the exports older than `version`: they are never loaded again."""
        for old in [x for x in s.exports if x < version]:
            del s.exports[old]

    async def restore(self, g: Groups, s: LoopState, step: int) -> None:
        """A checkpoint of `step` steps (> 0) was loaded into the policy: give the rollout engines, which start at
        version 0, the restored weights, the only export of `s`."""
        exported = self.export(g)
        await self.load(g, exported)
        s.exports = {step: exported}
        s.exported = s.rollout_version = step

    def export(self, g: Groups) -> GroupFuture[Any]:
        """Issue ``export_weights`` of the policy's current weights."""
        return stages.export_weights(g, transport=self.transport, dtype=self.dtype,
                                     keep=self._config.trainer.max_staleness + 3)

    async def load(self, g: Groups, exported: GroupFuture[Any] | None) -> None:
        """Load an exported version into the rollout engines."""
        assert exported is not None, "version 0 has no export unless rollout.sleep_level=2 staged it at setup"
        await stages.load_weights(g, exported, transport=self.transport)

    async def wake(self, g: Groups) -> bool:
        """Re-acquire the memory the rollout released; True when it must reload its weights (level 2)."""
        woke = await g.rollout.wake_up()
        return any(w["needs_weights"] for w in woke)
