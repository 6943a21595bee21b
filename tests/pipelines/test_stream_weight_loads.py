"""The streaming weight loop's loads on real Ray (``pipelines/rollout/stream_rollout.py``: ``load_every_rank``,
``load_ranks``): a group load that some ranks refuse as a version they hold loads the others one by one (a load that
failed part-way reached them, and a replaced replica was brought to the version before it), and a per-rank load
counts a version a rank holds as loaded and raises any other refusal, leaving no rank's error unretrieved."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import ray._private.worker as ray_worker
import torch

import asyncrl
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.loop.weights import WeightSync
from asyncrl.pipelines.rollout.stream_rollout import load_every_rank, load_ranks
from asyncrl.roles import PolicyWorker, RolloutConfig, RolloutWorker, StaleWeightsError, WeightSyncError


@pytest.fixture
def unhandled(monkeypatch) -> list[str]:
    """What Ray reports as unhandled errors (an error in an object nobody retrieved) while the test runs."""
    seen: list[str] = []
    monkeypatch.setattr(ray_worker, "_unhandled_error_handler", lambda e: seen.append(str(e)[:300]))
    return seen


@pytest.fixture
async def rollout(ray_cluster):
    cfg = tiny_test()
    group = asyncrl.RayWorkerGroup(RolloutWorker, world_size=2, name="weight-loads",
                                   kwargs={"model": cfg.model, "rollout": RolloutConfig(max_new_tokens=4)})
    async with group:
        yield group


def _export(version: int) -> tuple[int, dict]:
    """``(version, state_dict)`` as ``PolicyWorker.export_weights`` gives it: the tiny model's initial weights."""
    _, sd = PolicyWorker(tiny_test().model).export_weights()
    return version, sd


async def test_a_group_load_some_ranks_hold_already_loads_the_others(rollout, unhandled):
    exported = _export(1)
    await rollout.update_weights.options(rank=0)(exported)  # rank 0 holds version 1 (the load that failed part-way)
    with pytest.raises(asyncrl.RemoteError) as plain:  # the group load alone: rank 0 refuses it
        await WeightSync(tiny_test()).load(SimpleNamespace(rollout=rollout), exported)
    assert isinstance(plain.value.cause, StaleWeightsError) and "already has version 1" in str(plain.value)
    assert await rollout.get_version() == [1, 1]  # rank 1 loaded it all the same

    exported = _export(2)
    await rollout.update_weights.options(rank=1)(exported)
    await load_every_rank(WeightSync(tiny_test()), SimpleNamespace(rollout=rollout), exported)
    assert await rollout.get_version() == [2, 2]
    gc.collect()
    assert unhandled == []


async def test_the_collective_transport_raises_the_refusal(rollout):
    exported = _export(1)
    await rollout.update_weights.options(rank=0)(exported)
    weights = SimpleNamespace(transport="collective", load=WeightSync(tiny_test()).load)
    with pytest.raises(asyncrl.RemoteError) as info:  # its ranks receive together: no rank is loaded alone
        await load_every_rank(weights, SimpleNamespace(rollout=rollout), exported)
    assert isinstance(info.value.cause, StaleWeightsError)


async def test_a_per_rank_load_raises_a_refusal_other_than_a_held_version_and_leaves_no_error_unretrieved(rollout,
                                                                                                       unhandled):
    bad = (1, {"not.a.parameter": torch.zeros(2)})  # malformed: every rank refuses it
    with pytest.raises(asyncrl.RemoteError) as info:
        await load_ranks(rollout, bad, [0, 1])
    assert isinstance(info.value.cause, WeightSyncError)
    assert await rollout.get_version() == [0, 0]  # refused before anything changed, on both ranks
    gc.collect()
    assert unhandled == []  # rank 1's error too (its call is not awaited once rank 0's raised)

    await load_ranks(rollout, _export(1), [1])
    await load_ranks(rollout, _export(1), [0, 1])  # rank 1 holds it: counted as loaded
    assert await rollout.get_version() == [1, 1]
