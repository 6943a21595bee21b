"""Exact replay of the request batcher's rounds (the engine side of exact replay): a run whose rounds
depend on timing -- requests joining at round boundaries, weight updates interrupting rounds mid-way --
is recorded (`record_rounds=True`) and regenerated bit for bit by `ReplayBatcher` from the JSON log, with
the requests submitted in another order and the updates issued without any timing of their own."""

from __future__ import annotations

import asyncio
import time
import json
from typing import Any

import pytest
import torch

from asyncrl.roles import load_model
from asyncrl.roles.engines import SamplingParams
from asyncrl.roles.engines.batcher import RequestBatcher
from asyncrl.roles.engines.hf import HFEngine
from asyncrl.roles.engines.round_log import ReplayBatcher, ReplayDivergedError, RoundRecord

# a decoding round that builds autograd graphs (a segment run outside torch.no_grad) turns its sampled
# log-probs into tensors with requires_grad: this warning then fails the test
pytestmark = pytest.mark.filterwarnings("error:Converting a tensor with requires_grad")


def perturbed_from(initial: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """`initial` plus noise seeded by `version` (version 0: a copy)."""
    g = torch.Generator().manual_seed(1000 + version)
    return {k: (v + 0.05 * version * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v.clone()
            for k, v in initial.items()}

TEXTS = ["write digits:", "say hello", "x", "write vowels:"]
LENGTHS = [14, 9, 12, 6]


def requests(tok: Any) -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"r{i}", tok.encode(t), SamplingParams(max_new_tokens=n, seed=40 + i))
            for i, (t, n) in enumerate(zip(TEXTS, LENGTHS))]


