"""A call to one rank (``wg.method.options(rank=r)``), on real Ray: it runs on that rank alone as a group of one
(the whole batch, a group of one's result), keeps its issue order in that rank's lane beside group-wide calls,
pipelines like any call (same-process hand-off on its own rank) and names its rank in errors."""

from __future__ import annotations

import pytest
import pytest_asyncio
import torch
from tensordict import TensorDict

import asyncrl
from asyncrl import RayWorkerGroup
from asyncrl.errors import DispatchError, RemoteError

from .workers import Probe


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def wg(ray_cluster):
    async with RayWorkerGroup(Probe, world_size=4, name="targets", ranks_per_process=2) as g:
        yield g


def _batch(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(float(n)), "prompt": [f"p{i}" for i in range(n)]}, batch_size=[n])


async def test_a_call_to_one_rank_runs_there_alone_as_a_group_of_one(wg):
    out = await wg.tag.options(rank=2)(_batch(5))  # 5 rows: not split, not padded
    assert out["rank"].tolist() == [2] * 5 and out["y"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert await wg.add.options(rank=3)(10) == [13]  # ONE_TO_ALL: a one-item list
    assert await wg.whoami.options(rank=1)() == 1  # RANK_ZERO: the targeted rank's value
    fut = wg.add.options(rank=1)(0)
    assert fut.ranks == [1]
    await fut


async def test_calls_to_one_rank_keep_their_issue_order_beside_group_calls(wg):
    futs = []
    for i in range(30):
        futs.append(wg.record(i) if i % 3 == 0 else wg.record.options(rank=i % 4)(i))
    await asyncrl.gather(*futs)
    logs = await wg.get_log()
    for r in range(4):
        assert logs[r] == [i for i in range(30) if i % 3 == 0 or i % 4 == r]


async def test_a_call_to_one_rank_pipelines_into_the_same_rank_and_into_the_group(wg):
    before = wg.stats.inputs_local
    made = wg.tag.options(rank=3)(_batch(4))
    again = await wg.inc.options(rank=3)(made)  # same rank, same process: handed over in memory
    assert again["y"].tolist() == [1.0, 3.0, 5.0, 7.0] and wg.stats.inputs_local == before + 1
    spread = await wg.inc(wg.tag.options(rank=0)(_batch(8)))  # into a group call: split across the 4 ranks
    assert spread["y"].tolist() == [2 * i + 1.0 for i in range(8)]


async def test_a_call_to_one_rank_names_it_and_bad_targets_are_refused(wg):
    with pytest.raises(RemoteError) as info:
        await wg.boom_on_rank.options(rank=2)(TensorDict({"y": torch.zeros(3)}, batch_size=[3]), 2)
    assert info.value.rank == 2
    with pytest.raises(ValueError, match="rank 4 is not a rank of this group of 4 workers"):
        wg.add.options(rank=4)(1)
    with pytest.raises(ValueError, match="rank must be a rank of the group"):
        wg.add.options(rank=-1)
    m = wg.add.options(timeout=30.0).options(rank=1)  # options given later keep the earlier ones
    assert (m._timeout, m._rank) == (30.0, 1) and await m(0) == [1]


def test_a_mesh_method_cannot_be_sent_to_one_rank():
    g = RayWorkerGroup(Probe, world_size=2, args=(0, 2), name="mesh")  # refused as the call is made: no workers
    with pytest.raises(DispatchError, match="a call to one rank takes a non-mesh mode"):
        g.mesh_tag.options(rank=0)


def test_a_split_into_one_shard_sends_the_batch_itself_not_a_view():
    """A call to one rank (a group of one) takes every row: dispatch hands it the batch as it is, with no per-call
    slicing; a split into several shards still cuts rows."""
    from asyncrl.dispatch import World, dispatch_dp

    td = _batch(5)
    assert dispatch_dp(World(1, "g", {}), td).args[0][0] is td
    halves = dispatch_dp(World(2, "g", {}), td).args[0]
    assert [h["x"].tolist() for h in halves] == [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]
