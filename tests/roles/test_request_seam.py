"""The one generation seam (``RequestGeneration._run_rows``): plain requests, episodes and gateway sessions are
row programs over the same request-level engine, so ``generate_requests`` (the streaming trainer's call)
runs a configured episode with partial rollout across its turns and per-token versions.

In process, with the update forced at an exact decode step (tests/forward_hooks.py), so nothing races:
a weight update that lands in an episode's second turn pauses and resumes that turn; the trained ids are
the ids the engine sampled, turn by turn, and each token's behaviour log-prob is true for its version."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from asyncrl.roles import RolloutConfig, RolloutWorker
from asyncrl.roles.agentic.episodes import LLM, Sample, Trajectory, register_episode

from tests.forward_hooks import update_at_forwards
from tests.roles.test_partial_rollout import perturbed, teacher_forced

OBS = " again:"


@register_episode("seam_two_turns")
async def two_turns(llm: LLM, sample: Sample) -> Trajectory:
    traj = llm.start(sample)
    await llm.generate(traj, max_new_tokens=4)
    traj.observe(llm.encode(OBS))
    await llm.generate(traj, max_new_tokens=6)
    return traj


PAUSED: dict[str, asyncio.Event] = {}


@register_episode("seam_waits_between_turns")
async def waits_between_turns(llm: LLM, sample: Sample) -> Trajectory:
    traj = llm.start(sample)
    await llm.generate(traj, max_new_tokens=2)
    PAUSED["between"].set()
    await asyncio.Event().wait()  # only a cancellation ends it
    return traj


class RecordingRollout(RolloutWorker):
    """A rollout worker that keeps every ``(key, prompt ids, Generation)`` its request engine returned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampled: list[tuple[str | None, list[int], Any]] = []

    def _request_engine(self) -> Any:
        submit = super()._request_engine()

        async def recorded(ids: list[int], params: Any, key: str | None = None) -> Any:
            gen = await submit(ids, params, key=key)
            self.sampled.append((key, list(ids), gen))
            return gen

        return recorded


@pytest.mark.parametrize("mode", ["recompute", "keep"])
async def test_an_update_in_an_episodes_second_turn_pauses_that_turn_and_keeps_the_token_truth(
        model_config, prompt_batch, mode):
    R = 20
    rollout = RecordingRollout(model_config, RolloutConfig(max_new_tokens=R, episode="seam_two_turns",
                                                           partial_rollout=mode, temperature=1.0))
    rollout._request_engine()  # builds the batcher (its pause event is the hook's signal)
    initial = perturbed(rollout.model, 0)
    new = perturbed(rollout.model, 1)
    receipts: list[dict[str, Any]] = []

    async def update() -> None:
        receipts.append(await rollout.update_weights((1, new)))

    # one row: forwards 1-4 decode turn 1 (prefill + 3 steps), forward 5 prefills turn 2; the update
    # arrives in forward 7, so turn 2's first three tokens are version 0 and the next three version 1
    hook, started = update_at_forwards(rollout.model, {7: update}, rollout.requests._batcher._interrupt)
    batch = prompt_batch(n=1)
    try:
        out = await rollout.generate_requests(batch, seed=5)
        await asyncio.wrap_future(started[0])
    finally:
        hook.remove()
        await rollout.requests._batcher.aclose()
    obs = rollout.tokenizer.encode(OBS, add_special_tokens=False)
    n = 10 + len(obs)
    assert receipts[0]["version"] == 1 and receipts[0]["waited"] == 0  # it reached the episode, never waited
    assert out["response_mask"][0].tolist() == [1] * 4 + [0] * len(obs) + [1] * 6 + [0] * (R - n)
    assert out["attention_mask"][0, -R:].tolist() == [1] * n + [0] * (R - n)
    assert out["token_versions"][0].tolist() == [0] * 4 + [-1] * len(obs) + [0, 0, 0, 1, 1, 1] + [-1] * (R - n)
    assert out["version"].tolist() == [0] and out["num_turns"].tolist() == [2] and out["stop_reason"] == ["stop"]
    # token truth: the trained ids are the engine's sampled ids, each turn's request continued the row's ids
    (k1, p1, g1), (k2, p2, g2) = rollout.sampled
    prompt = batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist()
    assert (k1, k2) == ("5:0", "5:0/1")  # the round log's names of the row's two turns
    assert p1 == prompt and p2 == prompt + g1.response_ids + obs
    ids = out["response_ids"][0, :n].tolist()
    assert ids == g1.response_ids + obs + g2.response_ids
    m = out["response_mask"][0].bool()
    assert out["rollout_log_probs"][0][m].tolist() == g1.log_probs + g2.log_probs
    assert g2.versions == [0, 0, 0, 1, 1, 1]
    lp = {v: teacher_forced(rollout.model, w, prompt, ids, 1.0) for v, w in ((0, initial), (1, new))}
    versions = out["token_versions"][0, :n]
    got = out["rollout_log_probs"][0, :n].double()
    if mode == "recompute":  # each token's behaviour log-prob is its version's, across the turn boundary
        for v in (0, 1):
            sel = versions == v
            torch.testing.assert_close(got[sel], lp[v][sel], atol=1e-5, rtol=0)
    else:  # keep: tokens before the swap are version 0's; after it, the new weights on the old cache
        sel = versions == 0
        torch.testing.assert_close(got[sel], lp[0][sel], atol=1e-5, rtol=0)
        assert not torch.allclose(got[versions == 1], lp[1][versions == 1], atol=1e-3)
    stats = rollout.statistics()
    assert stats["trajectories"] == 1 and stats["spanning_trajectories"] == 1


async def test_a_plain_request_keeps_the_generate_layout_and_counts_no_episode(model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=6))
    out = await rollout.generate_requests(prompt_batch(n=2), seed=1)
    assert not {"num_turns", "stop_reason", "episode_reward", "tool_errors"} & set(out.keys())
    assert rollout.statistics()["trajectories"] == 0
    m = out["response_mask"].bool()
    assert (out["token_versions"][m] == 0).all() and (out["token_versions"][~m] == -1).all()


async def test_cancelling_a_call_mid_episode_drops_its_rows_and_the_next_update_waits_for_nothing(
        model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=8, episode="seam_waits_between_turns"))
    PAUSED["between"] = asyncio.Event()
    call = asyncio.ensure_future(rollout.generate_requests(prompt_batch(n=2), seed=0))
    await PAUSED["between"].wait()
    assert len(rollout.requests._episode_tasks) == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert rollout.requests._episode_tasks == set()
    receipt = await rollout.update_weights((1, perturbed(rollout.model, 1)))
    assert receipt["version"] == 1 and receipt["waited"] == 0
