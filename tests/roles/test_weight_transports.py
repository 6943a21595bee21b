"""Weight sync by the transport that fits the placement, on real local Ray (CPU, gloo).

* ``collective``: a process group of policy rank 0 + two rollout ranks in separate
  processes; the rollout side ends bit-identical to the policy; stale and mismatched
  versions are refused before a byte moves and the channel stays usable; a rank that dies
  mid-transfer ends the transfer on every member with a typed error (bounded by the
  channel's timeout), the survivors keep their previous weights, and the broken channel
  refuses further use until reopened.
* ``local``: policy and rollout colocated in one process hand a snapshot over in-process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import sys
import time
from typing import Any

import pytest
import ray
import torch

import asyncrl
from asyncrl import Dispatch, Execute, register
from asyncrl.roles import (
    ModelConfig,
    OptimConfig,
    PolicyWorker,
    RolloutConfig,
    RolloutWorker,
    StaleWeightsError,
    WeightHandle,
    WeightsLostError,
    WeightSyncError,
    open_weight_channel,
    sync_weights,
)
from asyncrl.roles.functional import grpo_advantages
from asyncrl.roles.modeling.models import state_dict_checksums
from asyncrl.pipelines.supervision.recovery import fault_origin, is_worker_fault


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test-only worker subclasses

TIMEOUT = 15.0  # the channel's deadline in these tests: every failure ends within it


class Policy(PolicyWorker):
    """The policy plus its exact weight bytes, to compare bit for bit."""

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def raw_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


class Rollout(RolloutWorker):
    received: dict[str, torch.Tensor] | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        resolve = self.weights.resolve

        async def recording(weights, version):
            v, state = await resolve(weights, version)
            self.received = state  # what the transport brought (object_store: views of Ray's store)
            return v, state

        self.weights.resolve = recording  # (RolloutWeights.update resolves through it)

    @register(Dispatch.ONE_TO_ALL)
    def raw_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @register(Dispatch.ONE_TO_ALL)
    def adopted_received(self) -> bool:
        """Whether every weight's storage is that of the tensors the last sync brought (released after)."""
        def ptrs(sd):
            return {k: t.untyped_storage().data_ptr() for k, t in sd.items()}

        same = self.received is not None and ptrs(self.received) == ptrs(self.model.state_dict())
        self.received = None
        return same


def _die(what: str) -> None:
    os._exit(1)


class DyingRollout(Rollout):
    """Rollout rank 1 dies after the first bucket of a transfer it receives; rank 0 writes down
    how its receive ended (its group cannot be called once a rank died)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.rank == 1:
            self.weights.on_bucket_received = _die
        receive = self.weights._receive

        async def reporting(handle):
            try:
                return await receive(handle)
            except Exception as e:
                if self.rank == 0:
                    with open(os.environ["SURVIVOR_LOG"], "w") as f:
                        json.dump({"error": type(e).__name__, "message": str(e), "version": self.version,
                                   "checksums": self.engine.weights_checksum()}, f)
                raise

        self.weights._receive = reporting  # (RolloutWeights.resolve receives a collective handle through it)


class DyingPolicy(Policy):
    """The policy dies after sending the first bucket of a transfer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.weights.on_bucket_sent = _die


    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def jump_to_version(self, version: int) -> None:
        self._version = version  # ahead of the rollout that earlier tests advanced

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def exit_now(self) -> None:
        os._exit(1)  # its process and every object it owns are gone, as when its node is lost


def _groups(model_config, policy_cls=Policy, rollout_cls=Rollout, name="wt", env=None):
    policy = asyncrl.RayWorkerGroup(policy_cls, world_size=1, name=f"{name}-policy",
                                    kwargs={"model": model_config, "optim": OptimConfig(lr=1e-2, micro_batch_size=4)})
    rollout = asyncrl.RayWorkerGroup(rollout_cls, world_size=2, name=f"{name}-rollout", env=env,
                                     kwargs={"model": model_config, "rollout": RolloutConfig(max_new_tokens=5)})
    return policy, rollout


