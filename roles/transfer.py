"""Weight transports between the policy and the rollout: in-process hand-over and a collective channel.

Three transports move a policy version to the rollout ranks (``sync_weights(transport=...)``):

``object_store``
    ``PolicyWorker.stage_weights("object_store")`` puts the version into Ray's object store
    itself (``ray.put``, inside the ordered call: the put is the snapshot, one copy of the live
    weights, or the cast when the rollout's dtype differs) and returns a :class:`WeightHandle`
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

Protocol of one collective transfer (every step is a collective with a timeout, so a rank
that dies or stalls ends it with an error on every other rank, never a hang)::

    1. header    root broadcasts [magic, version, tensors, layout hash, root code]
    2. vote      all-gather one code per rank: 0 = accept; STALE (version not newer than
                 the rank's), MISMATCH (not the version the controller asked for), LAYOUT
                 (names/shapes/dtypes differ), SENDER (root lost the snapshot)
                 -> any refusal: every rank stops here, nothing moved, channel still usable
    3. data      root broadcasts the tensors as byte buckets (bit-exact), receivers fill
                 their receive buffers (reused across transfers, never the set the engine
                 generates with nor one a rollback keeps: double buffering)
    4. ack       all-gather "received" codes -> only when every rank has everything
    5. commit    each rollout rank loads the buffers in its usual transaction (gate,
                 wait/abort in-flight generation, adopt them as the engine's weights,
                 verify, publish the version)

A failure in 1-4 (peer died, timeout) marks the channel broken on that rank: the call
raises :class:`~asyncrl.roles.WeightSyncError` and every later use raises at once until the
channel is reopened (``open_weight_channel``). Rollout ranks keep their previous weights and
version. Transfers over one channel must not overlap: ``sync_weights`` and the trainer
issue one at a time.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import os
import socket
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Mapping, NoReturn

import torch

from asyncrl import Dispatch, Execute, register

from .errors import StaleWeightsError, WeightSyncError
from .models import StateSlots
from .threads import computing

__all__ = [
    "WeightHandle",
    "fetch_stored",
    "store_state",
    "WeightChannel",
    "WeightSource",
    "SNAPSHOTS",
    "layout_of",
    "Transport",
]

Transport = Literal["object_store", "local", "collective"]

MAGIC = 0x5EED_A5C1
OK, STALE, MISMATCH, LAYOUT, SENDER, RECEIVE = 0, 1, 2, 3, 4, 5
_CODE_NAMES = {STALE: "stale version", MISMATCH: "not the version the controller asked for",
               LAYOUT: "different weight names/shapes/dtypes", SENDER: "the policy no longer holds that version",
               RECEIVE: "failed to receive"}


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
        """The snapshot a ``local`` handle names, or a WeightSyncError saying why not."""
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


def layout_of(state: Mapping[str, torch.Tensor] | Mapping[str, tuple[tuple[int, ...], str]]) -> list[tuple[str, tuple[int, ...], str]]:
    """``[(name, shape, dtype name)]`` in order, from tensors or from a ``weight_spec`` dict."""
    out = []
    for name, v in state.items():
        if isinstance(v, torch.Tensor):
            out.append((name, tuple(v.shape), str(v.dtype).removeprefix("torch.")))
        else:
            shape, dtype = v
            out.append((name, tuple(shape), str(dtype).removeprefix("torch.")))
    return out


def layout_hash(layout: list[tuple[str, tuple[int, ...], str]]) -> int:
    """A 62-bit hash of a layout (fits an int64 header field)."""
    h = hashlib.sha256(repr(layout).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 62) - 1)


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}


def _buckets(layout: list[tuple[str, tuple[int, ...], str]], bucket_bytes: int) -> list[list[int]]:
    """Indices of `layout` grouped into byte buckets of at most `bucket_bytes` (a lone larger tensor
    gets its own); both sides compute the same plan from the same layout."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(layout):
        n = _numel(shape) * _DTYPE[dtype].itemsize
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        out.append(cur)
    return out


