"""The HF engine adopts the weights a sync brings as its parameters (no load copy), for every transport.

* ``local`` (in-process snapshot) and ``collective`` (a channel's receive buffers): after a sync the
  engine's parameter storage IS the received tensors' storage (``object_store``, on real Ray: in
  test_weight_transports.py, beside the other Ray groups);
* the next sync never writes into the memory the engine holds: the snapshot pool skips it, the channel
  receives into its other buffer set (double buffering), the store keeps the adopted object pinned;
* a refused adoption leaves the old weights whole; a later copying load never writes into adopted
  tensors; tied weights stay tied; sleep/wake round-trips.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from asyncrl.roles import (
    OptimConfig,
    PolicyWorker,
    RolloutConfig,
    RolloutWorker,
    SamplingParams,
    WeightHandle,
    WeightSyncError,
)
from asyncrl.roles.modeling.models import state_dict_checksums
from asyncrl.roles.weights.transfer import SNAPSHOTS
from asyncrl.roles.weights.weight_channel import layout_of

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def _ptrs(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: t.untyped_storage().data_ptr() for k, t in state.items()}


def _engine_ptrs(rollout: RolloutWorker) -> dict[str, int]:
    return _ptrs(rollout.model.state_dict())


def _shifted(base: dict[str, torch.Tensor], v: float) -> dict[str, torch.Tensor]:
    return {k: t + v if t.is_floating_point() else t.clone() for k, t in base.items()}


@pytest.fixture
def tied(model_config):
    return dataclasses.replace(model_config, tie_word_embeddings=True)


def _stage(policy: PolicyWorker, keep: int = 4) -> tuple[WeightHandle, dict[str, torch.Tensor]]:
    with torch.no_grad():
        policy.model.lm_head.weight.add_(0.5)
    policy._version += 1
    h = policy.stage_weights("local", keep=keep)
    return h, SNAPSHOTS.get(h.owner, h.version)


async def test_a_local_sync_makes_the_snapshot_the_engines_parameters_and_keeps_ties(tied):
    policy = PolicyWorker(tied, OptimConfig(lr=0.1))
    rollout = RolloutWorker(tied, RolloutConfig(max_new_tokens=6))
    h1, snap = _stage(policy)
    await rollout.update_weights(h1)
    assert _engine_ptrs(rollout) == _ptrs(snap)  # every parameter and buffer: the snapshot's memory
    m = rollout.model
    assert m.lm_head.weight is m.model.embed_tokens.weight  # still one parameter
    assert m.lm_head.weight.untyped_storage().data_ptr() == snap["model.embed_tokens.weight"].untyped_storage().data_ptr()
    assert rollout.weights_checksum() == state_dict_checksums(snap.items())
    prompt = rollout.tokenizer.encode("say hello")
    policy.model.eval()
    ref = policy.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                pad_token_id=rollout.engine.pad_id)[0, len(prompt):].tolist()
    got = (await rollout.engine.generate([prompt], GREEDY))[0].response_ids
    assert got == ref[:len(got)] and len(got) > 0  # the policy's weights generate, through the tied head
    policy.close_weight_channel()


async def test_the_snapshot_pool_never_writes_over_the_set_the_engine_holds(model_config):
    """keep=1 retires a version as soon as the next is staged; the one the engine adopted is skipped by the
    pool (its tensors are referenced) until the engine adopts another."""
    policy = PolicyWorker(model_config, OptimConfig(lr=0.1))
    rollout = RolloutWorker(model_config, RolloutConfig())
    h1, s1 = _stage(policy, keep=1)
    p1, sums1 = _ptrs(s1), state_dict_checksums(s1.items())
    await rollout.update_weights(h1)
    _, s2 = _stage(policy, keep=1)  # version 1 retired, still the engine's
    h3, s3 = _stage(policy, keep=1)  # version 2 retired; version 1 still the engine's: not reused
    assert set(_ptrs(s3).values()).isdisjoint(p1.values())
    assert _engine_ptrs(rollout) == p1 and rollout.weights_checksum() == sums1  # untouched
    del s1, s2, s3
    await rollout.update_weights(h3)  # the engine lets version 1 go
    _, s4 = _stage(policy, keep=1)
    assert _ptrs(s4) == p1  # reusable again
    policy.close_weight_channel()


async def test_a_refused_adoption_leaves_the_old_weights_whole_and_generating(model_config):
    rollout = RolloutWorker(model_config, RolloutConfig())
    eng = rollout.engine
    base = {k: v.detach().clone() for k, v in rollout.model.state_dict().items()}
    one = _shifted(base, 0.01)
    eng.adopt_weights(one.items())
    prompt = rollout.tokenizer.encode("say hello")
    before = (await eng.generate([prompt], GREEDY))[0].response_ids
    ptrs, sums = _engine_ptrs(rollout), state_dict_checksums(one.items())
    last = list(base)[-1]
    bad_shape = dict(_shifted(base, 0.02), **{last: torch.zeros(3)})
    with pytest.raises(WeightSyncError, match=f"weight '{last}': expected shape"):
        eng.adopt_weights(bad_shape.items())
    missing = _shifted(base, 0.02)
    missing.pop(last)
    with pytest.raises(WeightSyncError, match="missing"):
        eng.adopt_weights(missing.items())
    assert _engine_ptrs(rollout) == ptrs and rollout.weights_checksum() == sums and not eng.needs_weights
    assert (await eng.generate([prompt], GREEDY))[0].response_ids == before


def test_a_copying_load_after_an_adoption_never_writes_into_the_adopted_tensors(model_config):
    rollout = RolloutWorker(model_config, RolloutConfig())
    eng = rollout.engine
    base = {k: v.detach().clone() for k, v in rollout.model.state_dict().items()}
    one, two = _shifted(base, 0.01), _shifted(base, 0.02)
    kept = {k: t.clone() for k, t in one.items()}
    eng.adopt_weights(one.items())
    assert eng.adopted is not None
    eng.load_weights(two.items())
    assert all(torch.equal(one[k], kept[k]) for k in one)  # version 1's memory unchanged
    assert set(_engine_ptrs(rollout).values()).isdisjoint(_ptrs(one).values()) and eng.adopted is None
    assert rollout.weights_checksum() == state_dict_checksums(two.items())


async def test_sleep_and_wake_round_trip_adopted_weights(model_config):
    policy = PolicyWorker(model_config, OptimConfig(lr=0.1))
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=6))
    h1, snap = _stage(policy)
    await rollout.update_weights(h1)
    prompt = rollout.tokenizer.encode("say hello")
    before = (await rollout.engine.generate([prompt], GREEDY))[0].response_ids
    sums = rollout.weights_checksum()
    await rollout.sleep(1)  # on the CPU level 1 keeps the weights where they are
    await rollout.wake_up()
    assert _engine_ptrs(rollout) == _ptrs(snap) and rollout.weights_checksum() == sums
    await rollout.sleep(2)  # discards: the adopted tensors are let go
    assert rollout.engine.adopted is None
    assert await rollout.wake_up() == {"needs_weights": True, "version": 1}
    await rollout.update_weights(h1)  # the same version restores them
    assert _engine_ptrs(rollout) == _ptrs(snap) and rollout.weights_checksum() == sums
    assert (await rollout.engine.generate([prompt], GREEDY))[0].response_ids == before
    policy.close_weight_channel()


async def test_collective_receives_into_the_other_buffer_set_never_the_engines(model_config, channel_sender):
    rollout = RolloutWorker(model_config, RolloutConfig())
    root = await channel_sender(rollout, "a")
    layout = layout_of(rollout.weight_spec())
    base = {k: v.detach().clone() for k, v in rollout.model.state_dict().items()}
    states = {v: _shifted(base, 0.01 * v) for v in (1, 2, 3)}

    async def sync(v):
        handle = WeightHandle(version=v, transport="collective", owner="test", pid=os.getpid(), channel="a",
                              num_tensors=len(layout), nbytes=0)
        got, sent = await asyncio.gather(rollout.update_weights(handle),
                                         asyncio.to_thread(root.send, v, states[v], layout))
        assert sent["sent"] and got["version"] == v
        return dict(rollout.model.state_dict())

    first = await sync(1)
    assert _ptrs(first) == _ptrs(rollout.engine.adopted)  # the receive buffers are the parameters
    second = await sync(2)
    assert set(_ptrs(second).values()).isdisjoint(_ptrs(first).values())
    assert state_dict_checksums(first.items()) == state_dict_checksums(states[1].items())  # not written over
    third = await sync(3)
    assert _ptrs(third) == _ptrs(first)  # the free set again: two sets, not one per sync
    assert rollout.weights_checksum() == state_dict_checksums(states[3].items())
    root.close()
    rollout.weights.close()


async def test_a_tied_weight_crosses_the_channel_once_and_stays_tied(tied, channel_sender):
    rollout = RolloutWorker(tied, RolloutConfig())
    assert rollout.tied_weights() == {"lm_head.weight": "model.embed_tokens.weight"}
    root = await channel_sender(rollout, "t")
    base = {k: v.detach().clone() for k, v in rollout.model.state_dict().items()}
    state = _shifted(base, 0.01)
    layout = [e for e in layout_of(state) if e[0] != "lm_head.weight"]  # what open_weight_channel gives the policy
    handle = WeightHandle(version=1, transport="collective", owner="test", pid=os.getpid(), channel="t",
                          num_tensors=len(layout), nbytes=0)
    _, sent = await asyncio.gather(rollout.update_weights(handle), asyncio.to_thread(root.send, 1, state, layout))
    once = sum(t.numel() * t.element_size() for k, t in state.items() if k != "lm_head.weight")
    assert sent["bytes"] == once
    m = rollout.model
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert torch.equal(m.lm_head.weight, state["model.embed_tokens.weight"])
    assert rollout.weights_checksum() == state_dict_checksums(
        dict(state, **{"lm_head.weight": state["model.embed_tokens.weight"]}).items())
    root.close()
    rollout.weights.close()


async def test_a_replaced_parameter_is_staged_and_adopted_not_a_cached_old_one(tied):
    """The policy and the engine map names to parameters once (``StateSlots``: walking the modules costs a
    tenth of a sync); a parameter replaced since (``module.weight = ...``) is still what a sync sends and
    what an adoption swaps, and ties are kept."""
    from asyncrl.roles.modeling.models import StateSlots

    policy = PolicyWorker(tied, OptimConfig(lr=0.1))
    rollout = RolloutWorker(tied, RolloutConfig(max_new_tokens=6))
    slots = StateSlots(policy.model)
    sd = policy.model.state_dict()
    assert list(slots.state()) == list(sd) and _ptrs(slots.state()) == _ptrs(sd)
    assert slots()["lm_head.weight"] is slots()["model.embed_tokens.weight"]  # tied: one parameter
    first = slots()
    assert slots() is first  # built once
    h1, _ = _stage(policy)
    await rollout.update_weights(h1)
    old = policy.model.model.layers[0].mlp.up_proj.weight
    policy.model.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(torch.full_like(old, 0.25))
    assert slots()["model.layers.0.mlp.up_proj.weight"] is policy.model.model.layers[0].mlp.up_proj.weight
    h2, snap = _stage(policy)  # the policy's own slots were built at h1, before the replacement
    assert bool((snap["model.layers.0.mlp.up_proj.weight"] == 0.25).all())
    m = rollout.model
    kept = m.model.layers[0].mlp.up_proj.weight
    m.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(kept.detach().clone())  # the engine's slot, replaced
    await rollout.update_weights(h2)
    assert bool((m.model.layers[0].mlp.up_proj.weight == 0.25).all())
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert rollout.weights_checksum() == state_dict_checksums(snap.items())
    policy.close_weight_channel()
