"""Weight transports between the policy and the rollout: in-process hand-over and a collective channel.

Three transports move a policy version to the rollout ranks (``sync_weights(transport=...)``):

``object_store``
    ``PolicyWorker.stage_weights("object_store")`` puts the version into Ray's object store
    itself (``ray.put``, inside the ordered call: the put is the snapshot, one copy of the live
    weights, or the cast when the rollout's dtype differs, packed into one buffer:
    :class:`PackedState`) and returns a :class:`WeightHandle`
    holding the reference; ``RolloutWorker.update_weights(handle)`` reads the tensors as
    zero-copy views of the store and the HF engine adopts them as its parameters (no load copy;
    the views pin the object until the next version is adopted). (``export_weights()`` returns ``(version,
    state_dict)`` copies instead, which Ray then copies into the store: a second copy; the
    rollout takes either.) Works for every placement.
``local``
    Policy and rollout are colocated in one process (``colocate`` / ``trainer.colocated``).
    ``PolicyWorker.stage_weights("local")`` keeps a snapshot of the version on its device in
    this process and returns a small :class:`WeightHandle`; ``update_weights(handle)`` hands the
    snapshot to the engine, which adopts it (the snapshot pool never reuses a snapshot the engine
    holds). No tensor leaves the process or touches the object store.
``collective``
    Separate pools: a :class:`WeightChannel` -- its own torch.distributed process group over
    policy rank 0 (channel rank 0) and every rollout rank (channel ranks 1..n), NCCL when all
    members sit on distinct GPUs, gloo otherwise (CPU, or members sharing one GPU).
    ``stage_weights("collective")`` snapshots the version; ``send_weights(handle)`` on the
    policy and ``update_weights(handle)`` on the rollout run the protocol below together.

The collective protocol (header, vote, data, ack, commit; failures on every rank, never a hang) is
described in :mod:`asyncrl.roles.weights.weight_channel`.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import threading
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Literal, Mapping, TypeVar

import torch

from asyncrl import Dispatch
from asyncrl.dispatch import dispatch_one_to_all

from asyncrl.roles.errors import WeightsLostError, WeightSyncError
from asyncrl.roles.modeling.lora import MergedWeights, merged_state
from asyncrl.roles.modeling.models import StateSlots
from asyncrl.roles.modeling.strategy import TrainStrategy, is_sharded
from asyncrl.roles.weights.weight_channel import (
    _DTYPE,
    WeightChannel,
    _cast,
    bucketed_snapshot,
    free_port,
    layout_of,
    member_info,
)

__all__ = [
    "WeightHandle",
    "PackedState",
    "fetch_stored",
    "store_state",
    "WeightChannel",
    "WeightSource",
    "SNAPSHOTS",
    "layout_of",
    "Transport",
]

Transport = Literal["object_store", "local", "collective"]


@dataclass(frozen=True)
class WeightHandle:
    """A staged policy version: what ``stage_weights`` returns and ``update_weights`` accepts.

    It is a few bytes; the tensors stay with the policy (a snapshot in its process) until a
    rollout rank copies them (``local``) or receives them over a channel (``collective``).
    """

    version: int
    """The policy version the snapshot holds."""
    transport: Literal["local", "collective", "object_store"]
    """How the rollout gets the tensors."""
    owner: str
    """Id of the policy worker that holds the snapshot."""
    pid: int
    """Process that holds it (a ``local`` handle only works there)."""
    channel: str | None
    """The channel's name (``collective``)."""
    num_tensors: int
    """Tensors in the snapshot."""
    nbytes: int
    """Bytes in the snapshot."""
    stored: Any = None
    """``object_store``: the Ray ObjectRef of the state dict (a plain dict of copies where the policy
    runs outside Ray, e.g. in-process)."""
    peers: tuple[tuple[int, str], ...] = ()
    """``local`` with several colocated ranks: ``(pid, owner)`` of the same version's snapshot in each other
    policy rank's process, so the rollout rank in that process takes its own."""

    def here(self) -> "WeightHandle":
        """The handle of this process's snapshot of the version (itself, or a peer's)."""
        pid = os.getpid()
        for peer_pid, owner in self.peers:
            if peer_pid == pid and pid != self.pid:
                return replace(self, pid=pid, owner=owner, peers=())
        return self


