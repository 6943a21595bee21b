"""Fake RL workers with random stage delays, for the trainer's scheduling tests.

They keep the roles' method contracts (names, dispatch modes, fields) but compute
nothing; each records ``(stage, step, version)`` into a shared event list in the order
the stages run, and the policy refuses a batch older than the staleness bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import TYPE_CHECKING, AsyncIterator

import torch
from tensordict import TensorDict

from asyncrl import Dispatch, Execute, LocalWorkerGroup, Worker, register

if TYPE_CHECKING:
    from asyncrl.pipelines.loop.stages import Groups

R = 3


class Recorder:
    """Events of one run (the workers run in this process on the local backend)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.held_group_done = asyncio.Event()
        """Set when :class:`HeldRollout`'s held group finished."""


def _step(batch, prompts_per_step: int) -> int:
    return int(batch["uid"][0]) // prompts_per_step


class FakeRollout(Worker):
    def __init__(self, rec: Recorder, seed: int, pps: int, max_delay: float) -> None:
        self.rec, self.rng, self.pps, self.max_delay = rec, random.Random(seed), pps, max_delay
        self.version = 0

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate(self, batch, seed: int | None = None):
        v = self.version
        await asyncio.sleep(self.rng.uniform(0, self.max_delay))
        assert self.version == v, "weights changed during a generation"
        self.rec.events.append(("generate", _step(batch, self.pps), v))
        out = batch.clone(recurse=False)
        n = batch.batch_size[0]
        out.set("response_ids", torch.ones(n, R, dtype=torch.long))
        out.set("response_mask", torch.ones(n, R, dtype=torch.long))
        out.set("version", torch.full((n,), v, dtype=torch.long))
        return out

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate_requests(self, batch, seed: int | None = None):
        """Streaming rollout's call: a weight update may land mid-call; each token records the version
        it was "decoded" under (one token per random delay)."""
        self.rec.events.append(("generate_requests", int(batch["uid"][0]), self.version))
        n = batch.batch_size[0]
        tv = torch.zeros(n, R, dtype=torch.long)
        for j in range(R):
            await asyncio.sleep(self.rng.uniform(0, self.max_delay / R))
            tv[:, j] = self.version
        out = batch.clone(recurse=False)
        out.set("response_ids", torch.ones(n, R, dtype=torch.long))
        out.set("response_mask", torch.ones(n, R, dtype=torch.long))
        out.set("version", tv[:, 0].clone())
        out.set("token_versions", tv)
        return out

    @register(Dispatch.ONE_TO_ALL)
    async def update_weights(self, weights, version: int | None = None):
        if isinstance(weights, list):
            weights = weights[0]
        v, _ = weights
        assert v > self.version, f"stale weight update {v} <= {self.version}"
        await asyncio.sleep(self.rng.uniform(0, self.max_delay))
        self.version = v
        self.rec.events.append(("weight_sync", -1, v))
        return {"version": v}

    @register(Dispatch.ONE_TO_ALL)
    def weights_checksum(self):
        return {"version": str(self.version)}


class FakeReward(Worker):
    def __init__(self, rec: Recorder, seed: int, pps: int, max_delay: float) -> None:
        self.rec, self.rng, self.pps, self.max_delay = rec, random.Random(seed + 1), pps, max_delay

    @register(Dispatch.DP_COMPUTE)
    async def compute_reward(self, batch):
        await asyncio.sleep(self.rng.uniform(0, self.max_delay))
        self.rec.events.append(("score", _step(batch, self.pps), int(batch["version"][0])))
        n = batch.batch_size[0]
        return TensorDict({"scores": torch.tensor([self.rng.random() for _ in range(n)])}, batch_size=[n])


