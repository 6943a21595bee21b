"""Which host a Ray group's processes get, and what only the threaded host must prove.

A process whose workers have no concurrent method gets the threaded host (no event loop
on the call path); one with a concurrent method anywhere (colocated roles included) the
async host. The contracts themselves run on both kinds in test_contracts, test_failures,
test_pipelining and test_protocol (`tests/core/kinds.py`).
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref

import pytest
import torch

import asyncrl
from asyncrl import Dispatch, RayWorkerGroup, Worker, colocate, register
from tests.core import kinds
from tests.core.workers import Other, Probe

HANG = 60  # seconds: ordered calls that should all run but have not by then are stuck


async def host_kinds(wg) -> list[str]:
    hs = wg._hostset
    return [await hs.backend.admin(h, "host_kind") for h in hs.hosts]


async def test_a_process_without_concurrent_methods_gets_the_threaded_host(ray_cluster):
    async with RayWorkerGroup(Other, world_size=2, name="kind-other") as other:
        assert await host_kinds(other) == ["threaded", "threaded"]
        assert await other.add(1) == [1001, 1002]
    async with RayWorkerGroup(Probe, world_size=1, name="kind-probe") as probe:
        assert await host_kinds(probe) == ["async"]


async def test_colocated_roles_with_a_concurrent_method_share_the_async_host(ray_cluster):
    async with colocate({"probe": Probe, "other": Other}, world_size=2, name="kind-co") as groups:
        assert await host_kinds(groups["other"]) == ["async", "async"]
        assert await groups["other"].pid() == await groups["probe"].pid()


class Both(Worker):
    """Ordered `def` and `async def` methods only: a threaded host. Records the thread
    of every plain def call and of its constructor."""

    def __init__(self) -> None:
        self.threads = {threading.get_ident()}
        self.log: list[int] = []

    @register()
    def record(self, x) -> int:
        self.threads.add(threading.get_ident())
        value = int(x[0]) if isinstance(x, list) else int(x)
        self.log.append(value)
        return value

    @register()
    async def record_async(self, x: int) -> int:
        await asyncio.sleep(0)
        self.log.append(x)
        return x

    @register()
    def take(self) -> tuple[list[int], int]:
        out, self.log = self.log, []
        return out, len(self.threads)

    @register(Dispatch.DP_COMPUTE)
    def double(self, t: torch.Tensor) -> torch.Tensor:
        return t * 2


async def test_ordered_calls_run_in_issue_order_on_the_threaded_hosts_one_thread(ray_cluster):
    """300 ordered calls mixed with 1 MiB arguments (Ray fetches those before dispatching the
    call) and ordered async def calls, issued without awaiting: all run, in issue order
    (one-thread-group-order of docs/protocol.md), every plain def on the one thread that built the worker."""
    async with kinds.group("ray-threaded", Both, world_size=2, name="threaded-order") as wg:
        assert await host_kinds(wg) == ["threaded", "threaded"]
        big = torch.zeros(1 << 18)  # 1 MiB
        futs = []
        for i in range(300):
            if i % 10 == 3:
                futs.append(wg.record_async(i))
            else:
                futs.append(wg.record([i, big] if i % 7 == 0 else i))
        async with asyncio.timeout(HANG):
            await asyncrl.gather(*futs)
            logs = await wg.take()
        assert logs == [(list(range(300)), 1), (list(range(300)), 1)]


async def test_a_threaded_host_resolves_pipelined_arguments(ray_cluster):
    async with kinds.group("ray-threaded", Both, world_size=2, name="threaded-pipe") as wg:
        t = torch.arange(6)
        assert torch.equal(await wg.double(wg.double(t)), t * 4)
        assert await wg.record(wg.record(5)) == [5, 5]


class Keeps(Worker):
    """Records a weak reference to every argument its plain def method received."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    @register(Dispatch.DP_COMPUTE)
    def rowsum(self, t: torch.Tensor) -> torch.Tensor:
        self.refs.append(weakref.ref(t))
        return t.sum(dim=1, keepdim=True)

    @register()
    async def alive(self) -> list[bool]:  # on the host's loop: the ordered thread stays idle meanwhile
        return [r() is not None for r in self.refs]


@pytest.mark.parametrize("backend", kinds.BACKENDS)
async def test_the_ordered_thread_drops_a_calls_arguments_when_it_returns(ray_cluster, backend):
    """Once a plain def call has returned, its host holds nothing of its arguments (a shard
    that aliases the object store), also while no other call comes to the ordered thread."""
    async with kinds.group(backend, Keeps, world_size=2, name=f"keeps-{backend}") as wg:
        t = torch.arange(12.0).reshape(4, 3)
        assert (await wg.rowsum(t)).flatten().tolist() == [3.0, 12.0, 21.0, 30.0]
        assert await wg.alive() == [[False], [False]]


class Threads(Worker):
    """Reports what its process was given to run torch with."""

    @register()
    def threads(self) -> tuple[str | None, int]:
        return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


class ThreadsAsync(Threads):
    @register(concurrent=True)
    async def noop(self) -> None:  # a concurrent method: the async host
        return None


@pytest.mark.parametrize("cls, per_process, kind", [(Threads, 1, "threaded"), (ThreadsAsync, 1, "async"),
                                                     (Threads, 2, "ranks")])
async def test_each_host_runs_torch_with_its_slots_cpus(ray_cluster, cls, per_process, kind):
    """A host's process gets OMP_NUM_THREADS from its bundle's CPUs (Ray's own default for an actor: asyncrl sets no
    runtime_env), and torch runs a plain def method with the rank's share of them, on every host kind; two ranks in
    a process share its CPUs. Two CPUs a bundle, so that neither is the default of 1."""
    async with asyncrl.ResourcePool([2], cpus_per_bundle=2, name=f"threads-{kind}") as pool:
        async with RayWorkerGroup(cls, pool, ranks_per_process=per_process, name=f"threads-{kind}") as wg:
            if kind != "ranks":
                assert await host_kinds(wg) == [kind, kind]
            assert await wg.threads() == [("2", 2 // per_process)] * 2