def merged_handles(world: Any, results: list[Any]) -> Any:
    """Collect of ``stage_weights``: rank 0's handle; a ``local`` one names every rank's snapshot (``peers``)."""
    first = results[0]
    if isinstance(first, WeightHandle) and first.transport == "local":
        peers = tuple((h.pid, h.owner) for h in results[1:] if isinstance(h, WeightHandle))
        return replace(first, peers=peers) if peers else first
    return first


STAGE = Dispatch.custom("stage_weights", dispatch_one_to_all, merged_handles)
"""Every rank stages (FSDP2 gathers on all ranks; ``local`` snapshots one per colocated process); the call
resolves to rank 0's handle, naming the others' for ``local``."""


def _unreferenced(state: dict[str, torch.Tensor]) -> bool:
    """Whether only :class:`_Snapshots` (its retired list, the caller's loop variable and this call)
    references `state` and its tensors: no rollout keeps them (a verified rollback point, a load in
    progress) and no send reads them. Python's reference counts are exact for objects only Python
    code holds, as these are (every transport reads a snapshot through the dict or its tensors)."""
    if sys.getrefcount(state) > 4:  # retired list + caller's variable + parameter + getrefcount's argument
        return False
    slots = collections.Counter(id(t) for t in state.values())  # a tied tensor fills several slots
    return all(sys.getrefcount(t) <= 2 + slots[id(t)] for t in state.values())  # dict slots + loop variable + argument


class _Snapshots:
    """Process-wide store of staged versions, ``owner -> {version: state}`` (oldest evicted first).

    A version evicted or dropped is *retired* (the two newest are kept per owner): the next snapshot
    of the same layout writes over its tensors (:meth:`reuse`) instead of faulting in fresh memory,
    once nothing else references them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, collections.OrderedDict[int, dict[str, torch.Tensor]]] = {}
        self._retired: dict[str, list[dict[str, torch.Tensor]]] = {}

    def _retire(self, owner: str, state: dict[str, torch.Tensor]) -> None:
        spare = self._retired.setdefault(owner, [])
        spare.append(state)
        del spare[:-2]

    def reuse(self, owner: str, layout: list[tuple[str, tuple[int, ...], str]],
              device: torch.device | str) -> dict[str, torch.Tensor] | None:
        """A retired snapshot of `owner` with exactly `layout` on `device` that nothing else references
        (taken out of the store: the caller copies the new version into its tensors), or None."""
        with self._lock:
            spare = self._retired.get(owner, [])
            for i in range(len(spare)):  # (enumerate's reused tuple would hold one more reference)
                state = spare[i]
                if (layout_of(state) == layout and all(t.device == torch.device(device) for t in state.values())
                        and _unreferenced(state)):
                    return spare.pop(i)
        return None

    def put(self, owner: str, version: int, state: dict[str, torch.Tensor], keep: int) -> None:
        with self._lock:
            d = self._items.setdefault(owner, collections.OrderedDict())
            d[version] = state
            d.move_to_end(version)
            while len(d) > max(1, keep):
                self._retire(owner, d.popitem(last=False)[1])

    def get(self, owner: str, version: int) -> dict[str, torch.Tensor] | None:
        with self._lock:
            d = self._items.get(owner)
            return d.get(version) if d is not None else None

    def versions(self, owner: str) -> list[int]:
        with self._lock:
            return list(self._items.get(owner, {}))

    def drop_older(self, owner: str, version: int) -> None:
        """Forget the versions older than `version` (a rollout holds `version` or newer)."""
        with self._lock:
            d = self._items.get(owner)
            if d is not None:
                for v in [v for v in d if v < version]:
                    self._retire(owner, d.pop(v))

    def clear(self, owner: str) -> None:
        with self._lock:
            self._items.pop(owner, None)
            self._retired.pop(owner, None)

    def take_local(self, handle: WeightHandle) -> dict[str, torch.Tensor]:
        """The snapshot a ``local`` handle names (this process's, when several colocated ranks staged it),
        or a WeightSyncError saying why not."""
        handle = handle.here()
        if handle.pid != os.getpid():
            raise WeightSyncError(
                f"a local weight handle of version {handle.version} from process {handle.pid} reached process "
                f"{os.getpid()}: transport='local' needs the policy and the rollout colocated in one process "
                "(colocate(...) / trainer.colocated=true); use transport='object_store' or 'collective' otherwise"
            )
        state = self.get(handle.owner, handle.version)
        if state is None:
            raise WeightSyncError(
                f"version {handle.version} is no longer staged on the policy (it keeps {self.versions(handle.owner)}); "
                "stage it again, or raise stage_weights(keep=...) when rollout lags further behind"
            )
        return state


SNAPSHOTS = _Snapshots()
"""The staged versions of every policy worker in this process."""


def new_owner_id() -> str:
    """A process-unique id for a policy worker's snapshots."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _in_ray_worker() -> bool:
    """Whether this process is a Ray worker (an actor), where ``ray.put`` makes an object it owns."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return bool(ray.get_runtime_context().worker.mode == ray.WORKER_MODE)


def _alias(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two state-dict entries one tensor (tied weights: ``lm_head`` and ``embed_tokens``); an FSDP2
    shard (DTensor) by its local part, which tied names share too."""
    local = t.to_local() if is_sharded(t) else t
    return (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape),
            tuple(local.stride()), t.dtype)