async def _train_once(policy, rollout, batch):
    out = rollout.generate(batch)
    lp = policy.compute_log_prob(out)
    b = (await out).clone(False)
    b.update(await lp)
    b["scores"] = (b["response_ids"][:, 0] % 2).float()
    b["advantages"] = grpo_advantages(b["scores"], b["uid"], b["response_mask"])
    return await policy.update(b)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == b[k].dtype and x.shape == b[k].shape and torch.equal(x.view(torch.uint8), b[k].view(torch.uint8))
        for k, x in a.items())


# ---------------------------------------------------------------- the channel itself (threads of this process)


def _channels(n: int, timeout_s: float, bucket_bytes: int = 1 << 20):
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.roles.weights.weight_channel import WeightChannel, free_port

    port = free_port()
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(lambda r: WeightChannel("t", "127.0.0.1", port, r, n, backend="gloo",
                                                   device=torch.device("cpu"), timeout_s=timeout_s,
                                                   bucket_bytes=bucket_bytes), range(n)))


def test_channel_moves_mixed_dtypes_bit_exactly_across_unaligned_bucket_offsets():
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.roles.weights.weight_channel import OK, layout_of

    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: what follows is unaligned
             "b": torch.randn(5, 7, generator=g), "c": torch.arange(3, dtype=torch.int64),
             "d": torch.randn(1, generator=g).to(torch.float16)}
    layout = layout_of(state)
    chans = _channels(3, timeout_s=30, bucket_bytes=64)
    with ThreadPoolExecutor(3) as ex:
        sent = ex.submit(chans[0].send, 7, state, layout)
        got = [ex.submit(c.receive, 7, layout, lambda v: OK, torch.device("cpu")) for c in chans[1:]]
        assert sent.result(timeout=60) == {"version": 7, "sent": True, "codes": [0, 0, 0], "bytes": 6 + 140 + 24 + 2}
        for f in got:
            assert _same_bits(f.result(timeout=60), state)
    for c in chans:
        c.close()


def test_receive_buffers_are_reused_across_transfers_except_those_a_rollback_keeps():
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.roles.weights.weight_channel import OK, layout_of

    versions = {v: {"a": torch.full((5, 7), float(v)), "b": torch.arange(3, dtype=torch.int64) + v} for v in (1, 2, 3, 4)}
    layout = layout_of(versions[1])
    chans = _channels(2, timeout_s=30, bucket_bytes=64)  # two buckets

    def move(v, keep=()):
        with ThreadPoolExecutor(2) as ex:
            sent = ex.submit(chans[0].send, v, versions[v], layout)
            got = ex.submit(chans[1].receive, v, layout, lambda _: OK, torch.device("cpu"), None, keep)
            assert sent.result(timeout=60)["sent"]
            return got.result(timeout=60)

    def ptrs(state):
        return [t.untyped_storage().data_ptr() for t in state.values()]

    first = move(1)
    assert _same_bits(first, versions[1])
    second = move(2)  # nothing kept: the same buffers, overwritten with version 2
    assert ptrs(second) == ptrs(first) and _same_bits(second, versions[2])
    kept = {k: t for k, t in second.items()}
    third = move(3, keep=kept.values())  # version 2 is a rollback point: a second set takes version 3
    assert set(ptrs(third)).isdisjoint(ptrs(kept)) and _same_bits(third, versions[3])
    assert _same_bits(kept, versions[2])  # untouched
    fourth = move(4, keep=third.values())  # version 3 kept now: back to the first set, no third one made
    assert ptrs(fourth) == ptrs(first) and _same_bits(fourth, versions[4]) and _same_bits(third, versions[3])
    for c in chans:
        c.close()


