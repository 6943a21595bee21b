"""Pipelined inputs passed as top-level Ray arguments (asyncrl._deferred): only the
matched shards of producers the controller knows finished successfully, and what a
user sees when such an input still fails before the consumer's host runs."""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap

import pytest
import pytest_asyncio
import torch
from tensordict import TensorDict

from asyncrl import RemoteError, UpstreamError, WorkerDiedError
from tests.core import kinds
from tests.core.kinds import BACKENDS, cancelled_and_timed_out, expect_top, run_script, top_from, until
from tests.core.workers import FRAGILE_ENV, Probe

RAY_KINDS = ["ray", "ray-threaded"]


def batch(n: int) -> TensorDict:
    td = TensorDict({"x": torch.arange(n)}, batch_size=[n])
    td["prompt"] = [f"p{i}" for i in range(n)]
    return td


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=BACKENDS)
async def groups(request, ray_cluster):
    """A group of 2 and a group of 1 on one backend (matched and mismatched layouts)."""
    G = kinds.group_class(request.param)
    # local_results=0: these producers and consumers share processes; this file is about
    # the paths through Ray (test_local_handoff.py is about the same-process one).
    pair, one = G(Probe, world_size=2, name="pair", local_results=0), G(Probe, world_size=1, name="one", local_results=0)
    with kinds.forced(request.param):
        await asyncio.gather(pair.setup(), one.setup())
    try:
        yield pair, one
    finally:
        await pair.close()
        await one.close()


@pytest.mark.parametrize("n", [3, 5, 8])
async def test_a_finished_future_goes_top_level_with_its_padding_and_selection(groups, n):
    pair, _ = groups
    produced = pair.tag(batch(n))
    await produced
    whole, selected = pair.inc(produced), pair.inc(produced.select("y"))
    expect_top(pair, whole, ("pair", "tag"))
    expect_top(pair, selected, ("pair", "tag"))
    want = [2 * i + 1 for i in range(n)]  # padding rows (n = 3, 5) stripped by the producer's meta
    assert (await whole)["y"].tolist() == want
    assert (await selected)["y"].tolist() == want
    nested = pair.inc(pair.tag(batch(n)))  # not known to have finished: stays nested
    assert top_from(nested) is None
    assert (await nested)["y"].tolist() == want


async def test_a_missing_selected_field_is_named_on_the_top_level_path(groups):
    pair, _ = groups
    produced = pair.tag(batch(4))
    await produced
    with pytest.raises(RemoteError, match=r"pair.tag has no field\(s\) \['nope'\]") as info:
        await pair.inc(produced.select("nope"))
    assert (info.value.group, info.value.method, info.value.exc_type) == ("pair", "inc", "asyncrl.errors.DispatchError")


async def test_known_ok_is_exact(groups):
    pair, one = groups
    b = batch(8)
    # Never awaited, never read: not known ok, even once it has finished.
    unread = pair.tag(b)
    assert top_from(pair.inc(unread)) is None
    # A consumer that read every result and succeeded marks its producer ok.
    read = pair.tag(b)
    assert (await pair.inc(read))["y"].tolist() == [2 * i + 1 for i in range(8)]
    assert read._call.ok
    expect_top(pair, pair.inc(read), ("pair", "tag"))
    # A consumer that failed marks nothing.
    failed_reader = pair.tag(b)
    with pytest.raises(RemoteError, match="rank 1 failed"):
        await pair.boom_on_rank(failed_reader, 1)
    assert not failed_reader._call.ok
    # A consumer that did not certainly read every result (2 -> 1: a rank fetches the
    # producer's shards its rows overlap) marks nothing, though it succeeded.
    partly = pair.tag(b)
    assert (await one.inc(partly))["y"].tolist() == [2 * i + 1 for i in range(8)]
    assert not partly._call.ok
    assert top_from(pair.inc(partly)) is None


async def test_a_finished_call_to_one_rank_goes_top_level_whole(groups):
    """A known-ok call to one rank (``options(rank=r)``), passed whole (an item of a rank's list: ``concat_shard``'s
    way) into a data-parallel call: its value as top-level arguments (``TopValue``), the field selection applied;
    not known ok, it stays nested. The same values either way."""
    pair, _ = groups
    await pair.get_log()
    first, second = pair.tag.options(rank=0)(batch(3)), pair.tag.options(rank=1)(batch(5))
    await asyncio.gather(first, second)
    assert first._call.ok and second._call.ok
    top = pair.sum_parts([[first, second.select("y")], [second]])
    expect_top(pair, top, ("pair", "tag"))
    got = await top
    assert got["sum"].tolist() == [6, 20, 20] and got["rows"].tolist() == [3, 5, 5]
    unread = pair.tag.options(rank=1)(batch(5))
    mixed = pair.sum_parts([[first], [unread]])  # not known ok: nested; the known-ok one still goes top-level
    expect_top(pair, mixed, ("pair", "tag"))
    assert (await mixed)["sum"].tolist() == [6, 20]
    never = pair.sum_parts([[pair.tag.options(rank=0)(batch(3))], [pair.tag.options(rank=0)(batch(2))]])
    assert top_from(never) is None
    assert (await never)["sum"].tolist() == [6, 2]
    assert await pair.get_log() == [[6, 20, 6, 6], [20, 20, 2]]


