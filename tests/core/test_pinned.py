"""The threaded host's pinned thread (pinned-thread of ``docs/protocol.md``).

Every ordered call goes to the host's ``ordered`` concurrency group, ONE Ray thread that
also built the worker, in the order the controller numbered them, and Ray keeps that order
(one-thread-group-order): the call runs its plain ``def`` method right there, and waits there for
a pipelined input that is still being produced while the calls behind it wait in Ray's
queue. A call queued in Ray behind a wedged one is invisible to the host, so the
controller fails it (the host's reply to the deadline's cancel says the lane is wedged).
Each race below is forced or repeated; nothing sleeps to wait and nothing is timed.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import pytest
import pytest_asyncio
import ray

import asyncrl
from asyncrl import CallCancelledError, CallTimeoutError, Dispatch, Worker, WorkerDiedError, register
from asyncrl._call import Sequencer
from asyncrl._lanes import NEVER_RAN, Lane
from asyncrl._wire import CallCancelled
from tests.core import kinds
from tests.core.kinds import until

HANG = 60  # seconds: a call that should finish at once but has not by then hangs


class Pinned(Worker):
    """Records every plain def call's value and thread; `block` holds the thread until
    `unblock` (concurrent, so the host is forced threaded by the tests)."""

    def __init__(self) -> None:
        self.init_thread = (threading.get_ident(), threading.current_thread().name)
        self.threads: set[int] = set()
        self.log: list[int] = []
        self.release = threading.Event()
        self.blocked = False

    def _seen(self) -> None:
        self.threads.add(threading.get_ident())

    @register()
    def record(self, x) -> int:
        self._seen()
        value = int(x[0]) if isinstance(x, list) else int(x)
        self.log.append(value)
        return value

    @register()
    async def record_async(self, x: int) -> int:
        await asyncio.sleep(0)
        self.log.append(x)
        return x

    @register()
    def block(self, x=None) -> int:
        """Holds the pinned thread until `unblock`; `x`: a pipelined input, if any."""
        self._seen()
        self.blocked = True
        try:
            self.release.wait()
            self.release.clear()
            return self.rank
        finally:
            self.blocked = False

    @register()
    def wait_gate(self, gate) -> int:
        """Holds the pinned thread until the Ray actor `gate` opens (no call to this process
        releases it)."""
        self._seen()
        self.blocked = True
        try:
            ray.get(gate.wait.remote())
            return self.rank
        finally:
            self.blocked = False

    @register(concurrent=True)
    async def unblock(self) -> None:
        self.release.set()

    @register(concurrent=True)
    async def is_blocked(self) -> bool:
        return self.blocked

    @register(concurrent=True)
    async def threads_seen(self) -> tuple[int, bool, str]:
        """How many threads ran plain def methods, whether that is the constructor's, and its name."""
        return len(self.threads), self.threads <= {self.init_thread[0]}, self.init_thread[1]

    @register(concurrent=True)
    async def pid(self) -> int:
        return os.getpid()

    @register(concurrent=True)
    async def peek(self) -> list[int]:
        return list(self.log)

    @register(concurrent=True)
    async def hold_next_cancel(self, until_logged: int) -> None:
        """Make this process's next cancel message wait (once) until a call waits for it
        (control-before-call) or `until_logged` was recorded: the order Ray allows and CI once hit."""
        original = Lane.cancel

        def held(lane, *args, **kwargs):
            Lane.cancel = original
            end = time.monotonic() + HANG
            while not (lane.control.waiting or until_logged in self.log) and time.monotonic() < end:
                threading.Event().wait(0.005)
            return original(lane, *args, **kwargs)

        Lane.cancel = held

    @register()
    def take(self) -> list[int]:
        self._seen()
        out, self.log = self.log, []
        return out


