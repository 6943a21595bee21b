"""Worker-timed spans: the workers time each call (arrived, started, ended) and return it in
the call's metadata; the tracer draws the execution solid and the waits before it (queued,
waiting for its turn or inputs) as separate spans that never overlap it, all inside the
call's issue..done. Mechanisms only: no timing is asserted beyond ordering."""

from __future__ import annotations

import asyncio
import json
import time

import pytest_asyncio
import torch

from asyncrl import LocalWorkerGroup, RayWorkerGroup
from asyncrl.pipelines.observe.trace import WAIT_LANES, Tracer
from tests.core.workers import Probe


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def wg(ray_cluster):
    async with RayWorkerGroup(Probe, world_size=2, name="trace-times") as group:
        yield group


def _contiguous(span) -> None:
    parts = span.parts()
    assert [k for k, _, _ in parts][-1] == "exec"
    assert parts[0][1] == span.start and parts[-1][2] <= span.end
    for (_, _, b), (_, a, _) in zip(parts, parts[1:]):
        assert a == b  # each part starts where the one before ended: no overlap, no gap
    assert all(a <= b for _, a, b in parts)


async def _spans(tracer: Tracer, n: int) -> list:
    """The tracer's spans once `n` are recorded: a timed call's span waits for its times,
    which Ray's thread hands over as the replies arrive (a deadline-bounded poll)."""
    deadline = time.monotonic() + 30
    while len(tracer.spans) < n:
        assert time.monotonic() < deadline, f"{len(tracer.spans)} of {n} spans recorded"
        await asyncio.sleep(0.01)
    return tracer.spans


async def _until_blocked(wg) -> None:
    deadline = time.monotonic() + 30
    while not all(await wg.is_blocked()):
        assert time.monotonic() < deadline, "block() never started on every rank"
        await asyncio.sleep(0.01)


async def test_a_queued_call_waits_for_the_one_before_and_its_spans_do_not_overlap(wg):
    tracer = Tracer()
    assert wg.time_calls is False
    first = tracer.watch(wg.add(0), "first")  # issued untimed: the watch switches the group's timing on
    assert not first.timed and wg.time_calls is True
    assert await first == [0, 1]
    blocker = tracer.watch(wg.block(), "block")
    queued = tracer.watch(wg.add(1), "add")  # ordered: runs after block() on each worker
    assert blocker.timed and queued.timed
    await _until_blocked(wg)
    await wg.unblock()
    assert await blocker == [0, 1] and await queued == [1, 2]
    spans = {s.name: s for s in await _spans(tracer, 3)}
    assert set(spans) == {"first", "block", "add"}
    assert spans["first"].ran is None and spans["first"].parts() == [("call", spans["first"].start, spans["first"].end)]
    for name in ("block", "add"):
        s = spans[name]
        assert s.start <= s.arrived <= s.ran[0] <= s.ran[1] <= s.end
        _contiguous(s)
    for fut in (blocker, queued):
        times = fut.worker_times()
        assert len(times) == 2 and all(a <= b <= c for a, b, c in times)
    b_times, a_times = blocker.worker_times(), queued.worker_times()
    # on each worker (its own clock) the queued call started only after the blocking one returned
    assert all(a[1] >= b[2] for a, b in zip(a_times, b_times))
    tracer.close()


async def test_trace_json_draws_the_waits_in_their_own_lanes_beside_the_execution(wg, tmp_path):
    tracer = Tracer()
    wg.time_calls = True
    blocker = tracer.watch(wg.block(), "block")
    queued = tracer.watch(wg.add(5), "add")
    await _until_blocked(wg)
    await wg.unblock()
    assert await blocker == [0, 1] and await queued == [5, 6]
    await _spans(tracer, 2)
    tracer.close()
    events = [e for e in json.loads(tracer.write(tmp_path / "trace.json").read_text())["traceEvents"]
              if e["ph"] == "X"]
    by_call: dict[str, list[dict]] = {}
    for e in events:
        by_call.setdefault(e["name"].split(" (")[0], []).append(e)
    for name, evs in by_call.items():
        [run] = [e for e in evs if e["cat"] == "stage"]
        assert run["name"] == name and run["tid"] < WAIT_LANES and run["args"]["part"] == "exec"
        for w in (e for e in evs if e["cat"] == "wait"):
            assert w["tid"] >= WAIT_LANES and w["name"] in (f"{name} (queued)", f"{name} (waiting)")
            assert w["ts"] + w["dur"] <= run["ts"] + 0.2  # a wait ends before its execution starts (rounding)
    span = {s.name: s for s in tracer.spans}["add"]
    assert [k for k, _, _ in span.parts()][-1] == "exec"


async def test_data_parallel_calls_carry_times_without_time_calls_and_failures_carry_none(wg):
    g = wg
    g.time_calls = False
    fut = g.double_tensor(torch.arange(4))
    assert fut.timed  # a DP_COMPUTE call's metadata carries the times anyway
    assert (await fut).tolist() == [0, 2, 4, 6]
    other = g.add(1)
    assert not other.timed and other.worker_times() is None
    assert await other == [1, 2]
    g.time_calls = True
    failing = g.boom("no")
    try:
        await failing
    except Exception as e:  # noqa: BLE001 - the call's own error, asserted below
        assert "no" in str(e)
    else:
        raise AssertionError("boom() returned")
    tracer = Tracer()
    tracer.watch(failing, "boom")
    tracer.close()
    [span] = tracer.spans
    assert failing.worker_times() in (None, [None, None]) and span.ran is None  # no times: issue..done
    deadline = time.monotonic() + 30
    while fut.worker_times() is None:  # the peek completes on Ray's thread
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert [len(t) for t in fut.worker_times()] == [3, 3]


async def test_local_groups_time_their_calls_too():
    async with LocalWorkerGroup(Probe, world_size=2) as g:
        g.time_calls = True
        tracer = Tracer()
        fut = tracer.watch(g.add(2), "add")
        assert await fut == [2, 3]
        await _spans(tracer, 1)
        tracer.close()
        [span] = tracer.spans
        assert span.ran is not None
        _contiguous(span)
