"""An awaited call's fetch: one event-loop wake-up per call, not per rank.

The backend counts a call's refs down off the loop (Ray: completion callbacks on Ray's
own thread; local: done callbacks) and delivers them together once — when the last rank
is done, or at once on the first error. These tests pin what that must keep: exact
values; the first error settling the call while other ranks still run, named by rank;
every rank's outcome retrieved (nothing logged as never retrieved); a late delivery
after a deadline or cancel changing nothing; thousands of refs past the batching limit
each delivered exactly once.

On Ray, an idle getter thread first waits for a fetch in Ray's blocking get; these tests
also pin that path: its exact values; a call not done within the window handed to the
callbacks; a busy thread never holding up another call's delivery; a call cancelled
while the thread waits staying cancelled; no thread inside an async Ray actor; Ray
shutting down while it waits leaving the thread alive and serving the next session; a
forked child starting without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator

import pytest
import pytest_asyncio
import torch
from tensordict import TensorDict

from asyncrl import CallCancelledError, CallTimeoutError, RemoteError
from asyncrl.backends import local as local_backend
from asyncrl.future import _Call

from tests.core import kinds
from tests.core.kinds import BACKENDS
from tests.core.workers import Probe

HANG = 60  # seconds: what should be delivered by then never will be


@contextlib.contextmanager
def no_error_left_unretrieved(wg, monkeypatch) -> Iterator[None]:
    """What asyncio reports (a future's exception nobody retrieved) and what Ray reports as unhandled (an error in
    an object nobody read) while the block runs: both must be empty once it ends."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, ctx: reported.append(ctx))
    unhandled: list = []
    if wg.kind != "local":
        import ray._private.worker as ray_worker

        monkeypatch.setattr(ray_worker, "_unhandled_error_handler", unhandled.append)
    try:
        yield
    finally:
        loop.set_exception_handler(previous)
    assert reported == [] and unhandled == []


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=BACKENDS)
async def wg(request, ray_cluster):
    async with kinds.group(request.param, Probe, world_size=2, name=f"fetch-{request.param}") as group:
        group.kind = request.param
        yield group


def _ray_fetch():
    from asyncrl.backends import _ray_fetch as ray_backend

    return ray_backend._Fetch


def deliveries(monkeypatch, kind: str) -> list:
    """Record every fetch whose outcomes reached the loop, live or late (cancelled)."""
    seen: list = []
    if kind == "local":
        one = local_backend._LocalFetch._one

        def recording_one(self, i, ref):
            one(self, i, ref)
            if self._left == 0:
                seen.append(self)

        monkeypatch.setattr(local_backend._LocalFetch, "_one", recording_one)
    else:
        cls = _ray_fetch()
        fire = cls._fire

        def recording_fire(self):
            fire(self)
            seen.append(self)

        monkeypatch.setattr(cls, "_fire", recording_fire)
    return seen


async def all_retrieved(handle) -> None:
    """Wait until the backend has the outcome of every ref of a fetch."""
    async def done() -> bool:
        return handle._left == 0

    await kinds.until(done)


def rows(n: int) -> TensorDict:
    td = TensorDict({"x": torch.arange(n)}, batch_size=[n])
    td["prompt"] = [f"p{i}" for i in range(n)]
    return td


async def test_one_delivery_per_call_with_exact_values(wg, monkeypatch):
    calls: list = []
    delivered = _Call._delivered

    def counting(self, got, failed, at):
        calls.append((self.method, failed))
        delivered(self, got, failed, at)

    monkeypatch.setattr(_Call, "_delivered", counting)
    fetched = wg.stats.results_fetched
    fut = wg.add(5)
    assert await fut == [5, 6]
    assert fut.done_time() is not None
    padded = await wg.tag(rows(3))  # rank 1 padded: its metadata is fetched in the same delivery
    assert padded["y"].tolist() == [0, 2, 4] and padded["prompt"] == ["P0", "P1", "P2"]
    assert await wg.whoami() == 0  # RANK_ZERO: rank 1's ref is fetched too (its errors surface)
    assert calls == [("add", -1), ("tag", -1), ("whoami", -1)]
    assert wg.stats.results_fetched == fetched + 2 + 2 + 1


async def _waiting(wg, want: list[bool]) -> None:
    """Wait until the ranks' `fail_or_wait` gates are as `want` (remote state that cannot be
    awaited: a rank enters the call when its ordered thread gets to it)."""
    async def reached() -> bool:
        return await wg.is_waiting() == want

    await kinds.until(reached)


