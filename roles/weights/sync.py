"""Versioned policy -> rollout weight sync from the controller, by the transport that fits the placement.

=================  ==============================================  ===========================================
transport          placement                                       how the tensors move
=================  ==============================================  ===========================================
``object_store``   any                                             ``stage_weights("object_store")`` puts it
                                                                   in Ray's object store -> every rollout rank
``local``          policy and rollout colocated in one process     a snapshot on the policy's device, copied
                                                                   in-process (no object store, no copy to host)
``collective``     separate pools (open a channel first)           broadcast over a process group of policy
                                                                   rank 0 + rollout ranks (NCCL on distinct
                                                                   GPUs, gloo otherwise)
=================  ==============================================  ===========================================

Every transport ends in the same rollout-side transaction: versions must increase
(:class:`~asyncrl.roles.StaleWeightsError` otherwise, nothing changed), names/shapes must
match, and with `verify` the loaded weights are checked against the policy's checksums.
The weights never pass through the controller.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from asyncrl import WorkerGroup

from asyncrl.roles.errors import WeightSyncError
from asyncrl.roles.weights.weight_channel import channel_backend, layout_of

__all__ = ["sync_weights", "open_weight_channel", "rollout_dtype"]


async def rollout_dtype(rollout: WorkerGroup[Any]) -> str:
    """The floating dtype the rollout holds its weights in (what exports are cast to)."""
    spec = await rollout.weight_spec()
    floats = {d for _, d in spec.values() if d in ("float32", "bfloat16", "float16", "float64")}
    if len(floats) != 1:
        raise WeightSyncError(f"the rollout holds weights in several floating dtypes {sorted(floats)}; pass dtype=")
    return floats.pop()


async def open_weight_channel(policy: WorkerGroup[Any], rollout: WorkerGroup[Any], *, name: str = "weights",
                              backend: Literal["auto", "gloo", "nccl"] = "auto", timeout_s: float = 120.0,
                              bucket_bytes: int = 256 << 20) -> dict[str, Any]:
    """Open the collective weight channel between policy rank 0 and every rollout rank.

    The backend is NCCL when every member has a GPU of its own, gloo otherwise (CPU, or
    members sharing one GPU); `timeout_s` bounds the rendezvous and every later transfer.
    Reopening replaces a broken channel. Returns ``{"name", "backend", "world_size"}``.
    Raises :class:`WeightSyncError` when policy and rollout differ in architecture or share
    a process (colocated: use ``transport="local"``).
    """
    pm, rms, pspec, rspec, tied = await asyncio.gather(policy.channel_member(), rollout.channel_member(),
                                                       policy.weight_spec(), rollout.weight_spec(),
                                                       rollout.tied_weights())
    chosen = channel_backend([pm, *rms], backend)
    ps = {n: tuple(s) for n, (s, _) in pspec.items()}
    rs = {n: tuple(s) for n, (s, _) in rspec.items()}
    if ps != rs:
        diff = sorted(set(ps) ^ set(rs)) or sorted(n for n in ps if ps[n] != rs[n])
        raise WeightSyncError(f"policy and rollout weights differ in names or shapes, e.g. {diff[:5]}; a weight "
                              "channel needs the same architecture on both sides")
    world = 1 + len(rms)
    layout = [entry for entry in layout_of(rspec) if entry[0] not in tied]  # a tied tensor is sent once
    results = await asyncio.gather(
        policy.join_weight_channel(name, pm["host"], pm["port"], world, chosen, layout, timeout_s, bucket_bytes,
                                   tied),
        rollout.join_weight_channel(name, pm["host"], pm["port"], world, chosen, timeout_s, bucket_bytes),
        return_exceptions=True,
    )
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return {"name": name, "backend": chosen, "world_size": world}


async def sync_weights(policy: WorkerGroup[Any], rollout: WorkerGroup[Any], *, verify: bool = False,
                       transport: Literal["object_store", "local", "collective"] = "object_store",
                       dtype: str | None = None, keep: int = 4) -> int:
    """Push the policy's current weights to every rollout rank; returns the synced version.

    Each rollout rank runs the transaction begin (version check) -> transfer -> commit;
    a version not newer than a rank's raises :class:`~asyncrl.roles.StaleWeightsError`
    (as the cause of the group's ``RemoteError``). `transport` picks how the tensors move
    (module table; ``collective`` needs :func:`open_weight_channel` first). Floating
    tensors are cast to the rollout's dtype (`dtype`, default: asked from the rollout).
    With `verify`, the rollout ranks check their loaded weights against the policy's
    checksums (in that dtype) and the result is re-checked here.
    """
    if transport not in ("object_store", "local", "collective"):
        raise ValueError(f"transport must be 'object_store', 'local' or 'collective', got {transport!r}")
    dt = dtype or await rollout_dtype(rollout)
    send = None
    if transport == "object_store":
        exported: Any = policy.stage_weights("object_store", dtype=dt)
    elif transport == "local":
        exported = policy.stage_weights("local", dtype=dt, keep=keep)
    else:
        exported = policy.stage_weights("collective", keep=keep)
    expected = await policy.weights_checksum(dtype=dt) if verify else None  # ordered: the same version
    if transport == "collective":
        send = policy.send_weights(exported)
    recv = rollout.update_weights(exported, expected_checksums=expected)
    if send is not None:
        outcome: tuple[Any, Any] = await asyncio.gather(recv, send, return_exceptions=True)
        got, sent = outcome
        if isinstance(got, BaseException):
            raise got  # the rollout's error says most (stale, layout, which rank failed)
        if isinstance(sent, BaseException):
            raise sent
        results = got
    else:
        results = await recv
    versions = {r["version"] for r in results}
    if len(versions) != 1:
        raise WeightSyncError(f"rollout ranks committed different versions: {sorted(versions)}")
    if verify:
        for rank, sums in enumerate(await rollout.weights_checksum()):
            if sums != expected:
                raise WeightSyncError(f"rollout rank {rank} weights differ from the policy's after sync")
    return versions.pop()
