"""The staleness buffer: bounded, FIFO, never delivers an item older than the bound."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import anyio
import pytest

from asyncrl.pipelines.loop.buffer import StaleSampleError, StalenessBuffer


@dataclass
class Item:
    name: str
    version: int


async def test_fresh_items_are_delivered_in_fifo_order():
    buf = StalenessBuffer(capacity=3, max_staleness=1)
    for i in range(3):
        await buf.put(Item(f"b{i}", version=i))
    got = [await buf.get(current_version=2), await buf.get(2)]
    assert [g.name for g in got] == ["b1", "b2"]
    s = buf.statistics()
    assert (s.size, s.capacity, s.peak, s.puts, s.delivered, s.dropped) == (0, 3, 3, 3, 2, 1)


async def test_items_older_than_the_bound_are_dropped_and_counted():
    buf = StalenessBuffer(capacity=8, max_staleness=2)
    for v in [0, 1, 2, 3, 5, 6]:
        await buf.put(Item(f"v{v}", v))
    first = await buf.get(current_version=6)
    assert first.version == 5  # 0..3 are 3+ versions behind 6
    assert buf.statistics().dropped == 4
    assert (await buf.get(6)).version == 6
    s = buf.statistics()
    assert (s.size, s.delivered, s.dropped, s.peak) == (0, 2, 4, 6)


async def test_zero_staleness_delivers_only_the_current_version():
    buf = StalenessBuffer(capacity=4, max_staleness=0)
    await buf.put(Item("old", 0))
    await buf.put(Item("now", 1))
    assert (await buf.get(1)).name == "now"
    assert buf.statistics().dropped == 1


async def test_put_waits_while_full_and_statistics_show_the_waiter():
    buf = StalenessBuffer(capacity=1, max_staleness=0)
    await buf.put(Item("a", 0))
    entered = asyncio.Event()

    async def producer():
        entered.set()
        await buf.put(Item("b", 0))

    task = asyncio.create_task(producer())
    await entered.wait()
    while buf.statistics().put_waiters != 1:  # the producer reaches the wait in the next loop turns
        await asyncio.sleep(0)
    assert buf.statistics().size == 1
    assert (await buf.get(0)).name == "a"
    await task
    s = buf.statistics()
    assert (s.size, s.put_waiters, s.peak, s.puts) == (1, 0, 1, 2)


async def test_get_waits_for_an_item_and_counts_the_waiter():
    buf = StalenessBuffer(capacity=2, max_staleness=0)
    task = asyncio.create_task(buf.get(0))
    while buf.statistics().get_waiters != 1:
        await asyncio.sleep(0)
    await buf.put(Item("x", 0))
    assert (await task).name == "x"
    assert buf.statistics().get_waiters == 0


async def test_close_drains_then_ends_the_stream():
    buf = StalenessBuffer(capacity=2, max_staleness=0)
    await buf.put(Item("last", 3))
    await buf.close()
    assert (await buf.get(3)).name == "last"
    with pytest.raises(anyio.EndOfStream):
        await buf.get(3)
    with pytest.raises(anyio.ClosedResourceError):
        await buf.put(Item("late", 3))


async def test_close_wakes_a_waiting_consumer():
    buf = StalenessBuffer(capacity=2, max_staleness=0)
    task = asyncio.create_task(buf.get(0))
    while buf.statistics().get_waiters != 1:
        await asyncio.sleep(0)
    await buf.close()
    with pytest.raises(anyio.EndOfStream):
        await task


async def test_a_version_ahead_of_the_consumer_is_a_bookkeeping_error():
    buf = StalenessBuffer(capacity=2, max_staleness=1)
    await buf.put(Item("future", 5))
    with pytest.raises(StaleSampleError, match="version 5"):
        await buf.get(4)


def test_invalid_sizes_are_rejected():
    with pytest.raises(ValueError, match="capacity"):
        StalenessBuffer(capacity=0, max_staleness=0)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessBuffer(capacity=1, max_staleness=-1)
