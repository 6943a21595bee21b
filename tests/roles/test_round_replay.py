"""Exact replay of the request batcher's rounds (issue 29 item 6, the engine side): a run whose rounds
depend on timing -- requests joining at round boundaries, weight updates interrupting rounds mid-way --
is recorded (`record_rounds=True`) and regenerated bit for bit by `ReplayBatcher` from the JSON log, with
the requests submitted in another order and the updates issued without any timing of their own."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch

from asyncrl.roles import load_model
from asyncrl.roles.engines import SamplingParams
from asyncrl.roles.engines.batcher import RequestBatcher
from asyncrl.roles.engines.hf import HFEngine
from asyncrl.roles.engines.round_log import ReplayBatcher, ReplayDivergedError, RoundRecord

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
