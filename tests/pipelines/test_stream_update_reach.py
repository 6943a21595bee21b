"""In stream mode a weight update reaches a group that is still generating: the group's ordered score call
is issued only once its generation finished, so it never holds the update back on the rollout workers' lane.

Real Ray, the tiny model: prompt group 0's generation waits until the rollout worker starts a weight update.
The other groups fill step 0, its export is loaded while group 0 waits, and group 0 then generates under the
new version and is trained at step 1. Had the score call been issued with the generate call (as before), the
update would queue behind it, behind group 0's tokens, which wait for the update: the run could not finish.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from asyncrl.pipelines.rollout.rollout_loop import batch_seed
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles import RolloutWorker
from tensordict import TensorDict, TensorDictBase

from asyncrl import Dispatch, register
from tests.pipelines.test_stream import journal, stream_config


class UpdateGatedRollout(RolloutWorker):
    """Holds the generation of the group whose seed is `gated_seed` until a weight update starts here."""

    def __init__(self, *args: Any, gated_seed: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gated_seed = gated_seed
        self._updating: asyncio.Event | None = None

    def _update_started(self) -> asyncio.Event:
        if self._updating is None:
            self._updating = asyncio.Event()
        return self._updating

    @register(Dispatch.DP_COMPUTE, concurrent=True, summary=("scores", "response_length"))
    async def generate_requests(self, batch: TensorDictBase, max_new_tokens: int | None = None,
                                temperature: float | None = None, seed: int | None = None,
                                compute_reward: bool = False) -> TensorDict:
        if seed == self._gated_seed:
            await self._update_started().wait()
        return await super().generate_requests(batch, max_new_tokens, temperature, seed, compute_reward=compute_reward)

    @register(Dispatch.ONE_TO_ALL)
    async def update_weights(self, weights: Any, version: int | None = None, **kwargs: Any) -> dict[str, Any]:
        self._update_started().set()
        return await super().update_weights(weights, version, **kwargs)


@pytest.mark.slow  # ~25 s: a real trainer run (before the fix: CallTimeoutError after rollout_timeout_s)
async def test_an_update_reaches_a_group_still_generating_in_stream_mode(ray_cluster, tmp_path):
    cfg = stream_config(tmp_path, steps=2)
    cfg.rollout.partial_rollout = "recompute"
    cfg.trainer.rollout_timeout_s = 60.0  # a lane held by the score call would end in a timeout, not a hang
    cfg.trainer.restart.max_restarts = 0
    cfg = cfg.validate()
    overrides = {"rollout": (UpdateGatedRollout, {"gated_seed": batch_seed(cfg, 0)})}
    async with GRPOTrainer(cfg, worker_overrides=overrides) as trainer:
        history = await trainer.fit()
    assert [h["step"] for h in history] == [0, 1]
    steps = {r["step"]: r["groups"] for r in journal(tmp_path) if r["kind"] == "step"}
    assert 0 not in steps[0] and 0 in steps[1]  # group 0 waited for the first update, then trained