async def test_a_failed_call_to_one_rank_is_never_passed_top_level(groups):
    pair, _ = groups
    await pair.get_log()
    b = batch(4)
    b["y"] = b["x"] * 10
    failed = pair.boom_on_rank.options(rank=1)(b, 1)
    with pytest.raises(RemoteError, match="rank 1 failed"):
        await failed
    assert not failed._call.ok
    ok = pair.tag.options(rank=0)(batch(2))
    await ok
    consumer = pair.sum_parts([[ok], [failed]])
    expect_top(pair, consumer, ("pair", "tag"))  # the known-ok input only
    with pytest.raises(UpstreamError) as info:
        await consumer
    e = info.value
    assert (e.group, e.method, e.rank) == ("pair", "sum_parts", 1)
    assert (e.upstream.group, e.upstream.method, e.upstream.rank) == ("pair", "boom_on_rank", 1)
    assert await pair.record(3) == [3, 3]  # the lanes kept their order
    assert await pair.get_log() == [[2, 3], [3]]  # rank 0 took its part; rank 1's call never ran


async def test_cancel_of_a_call_with_top_level_values_waiting_for_its_turn(groups):
    pair, _ = groups
    if pair._hostset.backend.name != "ray":
        pytest.skip("the top-level path is the Ray backend's")
    await pair.get_log()
    produced = pair.tag.options(rank=0)(batch(4))
    await produced
    holding = pair.block()
    await until(lambda: _blocked(pair))
    cancelled = pair.sum_parts([[produced], [produced]])
    timed = pair.sum_parts.options(timeout=0.2)([[produced], [produced]])
    assert top_from(cancelled) == top_from(timed) == (("pair", "tag"),)
    await cancelled_and_timed_out(cancelled, timed)
    await pair.unblock()
    assert await holding == [0, 1]
    assert (await pair.sum_parts([[produced], [produced]]))["sum"].tolist() == [12, 12]
    assert await pair.get_log() == [[12], [12]]  # the cancelled and timed-out calls never ran


async def test_a_failed_producer_is_never_passed_top_level(groups):
    g, _ = groups
    await g.get_log()
    b = batch(4)
    b["y"] = b["x"] * 10
    failed = g.boom_on_rank(b, 1)  # rank 0 returns its rows as they are
    with pytest.raises(RemoteError, match="rank 1 failed"):
        await failed
    assert not failed._call.ok
    consumer = g.log_rows(failed)
    assert top_from(consumer) is None
    with pytest.raises(UpstreamError) as info:
        await consumer
    e = info.value
    assert (e.group, e.method) == ("pair", "log_rows")
    assert (e.upstream.group, e.upstream.method, e.upstream.rank) == ("pair", "boom_on_rank", 1)
    assert await g.record(3) == [3, 3]  # the lanes kept their order: the next ordered call runs
    assert await g.get_log() == [[0, 10, 3], [3]]  # rank 0's input was fine


@pytest.mark.parametrize("kind", RAY_KINDS)
async def test_an_input_the_consumer_cannot_unpickle_releases_its_lane(ray_cluster, kind):
    """Ray fails such a call before the host runs it: the backend's observer releases its
    number even though nobody awaits the call, and its future names the producer."""
    async with kinds.group(kind, Probe, world_size=1, name="maker", local_results=0) as maker, \
            kinds.group(kind, Probe, world_size=1, name="taker", env={FRAGILE_ENV: "1"}, local_results=0) as taker:
        made = maker.fragile([1, 2, 3])
        assert [x.value for x in await made] == [1, 2, 3]  # this process can unpickle it
        top = taker.unwrap(made)
        assert top_from(top) == (("maker", "fragile"),)
        assert await taker.record(7) == [7]  # not awaited, yet its number was released
        with pytest.raises(UpstreamError, match="cannot be unpickled") as info:
            await top
        e = info.value
        assert (e.group, e.method, e.rank) == ("taker", "unwrap", 0)
        assert isinstance(e.upstream, RemoteError)
        assert (e.upstream.group, e.upstream.method) == ("maker", "fragile")
        assert e.upstream.exc_type == "ray.exceptions.RaySystemError"
        # The same input nested (its producer not known ok): the host reports it.
        nested = taker.unwrap(maker.fragile([4]))
        assert top_from(nested) is None
        assert await taker.record(8) == [8]
        with pytest.raises(UpstreamError, match="cannot be unpickled") as info:
            await nested
        assert (info.value.upstream.group, info.value.upstream.method) == ("maker", "fragile")
        assert await taker.get_log() == [[7, 8]]
        assert not taker.broken