@ray.remote
class Gate:
    """Opened by the test, never by a call to the worker that waits for it."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def wait(self) -> None:
        await self.opened.wait()

    async def open(self) -> None:
        self.opened.set()


class Source(Worker):
    """A producer in another group; `held` returns only when its release is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    @register(Dispatch.ONE_TO_ALL)
    def value(self, x: int) -> int:
        return x

    @register(Dispatch.ONE_TO_ALL)
    def held(self, x: int) -> int:
        self.release.wait()
        self.release.clear()
        return x

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def let_go(self) -> None:
        self.release.set()


async def blocked(wg) -> bool:
    return await wg.is_blocked() == [True] * wg.world_size


async def drain(wg) -> None:
    """Release the blocked threads; wait until ordered calls run again."""
    await wg.unblock()

    async def runs_again() -> bool:
        try:
            return await wg.record(-1) == [-1] * wg.world_size
        except asyncrl.LaneWedgedError:
            await wg.unblock()
            return False

    await until(runs_again, HANG)


async def timed_out_while_running(wg, issue_behind=None):
    """`block` with a deadline that passes while it runs on every rank (retried with longer
    deadlines on a slow machine); `issue_behind()` issues calls after it, before the
    deadline. Returns what `issue_behind` returned."""
    for timeout in (2.0, 4.0, 8.0):
        t0 = time.monotonic()
        stuck = wg.block.options(timeout=timeout)()
        behind = issue_behind() if issue_behind is not None else None
        await until(lambda: blocked(wg), HANG)
        in_time = time.monotonic() - t0 < timeout * 0.8
        with pytest.raises(CallTimeoutError):
            await stuck
        if in_time:
            return behind
        if behind is not None:
            await asyncio.gather(*behind, return_exceptions=True)
        await drain(wg)
        await wg.take()
    pytest.fail("the blocking call never started well inside its deadline")


@pytest.fixture
async def pinned(ray_cluster):
    """A fresh group for each test that wedges its lane (or patches its processes' lanes)."""
    async with kinds.group("ray-threaded", Pinned, world_size=2, name="pinned") as wg:
        yield wg


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def calm(ray_cluster):
    """One group shared by the tests that never wedge its lane: each leaves it idle and its logs taken."""
    async with kinds.group("ray-threaded", Pinned, world_size=2, name="pinned") as wg:
        yield wg


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def source(ray_cluster):
    """The producer group of the module: it keeps nothing from one test to the next (`held`
    clears its release when it returns)."""
    async with kinds.group("ray-threaded", Source, world_size=1, name="pinned-source") as g:
        yield g


# ---- one thread, in number order ----------------------------------------------------------------


async def test_the_constructor_and_every_def_call_run_on_the_one_pinned_thread(calm, source):
    """Calls with and without pipelined inputs and ordered async def calls, mixed: one
    thread, the constructor's."""
    pinned = calm
    futs = []
    for i in range(30):
        if i % 3 == 1:
            futs.append(pinned.record(source.value(i)))  # a pipelined input, nested
        elif i % 5 == 4:
            futs.append(pinned.record_async(i))
        else:
            futs.append(pinned.record(i))
    async with asyncio.timeout(HANG):
        await asyncrl.gather(*futs)
        assert await pinned.take() == [list(range(30))] * 2
        assert await pinned.threads_seen() == [(1, True, "asyncrl-ordered_0")] * 2


async def test_a_call_waits_for_its_input_on_the_pinned_thread_and_the_calls_behind_it_wait_in_ray(calm, source):
    """Its input is still being produced: the call waits for it on the pinned thread, the
    ordered calls sent after it wait in Ray's queue (none overtakes it), and a concurrent
    call runs meanwhile. The input arrives: all run, in issue order."""
    pinned = calm
    first = pinned.record(source.held(7))  # its input waits for `let_go`
    behind = [pinned.record(8), pinned.record_async(9), pinned.record(10)]
    async with asyncio.timeout(HANG):
        assert await pinned.peek() == [[], []]  # a concurrent call runs; no ordered one overtook the first
        await source.let_go()
        assert await first == [7, 7]
        assert [await f for f in behind] == [[8, 8], [9, 9], [10, 10]]
    assert await pinned.take() == [[7, 8, 9, 10]] * 2