async def test_a_verified_rollout_rolls_back_to_weights_it_received_over_the_channel(model_config, channel_sender):
    """The rollback point of a verified rollout (version 1, received over the channel) lives in the
    channel's receive buffers: the next receive must not write over it."""
    import asyncio

    from asyncrl.roles.weights.weight_channel import layout_of

    rollout = RolloutWorker(model_config, RolloutConfig(verify_checksums=True))
    root = await channel_sender(rollout, "v")
    layout = layout_of(rollout.weight_spec())
    base = {k: v.detach().clone() for k, v in rollout.model.state_dict().items()}
    states = {v: {k: t + v if t.is_floating_point() else t for k, t in base.items()} for v in (1, 2)}

    async def sync(v, expected=None):
        handle = WeightHandle(version=v, transport="collective", owner="test", pid=os.getpid(), channel="v",
                              num_tensors=len(layout), nbytes=0)
        sent = asyncio.to_thread(root.send, v, states[v], layout)
        got, receipt = await asyncio.gather(rollout.update_weights(handle, expected_checksums=expected), sent,
                                            return_exceptions=True)
        assert receipt["sent"]
        return got

    one = state_dict_checksums(states[1].items())
    assert (await sync(1))["checksums_verified"] and rollout.weights_checksum() == one
    wrong = dict(state_dict_checksums(states[2].items()), **{"lm_head.weight": "0" * 16})
    failed = await sync(2, expected=wrong)
    assert isinstance(failed, WeightSyncError) and "rolled back to version 1" in str(failed)
    assert rollout.version == 1 and rollout.weights_checksum() == one  # version 1's bytes, not version 2's
    root.close()
    rollout.weights.close()


async def test_local_snapshots_reuse_retired_buffers_but_never_a_rollback_point(model_config):
    """A new snapshot writes over a retired one (no fresh memory per sync), unless a verified rollout
    still keeps that one as its rollback point."""
    from asyncrl.roles.weights.transfer import SNAPSHOTS

    policy = PolicyWorker(model_config, OptimConfig(lr=0.1))
    rollout = RolloutWorker(model_config, RolloutConfig(verify_checksums=True))

    def stage():
        policy.model.lm_head.weight.data.add_(1.0)
        policy._version += 1
        h = policy.stage_weights("local", keep=1)  # the older version is retired at once
        state = SNAPSHOTS.get(h.owner, h.version)
        return h, state["lm_head.weight"].data_ptr(), state_dict_checksums(state.items())

    h1, p1, sums1 = stage()
    await rollout.update_weights(h1)  # version 1 committed: the rollback point
    h2, p2, _ = stage()
    h3, p3, sums3 = stage()  # retired: 1 (kept by the rollout) and 2
    assert p3 not in (p1, p2)
    with pytest.raises(WeightSyncError, match="rolled back to version 1"):
        await rollout.update_weights(h3, expected_checksums=dict(sums3, **{"lm_head.weight": "0" * 16}))
    assert rollout.weights_checksum() == sums1  # version 1's snapshot was not written over
    h4, p4, sums4 = stage()
    assert p4 == p2  # version 2's retired buffers take version 4
    assert (await rollout.update_weights(h4))["version"] == 4 and rollout.weights_checksum() == sums4
    h5, p5, _ = stage()
    assert p5 == p1  # version 1 is no rollback point any more: reusable again
    policy.close_weight_channel()


def test_a_stalled_member_ends_the_transfer_at_the_deadline_on_every_other_member():
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.roles.weights.weight_channel import OK, layout_of

    state = {"w": torch.ones(4)}
    layout = layout_of(state)
    chans = _channels(3, timeout_s=5)  # also the rendezvous deadline: room for a loaded machine
    with ThreadPoolExecutor(2) as ex:  # member 2 joined the channel but never takes part
        sent = ex.submit(chans[0].send, 1, state, layout)
        got = ex.submit(chans[1].receive, 1, layout, lambda v: OK, torch.device("cpu"))
        with pytest.raises(WeightSyncError, match="failed during the header/vote of version 1"):
            sent.result(timeout=60)
        with pytest.raises(WeightSyncError, match="failed during the vote on version 1"):
            got.result(timeout=60)
    with pytest.raises(WeightSyncError, match="is broken by an earlier failure"):
        chans[0].send(2, state, layout)
    for c in chans:
        c.close()