@pytest.mark.parametrize("kind", [pytest.param("ray", marks=pytest.mark.slow), "ray-threaded"])
async def test_producer_killed_after_or_before_it_finished(ray_cluster, kind):
    async with kinds.group(kind, Probe, world_size=1, name="dies", local_results=0) as dies, \
            kinds.group(kind, Probe, world_size=1, name="lives", local_results=0) as lives:
        done = dies.tag(batch(3))
        await done
        [pid] = await dies.pid()
        holding = dies.block()  # the producer's lane is held: `unfinished` never finishes
        unfinished = dies.tag(batch(2))
        nested = lives.log_rows(unfinished)
        await until(lambda: _blocked(dies))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            await holding
        # Finished before the kill: its (small) result lives with its owner, the
        # controller, and reaches the consumer top-level.
        top = lives.log_rows(done)
        assert top_from(top) == (("dies", "tag"),)
        assert (await top)["y"].tolist() == [1, 3, 5]
        with pytest.raises(UpstreamError) as info:
            await nested
        assert isinstance(info.value.upstream, WorkerDiedError)
        assert (info.value.upstream.group, info.value.upstream.method) == ("dies", "tag")
        assert await lives.record(4) == [4]
        assert await lives.get_log() == [[0, 2, 4, 4]]


async def _blocked(g) -> bool:
    return await g.is_blocked() == [True] * g.world_size


async def test_cancel_and_deadline_of_a_top_level_call_waiting_for_its_turn(groups):
    g, _ = groups
    if g._hostset.backend.name != "ray":
        pytest.skip("the top-level path is the Ray backend's")
    await g.get_log()
    produced = g.tag(batch(4))
    await produced
    holding = g.block()
    await until(lambda: _blocked(g))
    cancelled = g.log_rows(produced)
    timed = g.log_rows.options(timeout=0.2)(produced)
    assert top_from(cancelled) == top_from(timed) == (("pair", "tag"),)
    await cancelled_and_timed_out(cancelled, timed)
    # No wait for the cancel messages to reach the worker: a later call runs after them
    # (control-before-call of docs/protocol.md), so unblocking now never lets a cancelled call run.
    await g.unblock()
    assert await holding == [0, 1]
    after = g.log_rows(produced)
    assert (await after)["y"].tolist() == [1, 3, 5, 7]
    assert await g.record(9) == [9, 9]
    assert await g.get_log() == [[0, 2, 9], [4, 6, 9]]  # the cancelled and timed-out calls never ran


LOST_OBJECT = textwrap.dedent("""
    import asyncio, ray, torch
    from ray.cluster_utils import Cluster
    import asyncrl
    from asyncrl import RayWorkerGroup, ResourcePool, UpstreamError
    from tests.core.workers import Probe

    node = {"num_cpus": 2, "object_store_memory": 80 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        second = cluster.add_node(**node)
        cluster.wait_for_nodes()
        asyncrl.init(address=cluster.address)

        async def main():
            async with ResourcePool([1, 1]) as pool:  # one bundle on each node
                first, other = pool.split([1, 1])
                # local_results=0: the producer's own group reads `big` through Ray (so it is
                # known ok); handed over in the process, that read would prove nothing of Ray's copy
                async with RayWorkerGroup(Probe, first, name="g0", local_results=0) as g0, \\
                        RayWorkerGroup(Probe, other, name="g1", local_results=0) as g1:
                    nodes = [ray.util.placement_group_table(s.placement_group)["bundles_to_node_id"][s.bundle_index]
                             for s in pool.slots]
                    p, c = (g0, g1) if nodes[0] == second.node_id else (g1, g0)  # the producer on the node that goes
                    big = p.double_tensor(torch.ones(4, 65536))  # 1 MiB: in the second node's store only
                    assert (await p.double_tensor(big)).shape == (4, 65536)  # read whole there: known ok
                    cluster.remove_node(second)  # its only copy is gone; Ray cannot rebuild an actor's result
                    lost = c.double_tensor(big)
                    print("TOP", lost._call.top_from == ((p.name, "double_tensor"),))
                    print("NEXT", await asyncio.wait_for(c.record(5), 60))  # not awaited, yet released
                    try:
                        await asyncio.wait_for(lost, 60)
                    except UpstreamError as e:
                        print("LOST", (e.group, e.method, e.rank) == (c.name, "double_tensor", 0),
                              (e.upstream.group, e.upstream.method) == (p.name, "double_tensor"), e.upstream.exc_type)
        asyncio.run(main())
    finally:
        asyncrl.shutdown()
        cluster.shutdown()
    print("CLEAN")
""")


@pytest.mark.slow
async def test_an_input_lost_with_its_node_releases_the_lane(ray_cluster):
    """Two nodes on this machine (a Ray cluster of its own, in a subprocess): a known-ok
    input whose only copy was on a node that died fails its consumer before the host
    runs; the lane goes on and the future names the producer."""
    stdout = await run_script(LOST_OBJECT)
    assert "TOP True" in stdout
    assert "NEXT [5]" in stdout
    assert "LOST True True ray.exceptions.ObjectReconstructionFailedError" in stdout
    assert "CLEAN" in stdout
