"""A watched group call's span: from its issue until the backend saw its last rank finish,
read without waking the event loop (``GroupFuture.done_time``); unfinished ones are closed
at ``close()``; each span is recorded once."""

from __future__ import annotations

import time

import pytest_asyncio

from asyncrl import RayWorkerGroup
from asyncrl.pipelines.observe.trace import Tracer
from tests.core.workers import Probe


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def wg(ray_cluster):
    async with RayWorkerGroup(Probe, world_size=2, name="trace-spans") as group:
        yield group


async def test_a_span_ends_when_the_last_rank_finished_and_is_recorded_once(wg):
    tracer = Tracer()
    issued = tracer.now()
    first = tracer.watch(wg.gather_at_barrier(2), "barrier", step=3)  # pending until a second call arrives
    assert await wg.noop(1) == [1, 1]
    assert tracer.spans == []  # not done: nothing recorded yet
    released = time.perf_counter() - tracer.origin
    second = wg.gather_at_barrier(2)
    assert await second == [2, 2] and await first == [2, 2]
    awaited = tracer.now()
    [span] = tracer.spans
    assert (span.name, span.track, span.args) == ("barrier", wg.name, {"step": 3})
    assert issued <= span.start <= released <= span.end <= awaited
    assert span.end == first.done_time() - tracer.origin
    tracer.close()
    assert tracer.spans == [span]  # close adds nothing for a finished call


async def test_close_ends_unfinished_spans_now_and_later_watches_are_ignored(wg):
    tracer = Tracer()
    done = tracer.watch(wg.add(1), "add")
    assert await done == [1, 2]
    hanging = tracer.watch(wg.wait_forever("trace"), "forever")
    before = tracer.now()
    tracer.close()
    spans = {s.name: s for s in tracer.spans}
    assert set(spans) == {"add", "forever"}
    assert "unfinished" not in spans["add"].args and spans["add"].end == done.done_time() - tracer.origin
    assert spans["forever"].args == {"unfinished": True} and spans["forever"].end >= before
    tracer.watch(wg.add(2), "after-close")
    assert [s.name for s in tracer.spans].count("after-close") == 0
    assert hanging.cancel()


async def test_a_disabled_tracer_records_nothing_and_starts_no_watch(wg):
    tracer = Tracer(enabled=False)
    fut = tracer.watch(wg.add(3), "add")
    assert await fut == [3, 4]
    tracer.close()
    assert tracer.spans == [] and fut._call._watching is False