def test_channel_backend_follows_the_members_devices():
    from asyncrl.roles.weights.weight_channel import channel_backend

    def m(pid, device, uuid):
        return {"node": "n", "pid": pid, "device": device, "uuid": uuid}

    cpu = [m(1, "cpu", "cpu:n"), m(2, "cpu", "cpu:n")]
    one_gpu = [m(1, "cuda:0", "cuda:A"), m(2, "cuda:0", "cuda:A")]
    two_gpus = [m(1, "cuda:0", "cuda:A"), m(2, "cuda:0", "cuda:B")]
    assert channel_backend(cpu) == "gloo" and channel_backend(one_gpu) == "gloo"
    assert channel_backend(two_gpus) == "nccl" and channel_backend(two_gpus, "gloo") == "gloo"
    with pytest.raises(WeightSyncError, match="needs every channel member on its own GPU.*shared GPUs"):
        channel_backend(one_gpu, "nccl")
    with pytest.raises(WeightSyncError, match="share one process \\(colocated\\).*transport='local'"):
        channel_backend([m(1, "cpu", "cpu:n"), m(1, "cpu", "cpu:n")])


# ---------------------------------------------------------------- across processes (Ray)


@pytest.fixture(scope="module")
async def channel_groups(ray_cluster, model_config):
    policy, rollout = _groups(model_config)
    async with policy, rollout:
        info = await open_weight_channel(policy, rollout, timeout_s=TIMEOUT, bucket_bytes=64 << 10)
        assert info == {"name": "weights", "backend": "gloo", "world_size": 3}
        yield policy, rollout


async def test_collective_sync_gives_bit_identical_weights_on_every_rollout_rank(channel_groups, prompt_batch):
    policy, rollout = channel_groups
    await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
    fetched = policy.stats.bytes_fetched + rollout.stats.bytes_fetched
    version = await sync_weights(policy, rollout, transport="collective", verify=True)
    assert version == 1 and await rollout.get_version() == [1, 1]
    assert policy.stats.bytes_fetched + rollout.stats.bytes_fetched == fetched  # no weights via the controller
    want = await policy.raw_state()
    ranks = await rollout.raw_state()
    assert len(ranks) == 2 and all(_same_bits(r, want) for r in ranks)
    assert await rollout.weights_checksum() == [state_dict_checksums(want.items())] * 2
    # the rows generated after the sync carry the new version on both ranks
    out = await rollout.generate(prompt_batch(n=4))
    assert out["version"].tolist() == [1, 1, 1, 1]


async def test_collective_refuses_a_stale_version_before_any_byte_moves(channel_groups, prompt_batch):
    policy, rollout = channel_groups
    v = (await rollout.get_version())[0]
    if await policy.get_version() == v:  # make sure the policy is ahead, then sync once
        await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
        v = await sync_weights(policy, rollout, transport="collective")
    handle = await policy.stage_weights("collective")  # the version the rollout already has
    sent, got = await _both(policy.send_weights(handle), rollout.update_weights(handle))
    assert sent == {"version": v, "sent": False, "codes": [0, 1, 1], "bytes": 0}
    assert isinstance(got, asyncrl.RemoteError) and isinstance(got.cause, StaleWeightsError)
    assert "nothing was transferred" in str(got.cause)
    # the channel is still in step on every member: the next real update goes through
    await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
    assert await sync_weights(policy, rollout, transport="collective", verify=True) == v + 1


