"""Failure semantics: deadlines, cancellation, worker death. No call may hang."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import pytest_asyncio

import asyncrl

import torch
from tensordict import TensorDict

from asyncrl import (
    CallCancelledError,
    CallTimeoutError,
    GroupBrokenError,
    UpstreamError,
    WorkerDiedError,
)
from tests.core import kinds
from tests.core.kinds import BACKENDS
from tests.core.workers import Probe



@pytest_asyncio.fixture(scope="module", loop_scope="session", params=BACKENDS)
async def wg(request, ray_cluster):
    async with kinds.group(request.param, Probe, world_size=2, name=f"fail-{request.param}") as group:
        yield group


async def until(predicate, what: str, deadline: float = 30.0):
    """Poll a remote condition with a deadline (it cannot be awaited directly)."""
    async with asyncio.timeout(deadline):
        while not await predicate():
            await asyncio.sleep(0.02)


async def started_and_cancelled(wg):
    logs = await wg.peek_log()
    return logs


async def test_timeout_fails_with_typed_error_and_cancels_the_remote_work(wg):
    # The call must have started on both ranks when its deadline passes (otherwise the cancel
    # refuses it before it runs, and nothing is logged): a loaded machine may be slower to start
    # it than the first deadline, so retry with longer ones, as the sibling deadline tests do.
    for timeout in (0.5, 2.0, 8.0):
        await wg.get_log()
        fut = wg.wait_forever.options(timeout=timeout)("x")
        try:
            await until(lambda: _logs_are(wg, [[1], [1]]), "the call started on both ranks", deadline=timeout)
            started = True
        except TimeoutError:
            started = False
        with pytest.raises(CallTimeoutError, match="wait_forever did not finish within its timeout") as info:
            await fut
        assert isinstance(info.value, TimeoutError)
        if started:
            break
    else:
        pytest.fail("the call never started on both ranks within its deadline")
    await until(lambda: _logs_are(wg, [[1, -1], [1, -1]]), "remote coroutine saw the cancellation")


async def _logs_are(wg, want):
    return await wg.peek_log() == want


async def test_cancelling_the_awaiting_task_cancels_the_remote_call(wg):
    await wg.get_log()
    fut = wg.wait_forever("y")
    task = asyncio.ensure_future(fut)
    await until(lambda: _logs_are(wg, [[1], [1]]), "the call started on both ranks")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: _logs_are(wg, [[1, -1], [1, -1]]), "remote coroutine saw the cancellation")
    with pytest.raises(CallCancelledError):
        await fut


async def test_cancelling_a_task_in_asyncrl_gather_cancels_what_nobody_else_awaits(wg):
    await wg.get_log()
    done, shared, alone = wg.add(1), wg.wait_forever("g1"), wg.wait_forever("g2")
    assert await done == [1, 2]  # settled: cancelling the gather leaves it as it is
    other = asyncio.ensure_future(shared)  # a second task awaits `shared`
    task = asyncio.ensure_future(asyncrl.gather(done, shared, alone))
    await until(lambda: _logs_are(wg, [[1, 1], [1, 1]]), "both calls started on both ranks")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(CallCancelledError):
        await alone  # only the gather waited for it: its claim was the last
    await until(lambda: _logs_are(wg, [[1, 1, -1], [1, 1, -1]]), "remote coroutine saw the cancellation")
    assert not shared.cancelled() and not other.done()  # `other` still waits for it
    assert await done == [1, 2]
    assert shared.cancel() is True
    with pytest.raises(CallCancelledError):
        await other
    await until(lambda: _logs_are(wg, [[1, 1, -1, -1], [1, 1, -1, -1]]), "the second cancellation")


async def test_future_cancel_reaches_the_worker(wg):
    await wg.get_log()
    fut = wg.wait_forever("z")
    await until(lambda: _logs_are(wg, [[1], [1]]), "the call started on both ranks")
    assert fut.cancel() is True
    with pytest.raises(CallCancelledError):
        await fut
    await until(lambda: _logs_are(wg, [[1, -1], [1, -1]]), "remote coroutine saw the cancellation")
    assert fut.cancelled() and fut.done()


async def test_a_cancelled_queued_ordered_call_does_not_block_later_ones(wg):
    await wg.get_log()
    gate = wg.gather_at_barrier(2)
    first = wg.record_value(gate)  # holds the order until the gate opens
    second = wg.record(5)
    third = wg.record(6)
    second.cancel()
    await wg.gather_at_barrier(2)  # open the gate
    assert await first == [2, 2] and await third == [6, 6]
    with pytest.raises(CallCancelledError):
        await second
    assert await wg.get_log() == [[2, 6], [2, 6]]


async def test_timeout_must_be_positive(wg):
    for bad in (0, -1, "1", True):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            wg.add.options(timeout=bad)
    fut = wg.add(1)
    await fut
    with pytest.raises(ValueError, match="timeout must be positive"):
        await asyncio.to_thread(fut.result, -1)


async def test_result_refuses_to_block_inside_a_running_loop(wg):
    fut = wg.add(1)
    with pytest.raises(RuntimeError, match="use `await future`"):
        fut.result()
    assert await fut == [1, 2]


async def test_result_blocks_in_a_thread_without_a_loop(wg):
    if wg._hostset.backend.name != "ray":
        pytest.skip("the local backend needs an event loop")
    fut = wg.add(1)
    assert await asyncio.to_thread(fut.result, 30) == [1, 2]
    slow = wg.wait_forever("r")
    with pytest.raises(CallTimeoutError):
        await asyncio.to_thread(slow.result, 0.3)


@pytest.mark.parametrize("backend", ["ray", "ray-threaded"])
async def test_a_consumer_of_a_killed_producer_rank_names_that_rank(ray_cluster, backend):
    """The consumer's worker learns of the death from Ray alone ("the actor died"), reading
    the producer's metadata of each rank: its UpstreamError names the producer's group,
    method and the rank that died, as the producer's own future does."""
    async with kinds.group(backend, Probe, world_size=2, name="producer", local_results=0) as producer, \
            kinds.group(backend, Probe, world_size=1, name="consumer") as consumer:
        pids = await producer.pid()
        holding = producer.block()  # both lanes held: `unfinished` waits behind it, so it travels nested
        await until(lambda: _all_blocked(producer), "both producer ranks hold their lane")
        unfinished = producer.tag(TensorDict({"x": torch.arange(4.0), "prompt": list("abcd")}, batch_size=[4]))
        downstream = consumer.log_rows(unfinished)  # 2 producer shards -> 1 consumer rank: reads both
        os.kill(pids[1], signal.SIGKILL)
        async with asyncio.timeout(30):
            with pytest.raises(UpstreamError) as info:
                await downstream
            with pytest.raises(WorkerDiedError) as own:
                await unfinished
        up = info.value.upstream
        assert isinstance(up, WorkerDiedError)
        assert (up.group, up.method, up.rank) == (own.value.group, own.value.method, own.value.rank) == \
            ("producer", "tag", 1)
        assert str(up).startswith("worker rank 1 of group 'producer' died while running 'tag'")
        assert await consumer.record(3) == [3]  # the consumer's lane goes on
        del holding


async def _all_blocked(g) -> bool:
    return await g.is_blocked() == [True] * g.world_size


@pytest.mark.parametrize("backend", ["ray", "ray-threaded"])
async def test_sigkilled_worker_fails_pending_futures_fast_and_breaks_the_group(ray_cluster, backend):
    async with kinds.group(backend, Probe, world_size=2, name="doomed") as wg:
        pids = await wg.pid()
        pending = wg.wait_forever("k")
        await until(lambda: _logs_are(wg, [[1], [1]]), "the call started")
        os.kill(pids[1], signal.SIGKILL)
        # The contract: a typed error within seconds, never a hang (about 20 ms here when the
        # machine is quiet; the bound is wide so a loaded machine does not make it flaky).
        async with asyncio.timeout(30):
            with pytest.raises(WorkerDiedError) as info:
                await pending
        e = info.value
        assert (e.group, e.method, e.rank) == ("doomed", "wait_forever", 1)
        assert wg.broken
        with pytest.raises(GroupBrokenError, match="rank 1 died"):
            wg.add(1)
