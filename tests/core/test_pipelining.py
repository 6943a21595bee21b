"""Futures pipelining (shards flow worker to worker) and the responsiveness of the controller's loop."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
import torch
from tensordict import TensorDict

import asyncrl
from asyncrl import DispatchError, GroupClosedError, RayWorkerGroup, RemoteError, UpstreamError
from tests.core import kinds
from tests.core.kinds import BACKENDS, until
from tests.core.workers import Probe



@pytest_asyncio.fixture(scope="module", loop_scope="session", params=BACKENDS)
async def groups(request, ray_cluster):
    """A group of 4 and a group of 2 on the same backend (matched and mismatched layouts)."""
    G = kinds.group_class(request.param)
    four, two = G(Probe, world_size=4, name="four"), G(Probe, world_size=2, name="two")
    with kinds.forced(request.param):
        await asyncio.gather(four.setup(), two.setup())
    try:
        yield four, two
    finally:
        await four.close()
        await two.close()


def batch(n: int) -> TensorDict:
    td = TensorDict({"x": torch.arange(n)}, batch_size=[n])
    td["prompt"] = [f"p{i}" for i in range(n)]
    return td


@pytest.mark.parametrize("n", [1, 5, 8, 10])
@pytest.mark.parametrize("layout", ["4->4", "2->4", "4->2"])
async def test_pipelined_chain_equals_its_non_pipelined_twin(groups, n, layout):
    four, two = groups
    producer, consumer = {"4->4": (four, four), "2->4": (two, four), "4->2": (four, two)}[layout]
    twin = await consumer.inc(await producer.tag(batch(n)))
    piped = await consumer.inc(producer.tag(batch(n)))
    assert piped["y"].tolist() == twin["y"].tolist() == [2 * i + 1 for i in range(n)]


async def test_pipelined_chain_of_row_multiplying_stage(groups):
    four, two = groups
    out = await four.tag(two.repeat_rows(batch(3)))
    assert out["y"].tolist() == [0, 0, 2, 2, 4, 4]
    assert list(out["prompt"]) == ["P0", "P0", "P1", "P1", "P2", "P2"]


async def test_matched_chain_fetches_no_payload_bytes(groups):
    four, _ = groups
    before = four.stats.bytes_fetched
    first = four.tag(batch(1000))
    second = four.inc(first)  # rank i's output goes straight to rank i
    rows = await four.shard_rows(second)  # only per-rank ints come back
    assert rows == [250, 250, 250, 250]
    assert four.stats.bytes_fetched == before


async def test_a_resplit_chain_fetches_no_payload_bytes(groups):
    """2 -> 4 (the layout of examples/pipelining.py): the consumer's ranks re-split the
    producer's two shards among themselves; nothing but per-rank ints reaches the controller."""
    four, two = groups
    before = (two.stats.bytes_fetched, four.stats.bytes_fetched)
    rows = await four.shard_rows(four.inc(two.tag(batch(1000))))
    assert rows == [250, 250, 250, 250]
    assert (two.stats.bytes_fetched, four.stats.bytes_fetched) == before


async def test_field_selection_is_applied_on_the_worker(groups):
    four, two = groups
    out = await two.inc(four.tag(batch(6)).select("y"))
    assert out["y"].tolist() == [1, 3, 5, 7, 9, 11]
    assert (await four.tag(batch(2))["y", "rank"]).keys() == {"y", "rank"}


async def test_a_future_can_feed_a_broadcast_argument(groups):
    four, _ = groups
    assert await four.add(four.whoami()) == [0, 1, 2, 3]  # rank zero's 0, added to every rank


async def test_selecting_a_missing_field_fails_with_a_clear_error(groups):
    four, _ = groups
    with pytest.raises(RemoteError, match=r"has no field\(s\) \['nope'\]") as info:
        await four.inc(four.tag(batch(4)).select("nope"))
    assert isinstance(info.value.cause, DispatchError)


async def test_consumer_of_a_failed_producer_fails_with_the_producers_error(groups):
    four, two = groups
    producer = two.boom_on_rank(batch(4), rank=1)
    consumer = four.inc(producer)
    with pytest.raises(UpstreamError) as info:
        await consumer
    assert isinstance(info.value.upstream, RemoteError)
    assert (info.value.upstream.group, info.value.upstream.method, info.value.upstream.rank) == ("two", "boom_on_rank", 1)
    with pytest.raises(RemoteError, match="rank 1 failed"):
        await producer