async def test_calls_with_and_without_pipelined_inputs_interleave_by_number(calm, source):
    """Issued without awaiting, in a pseudo-random mix (fixed seed): all run once, in issue order."""
    pinned = calm
    rng = random.Random(14)
    futs = []
    for i in range(120):
        futs.append(pinned.record(source.value(i)) if rng.random() < 0.5 else pinned.record(i))
    async with asyncio.timeout(HANG):
        assert [f[0] for f in await asyncrl.gather(*futs)] == list(range(120))
        assert await pinned.take() == [list(range(120))] * 2
    assert await pinned.threads_seen() == [(1, True, "asyncrl-ordered_0")] * 2


async def test_a_call_cancelled_while_waiting_for_its_input_never_runs(calm, source):
    """cancelled-while-waiting on the pinned thread: the wait is cancelled, the method never
    runs, and the calls behind it run at once (the input is still not produced)."""
    pinned = calm
    waiting = pinned.record(source.held(11))
    later = pinned.record(12)
    assert waiting.cancel()
    async with asyncio.timeout(HANG):
        with pytest.raises(CallCancelledError):
            await waiting
        assert await later == [12, 12]
        await source.let_go()  # (the producer's own call ends)
    assert await pinned.take() == [[12], [12]]


def test_a_ray_ordered_lane_marks_the_numbers_that_never_arrived_as_never_ran():
    """On the threaded host Ray runs a lane's calls in number order, so a number that has
    not arrived when a later one does never will (cancelled, or failed by Ray before the
    host ran it): its same-process consumers read it as never ran, and a late arrival of
    it is refused."""
    lane = Lane(ray_ordered=True)
    lane.keep_results = 4
    first = lane.arrive(100, 0, "g", "m", 0)
    first.outcome = (True, "zero", (1, 0))
    lane.leave(first)
    third = lane.arrive(102, 2, "g", "m", 0)  # number 1 (call 101) never arrived
    assert lane.outcome(1, 101) == NEVER_RAN
    assert lane.outcome(0, 100) == (True, "zero", (1, 0))
    lane.leave(third)
    with pytest.raises(CallCancelled):
        lane.arrive(101, 1, "g", "m", 0)
    assert lane.next_number == 3


# ---- the wedge, seen by the controller ------------------------------------------------------------


async def test_a_pinned_call_queued_behind_a_wedged_one_fails_at_once_and_its_number_is_released(pinned):
    queued = await timed_out_while_running(pinned, lambda: [pinned.record(21)])
    async with asyncio.timeout(HANG):  # queued in Ray behind the stuck call: failed by the controller
        with pytest.raises(asyncrl.LaneWedgedError, match=r"record cannot run .* earlier ordered call "
                                                          r"pinned\.block") as info:
            await queued[0]
        with pytest.raises(asyncrl.LaneWedgedError, match=r"pinned\.block"):  # and every later one
            await pinned.record(22)
    assert info.value.rank in (0, 1)
    assert await pinned.is_blocked() == [True, True]  # it failed while the thread still runs
    await drain(pinned)
    log = await pinned.take()
    assert [[x for x in rank_log if x != -1] for rank_log in log] == [[], []]  # 21 and 22 never ran
    async with asyncio.timeout(HANG):
        assert await pinned.record(23) == [23, 23]  # the lane moves on
    assert await pinned.take() == [[23], [23]]


