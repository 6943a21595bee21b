"""The threaded host's pinned thread (pinned-thread of ``docs/protocol.md``).

An ordered call that can run at once goes to the host's ``ordered`` concurrency group,
ONE Ray thread that also built the worker, and runs its plain ``def`` method right there;
an ordered call with nested pipelined inputs waits in the ``calls`` group and hands its
method to that thread as a job (run by the pinned call waiting for its turn, or by a call
the host submits to itself). A pinned call queued in Ray behind a wedged lane is
invisible to the host, so the controller fails it (the host's reply to the deadline's
cancel says the lane is wedged). Each race below is forced or repeated; nothing sleeps to
wait and nothing is timed.
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import signal
import threading
import time

import pytest
import pytest_asyncio

import asyncrl
from asyncrl import CallCancelledError, CallTimeoutError, Dispatch, Worker, WorkerDiedError, register
from asyncrl._lanes import CallCancelled, ThreadLane
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
        """Holds the pinned thread until `unblock`; `x` (a pipelined input) routes it through the calls group."""
        self._seen()
        self.blocked = True
        try:
            self.release.wait()
            self.release.clear()
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
    async def hold_next_cancel(self, until_logged: int) -> None:
        """Make this process's next cancel message wait (once) until a call waits for it
        (control-before-call) or `until_logged` was recorded: the order Ray allows and CI once hit."""
        _hold("cancel", lambda lane: lane.control.waiting or until_logged in self.log, once=True)

    @register(concurrent=True)
    async def hold_unfences(self) -> None:
        """Make every ``unfence`` message to this process wait until a call waits for it
        (control-before-call): the controller has lifted the wedge, the host not yet."""
        _hold("unfence", lambda lane: lane.control.waiting, once=False)

    @register()
    def take(self) -> list[int]:
        self._seen()
        out, self.log = self.log, []
        return out


def _hold(name: str, ready, once: bool) -> None:
    """Patch this process's ``ThreadLane.<name>`` (a control message's handler) to poll,
    with a deadline, until ``ready(lane)`` before it runs; `once`: then restore it."""
    original = getattr(ThreadLane, name)

    def held(lane, *args):
        if once:
            setattr(ThreadLane, name, original)
        end = time.monotonic() + HANG
        while not ready(lane) and time.monotonic() < end:
            threading.Event().wait(0.005)
        return original(lane, *args)

    setattr(ThreadLane, name, held)


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


async def states(wg) -> list[dict]:
    hs = wg._hostset
    return [await hs.backend.admin(h, "pinned_state") for h in hs.hosts]


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
    """One group shared by the tests that never wedge its lane: each leaves it idle, its logs
    taken, and counts the jobs it runs from the state it found."""
    async with kinds.group("ray-threaded", Pinned, world_size=2, name="pinned") as wg:
        yield wg


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def source(ray_cluster):
    """The producer group of the module: it keeps nothing from one test to the next (`held`
    clears its release when it returns)."""
    async with kinds.group("ray-threaded", Source, world_size=1, name="pinned-source") as g:
        yield g


# ---- one thread, no hop -------------------------------------------------------------------------


async def test_the_constructor_and_every_def_call_run_on_the_one_pinned_thread(calm, source):
    """Pinned calls, calls-group calls (nested inputs: their def runs as a job on the
    pinned thread) and ordered async def calls, mixed: one thread, the constructor's."""
    pinned = calm
    before = await states(pinned)
    futs = []
    for i in range(30):
        if i % 3 == 1:
            futs.append(pinned.record(source.value(i)))  # a nested input: the calls group
        elif i % 5 == 4:
            futs.append(pinned.record_async(i))
        else:
            futs.append(pinned.record(i))
    async with asyncio.timeout(HANG):
        await asyncrl.gather(*futs)
        assert await pinned.take() == [list(range(30))] * 2
        assert await pinned.threads_seen() == [(1, True, "asyncrl-ordered_0")] * 2
    after = await states(pinned)
    # every nested call's def ran as a job
    assert [a["waiter"] + a["pump"] - b["waiter"] - b["pump"] for a, b in zip(after, before)] == [10, 10]