async def test_future_of_a_closed_group_is_refused(groups, ray_cluster):
    four, _ = groups
    G = type(four)
    temp = G(Probe, world_size=1, name="temp")
    async with temp:
        fut = temp.tag(batch(2))
        await fut
    with pytest.raises(GroupClosedError, match="after its group closed"):
        four.inc(fut)


async def test_streaming_yields_each_ranks_result(groups):
    four, _ = groups
    seen = {}
    async for rank, part in four.tag(batch(10)).as_completed():
        seen[rank] = part["y"].tolist()
    assert seen == {0: [0, 2, 4], 1: [6, 8, 10], 2: [12, 14, 16], 3: [18]}


async def test_streaming_with_return_exceptions_yields_a_failed_ranks_error_beside_the_others(groups):
    four, _ = groups
    seen = {}
    async for rank, part in four.boom_on_rank(batch(8), 2).as_completed(return_exceptions=True):
        seen[rank] = part if isinstance(part, Exception) else part["x"].tolist()
    assert [seen[r] for r in (0, 1, 3)] == [[0, 1], [2, 3], [6, 7]]
    assert isinstance(seen[2], RemoteError) and seen[2].rank == 2 and "rank 2 failed" in str(seen[2])
    with pytest.raises(RemoteError, match="rank 2 failed"):  # without it, the first error ends the stream
        async for _ in four.boom_on_rank(batch(8), 2).as_completed():
            pass


async def test_loop_stays_responsive_with_10000_calls_in_flight(ray_cluster):
    """10,000 calls on one worker: a heartbeat task keeps running while they resolve."""
    async with RayWorkerGroup(Probe, world_size=1, name="busy") as wg:
        ticks, max_lag, stop = 0, 0.0, False

        async def heartbeat():
            nonlocal ticks, max_lag
            while not stop:
                t0 = time.perf_counter()
                await asyncio.sleep(0.005)
                max_lag = max(max_lag, time.perf_counter() - t0 - 0.005)
                ticks += 1

        beat = asyncio.ensure_future(heartbeat())
        futures = []
        for i in range(10_000):
            futures.append(wg.noop(i))
            if i % 200 == 199:
                await asyncio.sleep(0)  # a well-behaved producer yields while submitting
        ticks_submitted = ticks
        results = await asyncrl.gather(*futures)
        stop = True
        await beat
        assert results == [[i] for i in range(10_000)]
        # Liveness, not speed: the heartbeat ran while the results came in (benchmarks/inflight.py
        # and benchmarks/loop_lag.py measure the lag itself).
        assert ticks > ticks_submitted, f"heartbeat starved while resolving (max lag {max_lag:.3f}s)"
        print(f"heartbeat max lag with 10,000 calls in flight: {max_lag * 1000:.0f} ms")


async def test_many_outstanding_refs_keep_errors_and_release_the_native_budget(ray_cluster):
    """Past 256 outstanding refs results arrive through the batched resolver: values,
    remote errors (named by rank) and cancellations come out exactly as through Ray's
    own futures, and every ref awaited returns its slot of the native budget."""
    from asyncrl.backends._ray_fetch import _RESOLVER

    async with RayWorkerGroup(Probe, world_size=1, name="many") as wg:
        futures = [wg.noop(i) for i in range(400)] + [wg.boom(f"no {i}") for i in range(3)]
        blocked = wg.wait_forever("x")
        got = await asyncio.gather(*futures, return_exceptions=True)  # one task per future: > 256 refs at once
        assert got[:400] == [[i] for i in range(400)]
        for i, e in enumerate(got[400:]):
            assert isinstance(e, RemoteError) and (e.rank, e.exc_type, e.message) == (0, "builtins.ValueError", f"no {i}")
        waiter = asyncio.ensure_future(blocked)

        async def fetching() -> bool:  # the call runs on the worker and the waiter's fetch holds its slot
            return await wg.peek_log() == [[1]] and _RESOLVER.native == 1

        await until(fetching)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert _RESOLVER.native == 0  # the cancelled fetch gave its slot back at once

        async def cancelled_there() -> bool:  # the cancellation reached the worker's coroutine
            return await wg.peek_log() == [[1, -1]]

        await until(cancelled_there)
        assert _RESOLVER.native == 0