def bucketed_snapshot(state: Mapping[str, torch.Tensor], layout: list[tuple[str, tuple[int, ...], str]],
                      bucket_bytes: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Copies of `state` in `layout`'s dtypes (floating tensors cast), laid out back to back in one flat
    byte buffer per bucket of the channel's plan (:func:`_buckets`): the send path then broadcasts each
    buffer as it is (:func:`_one_buffer`) instead of concatenating the bucket into a fresh one (a second
    copy of every byte, and fresh pages to fault in). A tensor whose offset in its bucket is not aligned
    to its dtype, or whose dtype the layout would change without casting, gets a buffer of its own
    (its bucket is then concatenated when sent, as before)."""
    out: dict[str, torch.Tensor] = {}
    for idx in _buckets(layout, bucket_bytes):
        sizes = [_numel(layout[i][1]) * _DTYPE[layout[i][2]].itemsize for i in idx]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        off = 0
        for i, n in zip(idx, sizes):
            name, shape, dtype = layout[i]
            dt, src = _DTYPE[dtype], state[name]
            if off % dt.itemsize == 0 and (src.is_floating_point() or src.dtype == dt):
                view = flat[off:off + n].view(dt).view(shape)
                view.copy_(src.detach())
                out[name] = view
            else:
                out[name] = _cast(src, dt, device)
            off += n
    return out


def _one_buffer(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat byte buffer `tensors` fill exactly, back to back in order (a bucket of
    :func:`bucketed_snapshot`), or None when they are not laid out so."""
    storage = tensors[0].untyped_storage()
    ptr, expected = storage.data_ptr(), 0
    for t in tensors:
        if (t.untyped_storage().data_ptr() != ptr or not t.is_contiguous()
                or t.storage_offset() * t.element_size() != expected):
            return None
        expected += t.numel() * t.element_size()
    if expected != storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class WeightChannel:
    """One member of a collective weight channel (a process group of its own).

    Args:
        name: the channel's name (keys the rendezvous).
        host, port: where channel rank 0 (the policy) serves the rendezvous store.
        rank, world_size: this member's channel rank (0 = sender) and the member count.
        backend: ``"gloo"`` (tensors staged through the CPU) or ``"nccl"`` (tensors on `device`).
        device: where received tensors are made (``nccl``: must be this member's GPU).
        timeout_s: deadline of the rendezvous and of every collective.
        bucket_bytes: most bytes per broadcast.
    """

    def __init__(self, name: str, host: str, port: int, rank: int, world_size: int, *, backend: str,
                 device: torch.device, timeout_s: float = 120.0, bucket_bytes: int = 256 << 20) -> None:
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"WeightChannel backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"channel rank {rank} is outside a world of {world_size}")
        self.name, self.rank, self.world_size = name, rank, world_size
        self.backend, self.timeout_s, self.bucket_bytes = backend, float(timeout_s), int(bucket_bytes)
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._recv_layout: int | None = None
        self._recv_sets: list[list[torch.Tensor]] = []  # receive buffers, reused across transfers
        td = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, port, world_size, rank == 0, timeout=td, wait_for_workers=True)
        except Exception as e:
            raise WeightSyncError(
                f"weight channel {name!r}: rank {rank} could not meet the other {world_size - 1} member(s) at "
                f"{host}:{port} within {timeout_s:g}s ({type(e).__name__}: {e}); every member must join "
                "(open_weight_channel joins policy rank 0 and every rollout rank together)"
            ) from e
        self._store = store
        prefix = dist.PrefixStore(f"asyncrl-weights/{name}", store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefix, rank, world_size, td)
        else:  # pragma: no cover - needs GPUs (unverified on real hardware, see README "On a GPU")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            torch.cuda.set_device(device)
            self.pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
        self._td = td
        self._check(torch.tensor([MAGIC], dtype=torch.int64), "handshake")

    # ---- collectives -------------------------------------------------------------------------

    def _wait(self, work: Any) -> None:
        try:
            if self.backend == "nccl":  # pragma: no cover
                work.wait(self._td)
                torch.cuda.current_stream(self.device).synchronize()
            else:
                work.wait()
        except BaseException:
            del work  # a failed Work keeps the group alive from the traceback; _abort needs it gone
            raise

    def _broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.pg.broadcast([t], opts))

    def _all_gather(self, value: int) -> list[int]:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        self._wait(self.pg.allgather([out], [t]))
        return [int(x.item()) for x in out]

    def _check(self, t: torch.Tensor, what: str) -> None:
        try:
            codes = self._all_gather(int(t.item()))
        except Exception as e:
            self._break(e, what)
        if any(c != MAGIC for c in codes):
            self._break(RuntimeError(f"handshake codes {codes}"), what)

    def _break(self, e: BaseException, what: str) -> NoReturn:
        self.broken = f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        self._abort()  # the peers' pending collectives fail now instead of at their timeout
        raise WeightSyncError(
            f"weight channel {self.name!r} (rank {self.rank} of {self.world_size}, {self.backend}) failed during "
            f"{self.broken}; a member died or stalled past {self.timeout_s:g}s. Rollout ranks keep their previous "
            "weights; reopen the channel (open_weight_channel) or fall back to transport='object_store'"
        ) from e

    def _usable(self) -> None:
        if self.broken is not None:
            raise WeightSyncError(
                f"weight channel {self.name!r} is broken by an earlier failure ({self.broken}); reopen it with "
                "open_weight_channel before syncing again"
            )

    # ---- the protocol --------------------------------------------------------------------------

    def send(self, version: int, state: dict[str, torch.Tensor] | None, layout: list[tuple[str, tuple[int, ...], str]],
             on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Run the protocol as channel rank 0. `state` None means the version is not staged (every
        rank is told, nothing moves). Returns ``{"version", "sent", "codes", "bytes"}``; raises
        :class:`WeightSyncError` only when the channel fails."""
        if self.rank != 0:
            raise RuntimeError("only channel rank 0 sends")
        with self._lock:
            self._usable()
            root_code = OK if state is not None else SENDER
            header = torch.tensor([MAGIC, version, len(layout), layout_hash(layout), root_code], dtype=torch.int64,
                                  device=self.device)
            try:
                self._broadcast(header)
                codes = self._all_gather(root_code)
            except Exception as e:
                self._break(e, f"the header/vote of version {version}")
            if any(codes):
                return {"version": version, "sent": False, "codes": codes, "bytes": 0}
            assert state is not None
            sent = 0
            try:
                for idx in _buckets(layout, self.bucket_bytes):
                    flat = _one_buffer([state[layout[i][0]] for i in idx])  # a bucketed snapshot: no copy
                    if flat is None:
                        parts = [state[layout[i][0]].detach().reshape(-1).view(torch.uint8) for i in idx]
                        flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
                    flat = flat.to(self.device)
                    self._broadcast(flat)
                    sent += flat.numel()
                    if on_progress is not None:
                        on_progress("bucket")
                acks = self._all_gather(OK)
            except Exception as e:
                self._break(e, f"the transfer of version {version}")
            return {"version": version, "sent": not any(acks), "codes": acks, "bytes": sent}

    def receive(self, expected_version: int, layout: list[tuple[str, tuple[int, ...], str]],
                vote: Callable[[int], int], device: torch.device,
                on_progress: Callable[[str], None] | None = None,
                keep: Iterable[torch.Tensor] = ()) -> dict[str, torch.Tensor]:
        """Run the protocol as a receiving rank: `vote(version)` returns OK or STALE for this rank.

        Returns the received tensors (on `device`, in `layout` order), views into the channel's
        receive buffers: one flat buffer per bucket, reused by the next transfer of the same layout
        (fresh buffers would cost a page fault per 4 KiB on every sync). The caller names what it keeps
        in `keep` (the tensors its engine adopted and generates with, the weights a verified rollout
        rolls back to): buffers that hold any of those are not written; another set is made instead
        (double buffering). Raises :class:`StaleWeightsError` when this rank refused a
        stale version, and :class:`WeightSyncError` when another rank refused or the channel failed."""
        if self.rank == 0:
            raise RuntimeError("channel rank 0 sends; it does not receive")
        with self._lock:
            self._usable()
            header = torch.zeros(5, dtype=torch.int64, device=self.device)
            try:
                self._broadcast(header)
            except Exception as e:
                self._break(e, f"the header of version {expected_version}")
            magic, version, _, lhash, root_code = (int(x) for x in header.tolist())
            if magic != MAGIC:
                self._break(RuntimeError(f"bad header magic {magic:#x}"), "the header")
            if root_code:
                code = OK
            elif version != expected_version:
                code = MISMATCH
            elif lhash != layout_hash(layout):
                code = LAYOUT
            else:
                code = vote(version)
            try:
                codes = self._all_gather(code)
            except Exception as e:
                self._break(e, f"the vote on version {version}")
            if any(codes):
                raise _refusal(self.rank, version, expected_version, codes)
            out: dict[str, torch.Tensor] = {}
            plan = _buckets(layout, self.bucket_bytes)
            buffers = self._receive_buffers(layout, plan, keep)
            try:
                for idx, flat in zip(plan, buffers):
                    nbytes = [_numel(layout[i][1]) * _DTYPE[layout[i][2]].itemsize for i in idx]
                    self._broadcast(flat)
                    flat = flat.to(device)
                    off = 0
                    for i, n in zip(idx, nbytes):
                        name, shape, dtype = layout[i]
                        part = flat[off:off + n]
                        if off % _DTYPE[dtype].itemsize:  # a view needs an aligned offset
                            part = part.clone()
                        out[name] = part.view(_DTYPE[dtype]).view(shape)
                        off += n
                    if on_progress is not None:
                        on_progress("bucket")
                acks = self._all_gather(OK)
            except Exception as e:
                self._break(e, f"the transfer of version {version}")
            if any(acks):
                raise WeightSyncError(f"weight channel {self.name!r}: version {version} aborted, ranks {acks} "
                                      "did not receive everything; weights unchanged")
            return out

    def _receive_buffers(self, layout: list[tuple[str, tuple[int, ...], str]], plan: list[list[int]],
                         keep: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """One flat byte buffer per bucket of `plan`: a set an earlier receive of this layout made, unless
        it holds a tensor of `keep`; else a new set. Kept are the sets holding a tensor of `keep` (the
        engine's adopted weights, a rollback point: at most two) and the one being written."""
        lhash = layout_hash(layout)
        if self._recv_layout != lhash:
            self._recv_layout, self._recv_sets = lhash, []
        kept = {t.untyped_storage().data_ptr() for t in keep if isinstance(t, torch.Tensor)}
        for bufs in self._recv_sets:
            if not any(b.untyped_storage().data_ptr() in kept for b in bufs):
                return bufs
        sizes = [sum(_numel(layout[i][1]) * _DTYPE[layout[i][2]].itemsize for i in idx) for idx in plan]
        bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        self._recv_sets = [s for s in self._recv_sets if any(b.untyped_storage().data_ptr() in kept for b in s)]
        self._recv_sets.append(bufs)
        return bufs

    def _abort(self) -> None:
        # Dropping the last reference closes the group's sockets, so the peers' pending collectives
        # fail at once ("connection closed") instead of at their timeout. (ProcessGroupGloo.abort()
        # keeps the sockets open until the process exits, and measured here it could crash a peer.)
        self.pg = None

    def close(self) -> None:
        """Drop the process group (the peers' pending and next collectives fail)."""
        self._abort()
        self.broken = self.broken or "closed"


def _refusal(rank: int, version: int, expected: int, codes: list[int]) -> Exception:
    own = codes[rank]
    others = {r: _CODE_NAMES.get(c, str(c)) for r, c in enumerate(codes) if c and r != rank}
    if own == STALE:
        return StaleWeightsError(
            f"refusing weights of version {version} on channel rank {rank}: this rank already has that version or a "
            "newer one; updates must carry strictly increasing versions (nothing was transferred)"
        )
    if own == MISMATCH:
        return WeightSyncError(
            f"channel rank {rank} was asked to receive version {expected} but the policy sent version {version} "
            "(concurrent or misordered syncs on one channel); nothing was transferred, issue one sync at a time"
        )
    if own == LAYOUT:
        return WeightSyncError(
            f"channel rank {rank}: the policy's weight layout differs from this rollout's (names, shapes or dtypes); "
            "nothing was transferred; policy and rollout must be the same architecture"
        )
    return WeightSyncError(f"version {version} was refused by channel rank(s) {others}; nothing was transferred and "
                           "this rank keeps its weights")


def channel_backend(members: Iterable[Mapping[str, Any]], requested: str = "auto") -> str:
    """``nccl`` when every member is on a distinct GPU (and `requested` allows it), else ``gloo``.

    Raises WeightSyncError when two members share a process (colocated: use ``local``) or
    ``nccl`` is requested where it cannot work."""
    ms = list(members)
    pids = [(m["node"], m["pid"]) for m in ms]
    if len(set(pids)) != len(pids):
        raise WeightSyncError(
            "the policy and a rollout rank share one process (colocated): a collective channel would deadlock "
            "there; use transport='local' (in-process hand-over) for colocated roles"
        )
    on_gpu = all(str(m["device"]).startswith("cuda") for m in ms)
    distinct = len({m["uuid"] for m in ms}) == len(ms)
    if requested == "gloo":
        return "gloo"
    if requested == "nccl":
        if not (on_gpu and distinct):
            raise WeightSyncError(
                "backend='nccl' needs every channel member on its own GPU, but the members are on "
                f"{[m['device'] for m in ms]} ({'shared GPUs' if on_gpu else 'some on the CPU'}); use backend='auto' "
                "(gloo, staged through the CPU) or place policy and rollout on distinct GPUs"
            )
        return "nccl"
    if requested != "auto":
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {requested!r}")
    return "nccl" if on_gpu and distinct else "gloo"


def member_info(device: torch.device) -> dict[str, Any]:
    """Who a prospective channel member is: process, node, device and the device's physical id."""
    from .device import device_uuid

    return {"pid": os.getpid(), "node": socket.gethostname(), "device": str(device), "uuid": device_uuid(device)}


def _in_ray_worker() -> bool:
    """Whether this process is a Ray worker (an actor), where ``ray.put`` makes an object it owns."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return bool(ray.get_runtime_context().worker.mode == ray.WORKER_MODE)


def _alias(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two state-dict entries one tensor (tied weights: ``lm_head`` and ``embed_tokens``)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def untied(state: Mapping[str, torch.Tensor], fn: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{name: fn(name, tensor)}`` with `fn` called once per distinct tensor: names that share one
    tensor (tied weights) share the result, so a snapshot copies, casts and ships it once."""
    seen: dict[tuple[Any, ...], torch.Tensor] = {}
    out = {}
    for k, v in state.items():
        key = _alias(v)
        if key not in seen:
            seen[key] = fn(k, v)
        out[k] = seen[key]
    return out


def store_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                scratch: dict[str, torch.Tensor] | None = None) -> Any:
    """`state` (floating tensors cast to `dtype`) as one object for the rollout: in a Ray worker, an
    ObjectRef of a ``ray.put`` of it, made before this returns, so the live tensors may change right
    after (Ray's one copy into the store is the snapshot; a cast makes its own copy first, into
    `scratch` when given: buffers kept across calls, whose pages are already mapped, since ``ray.put``
    has copied them into the store when it returns); elsewhere (in-process groups) a dict of copies.
    Tied weights are stored once (both names unpickle to one tensor)."""
    with torch.no_grad():
        if not _in_ray_worker():
            return untied(state, lambda k, v: _cast(v, dtype, "cpu"))
        import ray

        def view(name: str, t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if (dtype is not None and t.is_floating_point() and t.dtype != dtype) or t.device.type != "cpu":
                target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
                buf = scratch.get(name) if scratch is not None else None
                if buf is None or buf.shape != t.shape or buf.dtype != target:
                    buf = torch.empty(t.shape, dtype=target)
                    if scratch is not None:
                        scratch[name] = buf
                return buf.copy_(t)
            return t if t.is_contiguous() else t.contiguous()

        return ray.put(untied(state, view))


async def fetch_stored(handle: WeightHandle) -> dict[str, torch.Tensor]:
    """The state dict an ``object_store`` handle holds (read-only zero-copy views of the store on Ray)."""
    stored = handle.stored
    if isinstance(stored, Mapping):
        return dict(stored)
    try:
        state = await stored
    except Exception as e:
        raise WeightSyncError(
            f"the weights of version {handle.version} could not be read from Ray's object store "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); the policy that put them "
            "owns them: if it died, restart it and sync again"
        ) from e
    if not isinstance(state, Mapping):
        raise WeightSyncError(f"an object_store weight handle held {type(state).__name__}, not a state dict")
    return dict(state)


def _cast(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
    """A detached copy of `t` on `device`, floating tensors cast to `dtype` (when given)."""
    target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    return t.detach().to(device=device, dtype=target, copy=True)


class WeightSource:
    """The sending side of the weight transports, mixed into :class:`~asyncrl.roles.PolicyWorker`.

    Expects ``self.model`` (the trained module), ``self._version`` and ``self.placement``.
    Only rank 0 stages and sends (every rank holds the same weights).
    """

    model: torch.nn.Module
    _version: int
    placement: Any
    _channel: "WeightChannel | None" = None
    _channel_layout: list[tuple[str, tuple[int, ...], str]] | None = None
    _owner: str | None = None
    _cast_scratch: dict[str, torch.Tensor] | None = None
    """``object_store`` with a cast: the buffers the cast writes before ``ray.put`` copies them (kept)."""
    _bucketed_snapshots: bool = True
    """Stage collective snapshots in the channel's buckets (:func:`bucketed_snapshot`); False stages one
    tensor per weight and concatenates each bucket when sending (the path before; kept for the benchmark's
    side-by-side, benchmarks/weight_sync.py)."""

    def _own_state(self) -> dict[str, torch.Tensor]:
        """``self.model.state_dict()`` without walking the modules each time (:class:`StateSlots`)."""
        slots = self.__dict__.get("_state_slots")
        if slots is None or slots.model is not self.model:
            slots = self.__dict__["_state_slots"] = StateSlots(self.model)
        return slots.state()

    def _owner_id(self) -> str:
        if self._owner is None:
            self._owner = new_owner_id()
        return self._owner

    def _state_for(self, dtype: str | torch.dtype | None, device: torch.device | str) -> dict[str, torch.Tensor]:
        dt = _DTYPE[dtype] if isinstance(dtype, str) else dtype
        with torch.no_grad():
            return untied(self.model.state_dict(), lambda k, v: _cast(v, dt, device))

    def _reused(self, own: Mapping[str, torch.Tensor],
                layout: list[tuple[str, tuple[int, ...], str]]) -> dict[str, torch.Tensor] | None:
        """`own` copied (cast) into a retired snapshot of `layout` (:meth:`_Snapshots.reuse`), or None."""
        state = SNAPSHOTS.reuse(self._owner_id(), layout, self.placement.device)
        if state is not None:
            done: set[int] = set()
            for k, t in state.items():
                if id(t) not in done:  # a tied tensor once
                    done.add(id(t))
                    t.copy_(own[k].detach())
        return state

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{name: (shape, dtype)}`` of the weights as they would be exported."""
        return {n: (s, d) for n, s, d in layout_of(self.model.state_dict())}

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    @computing  # the copy (cast) is compute: with num_threads="follow" it takes the cores left idle
    def stage_weights(self, transport: Literal["local", "collective", "object_store"] = "local",
                      dtype: str | None = None, keep: int = 4) -> WeightHandle:
        """Snapshot the current version and return its :class:`WeightHandle`.

        ``local``/``collective``: on this worker's device; `dtype` casts floating tensors (e.g. the
        rollout's ``bfloat16``; a collective channel uses the dtypes the rollout announced when it
        opened). The `keep` newest snapshots are kept; older ones are dropped (a handle to a dropped
        version is refused). ``object_store``: put into Ray's object store (:func:`store_state`; the
        handle holds the reference, `keep` does not apply)."""
        if transport not in ("local", "collective", "object_store"):
            raise ValueError("stage_weights transport must be 'local', 'collective' or 'object_store', "
                             f"got {transport!r}")
        if transport == "object_store":
            own = self._own_state()
            dt = _DTYPE[dtype] if isinstance(dtype, str) else dtype
            if self._cast_scratch is None:
                self._cast_scratch = {}
            stored = store_state(own, dt, self._cast_scratch)
            size = {k: v.numel() * (dt.itemsize if dt is not None and v.is_floating_point() else v.element_size())
                    for k, v in own.items()}
            return WeightHandle(version=self._version, transport="object_store", owner=self._owner_id(),
                                pid=os.getpid(), channel=None, num_tensors=len(own), nbytes=sum(size.values()),
                                stored=stored)
        channel = None
        if transport == "collective":
            if self._channel is None or self._channel_layout is None:
                raise WeightSyncError("stage_weights('collective') needs an open weight channel: call "
                                      "open_weight_channel(policy, rollout) first")
            channel = self._channel.name
            with torch.no_grad():
                own = self._own_state()
                if self._bucketed_snapshots:  # one copy, already in the buckets send_weights broadcasts
                    state = self._reused(own, self._channel_layout) or bucketed_snapshot(
                        own, self._channel_layout, self._channel.bucket_bytes, self.placement.device)
                else:
                    dtypes = {n: _DTYPE[d] for n, _, d in self._channel_layout}
                    state = {k: _cast(v, dtypes.get(k), self.placement.device) for k, v in own.items()}
        else:
            dt = _DTYPE[dtype] if isinstance(dtype, str) else dtype
            with torch.no_grad():
                own = self._own_state()
                layout = [(n, s, str(dt).removeprefix("torch.") if dt is not None and own[n].is_floating_point() else d)
                          for n, s, d in layout_of(own)]
                state = self._reused(own, layout) or self._state_for(dtype, self.placement.device)
        SNAPSHOTS.put(self._owner_id(), self._version, state, keep)
        return WeightHandle(version=self._version, transport=transport, owner=self._owner_id(), pid=os.getpid(),
                            channel=channel, num_tensors=len(state),
                            nbytes=sum(t.numel() * t.element_size() for t in state.values()))

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def channel_member(self) -> dict[str, Any]:
        """This rank's process/device (``member_info``) and a free port to serve a channel's rendezvous."""
        host = os.environ.get("MASTER_ADDR") or "127.0.0.1"  # this group's rank 0 (this worker) address
        return {**member_info(self.placement.device), "host": host, "port": free_port()}

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO, concurrent=True)
    async def join_weight_channel(self, name: str, host: str, port: int, world_size: int, backend: str,
                                  layout: list[tuple[str, tuple[int, ...], str]], timeout_s: float = 120.0,
                                  bucket_bytes: int = 256 << 20, tied: Mapping[str, str] | None = None
                                  ) -> dict[str, Any]:
        """Join channel `name` as its rank 0 (the sender); `layout` is the rollout's weight layout
        (names must match this model's; floating dtypes may differ and are cast when staging), less
        the names in `tied` (the rollout's tied weights: sent once, under the name they are tied to)."""
        import asyncio

        own = {n: s for n, s, _ in layout_of(self.model.state_dict()) if n not in (tied or {})}
        theirs = {n: tuple(s) for n, s, _ in layout}
        if own != theirs:
            diff = sorted(set(own) ^ set(theirs)) or sorted(n for n in own if own[n] != theirs.get(n))
            raise WeightSyncError(f"the rollout's weights differ from the policy's (names or shapes), e.g. {diff[:5]}; "
                                  "policy and rollout must be the same architecture")
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        ch = await asyncio.to_thread(WeightChannel, name, host, port, 0, world_size, backend=backend,
                                     device=self.placement.device, timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        self._channel, self._channel_layout = ch, [(n, tuple(s), d) for n, s, d in layout]
        return {"rank": 0, "backend": ch.backend, "world_size": world_size}

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO, concurrent=True)
    async def send_weights(self, handle: WeightHandle) -> dict[str, Any]:
        """Send the staged version `handle` over the open channel (the rollout ranks receive it in
        ``update_weights(handle)`` at the same time). Runs beside training: the snapshot is immutable."""
        import asyncio

        if not isinstance(handle, WeightHandle) or handle.transport != "collective":
            raise WeightSyncError(f"send_weights needs a collective WeightHandle from stage_weights, got {handle!r}")
        ch, layout = self._channel, self._channel_layout
        if ch is None or layout is None or ch.name != handle.channel:
            raise WeightSyncError(f"no open weight channel {handle.channel!r} on the policy; call open_weight_channel")
        state = SNAPSHOTS.get(handle.owner, handle.version) if handle.owner == self._owner else None
        receipt = await asyncio.to_thread(ch.send, handle.version, state, layout, self._on_bucket_sent)
        if receipt["sent"]:
            SNAPSHOTS.drop_older(self._owner_id(), handle.version)
        return receipt

    def _on_bucket_sent(self, what: str) -> None:
        """Called after each bucket a transfer sends (a seam for fault-injection tests)."""

    def close_weight_channel(self) -> None:
        """Drop the channel and the staged snapshots (called on close)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._owner is not None:
            SNAPSHOTS.clear(self._owner)