async def test_collective_refuses_a_version_the_controller_did_not_ask_for(channel_groups, prompt_batch):
    policy, rollout = channel_groups
    await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
    handle = await policy.stage_weights("collective")
    before = await rollout.get_version()
    wrong = dataclasses.replace(handle, version=handle.version + 5)  # a misordered sync's handle
    sent, got = await _both(policy.send_weights(handle), rollout.update_weights(wrong))
    assert sent["sent"] is False and sent["codes"] == [0, 2, 2]
    assert isinstance(got.cause, WeightSyncError)
    assert f"asked to receive version {handle.version + 5} but the policy sent version {handle.version}" in str(got.cause)
    assert await rollout.get_version() == before
    assert await sync_weights(policy, rollout, transport="collective", verify=True) == handle.version


async def test_object_store_sync_adopts_the_stores_memory_and_keeps_it_pinned(channel_groups, prompt_batch):
    """Each rollout rank's weights are the zero-copy views of the stored object (no load copy). With no
    reference to the object left but those views, newer objects of the same size leave the weights intact
    (the views pin the object: Ray never reuses pinned memory; the tiny model is too small to fill the
    store here, so this pins that nothing of ours writes into it, and that the next sync swaps again)."""
    policy, rollout = channel_groups
    await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
    await rollout.update_weights(policy.stage_weights("object_store"))
    assert await rollout.adopted_received() == [True, True]
    sums = await rollout.weights_checksum()
    gc.collect()
    await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))  # other weights, same sizes
    for _ in range(3):
        await policy.stage_weights("object_store")  # put, then dropped: freed memory would be reused
    assert await rollout.weights_checksum() == sums
    assert (await rollout.update_weights(policy.stage_weights("object_store")))[0]["version"] == await policy.get_version()
    assert await rollout.adopted_received() == [True, True] and await rollout.weights_checksum() != sums


class PackingPolicy(Policy):
    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def packed_buffer(self) -> int | None:
        """Address of the buffer an object_store stage with a cast packs into (None: no such stage yet)."""
        held = (self.weights._cast_scratch or {}).get("packed")
        return None if held is None else held.flat.data_ptr()


class PackedRollout(Rollout):
    @register(Dispatch.ONE_TO_ALL)
    def received_buffers(self) -> tuple[int, bool]:
        """How many distinct storages the last sync brought, and whether the engine's tied weights are one tensor."""
        sd = self.model.state_dict()
        return (len({t.untyped_storage().data_ptr() for t in (self.received or {}).values()}),
                sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr())


async def test_an_object_store_sync_with_a_cast_packs_one_buffer_reused_across_versions(ray_cluster, model_config,
                                                                                      prompt_batch):
    """A float32 policy and a float16 rollout (the cast a bf16 rollout needs; bf16 compute is not on every CPU):
    the cast lands in one packed buffer that Ray stores as one object part, the rollout gets views of it,
    bit-identical to the policy's weights cast to float16, tied weights as one tensor; the next version reuses
    the policy's buffer and arrives whole (not the previous version's bytes)."""
    tied = dataclasses.replace(model_config, tie_word_embeddings=True)
    policy = asyncrl.RayWorkerGroup(PackingPolicy, world_size=1, name="wt-pack-policy",
                                    kwargs={"model": tied, "optim": OptimConfig(lr=1e-2, micro_batch_size=4)})
    rollout = asyncrl.RayWorkerGroup(PackedRollout, world_size=1, name="wt-pack-rollout",
                                     kwargs={"model": dataclasses.replace(tied, dtype="float16"),
                                             "rollout": RolloutConfig(max_new_tokens=5)})
    async with policy, rollout:
        buffers = []
        for step in range(2):
            await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
            version = await sync_weights(policy, rollout, transport="object_store", verify=True)
            assert version == step + 1 and await rollout.get_version() == [version]
            want = {k: (v.half() if v.is_floating_point() else v) for k, v in (await policy.raw_state()).items()}
            got = (await rollout.raw_state())[0]
            assert _same_bits(got, want)
            assert await rollout.received_buffers() == [(1, True)]  # views of one stored buffer; tied stays tied
            buffers.append(await policy.packed_buffer())
        assert buffers[0] is not None and buffers[0] == buffers[1]