@pytest.mark.parametrize("kind", ["ray-threaded", "ray"])
async def test_a_call_sent_while_the_deadlines_reply_is_on_its_way_never_runs_on_a_wedged_lane(
        ray_cluster, monkeypatch, kind):
    """The deadline's cancel reached the host while the stuck method ran (the lane is
    wedged), but the controller has not handled the reply yet, so it sends the next call;
    the stuck method returns (released by an actor of the test, not by a call to the
    host), and that call reaches the host. It waits for the controller's answer to the
    reply (the control message reserved with the deadline's cancel: control-before-call),
    which refuses it: it never runs, and fails as wedged."""
    replies: list = []
    original = Sequencer._replied
    monkeypatch.setattr(Sequencer, "_replied", lambda self, *args: replies.append((self, args)))
    gate = Gate.remote()
    async with kinds.group(kind, Pinned, world_size=1, name=f"verdict-{kind}") as wg:
        host = wg._hostset.hosts[0]
        for timeout in (2.0, 4.0, 8.0):
            t0 = time.monotonic()
            stuck = wg.wait_gate.options(timeout=timeout)(gate)
            await until(lambda: blocked(wg), HANG)
            if time.monotonic() - t0 < timeout * 0.8:
                break
            stuck.cancel()
            await gate.open.remote()
            gate = Gate.remote()
            await until(lambda: _control_waiting(wg, host, 0), HANG)
        else:
            pytest.fail("the blocking call never started well inside its deadline")
        async with asyncio.timeout(HANG):
            with pytest.raises(CallTimeoutError):
                await stuck
            await until(lambda: _true(len(replies) == 1), HANG)  # the host replied: the lane is wedged
            (seq, (rank, call, loop, wedge, verdict)), = replies
            assert wedge is not None and wedge[2].startswith(f"verdict-{kind}.wait_gate")
            sent = wg.record(31)  # the controller does not know of the wedge yet
            await gate.open.remote()  # the stuck method returns
            await until(lambda: _control_waiting(wg, host, 1), HANG)  # `sent` waits for the answer
            original(seq, rank, call, loop, wedge, verdict)
            with pytest.raises(asyncrl.LaneWedgedError, match=r"wait_gate"):
                await sent
            await until(lambda: _true(not seq.wedged), HANG)  # the stuck call's result came back
            assert await wg.record(32) == [32]
        assert await wg.take() == [[32]]  # 31 never ran


async def _control_waiting(wg, host, n: int) -> bool:
    return (await wg._hostset.backend.admin(host, "control_state"))["waiting"] == n


async def _true(value: bool) -> bool:
    return value


async def cancel_a_queued_call_then_unblock(pinned, cancelled: int, kept: int) -> None:
    """Block the pinned threads, queue `record(cancelled)` and `record(kept)` behind them,
    cancel the first, unblock: only `kept` ever runs, and the lane moves on."""
    stuck = pinned.block()
    await until(lambda: blocked(pinned), HANG)
    queued = pinned.record(cancelled)
    later = pinned.record(kept)
    assert queued.cancel() is True
    with pytest.raises(CallCancelledError):
        await queued
    async with asyncio.timeout(HANG):
        await pinned.unblock()
        assert await stuck == [0, 1]
        assert await later == [kept, kept]
    assert await pinned.take() == [[kept], [kept]]


async def test_a_cancelled_queued_pinned_call_never_runs_and_releases_its_number(pinned):
    await cancel_a_queued_call_then_unblock(pinned, 41, 42)


async def test_a_call_sent_after_a_cancel_runs_after_it_even_when_the_cancel_is_late(pinned):
    """The cancel message of a queued pinned call is held on the host until either a
    later call waits for it (control-before-call) or the cancelled call has run. Without the
    ordering, the later unblock() frees the pinned thread, which runs the cancelled call."""
    await pinned.hold_next_cancel(43)
    await cancel_a_queued_call_then_unblock(pinned, 43, 44)
    states = [await pinned._hostset.backend.admin(h, "control_state") for h in pinned._hostset.hosts]
    assert states == [{"seen": 1, "waiting": 0}] * 2


async def test_a_sigkilled_worker_fails_its_running_and_queued_pinned_calls(ray_cluster):
    async with kinds.group("ray-threaded", Pinned, world_size=2, name="pinned-kill") as wg:
        pids = await wg.pid()
        stuck = wg.block()
        await until(lambda: blocked(wg), HANG)
        queued = wg.record(51)
        os.kill(pids[1], signal.SIGKILL)
        async with asyncio.timeout(HANG):
            with pytest.raises(WorkerDiedError) as info:
                await stuck
            assert info.value.rank == 1
            with pytest.raises(WorkerDiedError):
                await queued
