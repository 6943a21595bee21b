"""Lifecycle and placement: colocation, pools, release on every path, two nodes."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import ray
from ray.util import placement_group_table

import asyncrl
from asyncrl import GroupClosedError, PlacementError, RayWorkerGroup, ResourcePool, colocate
from tests.core.kinds import run_script, until
from tests.core.workers import Other, Probe

def alive_hosts() -> int:
    return sum(1 for a in ray._private.state.actors().values()
               if a["State"] == "ALIVE" and a["ActorClassName"].endswith("WorkerHost"))


def live_pgs(prefix: str = "") -> int:
    """Placement groups not removed (those whose name starts with `prefix`)."""
    return sum(1 for pg in placement_group_table().values()
               if pg["name"].startswith(prefix) and pg["state"] in ("CREATED", "PENDING", "RESCHEDULING"))


async def settle(check, want, deadline: float = 60.0):
    """Actor death is reported asynchronously by the GCS; poll with a deadline (generous:
    it only runs out when something leaked, and a loaded machine reports deaths late)."""
    end = asyncio.get_running_loop().time() + deadline
    while True:
        now = await asyncio.to_thread(check)
        if now == want or asyncio.get_running_loop().time() > end:
            return now
        await asyncio.sleep(0.05)


async def test_colocated_groups_share_processes_and_match_separate_groups(ray_cluster):
    before_hosts, before_pgs = alive_hosts(), live_pgs()
    async with colocate({"probe": (Probe, (), {"base": 10}), "other": Other}, world_size=2, name="co") as groups:
        probe, other = groups["probe"], groups["other"]
        assert await probe.add(1) == [11, 12]
        assert await other.add(1) == [1001, 1002]
        assert await probe.pid() == await other.pid()  # same process per rank
        assert alive_hosts() - before_hosts == 2
    async with RayWorkerGroup(Probe, world_size=2, kwargs={"base": 10}) as separate:
        assert await separate.add(1) == [11, 12]
    assert await settle(alive_hosts, before_hosts) == before_hosts
    assert await settle(live_pgs, before_pgs) == before_pgs


async def test_async_with_releases_actors_and_placement_groups_on_error(ray_cluster):
    before_hosts, before_pgs = alive_hosts(), live_pgs()
    pool = ResourcePool([2], cpus_per_bundle=1)
    with pytest.raises(asyncrl.RemoteError):
        async with RayWorkerGroup(Probe, pool) as wg:
            await wg.boom("stop")
    assert wg.closed
    assert await settle(alive_hosts, before_hosts) == before_hosts
    pool_owned = RayWorkerGroup(Probe, world_size=1)
    async with pool_owned:
        pass
    assert await settle(live_pgs, before_pgs + 1) == before_pgs + 1  # the user's pool stays until released
    await pool.release()
    assert await settle(live_pgs, before_pgs) == before_pgs


async def test_cancelled_setup_releases_everything(ray_cluster):
    before_hosts, before_pgs = alive_hosts(), live_pgs()
    wg = RayWorkerGroup(Probe, world_size=2)

    async def use():
        async with wg:
            await asyncio.Event().wait()

    task = asyncio.ensure_future(use())

    async def up() -> bool:
        assert not task.done(), task  # a set-up that failed would never be ready
        return wg._hostset.state == "ready"

    await until(up, deadline=120)  # wait until it is really up, then cancel
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert wg.closed
    assert await settle(alive_hosts, before_hosts) == before_hosts
    assert await settle(live_pgs, before_pgs) == before_pgs
    with pytest.raises(GroupClosedError):
        wg.add(1)


async def test_colocate_count_lets_two_groups_share_a_pool(ray_cluster):
    pool = ResourcePool([2], cpus_per_bundle=2, max_colocate_count=2)
    a, b = RayWorkerGroup(Probe, pool), RayWorkerGroup(Other, pool)
    try:
        await asyncio.gather(a.setup(), b.setup())
        assert await a.add(0) == [0, 1] and await b.add(0) == [1000, 1001]
        assert pool.cpus_per_actor == 1.0
    finally:
        await a.close()
        await b.close()
        await pool.release()


async def test_split_and_merge_pools(ray_cluster):
    pool = ResourcePool([4], cpus_per_bundle=1)
    left, right = pool.split([1, 3])
    merged = ResourcePool.merge([left, right])
    assert (left.world_size, right.world_size, merged.world_size) == (1, 3, 4)
    async with RayWorkerGroup(Probe, right) as wg:
        assert await wg.add(0) == [0, 1, 2]
        assert [s.bundle_index for s in right.slots] == [1, 2, 3]
    with pytest.raises(ValueError, match="add up to the pool size 4"):
        pool.split([2, 3])
    await pool.release()


async def test_pool_larger_than_the_cluster_fails_fast(ray_cluster):
    with pytest.raises(PlacementError, match="needs 1000 CPUs"):
        async with RayWorkerGroup(Probe, ResourcePool([1000])):
            pass


async def test_pool_asking_for_absent_gpus_fails_fast(ray_cluster):
    before = live_pgs()
    with pytest.raises(PlacementError, match="needs 2 CPUs and 2 GPUs"):
        async with RayWorkerGroup(Probe, ResourcePool([2], gpus_per_bundle=1)):
            pass
    assert live_pgs() == before


async def test_a_pool_used_with_async_with_is_released_on_exit(ray_cluster):
    before = live_pgs()
    async with ResourcePool([2], name="scoped") as pool:
        async with RayWorkerGroup(Probe, pool) as wg:
            assert await wg.add(0) == [0, 1]
        assert pool.placed and await settle(live_pgs, before + 1) == before + 1  # the group does not release it
    assert not pool.placed
    assert await settle(live_pgs, before) == before
    await pool.release()  # idempotent


def test_bad_pool_arguments():
    with pytest.raises(ValueError, match="positive ints"):
        ResourcePool([0])
    with pytest.raises(ValueError, match="some CPUs or GPUs"):
        ResourcePool([1], cpus_per_bundle=0)
    with pytest.raises(ValueError, match="may not set"):
        RayWorkerGroup(Probe, world_size=1, env={"RANK": "3"})


TWO_NODES = textwrap.dedent("""
    import asyncio, ray
    from ray.cluster_utils import Cluster
    import asyncrl
    from asyncrl import RayWorkerGroup, ResourcePool
    from tests.core.workers import Probe

    # Every size explicit: nothing here depends on the machine (cores, memory).
    node = {"num_cpus": 2, "object_store_memory": 80 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        asyncrl.init(address=cluster.address)

        async def main():
            async with ResourcePool([2, 2]) as pool:
                async with RayWorkerGroup(Probe, pool) as wg:
                    assert await wg.add(0) == [0, 1, 2, 3]
                    envs = await wg.env()
                    print("LOCAL_RANKS", [e["LOCAL_RANK"] for e in envs])
                    nodes = [ray.util.placement_group_table(s.placement_group)["bundles_to_node_id"][s.bundle_index]
                             for s in pool.slots]
                    print("NODES", len(set(nodes[:2])), len(set(nodes[2:])), len(set(nodes)))
            # 4 CPUs in the cluster, but no node has 3: INFEASIBLE, reported at once (not pending forever)
            try:
                async with RayWorkerGroup(Probe, ResourcePool([1], cpus_per_bundle=3, placement_timeout=600)):
                    pass
            except asyncrl.PlacementError as e:
                print("INFEASIBLE" if "INFEASIBLE" in str(e) else str(e))
        asyncio.run(main())
    finally:
        asyncrl.shutdown()
        cluster.shutdown()
    print("CLEAN")
""")


async def test_pool_of_two_nodes_spans_both_and_leaves_the_session_ray_working(ray_cluster):
    """Ray's cluster utilities start a head and a worker node on this machine, in a process
    of their own (with an environment free of this session's Ray settings); afterwards the
    session's Ray still places and runs groups."""
    stdout = await run_script(TWO_NODES)
    assert "LOCAL_RANKS ['0', '1', '0', '1']" in stdout
    assert "NODES 1 1 2" in stdout
    assert "INFEASIBLE" in stdout and "CLEAN" in stdout
    assert ray.cluster_resources().get("CPU") == ray_cluster.get("CPU")
    async with RayWorkerGroup(Probe, world_size=2, name="after-two-nodes") as wg:
        assert await wg.add(0) == [0, 1]
