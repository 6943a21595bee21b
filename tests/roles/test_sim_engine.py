"""The simulated engine (roles/engines/sim.py): a step costs the same for any batch, lengths are
heavy-tailed and seeded, requests join and leave at step boundaries. Counts, never timing."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from asyncrl.roles.engines import SamplingParams, make_engine
from asyncrl.roles.engines.sim import SimEngine, response_length


class _Tok:
    eos_token_id = 3

    def __len__(self) -> int:
        return 10


def _engine(**kw) -> SimEngine:
    kw.setdefault("step_ms", 1.0)
    return make_engine("sim", model=None, tokenizer=_Tok(), model_dir=None, **kw)


def test_sim_is_a_registered_engine():
    assert isinstance(_engine(), SimEngine)


def test_lengths_are_seeded_and_heavy_tailed():
    lengths = [response_length(s, 10_000, 16.0, 1.2) for s in range(4000)]
    assert lengths[:50] == [response_length(s, 10_000, 16.0, 1.2) for s in range(50)]
    q = statistics.quantiles(lengths, n=100)
    assert 14 <= q[49] <= 18  # median 16
    assert q[98] / q[49] >= 8  # p99 / p50 (exp(2.326 * 1.2) = 16 in theory)
    assert response_length(0, 5, 1000.0, 0.0) == 5  # the cap


def test_a_batch_takes_its_longest_row_and_uses_one_slot_per_token():
    eng = _engine(max_batch_size=8, median_tokens=6.0, sigma=1.0)
    params = SamplingParams(max_new_tokens=64, seed=11)
    want = [response_length(11 + i, 64, 6.0, 1.0) for i in range(5)]

    async def main():
        eng.reset_statistics()
        out = await eng.generate([[1, 2]] * 5, params)
        return out, eng.statistics()

    out, st = asyncio.run(main())
    assert [len(c.response_ids) for c in out] == want
    assert all(c.response_ids[-1] == 3 and 3 not in c.response_ids[:-1] for c in out if c.finish_reason == "stop")
    assert all(len(c.log_probs) == len(c.response_ids) for c in out)
    assert st.steps == max(want)  # one step per token of the longest row, whatever the batch size
    assert st.slots_used == sum(want) == st.tokens
    assert st.requests == 5 and st.peak_in_flight == 5


def test_requests_beyond_the_slots_wait_and_stream_in_finish_order():
    eng = _engine(max_batch_size=2, median_tokens=4.0, sigma=0.0)  # every row: 4 tokens

    async def main():
        order = [i async for i, _ in eng.stream([[1]] * 3, SamplingParams(max_new_tokens=64, seed=0))]
        return order, eng.statistics()

    order, st = asyncio.run(main())
    assert order == [0, 1, 2]
    assert st.steps == 8 and st.slots_used == 12  # two rows decode together, the third after them


def _at_step(eng: SimEngine, actions: dict[int, object]) -> list[asyncio.Future]:
    """Start `actions[n]()` (a coroutine function) as a task right after decoding step n."""
    tasks: list[asyncio.Future] = []

    def hook(step: int) -> None:
        if step in actions:
            tasks.append(asyncio.ensure_future(actions[step]()))

    eng.on_step = hook
    return tasks


@pytest.mark.parametrize("mode, prefills", [("recompute", 1), ("keep", 0)])
def test_a_partial_pause_holds_the_engine_after_its_step_and_requests_continue(mode, prefills):
    eng = _engine(max_batch_size=4, median_tokens=20.0, sigma=0.0, round_steps=1000)
    seen: dict[str, object] = {}

    async def pause():
        async with eng.apaused(mode, deadline_s=5.0) as info:
            seen["held"] = eng.statistics().steps
            for _ in range(20):
                await asyncio.sleep(0)
            seen["still"] = eng.statistics().steps  # no step while paused
            await eng.aload_weights([])  # inside the pause: at once, not at the round's end
        seen["info"] = info

    async def main():
        tasks = _at_step(eng, {3: pause})
        out = await eng.generate([[1]], SamplingParams(max_new_tokens=64, seed=0))
        await asyncio.gather(*tasks)
        return out, eng.statistics()

    out, st = asyncio.run(main())
    assert seen["held"] == seen["still"] == 4  # requested after step 3: takes effect when step 4 ends
    assert seen["info"].in_flight == 1 and seen["info"].interrupted
    assert len(out[0].response_ids) == 20 and st.steps == 20
    assert st.loads == 1 and st.load_steps == [4] and st.prefills == prefills


def test_requests_record_the_version_of_every_token():
    eng = _engine(max_batch_size=4, median_tokens=6.0, sigma=0.0)
    version = [0]

    async def bump():
        async with eng.apaused("keep", deadline_s=5.0):
            version[0] = 1

    async def main():
        tasks = _at_step(eng, {2: bump})
        g = await eng.agenerate_request([1], SamplingParams(max_new_tokens=64, seed=0), version_fn=lambda: version[0])
        await asyncio.gather(*tasks)
        return g

    g = asyncio.run(main())
    assert g.versions == [0, 0, 0, 1, 1, 1]  # step 3 was running when the pause was asked for
    assert len(g.response_ids) == len(g.log_probs) == 6


def test_a_load_without_partial_rollout_waits_for_the_end_of_the_round():
    eng = _engine(max_batch_size=4, median_tokens=30.0, sigma=0.0, round_steps=8)

    async def load():
        await eng.aload_weights([])

    async def main():
        tasks = _at_step(eng, {3: load, 10: load})
        await eng.generate([[1]], SamplingParams(max_new_tokens=64, seed=0))
        await asyncio.gather(*tasks)
        await eng.aload_weights([])  # idle: at once, nothing to re-prefill
        return eng.statistics()

    st = asyncio.run(main())
    assert st.load_steps == [8, 16, 30] and st.prefills == 2 and st.steps == 30


def test_a_pause_that_cannot_start_fails_with_its_deadline():
    from asyncrl.roles.errors import PauseDeadlineError

    eng = _engine(step_ms=2000.0)

    async def main():
        task = asyncio.ensure_future(eng.generate([[1]], SamplingParams(max_new_tokens=4, seed=0)))
        async with asyncio.timeout(30):  # until the first step (2 s) is running
            while not eng._step_lock().locked():
                await asyncio.sleep(0.001)
        with pytest.raises(PauseDeadlineError):
            async with eng.apaused("recompute", deadline_s=0.05):
                pass
        task.cancel()
        eng.close()

    asyncio.run(main())


def test_closing_a_stream_drops_its_requests():
    eng = _engine(max_batch_size=4, median_tokens=1000.0, sigma=0.0)

    async def main():
        stream = eng.stream([[1]] * 2, SamplingParams(max_new_tokens=10_000, seed=0))
        task = asyncio.ensure_future(stream.__anext__())
        async with asyncio.timeout(30):
            while eng.statistics().steps < 2:
                await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        async with asyncio.timeout(30):  # until the engine dropped the closed stream's requests
            while eng._active or eng._waiting:
                await asyncio.sleep(0.002)
        return eng.statistics()

    st = asyncio.run(main())
    assert st.requests == 0 and not eng._active and not eng._waiting


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_batch_size >= 1"):
        _engine(max_batch_size=0)


def test_idle_between_counts_the_unused_slots_of_a_window():
    import time

    eng = _engine(max_batch_size=4, median_tokens=10.0, sigma=0.0)

    async def main():
        t0 = time.monotonic()
        await eng.generate([[1]], SamplingParams(max_new_tokens=64, seed=0))  # 1 of 4 slots, 10 steps
        return t0, time.monotonic()

    t0, t1 = asyncio.run(main())
    used = 1 - eng.idle_between(t0, t1)  # 10 slots used of 4 * elapsed / 1 ms available
    assert used * 4 * (t1 - t0) / 1e-3 == pytest.approx(10)
    assert eng.idle_between(t1, t1 + 1.0) == 1.0


# ---- the cost model (the cluster twin's engine) ----------------------------------------------


def _run(eng: SimEngine, n: int, seed: int = 5, max_new_tokens: int = 64):
    async def main():
        eng.reset_statistics()
        out = await eng.generate([[1, 2, 3]] * n, SamplingParams(max_new_tokens=max_new_tokens, seed=seed))
        return out, eng.statistics()

    return asyncio.run(main())


def test_stretches_count_what_single_steps_count():
    kw = dict(max_batch_size=3, median_tokens=8.0, sigma=0.9, step_ms=0.2)
    stepped = _engine(**kw)
    stepped.on_step = lambda step: None  # a hook: the engine stops after every step
    out1, st1 = _run(stepped, 7)
    out2, st2 = _run(_engine(**kw), 7)
    assert [c.response_ids for c in out1] == [c.response_ids for c in out2]
    assert (st1.steps, st1.slots_used, st1.tokens, st1.requests) == (st2.steps, st2.slots_used, st2.tokens,
                                                                     st2.requests)
    assert st2.steps == batch_steps([len(c.response_ids) for c in out2], 3)


def batch_steps(lengths: list[int], slots: int) -> int:
    import heapq

    free = [0] * slots
    for n in lengths:
        heapq.heappush(free, heapq.heappop(free) + n)
    return max(free)


def test_a_step_costs_its_base_its_requests_and_their_context():
    from asyncrl.roles.engines.sim import _Request

    eng = _engine(step_ms=2.0, step_ms_per_seq=0.5, step_ms_per_1k_kv=10.0, prompt_tokens=100, tokens_per_step=4)
    loop = asyncio.new_event_loop()
    try:
        eng._active = [_Request(10, 64, s, loop.create_future(), None, 100) for s in range(3)]
    finally:
        loop.close()
    eng._active[0].done = 2  # 100 + 2 tokens of context
    st = eng._plan(0.0, 0.0)
    C = 3 * 100 + 2
    assert st.a == pytest.approx((2.0 + 3 * 0.5 + 10 * C / 1000) / 1e3)  # 3 requests holding C tokens
    assert st.b == pytest.approx(10 * 3 / 1e6)  # each step's context is 3 tokens larger
    assert st.n == 8 and st.running == 3  # until the first request finishes
    assert [st.steps_by(st.end_of(m)) for m in range(9)] == list(range(9))
    assert st.steps_by(st.end_of(3) - 1e-9) == 2


def test_a_response_carries_one_id_per_k_tokens_and_each_id_the_version_of_its_last_token():
    eng = _engine(max_batch_size=4, median_tokens=10.0, sigma=0.0, tokens_per_step=4)
    version = [0]

    async def bump():
        async with eng.apaused("keep", deadline_s=5.0):
            version[0] = 1

    async def main():
        tasks = _at_step(eng, {5: bump})
        g = await eng.agenerate_request([1], SamplingParams(max_new_tokens=64, seed=0), version_fn=lambda: version[0])
        await asyncio.gather(*tasks)
        return g, eng.statistics()

    g, st = asyncio.run(main())
    assert st.steps == 10 and len(g.response_ids) == 3  # 10 tokens: ids for tokens 1-4, 5-8, 9-10
    assert g.versions == [0, 1, 1]  # token 6 (after the pause asked for at step 5) is the first of version 1
    assert g.finish_reason == "stop" and g.response_ids[-1] == 3


def test_the_kv_cache_bounds_the_context_in_flight_and_preempts_the_newest():
    cap = 50
    eng = _engine(max_batch_size=8, median_tokens=20.0, sigma=0.0, prompt_tokens=10, kv_capacity_tokens=cap)
    peaks: list[int] = []
    eng.on_step = lambda step: peaks.append(sum(eng._context(r) for r in eng._active))
    out, st = _run(eng, 3)
    assert [len(c.response_ids) for c in out] == [20, 20, 20]
    assert max(peaks) <= cap and st.preemptions >= 1
    assert st.requests == 3 and st.tokens == 60


def test_lengths_follow_a_histogram_or_a_per_prompt_median_and_the_tokens_per_id():
    from asyncrl.roles.engines.sim import draw_length

    hist = ([100.0, 200.0, 400.0], [1.0, 0.0])
    drawn = [draw_length(s, [1], 10_000, median_tokens=1.0, sigma=0.0, histogram=hist) for s in range(200)]
    assert min(drawn) >= 100 and max(drawn) <= 200  # the empty bin never drawn
    assert [draw_length(s, [1], 12, median_tokens=1.0, sigma=0.0, histogram=hist, tokens_per_id=10)
            for s in range(200)] == [min(n, 120) for n in drawn]  # the cap: 12 ids of 10 tokens
    a = [draw_length(s, [7, 7], 10_000, median_tokens=100.0, sigma=0.0, prompt_sigma=1.0) for s in range(3)]
    b = [draw_length(s, [8], 10_000, median_tokens=100.0, sigma=0.0, prompt_sigma=1.0) for s in range(3)]
    assert len(set(a)) == 1 and len(set(b)) == 1 and a[0] != b[0]  # a prompt's own median, shared by its rows
    assert draw_length(3, [1], 64, median_tokens=16.0, sigma=1.2) == response_length(3, 64, 16.0, 1.2)


class _CountingBurner:
    """Records each burn and does its work at once (no CPU time): `cut_at` cuts the first interruptible burn at that
    much work, once the test sets its stop flag (it waits for the flag, as a burn in progress is stopped)."""

    def __init__(self, cut_at: float | None = None) -> None:
        import threading

        self.calls: list[tuple[float, bool]] = []
        self.cut_at = cut_at
        self.started = threading.Event()

    def burn(self, seconds, stop=None):
        self.calls.append((seconds, stop is not None))
        if self.cut_at is not None and stop is not None:
            cut, self.cut_at = self.cut_at, None
            self.started.set()
            assert stop.wait(30)  # the test pokes the engine: a request arrives
            return cut
        return seconds


def test_a_shared_device_engine_burns_what_a_sleeping_one_sleeps_and_counts_the_same():
    kw = dict(max_batch_size=3, median_tokens=8.0, sigma=0.9, step_ms=0.2, step_ms_per_seq=0.05)
    out1, st1 = _run(_engine(**kw), 7)
    burned = _engine(**kw, burn_threads=1)
    burner = burned.burner = _CountingBurner()
    out2, st2 = _run(burned, 7)
    assert [c.response_ids for c in out1] == [c.response_ids for c in out2]
    assert (st1.steps, st1.slots_used, st1.tokens, st1.requests) == (st2.steps, st2.slots_used, st2.tokens,
                                                                     st2.requests)
    # every step's cost burned once: step_ms + step_ms_per_seq x its running requests
    assert sum(s for s, _ in burner.calls) == pytest.approx((0.2 * st2.steps + 0.05 * st2.slots_used) / 1e3)
    assert st2.burned_s == pytest.approx(sum(s for s, _ in burner.calls)) and st1.burned_s == 0.0


def test_a_burn_cut_short_by_a_request_finishes_its_step_and_the_request_joins_at_the_next():
    eng = _engine(max_batch_size=4, median_tokens=10.0, sigma=0.0, step_ms=1.0, burn_threads=1)  # rows of 10
    burner = eng.burner = _CountingBurner(cut_at=2.5e-3)  # 2.5 steps of work done when the request arrives
    params = SamplingParams(max_new_tokens=64, seed=0)

    async def main():
        first = asyncio.ensure_future(eng.generate([[1, 2]], params))
        await asyncio.to_thread(burner.started.wait, 30)
        second = asyncio.ensure_future(eng.generate([[1, 2]], params))  # pokes the engine: the burn stops
        return await first, await second, eng.statistics()

    a, b, st = asyncio.run(main())
    assert len(a[0].response_ids) == len(b[0].response_ids) == 10
    assert burner.calls[0] == (pytest.approx(10e-3), True)  # the stretch: 10 steps, cut after 2.5 of them
    assert burner.calls[1] == (pytest.approx(0.5e-3), False)  # the third step finished, not interruptible
    assert burner.calls[2] == (pytest.approx(7e-3), True)  # then both rows, until the first row's end
    assert st.steps == 13 and st.slots_used == 20  # the second row joined after step 3


def test_a_burner_does_the_work_of_its_cost_and_stops_when_asked():
    import threading

    from asyncrl.roles.engines.sim import Burner

    b = Burner(threads=None, work=0.5)
    op = b.op_s
    assert op > 0
    assert b.burn(0.0) == 0.0
    assert b.burn(100 * op) == pytest.approx(100 * op)  # 50 ops of work: half a second of work per second of cost
    stop = threading.Event()
    stop.set()
    assert b.burn(1.0, stop) == 0.0  # stopped before its first chunk
    with pytest.raises(ValueError, match="work > 0"):
        Burner(work=0.0)
    with pytest.raises(ValueError, match="threads >= 1"):
        Burner(threads=0)


def test_a_shared_device_engine_burns_a_batch_stretch_by_stretch_as_its_rows_end():
    kw = dict(max_batch_size=8, median_tokens=6.0, sigma=1.0, step_ms=1.0, step_ms_per_seq=0.5)
    out1, st1 = _run(_engine(**kw), 5, seed=11)
    burned = _engine(**kw, burn_threads=1)
    burner = burned.burner = _CountingBurner()
    out2, st2 = _run(burned, 5, seed=11)
    assert [c.response_ids for c in out1] == [c.response_ids for c in out2] and st1.steps == st2.steps
    lengths = sorted(len(c.response_ids) for c in out2)
    # one burn per stretch between two rows' ends, each of its steps costing 1 ms + 0.5 ms x the rows still running
    want, prev = [], 0
    for i, n in enumerate(lengths):
        if n > prev:
            want.append((n - prev) * (1.0 + 0.5 * (5 - i)) / 1e3)
            prev = n
    assert [s for s, _ in burner.calls] == pytest.approx(want) and all(stoppable for _, stoppable in burner.calls)


@pytest.mark.parametrize("join_rounds, steps", [(False, 6), (True, 8)])
def test_with_join_rounds_a_request_arriving_mid_round_waits_for_the_round_to_end(join_rounds, steps):
    eng = _engine(max_batch_size=4, median_tokens=4.0, sigma=0.0, join_rounds=join_rounds)  # rows of 4 tokens
    params = SamplingParams(max_new_tokens=64, seed=0)
    later: list[asyncio.Future] = []

    def on_step(step: int) -> None:
        if step == 1:  # a request arrives during the second step (its task runs once the step has started)
            later.append(asyncio.ensure_future(eng.generate([[1, 2]], params)))

    eng.on_step = on_step

    async def main():
        first = await eng.generate([[1, 2]], params)
        second = await later[0]
        return first, second, eng.statistics()

    a, b, st = asyncio.run(main())
    assert len(a[0].response_ids) == len(b[0].response_ids) == 4 and st.slots_used == 8
    assert st.steps == steps  # continuous: it joins at step 3 (6 steps); in rounds: after the first row's 4