async def test_the_first_error_settles_the_call_while_another_rank_still_runs(wg):
    fut = wg.fail_or_wait(0)
    with pytest.raises(RemoteError) as err:
        async with asyncio.timeout(HANG):  # (a fetch waiting for every rank would never finish)
            await fut
    assert (err.value.rank, err.value.exc_type, err.value.message) == (0, "builtins.ValueError", "rank 0 failed")
    await _waiting(wg, [False, True])  # rank 1 is still inside the call (it may reach its gate after rank 0's error)
    assert fut.done() and fut.done_time() is not None
    handle = fut._call._fetch
    assert handle is None  # delivered
    await wg.open_gate()
    assert await wg.add(1) == [1, 2]  # rank 1 finished its part; the ordered lane goes on
    with pytest.raises(RemoteError) as again:
        await fut  # the same outcome for every awaiter
    assert again.value is err.value


async def test_every_rank_failing_retrieves_every_error_and_logs_none(wg, monkeypatch):
    with no_error_left_unretrieved(wg, monkeypatch):
        fut = wg.boom("all fail")
        fut._call.outcome()  # the fetch starts
        handle = fut._call._fetch
        with pytest.raises(RemoteError) as err:
            await fut
        assert err.value.rank in (0, 1)
        assert (err.value.exc_type, err.value.message) == ("builtins.ValueError", "all fail")
        await all_retrieved(handle)  # the other rank's error came in after the call was settled
        assert all(isinstance(o, BaseException) for o in handle._outcomes)  # both errors, retrieved
        del fut, handle, err
        gc.collect()
        assert await wg.add(0) == [0, 1]  # a round trip after the collection
        gc.collect()


@pytest.mark.parametrize("how", ["every_rank", "data_parallel"])
async def test_a_timed_call_that_fails_retrieves_its_metadata_errors_too(wg, monkeypatch, how):
    """A call that returns its workers' times (``time_calls``; a data-parallel call always does) carries each rank's
    error in its metadata as well as in its result: a failed call reads its times as it is settled, so neither
    error is left for Ray (or asyncio) to report as unhandled, although nobody asked for the times; they read None
    for a failed rank."""
    monkeypatch.setattr(wg, "time_calls", True)  # (restored after the test)
    with no_error_left_unretrieved(wg, monkeypatch):
        fut = wg.boom("all fail") if how == "every_rank" else wg.boom_on_rank(rows(4), 1)
        assert fut.timed
        with pytest.raises(RemoteError) as err:
            await fut
        assert err.value.exc_type == ("builtins.ValueError" if how == "every_rank" else "builtins.KeyError")
        call = fut._call
        assert call.times is not None  # being read (False) or read: the failure started reading them

        async def read() -> bool:
            return isinstance(call.times, list)

        await kinds.until(read)  # every rank's metadata reached the controller
        got = fut.worker_times()
        assert got is not None and [t is None for t in got] == ([True, True] if how == "every_rank" else [False, True])
        assert all(len(t) == 3 for t in got if t is not None)
        del fut, call, err, got
        gc.collect()
        assert await wg.add(0) == [0, 1]  # a round trip after the collection
        gc.collect()


@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_a_late_delivery_after_the_controller_failed_the_call_changes_nothing(wg, monkeypatch, how):
    seen = deliveries(monkeypatch, wg.kind)
    if how == "deadline":
        fut = wg.fail_or_wait.options(timeout=0.3)(-1)  # no rank fails: every rank waits until cancelled
        outcome = fut._call.outcome()  # the fetch starts
        handle = fut._call._fetch
        with pytest.raises(CallTimeoutError):
            await fut
    else:
        fut = wg.fail_or_wait(-1)
        outcome = fut._call.outcome()
        handle = fut._call._fetch
        try:
            await _waiting(wg, [True, True])  # both ranks inside the call (each reaches its gate in its own time)
        finally:
            assert fut.cancel()  # (even when the wait above failed: the module's group must not stay blocked)
        with pytest.raises(CallCancelledError):
            await fut
    assert handle is not None and fut._call._fetch is None
    done_at, error, fetched = fut.done_time(), outcome.exception(), wg.stats.results_fetched

    async def delivered() -> bool:
        return handle in seen

    await kinds.until(delivered)  # the ranks' cancelled outcomes arrived after the call was failed
    assert outcome.exception() is error and fut.done_time() == done_at
    assert wg.stats.results_fetched == fetched
    assert await wg.is_waiting() == [False, False]
    assert await wg.add(2) == [2, 3]


