"""Several ranks per worker process (``ranks_per_process``), on real Ray: each rank keeps its own worker object,
identity and ordered lane; a rank's failure fails that rank's call alone, the loss of a process fails its ranks
(and breaks the group, as any dead worker does); closing releases every process."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from tensordict import TensorDict

import asyncrl
from asyncrl import RayWorkerGroup, colocate
from asyncrl.errors import GroupBrokenError, RemoteError, WorkerDiedError

from .kinds import until
from .workers import Other, Probe


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_ranks_hosted_together_keep_their_own_identity_and_order(ray_cluster):
    async with RayWorkerGroup(Probe, world_size=6, ranks_per_process=4, name="packed") as wg:
        pids = await wg.pid()
        assert len(set(pids[:4])) == 1 and len(set(pids[4:])) == 1 and pids[0] != pids[4]  # 4 + 2 ranks
        assert [e["rank_at_init"] for e in await wg.env()] == list(range(6))
        assert await wg.add(10) == [10 + r for r in range(6)]
        await asyncrl.gather(*(wg.record_async(i) for i in range(40)))  # ordered calls yield inside: no interleaving
        assert await wg.get_log() == [list(range(40))] * 6
        batch = TensorDict({"x": torch.arange(12.0), "prompt": [f"p{i}" for i in range(12)]}, batch_size=[12])
        out = await wg.tag(batch)
        assert out["rank"].tolist() == [r for r in range(6) for _ in range(2)]  # each rank its own shard
        assert out["y"].tolist() == (batch["x"] * 2).tolist()


async def test_a_failing_rank_fails_alone_and_a_lost_process_takes_its_ranks(ray_cluster):
    wg = RayWorkerGroup(Probe, world_size=4, ranks_per_process=2, name="pairs")
    async with wg:
        batch = TensorDict({"y": torch.arange(8.0)}, batch_size=[8])
        with pytest.raises(RemoteError) as info:
            await wg.boom_on_rank(batch, 3)
        assert (info.value.group, info.value.rank) == ("pairs", 3)
        assert await wg.add(0) == [0, 1, 2, 3] and not wg.broken  # its process-mate and the others go on
        pids = await wg.pid()
        assert pids[0] == pids[1] != pids[2] == pids[3]
        pending = wg.wait_forever("k")
        await until(lambda: _logs(wg, [[1]] * 4))
        os.kill(pids[2], signal.SIGKILL)  # the process of ranks 2 and 3
        with pytest.raises(WorkerDiedError) as died:
            await pending
        assert died.value.rank in (2, 3)
        assert wg.broken
        with pytest.raises(GroupBrokenError):
            wg.add(1)
        assert _alive(pids[0])  # ranks 0 and 1 live until the group closes
    await until(_async(lambda: not _alive(pids[0])))  # closing released the remaining process


async def test_colocated_roles_share_each_process_at_several_ranks_per_process(ray_cluster):
    col = colocate({"a": Probe, "b": Other}, world_size=3, ranks_per_process=2, name="col")
    async with col:
        a, b = col["a"], col["b"]
        pa, pb = await a.pid(), await b.pid()
        assert pa == pb and pa[0] == pa[1] != pa[2]
        assert await b.add(0) == [1000, 1001, 1002]
    await until(_async(lambda: not any(_alive(p) for p in set(pa))))


def test_a_pool_must_hold_the_processes_and_the_count_must_be_positive():
    from asyncrl import ResourcePool

    with pytest.raises(ValueError, match="ranks_per_process must be a positive int"):
        RayWorkerGroup(Probe, world_size=2, ranks_per_process=0)
    with pytest.raises(ValueError, match="larger than the pool's 1 bundles hold at 2 ranks per process"):
        RayWorkerGroup(Probe, ResourcePool([1]), world_size=3, ranks_per_process=2)
    g = RayWorkerGroup(Probe, ResourcePool([2]), world_size=3, ranks_per_process=2)
    assert g._hostset.processes == 2


async def _logs(wg, want) -> bool:
    return await wg.peek_log() == want


def _async(fn):
    async def check() -> bool:
        return fn()

    return check
