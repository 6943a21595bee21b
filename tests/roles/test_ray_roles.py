"""Roles across processes on real local Ray: generation, pipelined log-probs, versioned weight sync."""

from __future__ import annotations

import pytest
import torch

import asyncrl
from asyncrl.roles import (
    OptimConfig,
    PolicyWorker,
    PromptTooLongError,
    RolloutConfig,
    RolloutWorker,
    StaleWeightsError,
    sync_weights,
)
from asyncrl.roles.functional import grpo_advantages


@pytest.fixture(scope="module")
async def groups(ray_cluster, model_config):
    policy = asyncrl.RayWorkerGroup(PolicyWorker, world_size=1, name="policy",
                                    kwargs={"model": model_config, "optim": OptimConfig(lr=1e-2, micro_batch_size=4)})
    rollout = asyncrl.RayWorkerGroup(RolloutWorker, world_size=1, name="rollout",
                                     kwargs={"model": model_config, "rollout": RolloutConfig(max_new_tokens=6)})
    async with policy, rollout:
        yield policy, rollout


async def _train_once(policy, rollout, batch):
    out = rollout.generate(batch)
    lp = policy.compute_log_prob(out)
    b = (await out).clone(False)
    b.update(await lp)
    b["scores"] = (b["response_ids"][:, 0] % 2).float()  # any deterministic reward will do
    b["advantages"] = grpo_advantages(b["scores"], b["uid"], b["response_mask"])
    return await policy.update(b)


async def test_generate_and_pipelined_log_probs_agree_across_processes(groups, prompt_batch):
    policy, rollout = groups
    batch = prompt_batch("mixed", n=4, repeat=2)
    out = rollout.generate(batch)
    lp = await policy.compute_log_prob(out)  # the rollout's shard flows worker to worker
    gen = await out
    assert gen["response_ids"].shape == (8, 6) and gen["version"].tolist() == [0] * 8
    assert (lp["old_log_probs"] - gen["rollout_log_probs"]).abs().max().item() < 1e-5


async def test_weight_sync_is_versioned_and_checksums_match(groups, prompt_batch):
    policy, rollout = groups
    before = (await rollout.weights_checksum())[0]
    assert before == await policy.weights_checksum()  # same config and seed: version 0 matches
    metrics = await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
    assert metrics[0]["version"] == 1.0
    fetched = policy.stats.bytes_fetched
    (result,) = await rollout.update_weights(policy.export_weights())  # future passed straight in
    assert policy.stats.bytes_fetched == fetched  # the controller never held the weights
    assert result["version"] == 1 and await rollout.get_version() == [1]
    assert (await rollout.weights_checksum())[0] == await policy.weights_checksum() != before
    gen = await rollout.generate(prompt_batch(n=2))
    assert gen["version"].tolist() == [1, 1]

    with pytest.raises(asyncrl.RemoteError) as info:  # the same version again: out of order
        await rollout.update_weights(policy.export_weights())
    assert isinstance(info.value.cause, StaleWeightsError) and "already has version 1" in str(info.value)
    assert await rollout.get_version() == [1]

    await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
    assert await sync_weights(policy, rollout, verify=True) == 2
    assert (await rollout.weights_checksum())[0] == await policy.weights_checksum()


async def test_an_object_store_stage_is_a_snapshot_put_by_the_policy_itself(groups, prompt_batch):
    """stage_weights("object_store") puts the weights into the store inside its ordered call: training
    right after it does not change what the rollout loads, and a stale handle is refused."""
    from asyncrl.roles import WeightHandle

    policy, rollout = groups
    await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
    version, staged_sums = await policy.get_version(), await policy.weights_checksum()
    handle = policy.stage_weights("object_store")
    await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))  # issued after it: the live weights change
    assert await policy.weights_checksum() != staged_sums
    got = await handle
    assert isinstance(got, WeightHandle) and got.version == version and type(got.stored).__name__ == "ObjectRef"
    fetched = policy.stats.bytes_fetched + rollout.stats.bytes_fetched
    (receipt,) = await rollout.update_weights(handle)
    assert policy.stats.bytes_fetched + rollout.stats.bytes_fetched == fetched  # not through the controller
    assert receipt["version"] == version and (await rollout.weights_checksum())[0] == staged_sums
    with pytest.raises(asyncrl.RemoteError) as info:  # the same version again
        await rollout.update_weights(handle)
    assert isinstance(info.value.cause, StaleWeightsError)
    assert await sync_weights(policy, rollout, verify=True) == version + 1  # sync_weights stages the same way


async def test_too_long_prompt_fails_the_call_with_a_typed_cause(groups, prompt_batch):
    _, rollout = groups
    batch = prompt_batch("echo_word", n=2)
    batch["prompt_ids"] = torch.ones(2, 510, dtype=torch.long) * 5
    batch["prompt_mask"] = torch.ones(2, 510, dtype=torch.long)
    with pytest.raises(asyncrl.RemoteError) as info:
        await rollout.generate(batch)
    assert isinstance(info.value.cause, PromptTooLongError)


async def test_submit_and_poll_stream_rows_as_they_finish(groups, prompt_batch):
    _, rollout = groups
    batch = prompt_batch(n=3, repeat=2)
    assert await rollout.submit(batch, "req-1") == [6]
    seen: list[int] = []
    done = False
    while not done:
        (part,) = await rollout.poll("req-1")
        if part["rows"] is not None:
            assert part["rows"]["response_ids"].shape[1] == 6
            seen += part["rows"]["index"].tolist()
        done = part["done"]
    assert sorted(seen) == list(range(6))
