"""The process restart policy (``restart="process"``), on real Ray: a group that loses one of its processes keeps
the others and their calls, refuses calls that reach the lost ranks, and ``replace_process`` starts a new process
for those ranks alone (the others' pids unchanged) whose ordered lanes start again from their first number. A
replacement whose start fails or never ends raises a clear error and leaves the ranks lost, never a hang."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

import asyncrl
from asyncrl import PlacementError, RayWorkerGroup
from asyncrl.errors import GroupBrokenError, GroupClosedError, RemoteError, WorkerDiedError

from .kinds import until
from .workers import Probe, Restartable


async def _rank_log(wg, rank: int, want: list[int]) -> bool:
    return (await wg.peek_log())[rank] == want


async def _lose_process(wg, rank: int) -> list[int]:
    """SIGKILL the process of `rank` while it runs a call of the group's; returns the pids before."""
    pids = await wg.pid()
    pending = wg.wait_forever.options(rank=rank)("held")
    await until(lambda: _rank_log(wg, rank, [1]))  # the call runs there: the process is lost mid-call
    os.kill(pids[rank], signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as died:
        await pending
    assert died.value.rank == rank
    return pids


async def test_a_lost_process_is_replaced_alone_and_its_ranks_serve_again(ray_cluster, tmp_path):
    wg = RayWorkerGroup(Restartable, world_size=4, ranks_per_process=2, name="restartable", restart="process",
                        kwargs={"gate": str(tmp_path / "gate")})
    async with wg:
        await asyncrl.gather(*(wg.record_async(i) for i in range(3)))  # every lane numbered past its first call
        assert await wg.get_log() == [[0, 1, 2]] * 4
        held = wg.wait_forever.options(rank=0)("kept")  # a call of another process, in flight through the loss
        pids = await _lose_process(wg, 2)
        assert not wg.broken and wg.lost_ranks == [2, 3]
        with pytest.raises(GroupBrokenError, match=r"replace_process\(2\)") as refused:
            wg.add(1)
        assert refused.value.ranks == (2, 3)
        with pytest.raises(GroupBrokenError):
            wg.add.options(rank=3)(1)
        assert await wg.add.options(rank=1)(10) == [11]  # the other process serves on
        assert await wg.replace_process(3) == [2, 3]
        new = await wg.pid()
        assert new[:2] == pids[:2] and new[2] == new[3] and new[2] != pids[2]
        assert wg.lost_ranks == [] and not wg.broken and not held.done()
        assert [e["rank_at_init"] for e in await wg.env()] == [0, 1, 2, 3]
        assert await wg.get_log() == [[1], [], [], []]  # (rank 0's held call; the new ranks start empty)
        await asyncrl.gather(*(wg.record_async(i) for i in range(3)))  # new lanes from their first number
        assert await wg.get_log() == [[0, 1, 2]] * 4
        held.cancel()


async def test_a_replacement_that_fails_to_start_raises_and_the_ranks_stay_lost(ray_cluster, tmp_path):
    gate = tmp_path / "gate"
    wg = RayWorkerGroup(Restartable, world_size=4, ranks_per_process=2, name="gated", restart="process",
                        kwargs={"gate": str(gate)})
    async with wg:
        pids = await _lose_process(wg, 0)
        gate.write_text("fail")
        with pytest.raises(RemoteError, match="start refused by the test's gate"):
            await wg.replace_process(0)
        assert wg.lost_ranks == [0, 1]
        gate.write_text("hang")  # no capacity: the new process never comes up
        with pytest.raises(PlacementError, match=r"ranks \[0, 1\] did not start within 1 s"):
            await wg.replace_process(1, timeout_s=1.0)
        assert wg.lost_ranks == [0, 1]
        gate.unlink()
        assert await wg.replace_process(0) == [0, 1]
        new = await wg.pid()
        assert new[2:] == pids[2:] and new[0] != pids[0]
        assert await wg.add(0) == [0, 1, 2, 3]


async def test_without_the_policy_a_lost_process_breaks_the_group_and_bad_input_is_refused(ray_cluster):
    with pytest.raises(ValueError, match="restart must be one of"):
        RayWorkerGroup(Probe, world_size=2, restart="rank")
    wg = RayWorkerGroup(Probe, world_size=4, ranks_per_process=2, name="plain")
    async with wg:
        with pytest.raises(RuntimeError, match="create it with restart='process'"):
            await wg.replace_process(0)
        await _lose_process(wg, 3)
        assert wg.broken  # the whole group, as before
    async with RayWorkerGroup(Probe, world_size=2, name="policy", restart="process") as wg2:
        with pytest.raises(ValueError, match=r"needs a rank of group 'policy' \(0..1\), got 2"):
            await wg2.replace_process(2)
        with pytest.raises(ValueError, match="timeout_s must be a positive number"):
            await wg2.replace_process(0, timeout_s=0)


async def test_closing_the_group_stops_a_replacement_that_never_starts(ray_cluster, tmp_path):
    gate = tmp_path / "gate"
    wg = RayWorkerGroup(Restartable, world_size=2, ranks_per_process=1, name="closing", restart="process",
                        kwargs={"gate": str(gate)})
    async with wg:
        await _lose_process(wg, 1)
        gate.write_text("hang")
        replacing = asyncio.ensure_future(wg.replace_process(1))
        started = tmp_path / "gate.started"

        async def starting() -> bool:
            return started.exists()

        await until(starting)  # the old process killed, the new one's constructor running
        await wg.close()
        with pytest.raises(GroupClosedError, match="closed while a process was being replaced"):
            await replacing
