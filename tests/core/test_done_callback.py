"""`GroupFuture.add_done_callback`: a call's completion reported on the loop, without
fetching its results, and `done_time()`, the moment it was seen (what the trainer's tracer
ends its stage spans with)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import pytest_asyncio
import torch
from tensordict import TensorDict

from asyncrl import RemoteError

from tests.core import kinds
from tests.core.kinds import BACKENDS
from tests.core.workers import Probe

HANG = 30  # seconds: a callback that should have run by then never will


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=BACKENDS)
async def wg(request, ray_cluster):
    async with kinds.group(request.param, Probe, world_size=2, name=f"done-cb-{request.param}") as group:
        yield group


class Recorder:
    """A done callback that records (future, thread, future.done()) per call."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, int, bool]] = []
        self.fired = asyncio.Event()

    def __call__(self, fut) -> None:
        self.seen.append((fut, threading.get_ident(), fut.done()))
        self.fired.set()

    async def wait(self) -> None:
        async with asyncio.timeout(HANG):
            await self.fired.wait()


async def test_runs_once_on_the_loop_after_every_rank_finished_and_fetches_nothing(wg):
    rec = Recorder()
    first = wg.gather_at_barrier(2)  # pending until a second call arrives on each rank
    first.add_done_callback(rec)
    assert await wg.noop(7) == [7, 7]  # a later call finished; the first has not
    assert rec.seen == [] and not first.done()
    fetched = wg.stats.results_fetched
    second = wg.gather_at_barrier(2)
    await rec.wait()
    assert rec.seen == [(first, threading.get_ident(), True)]
    assert wg.stats.results_fetched == fetched  # the callback fetched no result
    assert await second == [2, 2] and await first == [2, 2]
    later = Recorder()  # scheduled after anything the first callback could still have pending
    first.add_done_callback(later)
    await later.wait()
    assert len(rec.seen) == 1


async def test_on_a_finished_call_it_is_scheduled_not_called_inline(wg):
    fut = wg.add(1)
    assert await fut == [1, 2]
    rec = Recorder()
    fut.add_done_callback(rec)
    assert rec.seen == []
    await rec.wait()
    assert rec.seen == [(fut, threading.get_ident(), True)]


async def test_runs_when_the_controller_fails_the_call(wg):
    rec = Recorder()
    fut = wg.wait_forever("done-callback")  # never finishes by itself
    fut.add_done_callback(rec)
    assert fut.cancel()
    await rec.wait()
    assert rec.seen == [(fut, threading.get_ident(), True)] and fut.cancelled()


async def test_a_raising_callback_is_reported_to_the_loop_and_the_others_still_run(wg):
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, ctx: reported.append(ctx))
    try:
        rec = Recorder()
        fut = wg.add(2)

        def boom(_):
            raise ValueError("callback failed")

        fut.add_done_callback(boom)
        fut.add_done_callback(rec)
        await rec.wait()
    finally:
        loop.set_exception_handler(previous)
    assert rec.seen == [(fut, threading.get_ident(), True)]
    assert [(type(c["exception"]), c["message"]) for c in reported] == [
        (ValueError, f"done callback of {wg.name}.add raised")]
    assert await fut == [2, 3]


async def test_a_call_whose_rank_fails_fires_once_and_its_error_names_the_rank(wg):
    rec = Recorder()
    batch = TensorDict({"x": torch.arange(4)}, batch_size=[4])
    fut = wg.boom_on_rank(batch, 1)  # rank 1 raises, rank 0 returns
    fut.add_done_callback(rec)
    await rec.wait()
    assert rec.seen == [(fut, threading.get_ident(), True)]
    with pytest.raises(RemoteError) as info:
        await fut
    assert (info.value.group, info.value.method, info.value.rank) == (wg.name, "boom_on_rank", 1)
    later = Recorder()
    fut.add_done_callback(later)
    await later.wait()
    assert len(rec.seen) == 1 and later.seen == [(fut, threading.get_ident(), True)]


async def test_many_watches_at_once_each_fire_once(wg):
    recs = [Recorder() for _ in range(50)]
    futs = [wg.add(i) for i in range(50)]
    for f, r in zip(futs, recs):
        f.add_done_callback(r)
    for r in recs:
        await r.wait()
    assert [len(r.seen) for r in recs] == [1] * 50
    assert [await f for f in futs] == [[i, i + 1] for i in range(50)]


def test_the_ray_watch_counts_every_ref_once_even_when_ready_or_unwatchable(ray_cluster):
    """The Ray backend's watch (``ObjectRef._on_ready``, no polling): refs that exist
    already fire at registration, once; a ref Ray cannot watch (Ray shut down) counts
    as done rather than hanging the watch."""
    import ray

    from asyncrl.backends._ray_fetch import _Watch

    fired: list[int] = []
    all_fired = threading.Event()

    def fire(tag: int) -> None:  # on Ray's thread, or inline at registration
        fired.append(tag)
        if len(fired) == 3:
            all_fired.set()

    _Watch([ray.put(1), ray.put(2)], lambda: fire(1))
    _Watch([], lambda: fire(2))

    class Unwatchable:
        def _on_ready(self, _cb):
            raise RuntimeError("Ray is shut down")

    _Watch([ray.put(3), Unwatchable()], lambda: fire(3))
    assert all_fired.wait(HANG)
    assert sorted(fired) == [1, 2, 3]


async def test_done_time_is_when_the_last_rank_finished_and_never_changes(wg):
    first = wg.gather_at_barrier(2)  # pending until a second call arrives on each rank
    assert first.done_time() is None  # starts watching; nothing is done yet
    assert await wg.noop(1) == [1, 1]
    assert first.done_time() is None
    rec = Recorder()
    first.add_done_callback(rec)
    released = time.perf_counter()
    second = wg.gather_at_barrier(2)  # first cannot finish before this call is issued
    await rec.wait()
    t = first.done_time()
    assert t is not None and released <= t <= time.perf_counter()
    assert await first == [2, 2] and await second == [2, 2]
    assert first.done_time() == t  # fetching the results later does not move it


async def test_done_time_of_a_call_failed_by_the_controller_is_when_it_failed(wg):
    fut = wg.wait_forever("done-time")
    assert fut.done_time() is None
    before = time.perf_counter()
    assert fut.cancel()
    t = fut.done_time()
    assert t is not None and before <= t <= time.perf_counter()