@ray.remote(num_cpus=0)
class _Storer:
    """A plain Ray actor: ``store_state`` there makes an object it owns, as the policy does."""

    def store_and_read(self, extra_complex: bool) -> tuple[str, dict[str, str], bool]:
        from asyncrl.roles.weights.transfer import PackedState, store_state

        state = {"w": torch.arange(12.0).reshape(4, 3) / 7, "i": torch.arange(3)}
        if extra_complex:
            state["c"] = torch.zeros(2, dtype=torch.complex64)  # no packed view for this dtype
        got = ray.get(store_state(state, torch.float16, {}))
        views = got.views() if isinstance(got, PackedState) else got
        return (type(got).__name__, {k: str(v.dtype).removeprefix("torch.") for k, v in views.items()},
                torch.equal(views["w"], state["w"].half()) and torch.equal(views["i"], state["i"]))


async def test_a_cast_into_a_dtype_the_packing_cannot_view_still_casts_tensor_by_tensor(ray_cluster):
    storer = _Storer.remote()
    try:
        assert await storer.store_and_read.remote(False) == ("PackedState", {"w": "float16", "i": "int64"}, True)
        assert await storer.store_and_read.remote(True) == (
            "dict", {"w": "float16", "i": "int64", "c": "complex64"}, True)
    finally:
        ray.kill(storer)


async def test_local_handoff_between_colocated_policy_and_rollout(ray_cluster, model_config, prompt_batch):
    col = asyncrl.colocate({
        "policy": (Policy, (model_config, OptimConfig(lr=1e-2, micro_batch_size=4)), {}),
        "rollout": (Rollout, (model_config, RolloutConfig(max_new_tokens=5)), {}),
    }, world_size=1, name="local-sync")
    async with col:
        policy, rollout = col["policy"], col["rollout"]
        with pytest.raises(WeightSyncError, match="share one process"):
            await open_weight_channel(policy, rollout)
        await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
        fetched = policy.stats.bytes_fetched + rollout.stats.bytes_fetched
        assert await sync_weights(policy, rollout, transport="local", verify=True) == 1
        assert policy.stats.bytes_fetched + rollout.stats.bytes_fetched == fetched
        assert _same_bits((await rollout.raw_state())[0], await policy.raw_state())
        handle = await policy.stage_weights("local")
        with pytest.raises(asyncrl.RemoteError) as info:
            await rollout.update_weights(handle)  # version 1 again
        assert isinstance(info.value.cause, StaleWeightsError)


async def test_a_local_handle_outside_its_process_is_refused(channel_groups):
    policy, rollout = channel_groups
    handle = await policy.stage_weights("local")
    assert isinstance(handle, WeightHandle) and handle.transport == "local"
    with pytest.raises(asyncrl.RemoteError) as info:
        await rollout.update_weights(dataclasses.replace(handle, version=handle.version + 100))
    assert isinstance(info.value.cause, WeightSyncError)
    assert "transport='local' needs the policy and the rollout colocated in one process" in str(info.value.cause)