_T = TypeVar("_T")


def untied(state: Mapping[str, torch.Tensor], fn: Callable[[str, torch.Tensor], _T]) -> dict[str, _T]:
    """``{name: fn(name, tensor)}`` with `fn` called once per distinct tensor: names that share one
    tensor (tied weights) share the result, so a snapshot copies, casts and ships it once."""
    seen: dict[tuple[Any, ...], _T] = {}
    out = {}
    for k, v in state.items():
        key = _alias(v)
        if key not in seen:
            seen[key] = fn(k, v)
        out[k] = seen[key]
    return out


_ALIGN = 64
"""Byte alignment of each tensor in a :class:`PackedState` (any dtype's view of the buffer is then aligned)."""


@dataclass(frozen=True)
class PackedState:
    """A state dict as one flat byte buffer and where each tensor lies in it: what :func:`store_state`
    puts into Ray's object store when it must copy the weights anyway (a cast to the rollout's dtype, or
    a move off the device). Ray's put and get cost per pickled buffer, and one buffer replaces one per
    tensor: on SmolLM2-135M's 272 tensors in bf16, the put went from 0.058 to 0.031 s and the get from
    0.008 to 0.0005 s (benchmarks/weight_sync.py's ``object_store`` row gains the difference)."""

    flat: torch.Tensor
    """The bytes (``uint8``, CPU)."""
    entries: tuple[tuple[str, tuple[int, ...], str, int], ...]
    """``(name, shape, dtype name, byte offset)`` of each distinct tensor."""
    aliases: tuple[tuple[str, str], ...]
    """``(name, name it shares its tensor with)``: tied weights, stored once."""

    @staticmethod
    def plan(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[
            tuple[tuple[str, tuple[int, ...], str, int], ...], tuple[tuple[str, str], ...], int] | None:
        """``(entries, aliases, total bytes)`` for `state` with floating tensors in `dtype`, or None when a
        tensor's dtype has no name here (the caller then puts the tensors one by one)."""
        first = untied(state, lambda name, t: name)  # {name: the first name of its tensor}
        aliases = tuple((name, src) for name, src in first.items() if src != name)
        entries, off = [], 0
        for name, t in state.items():
            if first[name] != name:
                continue
            dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
            dname = str(dt).removeprefix("torch.")
            if _DTYPE.get(dname) != dt:
                return None
            off = -(-off // _ALIGN) * _ALIGN
            entries.append((name, tuple(t.shape), dname, off))
            off += t.numel() * dt.itemsize
        return tuple(entries), aliases, off

    def views(self) -> dict[str, torch.Tensor]:
        """``{name: tensor}``: views of :attr:`flat` (no copy; tied names share one view)."""
        out: dict[str, torch.Tensor] = {}
        for name, shape, dname, off in self.entries:
            dt = _DTYPE[dname]
            n = math.prod(shape) * dt.itemsize
            out[name] = self.flat[off:off + n].view(dt).view(shape)
        for name, source in self.aliases:
            out[name] = out[source]
        return out


def store_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                scratch: dict[str, Any] | None = None) -> Any:
    """`state` (floating tensors cast to `dtype`) as one object for the rollout: in a Ray worker, an
    ObjectRef of a ``ray.put`` of it, made before this returns, so the live tensors may change right
    after; elsewhere (in-process groups) a dict of copies. Tied weights are stored once.

    Without a cast, on the CPU, the put takes the live tensors (Ray's one copy into the store is the
    snapshot). With a cast (or a move off the device), the copy it needs is written into one
    :class:`PackedState` buffer, which the put copies in one piece; `scratch` when given keeps that
    buffer across calls (its pages stay mapped; ``ray.put`` has copied it when it returns)."""
    with torch.no_grad():
        if not _in_ray_worker():
            return untied(state, lambda k, v: _cast(v, dtype, "cpu"))
        import ray

        def needs_copy(t: torch.Tensor) -> bool:
            return (dtype is not None and t.is_floating_point() and t.dtype != dtype) or t.device.type != "cpu"

        def as_is(name: str, t: torch.Tensor) -> torch.Tensor:  # unpackable dtypes: a copy of its own where needed
            if needs_copy(t):
                return _cast(t, dtype, "cpu")
            return t.detach() if t.is_contiguous() else t.detach().contiguous()

        plan = PackedState.plan(state, dtype) if any(needs_copy(t) for t in state.values()) else None
        if plan is None:
            return ray.put(untied(state, as_is))
        entries, aliases, nbytes = plan
        held = scratch.get("packed") if scratch is not None else None
        if not isinstance(held, PackedState) or held.entries != entries or held.aliases != aliases:
            held = PackedState(torch.empty(nbytes, dtype=torch.uint8), entries, aliases)
            if scratch is not None:
                scratch["packed"] = held
        views = held.views()
        for name, *_ in entries:  # each distinct tensor once
            views[name].copy_(state[name].detach())
        return ray.put(held)


async def fetch_stored(handle: WeightHandle) -> dict[str, torch.Tensor]:
    """The state dict an ``object_store`` handle holds (read-only zero-copy views of the store on Ray)."""
    stored = handle.stored
    if isinstance(stored, Mapping):
        return dict(stored)
    try:
        state = await stored
    except Exception as e:
        from ray.exceptions import ObjectLostError  # an ObjectRef: Ray is there (OwnerDiedError is one)

        raise (WeightsLostError if isinstance(e, ObjectLostError) else WeightSyncError)(
            f"the weights of version {handle.version} could not be read from Ray's object store "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); the policy that put them "
            "owns them: if it died, restart it and sync again"
        ) from e
    if isinstance(state, PackedState):
        return state.views()
    if not isinstance(state, Mapping):
        raise WeightSyncError(f"an object_store weight handle held {type(state).__name__}, not a state dict")
    return dict(state)


