"""Which failures the trainer's recovery counts as worker faults (`recovery.is_worker_fault`), for the errors a
lost process makes its *peers* raise. A lost node kills several processes at once; the survivors' errors can
reach the supervisor before the deaths do, and must lead to the same recovery, not to a failed run."""

from __future__ import annotations

import asyncio
import datetime
import os

import pytest
import torch
import torch.distributed as dist

import asyncrl
from asyncrl import Dispatch, register
from asyncrl.pipelines.supervision.recovery import fault_origin, is_worker_fault
from asyncrl.roles.weights.weight_channel import free_port


class _Peer(asyncrl.Worker):
    """One member of a two-process gloo group (each its own asyncrl group, as training ranks' processes)."""

    @register(Dispatch.ONE_TO_ALL)
    def join(self, port: int, rank: int) -> float:
        td = datetime.timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=td)
        self.pg = dist.ProcessGroupGloo(store, rank, 2, td)
        return self.reduce()

    @register(Dispatch.ONE_TO_ALL)
    def reduce(self) -> float:
        t = torch.ones(1)
        self.pg.allreduce([t]).wait()
        return float(t)

    @register(Dispatch.ONE_TO_ALL)
    def exit_now(self) -> None:
        os._exit(1)  # as when its node is lost


async def test_a_collective_whose_peer_died_fails_as_a_worker_fault(ray_cluster):
    """A training rank whose all-reduce peer died raises gloo's connection error, not a death: recovery counts it
    as a worker fault, so the run restarts whichever of the two errors it sees first."""
    port = free_port()
    async with (asyncrl.RayWorkerGroup(_Peer, world_size=1, name="peer-a") as a,
                asyncrl.RayWorkerGroup(_Peer, world_size=1, name="peer-b") as b):
        assert await asyncio.gather(a.join(port, 0), b.join(port, 1)) == [[2.0], [2.0]]
        with pytest.raises(asyncrl.WorkerDiedError):
            await b.exit_now()
        with pytest.raises(asyncrl.RemoteError) as info:
            await a.reduce()
    e = info.value
    assert e.exc_type == "builtins.RuntimeError" and "Connection closed by peer" in e.message
    assert is_worker_fault(e)
    assert fault_origin(e) == "a peer of peer-a"  # not its own group: the cure is a restart, not replacing it