async def test_the_policy_dying_mid_transfer_leaves_every_rollout_rank_unchanged(channel_groups, model_config,
                                                                               prompt_batch):
    _, rollout = channel_groups
    policy = asyncrl.RayWorkerGroup(DyingPolicy, world_size=1, name="wt-policy-dies", kwargs={"model": model_config})
    async with policy:
        await open_weight_channel(policy, rollout, timeout_s=TIMEOUT, bucket_bytes=16 << 10)
        before, versions = await rollout.raw_state(), await rollout.get_version()
        await policy.jump_to_version(versions[0] + 1)
        handle = await policy.stage_weights("collective")
        sent, got = await _both(policy.send_weights(handle), rollout.update_weights(handle))
        assert isinstance(sent, asyncrl.WorkerDiedError)
        assert isinstance(got, asyncrl.RemoteError) and isinstance(got.cause, WeightsLostError)
        assert is_worker_fault(got)  # the trainer restarts on it, whichever of the two errors reaches it first
        assert f"failed during the transfer of version {handle.version}" in str(got.cause)
        assert "Rollout ranks keep their previous weights" in str(got.cause)
        assert await rollout.get_version() == versions
        assert all(_same_bits(a, b) for a, b in zip(await rollout.raw_state(), before))
        out = await rollout.generate(prompt_batch(n=4))  # still serving, on the old weights
        assert out["version"].tolist() == [versions[0]] * 4
        # the broken channel refuses at once instead of waiting for a peer that is gone
        with pytest.raises(asyncrl.RemoteError) as info:
            await rollout.update_weights(handle)
        assert "is broken by an earlier failure" in str(info.value.cause)
        assert type(info.value.cause) is WeightSyncError and not is_worker_fault(info.value)  # a misuse now


@ray.remote(num_cpus=0)
class _Gate:
    async def wait(self) -> None:
        await asyncio.Event().wait()  # never opens: what waits on it is never stored


@ray.remote(num_cpus=0)
def _never_stored(gate: Any) -> None:
    ray.get(gate.wait.remote())


@ray.remote(num_cpus=0)
class _WeightOwner:
    """A plain Ray actor that owns staged weights as the policy does: `stage` stores them; `pending` hands out
    the ref of weights not stored yet (a task it owns still produces them)."""

    def stage(self) -> list:
        from asyncrl.roles.weights.transfer import store_state

        return [store_state({"w": torch.arange(4.0)}, None)]  # nested: the caller borrows, this actor owns

    def pending(self, gate: Any) -> list:
        return [_never_stored.remote(gate)]


class _Loader(asyncrl.Worker):
    @register(Dispatch.ONE_TO_ALL)
    async def load(self, handle: WeightHandle) -> dict[str, list[float]]:
        from asyncrl.roles.weights.transfer import fetch_stored

        return {k: v.tolist() for k, v in (await fetch_stored(handle)).items()}


async def test_weights_whose_owner_died_fail_the_load_as_a_worker_fault(ray_cluster):
    """An ``object_store`` stage is owned by the process that put it (the policy). When that process dies
    before a rollout could read it (with its node), the read fails with ``WeightsLostError``, and the trainer's
    recovery counts it as a worker fault (its restart policy applies), not a bug: a rollout's failed load can
    reach the trainer before the policy's own death does. (On one node a stored object outlives its owner in the
    node's store; here the owner dies while its weights are still being produced, which Ray reports the same
    way, ``OwnerDiedError``.)"""
    owner, gate = _WeightOwner.remote(), _Gate.remote()
    (stored,), (pending,) = await owner.stage.remote(), await owner.pending.remote(gate)
    handle = WeightHandle(version=3, transport="object_store", owner="w", pid=0, channel=None, num_tensors=1,
                          nbytes=16, stored=stored)
    try:
        async with asyncrl.RayWorkerGroup(_Loader, world_size=1, name="wt-loader") as loader:
            assert await loader.load(handle) == [{"w": [0.0, 1.0, 2.0, 3.0]}]
            ray.kill(owner)
            with pytest.raises(asyncrl.RemoteError) as info:
                await asyncio.wait_for(loader.load(dataclasses.replace(handle, stored=pending)), TIMEOUT)
    finally:
        ray.kill(gate)
    e = info.value
    assert type(e.cause) is WeightsLostError and e.exc_type == "asyncrl.roles.errors.WeightsLostError"
    assert e.message.startswith("the weights of version 3 could not be read from Ray's object store (OwnerDiedError")
    assert is_worker_fault(e)
    # the loader is not at fault: replacing it would load the same lost weights again, so the run restarts
    assert fault_origin(e) == "a peer of wt-loader"