class WeightSource:
    """The sending side of the weight transports: a :class:`~asyncrl.roles.PolicyWorker` holds one
    (``self.weights``), and its registered transport methods delegate here.

    It reads the weights of `strategy`'s module (the trained model, a peft model when `lora`) and the current
    version from `version`. Every transport reads the weights through :meth:`export_state` (the base model's
    names; LoRA merged there). Rank 0 stages and sends; under ``fsdp2`` every rank takes part in staging (each
    weight is gathered from its shards, one at a time, into rank 0's host buffer), and the staged copy lives in
    host memory except for ``local``.

    Args:
        strategy: the policy's :class:`~asyncrl.roles.modeling.strategy.TrainStrategy` (its ``module`` is the model).
        rank: the policy rank this runs on.
        device: the device the policy's weights live on (``local`` and ``collective`` snapshots go there).
        lora: the model is a peft model with LoRA adapters: the weights leave merged (:meth:`export_state`).
        version: the policy's current version (what a staged snapshot is labelled).
    """

    def __init__(self, *, strategy: TrainStrategy, rank: int, device: torch.device | str, lora: bool,
                 version: Callable[[], int]) -> None:
        self.strategy = strategy
        self.model: torch.nn.Module = strategy.module
        self.rank = rank
        self.device = device
        self.lora = lora
        self._version = version
        self._channel: WeightChannel | None = None
        self._channel_layout: list[tuple[str, tuple[int, ...], str]] | None = None
        self._owner: str | None = None
        self._state_slots: StateSlots | None = None
        self._cast_scratch: dict[str, Any] | None = None
        """``object_store`` with a cast: the :class:`PackedState` buffer the cast writes before ``ray.put``
        copies it (kept across versions)."""
        self.bucketed_snapshots = True
        """Stage collective snapshots in the channel's buckets (:func:`bucketed_snapshot`); False stages one
        tensor per weight and concatenates each bucket when sending (the path before; kept for the benchmark's
        side-by-side, benchmarks/weight_sync.py)."""
        self.on_bucket_sent: Callable[[str], None] = _no_fault
        """Called after each bucket a transfer sends (a seam for fault-injection tests)."""

    def _own_state(self) -> dict[str, torch.Tensor]:
        """``self.model.state_dict()`` without walking the modules each time (:class:`StateSlots`)."""
        if self._state_slots is None or self._state_slots.model is not self.model:
            self._state_slots = StateSlots(self.model)
        return self._state_slots.state()

    def export_state(self) -> dict[str, torch.Tensor]:
        """The weights as they leave the policy, under the base model's ``state_dict`` names: the one seam every
        transport, checksum and export reads. With LoRA, the merged weights (``W + scaling * B @ A``, new
        tensors computed beside the live model, which is not changed); else the model's own tensors. LoRA under
        FSDP2 merges from gathered units instead (:meth:`whole_by_unit`)."""
        if self.lora and self.strategy.sharded:
            raise RuntimeError("a sharded LoRA model's merged weights are read one FSDP unit at a time "
                               "(whole_by_unit), not as one state dict")
        return merged_state(self.model) if self.lora else self._own_state()

    def export_layout(self) -> dict[str, torch.Tensor]:
        """Tensors with the names, shapes, dtypes and ties of :meth:`export_state`, without merging LoRA (under
        FSDP2: the shards, whose shapes are the whole tensors')."""
        return MergedWeights(self.model).layout() if self.lora else self._own_state()

    def whole_by_unit(self, names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        """``{name: whole exported tensor}`` of `names` (of :meth:`export_layout`), one FSDP unit at a time (every
        rank must iterate it to the end; the tensors may be views of the unit's gathered storage: copy what you
        keep before the next is yielded). With LoRA, each adapted weight is merged from its gathered unit."""
        if not self.lora:
            yield from self.strategy.whole_by_unit(names)
            return
        view = MergedWeights(self.model)
        for keys in self.strategy.by_unit({n: view.sources[n] for n in names}):
            yield {n: view.read(n) for n in keys}

    def _owner_id(self) -> str:
        if self._owner is None:
            self._owner = new_owner_id()
        return self._owner

    def _state_for(self, own: Mapping[str, torch.Tensor], dtype: str | torch.dtype | None,
                   device: torch.device | str) -> dict[str, torch.Tensor]:
        dt = _DTYPE[dtype] if isinstance(dtype, str) else dtype
        with torch.no_grad():
            return untied(own, lambda k, v: _cast(v, dt, device))

    def gathered(self, dtype: torch.dtype | None, every_rank: bool = False) -> PackedState | None:
        """The whole weights (floating ones in `dtype`) in rank 0's host buffer, gathered from the FSDP2 shards
        one unit (decoder layer) at a time (every rank runs this; the others return None unless `every_rank`). The buffer is kept across versions:
        what reads it (``ray.put``, a snapshot copy) has copied it before the next gather."""
        state = self.export_layout()
        plan = PackedState.plan(state, dtype)
        if plan is None:
            raise WeightSyncError(f"a weight's dtype cannot be staged from shards (dtypes {sorted({str(t.dtype) for t in state.values()})})")
        entries, aliases, nbytes = plan
        held = None
        if self.rank == 0 or every_rank:
            if self._cast_scratch is None:
                self._cast_scratch = {}
            held = self._cast_scratch.get("gathered")
            if not isinstance(held, PackedState) or held.entries != entries or held.aliases != aliases:
                held = self._cast_scratch["gathered"] = PackedState(torch.empty(nbytes, dtype=torch.uint8), entries,
                                                                    aliases)
        views = held.views() if held is not None else {}
        with torch.no_grad():  # one all-gather per FSDP unit, in module order on every rank
            for whole in self.whole_by_unit([name for name, *_ in entries]):
                if held is not None:
                    for name, t in whole.items():
                        views[name].copy_(t)
        return held

    def _reused(self, own: Mapping[str, torch.Tensor], layout: list[tuple[str, tuple[int, ...], str]],
                device: torch.device | str) -> dict[str, torch.Tensor] | None:
        """`own` copied (cast) into a retired snapshot of `layout` on `device` (:meth:`_Snapshots.reuse`), or None."""
        state = SNAPSHOTS.reuse(self._owner_id(), layout, device)
        if state is not None:
            done: set[int] = set()
            for k, t in state.items():
                if id(t) not in done:  # a tied tensor once
                    done.add(id(t))
                    t.copy_(own[k].detach())
        return state

    def spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{name: (shape, dtype)}`` of the weights as they would be exported."""
        return {n: (s, d) for n, s, d in layout_of(self.export_layout())}

    def stage(self, transport: Literal["local", "collective", "object_store"] = "local",
              dtype: str | None = None, keep: int = 4) -> WeightHandle | None:
        """Snapshot the current version and return its :class:`WeightHandle` (``PolicyWorker.stage_weights``).

        ``local``/``collective``: on this worker's device; `dtype` casts floating tensors (e.g. the
        rollout's ``bfloat16``; a collective channel uses the dtypes the rollout announced when it
        opened). The `keep` newest snapshots are kept; older ones are dropped (a handle to a dropped
        version is refused). ``object_store``: put into Ray's object store (:func:`store_state`; the
        handle holds the reference, `keep` does not apply)."""
        if transport not in ("local", "collective", "object_store"):
            raise ValueError("stage_weights transport must be 'local', 'collective' or 'object_store', "
                             f"got {transport!r}")
        version = self._version()
        sharded = self.strategy.sharded
        every_rank = transport == "local"  # each colocated rollout rank takes the snapshot in its own process
        if sharded:  # every rank gathers; rank 0 (every rank for local) stages from its host copy
            cast = dtype if transport == "object_store" else None  # (the others cast into their snapshot)
            held = self.gathered(_DTYPE[cast] if isinstance(cast, str) else cast, every_rank)
            if held is None:
                return None
            own = held.views()
        elif self.rank != 0 and not every_rank:
            return None  # every rank holds the weights: rank 0 alone stages them
        else:
            own = self.export_state()
        if transport == "object_store":
            dt = _DTYPE[dtype] if isinstance(dtype, str) else dtype
            if sharded and _in_ray_worker():
                import ray

                stored = ray.put(held)  # the gather already wrote (and cast) the one packed buffer
            else:
                if self._cast_scratch is None:
                    self._cast_scratch = {}
                stored = store_state(own, dt, self._cast_scratch)
            size = {k: v.numel() * (dt.itemsize if dt is not None and v.is_floating_point() else v.element_size())
                    for k, v in own.items()}
            return WeightHandle(version=version, transport="object_store", owner=self._owner_id(),
                                pid=os.getpid(), channel=None, num_tensors=len(own), nbytes=sum(size.values()),
                                stored=stored)
        channel = None
        if transport == "collective":
            if self._channel is None or self._channel_layout is None:
                raise WeightSyncError("stage_weights('collective') needs an open weight channel: call "
                                      "open_weight_channel(policy, rollout) first")
            channel = self._channel.name
            device = "cpu" if sharded else self.device  # sharded: no whole copy on the device
            with torch.no_grad():
                if self.bucketed_snapshots:  # one copy, already in the buckets send_weights broadcasts
                    state = self._reused(own, self._channel_layout, device) or bucketed_snapshot(
                        own, self._channel_layout, self._channel.bucket_bytes, device)
                else:
                    dtypes = {n: _DTYPE[d] for n, _, d in self._channel_layout}
                    state = {k: _cast(v, dtypes.get(k), device) for k, v in own.items()}
        else:
            dt = _DTYPE[dtype] if isinstance(dtype, str) else dtype
            with torch.no_grad():
                layout = [(n, s, str(dt).removeprefix("torch.") if dt is not None and own[n].is_floating_point() else d)
                          for n, s, d in layout_of(own)]
                state = (self._reused(own, layout, self.device)
                         or self._state_for(own, dtype, self.device))
        SNAPSHOTS.put(self._owner_id(), version, state, keep)
        return WeightHandle(version=version, transport=transport, owner=self._owner_id(), pid=os.getpid(),
                            channel=channel, num_tensors=len(state),
                            nbytes=sum(t.numel() * t.element_size() for t in state.values()))

    def member(self) -> dict[str, Any]:
        """This rank's process/device (``member_info``) and a free port to serve a channel's rendezvous."""
        host = os.environ.get("MASTER_ADDR") or "127.0.0.1"  # this group's rank 0 (this worker) address
        return {**member_info(self.device), "host": host, "port": free_port()}

    async def join_channel(self, name: str, host: str, port: int, world_size: int, backend: str,
                           layout: list[tuple[str, tuple[int, ...], str]], timeout_s: float = 120.0,
                           bucket_bytes: int = 256 << 20, tied: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Join channel `name` as its rank 0 (the sender); `layout` is the rollout's weight layout
        (names must match this model's; floating dtypes may differ and are cast when staging), less
        the names in `tied` (the rollout's tied weights: sent once, under the name they are tied to)."""
        import asyncio

        own = {n: s for n, s, _ in layout_of(self.export_layout()) if n not in (tied or {})}
        theirs = {n: tuple(s) for n, s, _ in layout}
        if own != theirs:
            diff = sorted(set(own) ^ set(theirs)) or sorted(n for n in own if own[n] != theirs.get(n))
            raise WeightSyncError(f"the rollout's weights differ from the policy's (names or shapes), e.g. {diff[:5]}; "
                                  "policy and rollout must be the same architecture")
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        ch = await asyncio.to_thread(WeightChannel, name, host, port, 0, world_size, backend=backend,
                                     device=self.device, timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        self._channel, self._channel_layout = ch, [(n, tuple(s), d) for n, s, d in layout]
        return {"rank": 0, "backend": ch.backend, "world_size": world_size}

    async def send(self, handle: WeightHandle) -> dict[str, Any]:
        """Send the staged version `handle` over the open channel (the rollout ranks receive it in
        ``update_weights(handle)`` at the same time). Runs beside training: the snapshot is immutable."""
        import asyncio

        if not isinstance(handle, WeightHandle) or handle.transport != "collective":
            raise WeightSyncError(f"send_weights needs a collective WeightHandle from stage_weights, got {handle!r}")
        ch, layout = self._channel, self._channel_layout
        if ch is None or layout is None or ch.name != handle.channel:
            raise WeightSyncError(f"no open weight channel {handle.channel!r} on the policy; call open_weight_channel")
        state = SNAPSHOTS.get(handle.owner, handle.version) if handle.owner == self._owner else None
        receipt = await asyncio.to_thread(ch.send, handle.version, state, layout, self.on_bucket_sent)
        if receipt["sent"]:
            SNAPSHOTS.drop_older(self._owner_id(), handle.version)
        return receipt

    def close(self) -> None:
        """Drop the channel and the staged snapshots (the policy's ``on_close``)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._owner is not None:
            SNAPSHOTS.clear(self._owner)


def _no_fault(what: str) -> None:
    """The default :attr:`WeightSource.on_bucket_sent`: nothing."""
