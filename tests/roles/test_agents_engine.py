"""The request-level HF engine (`RequestBatcher`): requests from independent coroutines share decoding
rounds, sample what they sample alone, carry the weight version of every token, and a weight update
taken at a round boundary reaches requests in flight."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.roles import load_model
from asyncrl.roles._util import response_log_probs
from asyncrl.roles.engines import SamplingParams
from asyncrl.roles.engines.batcher import RequestBatcher
from asyncrl.roles.engines.hf import HFEngine


@pytest.fixture(scope="module")
def engine(model_config):
    model, tok = load_model(model_config)
    return HFEngine(model=model, tokenizer=tok), tok


async def test_a_request_samples_exactly_what_the_batch_engine_samples_for_it_alone(engine):
    eng, tok = engine
    b = RequestBatcher(eng, chunk_tokens=4)
    prompts = [tok.encode("write digits:"), tok.encode("say hello"), tok.encode("x")]
    params = [SamplingParams(max_new_tokens=10, seed=11 + i) for i in range(3)]
    try:
        alone = [await b.generate(p, q) for p, q in zip(prompts, params)]
        together = await asyncio.gather(*[b.generate(p, q) for p, q in zip(prompts, params)])
    finally:
        await b.aclose()
    for i, p in enumerate(prompts):
        ref = (await eng.generate([p], params[i]))[0]
        # alone, the first chunk decodes exactly as the batch engine's loop (bit-identical log-probs) ...
        assert alone[i].response_ids[:4] == ref.response_ids[:4] and alone[i].log_probs[:4] == ref.log_probs[:4]
        # ... later chunks prefill prompt + tokens so far, equal up to float rounding
        assert alone[i].response_ids == ref.response_ids and together[i].response_ids == ref.response_ids
        torch.testing.assert_close(torch.tensor(together[i].log_probs), torch.tensor(ref.log_probs), atol=2e-6, rtol=0)
        assert together[i].finish_reason == ref.finish_reason
    s = b.statistics()
    assert s.requests == 6 and s.peak_active == 3 and s.pending == 0


async def test_every_token_carries_the_version_of_the_round_that_produced_it(engine):
    eng, tok = engine
    rounds = iter(range(100))
    b = RequestBatcher(eng, chunk_tokens=2, version_fn=lambda: next(rounds))
    try:
        g = await b.generate(tok.encode("write vowels:"), SamplingParams(max_new_tokens=6, seed=3, temperature=0.0))
    finally:
        await b.aclose()
    assert g.finish_reason == "length" and len(g.response_ids) == 6
    assert g.versions == [0, 0, 1, 1, 2, 2]  # one round per chunk of two tokens


async def test_weights_swapped_at_a_round_boundary_reach_the_request_in_flight(model_config):
    model, tok = load_model(model_config)
    eng = HFEngine(model=model, tokenizer=tok)
    state = {"version": 0}
    first_round = asyncio.Event()

    def version() -> int:
        first_round.set()
        return state["version"]

    b = RequestBatcher(eng, chunk_tokens=2, version_fn=version)
    prompt = tok.encode("write digits:")
    task = asyncio.ensure_future(b.generate(prompt, SamplingParams(max_new_tokens=6, seed=5)))
    await first_round.wait()  # round 1 runs; paused() queues behind it, before round 2
    new = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) if v.is_floating_point()
           else v for k, v in model.state_dict().items()}
    async with b.paused():
        eng.load_weights(new.items())
        state["version"] = 1
    g = await task
    await b.aclose()
    assert g.versions == [0, 0, 1, 1, 1, 1]
    # the version-1 tokens were sampled from the new weights given prompt + the version-0 tokens
    ids = torch.tensor([prompt + g.response_ids])
    lp, _ = response_log_probs(eng.model, ids, torch.ones_like(ids), torch.tensor([g.response_ids]), 1.0,
                               with_entropy=False)
    torch.testing.assert_close(lp[0, 2:].double(), torch.tensor(g.log_probs[2:], dtype=torch.float64),
                               atol=2e-5, rtol=0)


async def test_a_request_stops_on_eos_and_a_cancelled_request_leaves_the_others_running(engine):
    eng, tok = engine
    b = RequestBatcher(eng, chunk_tokens=3)
    try:
        gone = asyncio.ensure_future(b.generate(tok.encode("x"), SamplingParams(max_new_tokens=30, seed=1)))
        kept = asyncio.ensure_future(b.generate(tok.encode("say hello"), SamplingParams(max_new_tokens=30, seed=12)))
        await asyncio.sleep(0)
        gone.cancel()
        g = await kept
    finally:
        await b.aclose()
    assert gone.cancelled()
    ref = (await eng.generate([tok.encode("say hello")], SamplingParams(max_new_tokens=30, seed=12)))[0]
    assert g.response_ids == ref.response_ids and g.finish_reason == ref.finish_reason == "stop"
    assert g.response_ids[-1] == eng.eos_id and len(g.response_ids) < 30


async def test_a_request_to_a_sleeping_engine_is_refused_with_the_fix(engine):
    eng, tok = engine
    b = RequestBatcher(eng)
    eng.sleep(1)
    try:
        with pytest.raises(RuntimeError, match="asleep.*wake_up"):
            await b.generate(tok.encode("x"), SamplingParams(max_new_tokens=2))
    finally:
        eng.wake_up()
        await b.aclose()