async def test_a_rollout_rank_dying_mid_transfer_ends_the_sync_on_every_member(channel_groups, model_config, tmp_path,
                                                                              prompt_batch):
    policy, first = channel_groups
    await _train_once(policy, first, prompt_batch(n=4, repeat=2))  # the policy's version ahead of the new rollout's 0
    log = tmp_path / "survivor.json"
    rollout = asyncrl.RayWorkerGroup(DyingRollout, world_size=2, name="wt-rollout-dies", env={"SURVIVOR_LOG": str(log)},
                                     kwargs={"model": model_config, "rollout": RolloutConfig(max_new_tokens=5)})
    async with rollout:
        await open_weight_channel(policy, rollout, timeout_s=TIMEOUT, bucket_bytes=16 << 10)
        initial = (await rollout.weights_checksum())[0]
        handle = await policy.stage_weights("collective")
        update = rollout.update_weights(handle)
        t0 = time.monotonic()
        sent, got = await _both(policy.send_weights(handle), update)
        assert isinstance(sent, asyncrl.RemoteError) and isinstance(sent.cause, WeightSyncError)
        assert f"failed during the transfer of version {handle.version}" in str(sent.cause)
        assert isinstance(got, asyncrl.WorkerDiedError)  # rank 1's process is gone
        # the surviving rank's own call ends too (the group future failed at the first death)
        with pytest.raises(Exception, match="WeightSyncError"):
            await update.refs[0]
        print(f"every member of the transfer ended {time.monotonic() - t0:.2f}s after it started")
        survivor = json.loads(log.read_text())  # it failed typed, and kept version 0 and its weights
        assert survivor["error"] == "WeightsLostError"  # a WeightSyncError: a member died
        assert f"failed during the transfer of version {handle.version}" in survivor["message"]
        assert survivor["version"] == 0 and survivor["checksums"] == initial
        # the broken channel refuses at once on the policy's side
        with pytest.raises(asyncrl.RemoteError, match="is broken by an earlier failure"):
            await policy.send_weights(handle)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/gpu_check.sh)")
async def test_weight_channel_between_processes_sharing_one_gpu(ray_cluster, prompt_batch):
    """Policy and rollout on half a GPU each: the channel picks gloo (NCCL refuses two ranks on one
    GPU), stages through the CPU, and the bf16 rollout ends bit-identical to the cast policy."""
    from asyncrl import ResourcePool

    cfg = ModelConfig(seed=0)  # device="auto": the GPU the bundle reserves; dtype auto: bf16 rollout
    pool = ResourcePool([2], gpus_per_bundle=0.5, name="wt-gpu")
    ppool, rpool = pool.split([1, 1])
    policy = asyncrl.RayWorkerGroup(Policy, ppool, name="wt-gpu-policy",
                                    kwargs={"model": cfg, "optim": OptimConfig(lr=1e-2, micro_batch_size=4)})
    rollout = asyncrl.RayWorkerGroup(Rollout, rpool, name="wt-gpu-rollout",
                                     kwargs={"model": cfg, "rollout": RolloutConfig(max_new_tokens=5)})
    try:
        async with policy, rollout:
            assert (await policy.placement_info())["device"] == "cuda:0"
            info = await open_weight_channel(policy, rollout, timeout_s=60)
            assert info["backend"] == "gloo"
            await _train_once(policy, rollout, prompt_batch(n=4, repeat=2))
            assert await sync_weights(policy, rollout, transport="collective", verify=True) == 1
            sums = await policy.weights_checksum(dtype="bfloat16" if torch.cuda.is_bf16_supported() else None)
            assert await rollout.weights_checksum() == [sums]
    finally:
        await pool.release()


async def _both(a, b):
    """Await two futures; each result or the error it raised."""
    import asyncio

    return await asyncio.gather(a, b, return_exceptions=True)