async def test_many_calls_past_the_batching_limit_are_each_delivered_exactly_once(wg, monkeypatch):
    if wg.kind == "local":
        pytest.skip("the local backend has no threads to batch deliveries from")
    from asyncrl.backends._ray_fetch import _NATIVE_LIMIT, _RESOLVER

    counts: dict[int, int] = {}
    queued: list[bool] = []
    delivered = _Call._delivered

    def counting(self, got, failed, at):
        counts[id(self)] = counts.get(id(self), 0) + 1
        queued.append(self._fetch._queued)
        delivered(self, got, failed, at)

    monkeypatch.setattr(_Call, "_delivered", counting)
    n = 300  # 600 refs on 2 ranks: past the limit of refs fetched with a direct wake-up each
    assert 2 * n > _NATIVE_LIMIT
    futures = [wg.noop(i) for i in range(n)] + [wg.boom(f"no {i}") for i in range(3)]
    blocked = [wg.wait_forever(str(i)) for i in range(4)]
    waiters = [asyncio.ensure_future(b) for b in blocked]  # fetched through the queue, then cancelled
    got = await asyncio.gather(*futures, return_exceptions=True)  # a task per future: all fetches outstanding
    assert got[:n] == [[i, i] for i in range(n)]
    for i, e in enumerate(got[n:]):
        assert isinstance(e, RemoteError) and (e.exc_type, e.message) == ("builtins.ValueError", f"no {i}")
    assert sorted(counts.get(id(f._call)) for f in futures) == [1] * (n + 3)
    assert True in queued and False in queued  # both paths were taken
    for w in waiters:
        w.cancel()
    for w in waiters:
        with pytest.raises(asyncio.CancelledError):
            await w
    handles = [b._call for b in blocked]
    assert all(c._fetch is None for c in handles)
    assert _RESOLVER.native == 0
    assert all(counts.get(id(c), 0) == 0 for c in handles)  # their late outcomes were not delivered
    assert await wg.noop(7) == [7, 7]


# ---- the getter thread (Ray backend): a fetch waited for in ray.get, off the loop ----------------


def _getter(wg):
    if wg.kind == "local":
        pytest.skip("the local backend has no getter thread")
    from asyncrl.backends import _ray_fetch as ray_backend

    return ray_backend, ray_backend._GETTER


async def _getter_idle(g) -> tuple[int, int]:
    """Wait until the getter thread is idle (it marks itself so just after posting a
    delivery, which the loop may already have run); then (served, handed)."""
    async def idle() -> bool:
        return g._idle or g._thread is None

    await kinds.until(idle)
    return g.served, g.handed


async def test_an_idle_getter_thread_delivers_a_call_from_rays_get(wg, monkeypatch):
    rb, g = _getter(wg)
    # (a window no call outlasts: on a busy machine a call can take longer than the default's, and is then handed
    # to the callbacks -- the next test's case, not this one's)
    monkeypatch.setattr(rb, "_GET_WINDOW", HANG)
    await wg.add(0)  # (the thread exists from the first fetch on)
    served, handed = await _getter_idle(g)
    fut = wg.add(5)
    assert await fut == [5, 6]
    assert fut.done_time() is not None
    assert await _getter_idle(g) == (served + 1, handed)
    assert await wg.whoami() == 0  # RANK_ZERO: rank 1's ref is waited for as well
    assert await _getter_idle(g) == (served + 2, handed)


async def test_a_call_not_done_within_the_window_moves_to_the_callbacks(wg, monkeypatch):
    rb, g = _getter(wg)
    monkeypatch.setattr(rb, "_GET_WINDOW", 0.05)
    served, handed = await _getter_idle(g)
    fut = wg.fail_or_wait(-1)  # every rank waits at its gate
    fut._call.outcome()  # the fetch starts: the idle thread takes it

    async def handed_over() -> bool:
        return g.handed == handed + 1

    await kinds.until(handed_over)
    await _waiting(wg, [True, True])
    served, _ = await _getter_idle(g)
    # a window no call outlasts from here on (at 50 ms a loaded machine's call moved to the callbacks too)
    monkeypatch.setattr(rb, "_GET_WINDOW", HANG)
    try:
        assert await wg.noop(3) == [3, 3]  # the thread is free again: it delivers this one
        assert await _getter_idle(g) == (served + 1, handed + 1)
    finally:
        await wg.open_gate()  # (the thread's too; also when the test fails: the next tests share the ranks)
    assert await fut == [0, 1]  # through the callbacks
    assert await _getter_idle(g) == (served + 2, handed + 1)


async def test_a_busy_getter_thread_never_holds_up_another_calls_delivery(wg, monkeypatch):
    rb, g = _getter(wg)
    monkeypatch.setattr(rb, "_GET_WINDOW", HANG)  # the thread stays in the long call's get
    served, handed = await _getter_idle(g)
    fut = wg.fail_or_wait(-1)
    fut._call.outcome()
    assert not g._idle  # taken on the loop, at once
    async with asyncio.timeout(HANG / 2):
        await _waiting(wg, [True, True])  # concurrent calls, delivered meanwhile through the callbacks
        assert await wg.noop(3) == [3, 3]
    assert (g.served, g.handed) == (served, handed)
    await wg.open_gate()
    assert await fut == [0, 1]  # from the thread's get
    assert await _getter_idle(g) == (served + 1, handed)