async def test_a_job_is_run_by_the_pinned_call_waiting_for_its_turn(calm, source):
    """A calls-group call waits for its input; the next pinned call waits for its turn on
    the pinned thread; the input arrives: the waiting pinned call runs the job (no
    self-submitted call), then its own method."""
    pinned = calm
    before = await states(pinned)
    first = pinned.record(source.held(7))  # calls group: its input is held
    second = pinned.record(8)  # pinned: waits for its turn on the pinned thread

    async def serving() -> bool:
        return all(s["serving"] for s in await states(pinned))

    await until(serving, HANG)
    await source.let_go()
    async with asyncio.timeout(HANG):
        assert await first == [7, 7] and await second == [8, 8]
    after = await states(pinned)
    assert [(a["waiter"] - b["waiter"], a["pump"] - b["pump"]) for a, b in zip(after, before)] == [(1, 0)] * 2
    assert await pinned.take() == [[7, 8]] * 2


async def test_a_job_that_finds_the_thread_idle_gets_it_by_a_call_of_its_own(calm, source):
    pinned = calm
    before = await states(pinned)
    async with asyncio.timeout(HANG):
        assert await pinned.record(source.value(5)) == [5, 5]
    after = await states(pinned)
    assert [(a["waiter"] - b["waiter"], a["pump"] - b["pump"]) for a, b in zip(after, before)] == [(0, 1)] * 2
    assert await pinned.threads_seen() == [(1, True, "asyncrl-ordered_0")] * 2
    assert await pinned.take() == [[5]] * 2  # (the group is shared: leave its log empty)


async def test_pinned_and_calls_group_calls_interleave_by_number(calm, source):
    """Issued without awaiting, in a pseudo-random mix (fixed seed): the jobs race the
    pinned calls for the thread, every way round; all run once, in issue order."""
    pinned = calm
    rng = random.Random(14)
    futs = []
    for i in range(120):
        futs.append(pinned.record(source.value(i)) if rng.random() < 0.5 else pinned.record(i))
    async with asyncio.timeout(HANG):
        assert [f[0] for f in await asyncrl.gather(*futs)] == list(range(120))
        assert await pinned.take() == [list(range(120))] * 2
    assert await pinned.threads_seen() == [(1, True, "asyncrl-ordered_0")] * 2


def test_jobs_never_strand_whoever_wins_the_race_for_the_thread():
    """The lane alone, with a stand-in for Ray's one-thread group (a FIFO queue served by
    one thread, as Ray dispatches it: submission order) and the calls group (a thread per
    call): 2,000 ordered calls, each pinned or not at random, issued in number order. Every
    one runs once, in number order, on the one thread; nothing waits forever."""
    group: queue.SimpleQueue = queue.SimpleQueue()
    lane = ThreadLane(pump=lambda: group.put(lane.serve_jobs))
    ran: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def pinned_thread() -> None:
        while (task := group.get()) is not None:
            task()

    def one(seq: int, pinned: bool) -> None:
        try:
            ticket = lane.arrive(seq, seq, "g", "m", 0)
            try:
                lane.wait_turn(ticket, serve=pinned)
                run = lambda: ran.append((seq, threading.get_ident()))  # noqa: E731
                lane.run_pinned(ticket, run) if pinned else lane.run_in_thread(ticket, run, lane)
            finally:
                lane.leave(ticket)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=pinned_thread)
    t.start()
    rng = random.Random(15)
    helpers = []
    for seq in range(2000):
        if rng.random() < 0.5:
            group.put(lambda seq=seq: one(seq, True))
        else:
            h = threading.Thread(target=one, args=(seq, False))
            h.start()
            helpers.append(h)
    for h in helpers:
        h.join(HANG)
    group.put(None)
    t.join(HANG)
    assert not errors and not t.is_alive() and not any(h.is_alive() for h in helpers)
    assert [s for s, _ in ran] == list(range(2000))
    assert {tid for _, tid in ran} == {t.ident}
    assert lane.next_number == 2000
    st = lane.pinned_state()
    assert st["waiter"] + st["pump"] == len(helpers)