async def record(model_config, mode: str) -> tuple[list[Any], list[dict[str, Any]], int]:
    model, tok = load_model(model_config)
    eng = HFEngine(model=model, tokenizer=tok)
    initial = perturbed_from(model.state_dict(), 0)
    state = {"version": 0}
    b = RequestBatcher(eng, chunk_tokens=4, version_fn=lambda: state["version"], partial_rollout=mode,
                       record_rounds=True)
    loop = asyncio.get_running_loop()
    late = asyncio.Event()
    calls = {"n": 0}
    updates: list[Any] = []

    async def update() -> None:
        async with b.paused():
            eng.load_weights(perturbed_from(initial, state["version"] + 1).items())
            state["version"] += 1

    def hook(module: Any, args: Any, output: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            loop.call_soon_threadsafe(late.set)  # the last two requests join whichever round is next
        if calls["n"] in (3, 11):  # updates mid-round, held until their pause is requested
            updates.append(asyncio.run_coroutine_threadsafe(update(), loop))
            assert b._interrupt.wait(30)

    handle = model.register_forward_hook(hook)
    reqs = requests(tok)
    try:
        first = [asyncio.ensure_future(b.generate(p, q, key=k)) for k, p, q in reqs[:2]]
        await late.wait()
        rest = [asyncio.ensure_future(b.generate(p, q, key=k)) for k, p, q in reqs[2:]]
        gens = await asyncio.gather(*first, *rest)
        for f in updates:
            await asyncio.wrap_future(f)
    finally:
        handle.remove()
        await b.aclose()
    log = json.loads(json.dumps([r.to_dict() for r in b.round_log()]))
    return gens, log, state["version"]


async def replay(model_config, mode: str, log: list[dict[str, Any]], updates: int,
                 version_fn: Any = None) -> list[Any]:
    model, tok = load_model(model_config)
    eng = HFEngine(model=model, tokenizer=tok)
    initial = perturbed_from(model.state_dict(), 0)
    state = {"version": 0}
    b = ReplayBatcher(eng, [RoundRecord.from_dict(d) for d in log], chunk_tokens=4, partial_rollout=mode,
                      version_fn=version_fn or (lambda: state["version"]))

    async def updater() -> None:  # the same updates in order, no timing: each lands where the log says
        for v in range(1, updates + 1):
            async with b.paused():
                eng.load_weights(perturbed_from(initial, v).items())
                state["version"] = v

    try:
        up = asyncio.ensure_future(updater())
        gens = await asyncio.gather(*[b.generate(p, q, key=k) for k, p, q in reversed(requests(tok))],
                                    return_exceptions=version_fn is not None)
        if version_fn is None:
            await up
        else:
            up.cancel()
    finally:
        await b.aclose()
    return list(reversed(gens))


@pytest.mark.parametrize("mode", ["recompute", "keep"])
async def test_a_replay_of_the_round_log_regenerates_a_timing_dependent_run_bit_for_bit(model_config, mode):
    gens, log, updates = await record(model_config, mode)
    assert updates == 2 and any(len(set(g.versions)) > 1 for g in gens)
    if mode == "keep":
        assert any(len(r["segments"]) > 1 for r in log)  # a round parked by an update and resumed
    again = await replay(model_config, mode, log, updates)
    for g, h in zip(gens, again):
        assert h.response_ids == g.response_ids
        assert h.log_probs == g.log_probs  # bit for bit, not within a tolerance
        assert h.versions == g.versions and h.finish_reason == g.finish_reason


async def test_a_replay_refuses_unknown_keys_and_weights_ahead_of_the_log(model_config):
    gens, log, updates = await record(model_config, "recompute")
    model, tok = load_model(model_config)
    b = ReplayBatcher(HFEngine(model=model, tokenizer=tok), [RoundRecord.from_dict(d) for d in log], chunk_tokens=4)
    with pytest.raises(ValueError, match="request key 'nope' is not in the replayed round log"):
        await b.generate(tok.encode("x"), SamplingParams(max_new_tokens=2), key="nope")
    await b.aclose()
    ahead = await replay(model_config, "recompute", log, updates, version_fn=lambda: 5)
    assert all(isinstance(g, ReplayDivergedError) for g in ahead)
    assert "ran under version 0 but the weights are at version 5" in str(ahead[0])


async def test_a_rollout_worker_records_its_rounds_and_a_fresh_one_replays_them(model_config):
    from asyncrl.roles import RolloutConfig, RolloutWorker

    def worker() -> RolloutWorker:
        return RolloutWorker(model_config, RolloutConfig(partial_rollout="recompute", chunk_tokens=4,
                                                         record_rounds=True))

    first = worker()
    tok, reqs = first.tokenizer, requests(first.tokenizer)
    initial = perturbed_from(first.model.state_dict(), 0)
    submit = first._request_engine()
    calls = {"n": 0}
    loop = asyncio.get_running_loop()
    started: list[Any] = []

    def hook(module: Any, args: Any, output: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            started.append(asyncio.run_coroutine_threadsafe(first.update_weights((1, perturbed_from(initial, 1))), loop))
            assert first.requests._batcher._interrupt.wait(30)

    handle = first.model.register_forward_hook(hook)
    try:
        gens = await asyncio.gather(*[submit(p, q, key=k) for k, p, q in reqs])
        await asyncio.wrap_future(started[0])
    finally:
        handle.remove()
        await first.requests._batcher.aclose()
    log = json.loads(json.dumps(first.round_log(clear=True)))
    assert first.round_log() == [] and len(log) >= 2

    second = worker()
    assert second.replay_rounds(log) == len(log)
    replay_submit = second._request_engine()

    async def update() -> None:  # the replaying batcher holds its pause until the log needs version 1
        await second.update_weights((1, perturbed_from(initial, 1)))

    try:
        up = asyncio.ensure_future(update())
        again = list(reversed(await asyncio.gather(*[replay_submit(p, q, key=k) for k, p, q in reversed(reqs)])))
        await up
    finally:
        await second.requests._batcher.aclose()
    assert [(g.response_ids, g.log_probs, g.versions) for g in gens] == \
        [(g.response_ids, g.log_probs, g.versions) for g in again]
    with pytest.raises(RuntimeError, match="replay_rounds must come before any request-level generation"):
        second.replay_rounds(log)


async def test_a_replay_holds_unknown_requests_and_its_held_update_is_not_past_the_pause_deadline(model_config):
    """What a trainer's replay needs: a request no recorded round ran (in flight when the recording ended) is
    held, never decoded, while the recorded ones finish; an update held until the rounds need it does not
    count against the pause deadline (which covers only the engine reaching its pause)."""
    gens, log, updates = await record(model_config, "recompute")
    model, tok = load_model(model_config)
    eng = HFEngine(model=model, tokenizer=tok)
    initial = perturbed_from(model.state_dict(), 0)
    state = {"version": 0}
    b = ReplayBatcher(eng, [RoundRecord.from_dict(d) for d in log], chunk_tokens=4, partial_rollout="recompute",
                      version_fn=lambda: state["version"], hold_unknown=True)

    async def updater() -> None:
        for v in range(1, updates + 1):
            async with b.paused(deadline_s=1e-3):  # held far longer than this until the rounds need version v
                eng.load_weights(perturbed_from(initial, v).items())
                state["version"] = v

    try:
        up = asyncio.ensure_future(updater())
        deadline = time.monotonic() + 30  # the first update waits at its hold: the rounds have not started
        while not (b._grants is not None and b._grants._waiters):
            assert time.monotonic() < deadline, "the update never reached its hold"
            await asyncio.sleep(0)
        held = asyncio.ensure_future(b.generate(tok.encode("held"), SamplingParams(max_new_tokens=3, seed=1),
                                                key="not-recorded"))
        again = await asyncio.gather(*[b.generate(p, q, key=k) for k, p, q in requests(tok)])
        await up
        assert not held.done()  # never decoded
    finally:
        await b.aclose()
    with pytest.raises(asyncio.CancelledError):  # closing the batcher cancels it
        await held
    assert [(g.response_ids, g.log_probs, g.versions) for g in again] == \
        [(g.response_ids, g.log_probs, g.versions) for g in gens]