async def test_a_call_cancelled_while_the_getter_thread_waits_for_it_stays_cancelled(wg, monkeypatch):
    rb, g = _getter(wg)
    monkeypatch.setattr(rb, "_GET_WINDOW", HANG)
    seen = deliveries(monkeypatch, wg.kind)
    served, handed = await _getter_idle(g)
    fut = wg.fail_or_wait(-1)
    outcome = fut._call.outcome()
    handle = fut._call._fetch
    try:
        await _waiting(wg, [True, True])
    finally:
        assert fut.cancel()
    with pytest.raises(CallCancelledError):
        await fut
    error, fetched = outcome.exception(), wg.stats.results_fetched
    # the ranks end their part cancelled; the thread's get raises and hands the fetch to the
    # callbacks, whose delivery finds the call failed already
    assert await _getter_idle(g) == (served, handed + 1)

    async def delivered() -> bool:
        return handle in seen

    await kinds.until(delivered)
    assert outcome.exception() is error and wg.stats.results_fetched == fetched
    assert await wg.add(2) == [2, 3]


async def test_no_getter_thread_inside_an_async_ray_actor(wg):
    rb, _ = _getter(wg)
    import ray

    @ray.remote(num_cpus=0)
    class AsyncActor:
        async def allowed(self) -> bool:
            from asyncrl.backends._ray_fetch import _getter_allowed

            return _getter_allowed()

    @ray.remote(num_cpus=0)
    class SyncActor:
        def allowed(self) -> bool:
            from asyncrl.backends._ray_fetch import _getter_allowed

            return _getter_allowed()

    a, s = AsyncActor.remote(), SyncActor.remote()
    try:
        # Ray warns about any blocking get inside an async actor: a controller run there keeps
        # the callbacks only; a driver or a sync actor has the thread
        assert (await a.allowed.remote(), await s.allowed.remote(), rb._getter_allowed()) == (False, True, True)
    finally:
        ray.kill(a)
        ray.kill(s)


SHUTDOWN_WHILE_GETTING = """
import asyncrl
from asyncrl.backends import _ray_fetch as rb
from tests.core import kinds
from tests.core.workers import Probe


async def idle(g, deadline=30.0):
    async def is_idle():
        return g._idle

    await kinds.until(is_idle, deadline)


async def main():
    rb._GET_WINDOW = 60.0  # the thread would stay in the call's get for a minute
    g = rb._GETTER
    await asyncrl.ainit(num_cpus=2)
    wg = asyncrl.RayWorkerGroup(Probe, world_size=1, name="first")
    await wg.setup()
    assert await wg.add(1) == [1]
    await idle(g)
    fut = wg.fail_or_wait(-1)  # never ends on its own
    fut._call.outcome()
    assert not g._idle
    await asyncrl.ashutdown()  # Ray goes away while the thread waits in ray.get
    # the thread is back, not dead: Ray's get raised, the callbacks could not be registered (the deadline outlasts
    # the get's window: at a load of 5-18 this once took longer than 30 s, and the get returns by its window's end)
    await idle(g, deadline=rb._GET_WINDOW + 30.0)
    assert g._thread.is_alive()
    assert fut.done()  # (nothing will come: its refs count as done, and asking does not raise)
    rb._GET_WINDOW = 0.02
    await asyncrl.ainit(num_cpus=2)  # a new Ray session in the same process: the same thread serves it
    wg2 = asyncrl.RayWorkerGroup(Probe, world_size=1, name="second")
    await wg2.setup()
    served = g.served
    assert await wg2.add(2) == [2]
    await idle(g)
    print("served", g.served - served, "handed", g.handed)
    await wg2.close()
    await asyncrl.ashutdown()


asyncrl.run(main())
"""


@pytest.mark.slow  # a Ray of its own in a subprocess (22 s)
@pytest.mark.parametrize("backend", ["ray"])
async def test_ray_shutting_down_while_the_getter_thread_waits_leaves_it_serving(backend):
    out = await kinds.run_script(SHUTDOWN_WHILE_GETTING)
    assert out.strip().splitlines()[-1] == "served 1 handed 1"


def test_a_forked_child_does_not_inherit_the_getter_thread(monkeypatch):
    import os
    import threading

    from asyncrl.backends import _ray_fetch as ray_backend

    g = ray_backend._GETTER
    monkeypatch.setattr(g, "_thread", threading.Thread(target=lambda: None))  # the parent's, idle
    monkeypatch.setattr(g, "_idle", True)
    pid = os.fork()
    if pid == 0:  # the child: a fetch handed to a thread that is not there would never be delivered
        os._exit(0 if g._thread is None and not g._idle and g.served == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert g._idle  # the parent's state is untouched
