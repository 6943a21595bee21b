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