class FakePolicy(Worker):
    def __init__(self, rec: Recorder, seed: int, pps: int, max_delay: float, max_staleness: int) -> None:
        self.rec, self.rng, self.pps, self.max_delay = rec, random.Random(seed + 2), pps, max_delay
        self.k = max_staleness
        self.version = 0

    def _check(self, batch) -> None:
        lag = self.version - int(batch["version"].min())
        if lag > self.k or int(batch["version"].max()) > self.version:
            raise AssertionError(f"policy at version {self.version} received rows of versions "
                                 f"{batch['version'].unique().tolist()} (bound {self.k})")

    @register(Dispatch.DP_COMPUTE)
    async def compute_log_prob(self, batch):
        await asyncio.sleep(self.rng.uniform(0, self.max_delay))
        self._check(batch)
        self.rec.events.append(("old_log_prob", _step(batch, self.pps), self.version))
        n = batch.batch_size[0]
        return TensorDict({"old_log_probs": torch.zeros(n, R), "entropy": torch.zeros(n, R)}, batch_size=[n])

    @register(Dispatch.DP_COMPUTE_METRIC)
    async def update(self, batch):
        await asyncio.sleep(self.rng.uniform(0, self.max_delay))
        self._check(batch)
        assert "advantages" in batch.keys()
        self.rec.events.append(("actor_update", _step(batch, self.pps), self.version))
        self.version += 1
        return {"version": float(self.version)}

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def export_weights(self):
        self.rec.events.append(("export_weights", -1, self.version))
        return self.version, {}

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def weights_checksum(self):
        return {"version": str(self.version)}


class HeldRollout(FakeRollout):
    """Streaming: group 0 decodes its tokens under the weights it was admitted with, then finishes only once
    version 2 is loaded -- with ``max_staleness=1`` it can then never be trained (step >= 2, v0 = 0)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._v2 = asyncio.Event()

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate_requests(self, batch, seed: int | None = None):
        out = await super().generate_requests(batch, seed)
        if int(batch["uid"][0]) == 0:
            await self._v2.wait()
            self.rec.held_group_done.set()
        return out

    @register(Dispatch.ONE_TO_ALL)
    async def update_weights(self, weights, version: int | None = None):
        out = await super().update_weights(weights, version)
        if self.version >= 2:
            self._v2.set()
        return out


class HeldPolicy(FakePolicy):
    """Step 3's update waits until :class:`HeldRollout`'s group 0 finished, so that a later step's take
    sees it finished (and past the bound) whatever the delays."""

    @register(Dispatch.DP_COMPUTE_METRIC)
    async def update(self, batch):
        if _step(batch, self.pps) == 3:
            await self.rec.held_group_done.wait()
        return await super().update(batch)


class ConstantReward(FakeReward):
    """Every response scores 0.5: every group's rewards are equal (dynamic sampling drops them all)."""

    @register(Dispatch.DP_COMPUTE)
    async def compute_reward(self, batch):
        out = await super().compute_reward(batch)
        return TensorDict({"scores": torch.full_like(out["scores"], 0.5)}, batch_size=out.batch_size)


@contextlib.asynccontextmanager
async def fake_groups(rec: Recorder, seed: int, prompts_per_step: int, max_delay: float,
                      max_staleness: int, *, rollout: type[FakeRollout] = FakeRollout,
                      reward: type[FakeReward] = FakeReward,
                      policy: type[FakePolicy] = FakePolicy) -> AsyncIterator["Groups"]:
    """Started in-process groups of the fake workers (one rank each; `rollout`, `reward`, `policy`: the
    classes), closed on exit."""
    from asyncrl.pipelines.loop.stages import AdvantageWorker, Groups

    groups = Groups(
        rollout=LocalWorkerGroup(rollout, world_size=1, args=(rec, seed, prompts_per_step, max_delay)),
        reward=LocalWorkerGroup(reward, world_size=1, args=(rec, seed, prompts_per_step, max_delay)),
        policy=LocalWorkerGroup(policy, world_size=1, args=(rec, seed, prompts_per_step, max_delay,
                                                            max_staleness)),
        advantage=LocalWorkerGroup(AdvantageWorker, world_size=1),
    )
    members = (groups.rollout, groups.reward, groups.policy, groups.advantage)
    try:
        for g in members:
            await g.setup()
        yield groups
    finally:
        for g in members:
            await g.close()
