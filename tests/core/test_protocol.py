"""The ordered-call protocol (``docs/protocol.md``), the one deadline and lifecycle races.

Each section names the invariants it pins: a lost number would hang every later ordered
call, a cancelled thread would let the next ordered call overlap it, a call finished in
time must not raise ``CallTimeoutError`` when awaited late, and close/setup/wait_for must
not race. Every test that can hang on a regression runs under ``asyncio.timeout`` so it
fails instead.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
import time

import pytest
import pytest_asyncio

import asyncrl
import asyncrl._call
from asyncrl import (
    CallCancelledError,
    CallTimeoutError,
    GroupClosedError,
    RayWorkerGroup,
    RemoteError,
    UpstreamError,
    WorkerDiedError,
)
from tests.core import kinds
from tests.core.kinds import BACKENDS, until
from tests.core.workers import DiesInInit, Probe, RefusesUnpickling, WaitsInInit

HANG = 30  # seconds: a call that should finish at once but has not by then hangs


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=BACKENDS)
async def wg(request, ray_cluster):
    async with kinds.group(request.param, Probe, world_size=2, name=f"protocol-{request.param}") as group:
        yield group


async def blocked_on_every_rank(wg) -> bool:
    return await wg.is_blocked() == [True] * wg.world_size


async def gated(wg):
    """An ordered call that holds both lanes until `open_gate` (its argument is a
    concurrent call that resolves only when a second one arrives)."""
    gate = wg.gather_at_barrier(2)
    return wg.record_value(gate)


async def open_gate(wg, first) -> None:
    await wg.gather_at_barrier(2)
    assert await first == [2, 2]


# ---- every number taken is released (build-before-send, failed-submission, unpickling-never-raises) ----


async def test_an_argument_that_cannot_be_pickled_leaves_no_gap_in_the_order(wg):
    await wg.get_log()
    with pytest.raises(Exception, match="lock"):
        wg.record_value(threading.Lock())
    async with asyncio.timeout(HANG):  # before: the lost number hung every later ordered call
        assert await wg.record(1) == [1, 1]
    assert await wg.get_log() == [[1], [1]]


async def test_a_failed_submission_cancels_the_ranks_already_submitted(wg):
    await wg.get_log()
    first = await gated(wg)
    with pytest.raises(Exception, match="lock"):
        wg.record_each([5, threading.Lock()])  # rank 0 is submitted, rank 1 cannot be
    later = wg.record(6)
    async with asyncio.timeout(HANG):
        await open_gate(wg, first)
        assert await later == [6, 6]
    assert await wg.get_log() == [[2, 6], [2, 6]]  # rank 0 never ran the half-issued call


async def test_a_custom_dispatch_with_short_padding_is_refused_before_anything_is_sent(wg):
    with pytest.raises(asyncrl.DispatchError, match="padding for 1 ranks"):
        wg.short_pad(4)
    async with asyncio.timeout(HANG):
        assert await wg.record(7) == [7, 7]


async def test_arguments_the_worker_cannot_unpickle_fail_the_call_and_release_its_turn(wg):
    await wg.get_log()
    with pytest.raises(RemoteError, match="could not unpickle the call's arguments") as info:
        await wg.record_value(RefusesUnpickling())
    e = info.value
    assert (e.group, e.method) == (wg.name, "record_value") and e.rank in (0, 1)
    assert "only_on_the_controller" in e.message
    async with asyncio.timeout(HANG):
        assert await wg.record(8) == [8, 8]
    assert await wg.get_log() == [[8], [8]]


async def test_a_class_missing_on_the_workers_fails_with_its_name(ray_cluster, tmp_path, monkeypatch):
    """On Ray, an argument of a class that only the controller can import (the issue's case)."""
    (tmp_path / "only_here.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_here

    try:
        async with RayWorkerGroup(Probe, world_size=1, name="missing-class") as g:
            with pytest.raises(RemoteError, match="No module named 'only_here'") as info:
                await g.record_value(only_here.Thing())
            assert (info.value.group, info.value.method, info.value.rank) == ("missing-class", "record_value", 0)
            async with asyncio.timeout(HANG):
                assert await g.record(9) == [9]
    finally:
        sys.modules.pop("only_here", None)


# ---- running-thread-keeps-lane, wedged-lane --------------------------------------------------------


async def test_a_cancelled_running_thread_is_never_overlapped_by_the_next_ordered_call(wg):
    await wg.get_log()
    stuck = wg.block()
    await until(lambda: blocked_on_every_rank(wg))
    assert stuck.cancel() is True
    with pytest.raises(CallCancelledError):
        await stuck
    later = wg.record(10)  # must wait for the thread: a plain def cannot be interrupted
    assert await wg.is_blocked() == [True, True]
    await wg.unblock()
    async with asyncio.timeout(HANG):
        assert await later == [10, 10]
    assert await wg.peak_sync() == [1, 1]  # never two plain def methods at once
    assert await wg.get_log() == [[10], [10]]


async def test_a_thread_past_its_deadline_wedges_its_lane_until_it_returns(wg):
    await wg.get_log()
    for timeout in (2.0, 4.0, 8.0):  # the thread must be running when the deadline passes (a loaded machine is slow to start it)
        t0 = time.monotonic()
        stuck = wg.block.options(timeout=timeout)()
        await until(lambda: blocked_on_every_rank(wg))
        started_in_time = time.monotonic() - t0 < timeout * 0.8
        with pytest.raises(CallTimeoutError, match=f"block did not finish within its timeout of {timeout:g}s"):
            await stuck
        if started_in_time:
            break
        await _drain(wg)
    else:
        pytest.fail("the blocking call never started well inside its deadline")
    async with asyncio.timeout(HANG):  # fails fast, naming the stuck call, instead of queueing behind it
        with pytest.raises(asyncrl.LaneWedgedError, match=r"record cannot run .* earlier ordered call "
                                                          rf"{wg.name}\.block") as info:
            await wg.record(11)
    assert info.value.rank in (0, 1) and isinstance(info.value, RuntimeError)
    assert await wg.is_blocked() == [True, True]
    await _drain(wg)  # the thread's return is the worker's proof: the lane is healthy again
    assert await wg.peak_sync() == [1, 1]
    log = await wg.get_log()
    assert all(11 not in rank_log and rank_log[-1] == 12 for rank_log in log)


async def _drain(wg) -> None:
    """Release blocked threads and wait until ordered calls run again."""
    await wg.unblock()

    async def runs_again() -> bool:
        try:
            return await wg.record(12) == [12, 12]
        except asyncrl.LaneWedgedError:
            await wg.unblock()
            return False

    await until(runs_again)


# ---- one deadline, checked against completion -------------------------------------------------


async def test_a_call_that_finished_in_time_never_times_out_when_awaited_late(wg):
    for timeout in (1.0, 2.0, 4.0):  # a loaded machine may miss the first: the property needs finish < deadline
        t0 = time.monotonic()
        fut = wg.add.options(timeout=timeout)(1)
        await until(lambda: _done(fut))
        if time.monotonic() - t0 < timeout * 0.8:
            break
    else:
        pytest.fail("the call never finished well inside its deadline")
    await until(lambda: _deadline_fired(fut._call), deadline=timeout + 30)  # the deadline passing is the subject
    await asyncio.gather(*list(asyncrl._call._BACKGROUND))  # and its check, if it started one, has run
    assert fut.done()
    assert await fut == [1, 2]


async def _done(fut) -> bool:
    return fut.done()


async def _deadline_fired(call) -> bool:
    """The call's deadline timer has fired (it clears itself then) and its time has passed."""
    return call._timer is None and time.monotonic() >= call.deadline


# ---- lifecycle races ------------------------------------------------------------------------------


async def test_one_awaiters_wait_for_does_not_cancel_the_call_for_other_holders(wg):
    producer = wg.gather_at_barrier(2)  # resolves when a second one arrives
    consumer = wg.record_value(producer)  # a pipelined holder
    other = asyncio.ensure_future(producer)  # another task awaiting it
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(producer, 0.2)
    assert not producer.cancelled()
    async with asyncio.timeout(HANG):
        await wg.gather_at_barrier(2)
        assert await other == [2, 2]
        assert await consumer == [2, 2]
        assert await producer == [2, 2]


async def test_cancelling_the_only_awaiter_cancels_the_call(wg):
    await wg.get_log()
    fut = wg.wait_forever("only")
    task = asyncio.ensure_future(fut)
    await until(lambda: _logs_end_with(wg, 1))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled()
    with pytest.raises(CallCancelledError):
        await fut
    await until(lambda: _logs_end_with(wg, -1))


async def _logs_end_with(wg, value) -> bool:
    return all(log and log[-1] == value for log in await wg.peek_log())


@pytest.mark.parametrize("backend", BACKENDS)
async def test_close_with_calls_in_flight_fails_them_with_group_closed(ray_cluster, backend):
    g = kinds.group_class(backend)(Probe, world_size=2, name=f"closing-{backend}")
    with kinds.forced(backend):
        await g.setup()
    running = g.wait_forever("c")
    await until(lambda: _logs_end_with(g, 1))
    await g.close()
    async with asyncio.timeout(HANG):  # before: WorkerDiedError on Ray, a hang on the local backend
        with pytest.raises(GroupClosedError, match="was closed while") as info:
            await running
    assert "closing-" + backend in str(info.value)
    with pytest.raises(GroupClosedError):
        g.record(1)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_close_during_setup_leaves_nothing_and_the_group_never_becomes_ready(ray_cluster, backend, tmp_path):
    from tests.core.test_lifecycle import alive_hosts, live_pgs, settle

    before = (alive_hosts(), live_pgs())
    g = kinds.group_class(backend)(WaitsInInit, world_size=2, args=(str(tmp_path),), name=f"half-started-{backend}")
    try:
        with kinds.forced(backend):  # until the hosts exist: their kind is chosen then
            setup = asyncio.ensure_future(g.setup())
            await until(lambda: _exists(tmp_path / "started-0"), deadline=120)  # constructors are running
        await g.close()
        async with asyncio.timeout(HANG):
            with pytest.raises(GroupClosedError, match="closed during setup"):
                await setup
    finally:
        (tmp_path / "go").touch()  # let the constructor threads end
    assert g.closed and g._hostset.state == "closed"
    with pytest.raises(GroupClosedError):
        g.ping()
    assert await settle(alive_hosts, before[0]) == before[0]
    assert await settle(live_pgs, before[1]) == before[1]


async def _exists(path) -> bool:
    return path.exists()


async def test_close_while_placement_is_pending_removes_the_placement_groups(ray_cluster):
    """The group's placement group stays pending (its one bundle asks for every CPU of the
    session's Ray while a blocker holds one of them), close() ends setup with a clear error
    and removes it. Only this test's placement groups are counted: another test's groups
    may still be going away meanwhile (Ray removes them asynchronously)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from tests.core.test_lifecycle import live_pgs, settle

    total = int(ray.cluster_resources()["CPU"])
    blocker = placement_group([{"CPU": 1}], name="blocker-of-pending")
    await asyncio.wrap_future(blocker.ready().future())
    pool = asyncrl.ResourcePool([1], cpus_per_bundle=total, placement_timeout=20, name="pending")
    g = RayWorkerGroup(Probe, pool, name="pending")
    setup = asyncio.ensure_future(g.setup())
    try:
        await until(lambda: _pending_pg("pending"))
        await g.close()
        async with asyncio.timeout(HANG):  # before: close() returned, setup went on and failed 20 s later
            with pytest.raises(GroupClosedError, match="closed during setup"):
                await setup
    finally:
        remove_placement_group(blocker)
    assert await settle(lambda: live_pgs("pending"), 0) == 0


async def _pending_pg(prefix: str) -> bool:
    from ray.util import placement_group_table

    return any(pg["name"].startswith(prefix) and pg["state"] == "PENDING" for pg in placement_group_table().values())


async def test_a_worker_dying_in_its_constructor_is_a_worker_died_error(ray_cluster):
    g = RayWorkerGroup(DiesInInit, world_size=1, name="dies")
    with pytest.raises(WorkerDiedError) as info:
        async with g:
            pass
    assert (info.value.group, info.value.method, info.value.rank) == ("dies", "DiesInInit.__init__", 0)
    assert g.closed


async def test_a_timed_out_producer_fails_its_consumer_with_the_producers_error(wg):
    producer = wg.wait_forever.options(timeout=0.5)("p")
    consumer = wg.record_value(producer)
    async with asyncio.timeout(HANG):
        with pytest.raises(CallTimeoutError):
            await producer
        with pytest.raises(UpstreamError) as info:
            await consumer
    assert isinstance(info.value.upstream, CallCancelledError)
    assert "wait_forever" in str(info.value.upstream)


# ---- a group's constructor does not start Ray ---------------------------------------------------


def test_constructing_a_ray_group_does_not_start_ray(tmp_path):
    import subprocess

    script = textwrap.dedent("""
        import ray, asyncrl
        from tests.core.workers import Probe
        asyncrl.RayWorkerGroup(Probe, world_size=1)
        print("initialized", ray.is_initialized())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialized False" in proc.stdout


# ---- nothing blocking on the controller's event loop ------------------------------------------------

_BLOCKING = ["init", "nodes", "cluster_resources", "available_resources", "wait", "get", "kill"]


async def test_no_blocking_ray_call_runs_on_the_event_loop(ray_cluster, monkeypatch):
    """Setup (placement polling included), calls, done(), repr() and close of a Ray group:
    every blocking Ray call (GCS round trips, ray.wait/ray.get) runs off the loop thread."""
    import ray

    import asyncrl.backends.ray as rb

    loop_thread = threading.get_ident()
    on_loop: list[str] = []

    def spy(name, fn):
        def wrapper(*a, **k):
            if threading.get_ident() == loop_thread:
                on_loop.append(name)
            return fn(*a, **k)
        return wrapper

    for name in _BLOCKING:
        monkeypatch.setattr(ray, name, spy(f"ray.{name}", getattr(ray, name)))
    for name in ("placement_group", "placement_group_table", "remove_placement_group"):
        monkeypatch.setattr(rb, name, spy(name, getattr(rb, name)))
    pool = asyncrl.ResourcePool([2])
    async with pool:
        async with RayWorkerGroup(Probe, pool, name="never-blocks") as g:
            fut = g.add(1)
            fut.done()  # starts watching in the background; reports only what is known
            assert repr(fut).startswith("<GroupFuture never-blocks.add ranks=[0, 1] ")
            await until(lambda: _done(fut))
            assert repr(fut) == "<GroupFuture never-blocks.add ranks=[0, 1] completed>"
            assert await fut == [1, 2]
            assert repr(fut) == "<GroupFuture never-blocks.add ranks=[0, 1] done>"
    assert on_loop == []