def test_a_job_cancelled_before_the_pinned_thread_takes_it_never_runs():
    """A calls-group call (nested input) whose job waits for the pinned thread is cancelled
    before the thread takes the job: the call fails at once, its method never runs, and its
    number is released when the thread reaches the job."""
    queued = threading.Event()
    pumps: list = []
    lane = ThreadLane(pump=lambda: (pumps.append(lane.serve_jobs), queued.set()))
    ran: list[int] = []
    failed: list[BaseException] = []
    ticket = lane.arrive(7, 0, "g", "m", 0)
    lane.wait_turn(ticket)

    def call() -> None:
        try:
            lane.run_in_thread(ticket, lambda: ran.append(1), lane)
        except CallCancelled as e:
            failed.append(e)
        finally:
            lane.leave(ticket)

    h = threading.Thread(target=call)
    h.start()
    assert queued.wait(HANG)  # the job waits for the pinned thread (nobody serves it yet)
    lane.cancel([(7, 0)], deadline=False)
    h.join(HANG)
    assert not h.is_alive() and len(failed) == 1  # the call failed at once
    assert lane.next_number == 0  # it keeps the lane until the thread reaches its job
    assert len(pumps) == 1
    pumps[0]()  # the pinned thread takes the job
    assert ran == []  # the method never started
    assert lane.next_number == 1  # and the number is released
    assert lane.pinned_state()["pump"] == 1


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
        assert await pinned.record(23) == [23, 23]  # their numbers were released: the lane moves on
    assert await pinned.take() == [[23], [23]]


async def test_a_wedge_by_a_calls_group_call_fails_the_pinned_calls_behind_it(pinned, source):
    """The stuck method is a job on the pinned thread (its call came through the calls
    group): the pinned calls queued behind it fail at once, too."""
    for timeout in (2.0, 4.0, 8.0):
        t0 = time.monotonic()
        stuck = pinned.block.options(timeout=timeout)(source.value(1))
        behind = pinned.record(31)
        await until(lambda: blocked(pinned), HANG)
        in_time = time.monotonic() - t0 < timeout * 0.8
        with pytest.raises(CallTimeoutError):
            await stuck
        if in_time:
            break
        await asyncio.gather(behind, return_exceptions=True)
        await drain(pinned)
        await pinned.take()
    else:
        pytest.fail("the blocking call never started well inside its deadline")
    async with asyncio.timeout(HANG):
        with pytest.raises(asyncrl.LaneWedgedError, match=r"pinned\.block"):
            await behind
    assert await pinned.is_blocked() == [True, True]
    await drain(pinned)
    assert [[x for x in rank_log if x != -1] for rank_log in await pinned.take()] == [[], []]
    async with asyncio.timeout(HANG):
        assert await pinned.record(32) == [32, 32]


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


async def test_a_call_sent_after_the_wedge_is_lifted_runs_even_when_the_unfence_is_late(pinned):
    """The controller saw the stuck thread return and sent ``unfence``; the host handles it
    only once a later call waits for it (control-before-call). Without the ordering that call reaches
    the host's fence first and fails as wedged although the wedge is over."""
    await pinned.hold_unfences()
    await timed_out_while_running(pinned)
    seq = pinned._hostset.sequencer

    async def wedged() -> bool:
        return len(seq.wedged) == 2

    async def lifted() -> bool:
        return not seq.wedged

    await until(wedged, HANG)  # both hosts answered the deadline's cancel: their lanes are wedged
    await pinned.unblock()
    await until(lifted, HANG)  # the controller heard both threads return and sent unfence
    async with asyncio.timeout(HANG):
        assert await pinned.record(61) == [61, 61]
    assert await pinned.take() == [[61], [61]]


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


def test_a_failed_self_submission_fails_the_job_instead_of_stranding_it():
    """Ray shutting down under the host: the job's caller gets an error, never a wait."""
    def pump() -> None:
        raise RuntimeError("Ray is shutting down")

    lane = ThreadLane(pump=pump)
    ticket = lane.arrive(1, 0, "g", "m", 0)
    lane.wait_turn(ticket)
    with pytest.raises(CallCancelled, match="could not reach its pinned thread"):
        lane.run_in_thread(ticket, lambda: 1, lane)
