"""The collective weight channel: a torch.distributed process group of its own between policy rank 0
(channel rank 0, the sender) and every rollout rank (channel ranks 1..n), NCCL when all members sit on
distinct GPUs, gloo otherwise; and what both ends share (layouts, byte buckets, casts).

Used by the ``collective`` transport of :mod:`asyncrl.roles.weights.transfer` (``stage_weights("collective")``,
``send_weights`` on the policy, ``update_weights`` on the rollout).

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

import datetime
import hashlib
import os
import socket
import threading
from typing import Any, Callable, Iterable, Mapping, NoReturn

import torch

from asyncrl.roles.errors import StaleWeightsError, WeightsLostError, WeightSyncError
from asyncrl.roles.modeling.device import device_uuid
from asyncrl.runtime import free_port

__all__ = ["WeightChannel", "bucketed_snapshot", "channel_backend", "free_port", "layout_hash", "layout_of",
           "member_info"]

MAGIC = 0x5EED_A5C1
OK, STALE, MISMATCH, LAYOUT, SENDER, RECEIVE = 0, 1, 2, 3, 4, 5
_CODE_NAMES = {STALE: "stale version", MISMATCH: "not the version the controller asked for",
               LAYOUT: "different weight names/shapes/dtypes", SENDER: "the policy no longer holds that version",
               RECEIVE: "failed to receive"}


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
            self._break(RuntimeError(f"handshake codes {codes}"), what, lost=False)

    def _break(self, e: BaseException, what: str, *, lost: bool = True) -> NoReturn:
        """Mark the channel broken and raise: a `WeightsLostError` when a member died or stalled (`lost`), a
        plain `WeightSyncError` when the members disagree on the protocol."""
        self.broken = f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        self._abort()  # the peers' pending collectives fail now instead of at their timeout
        raise (WeightsLostError if lost else WeightSyncError)(
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
                self._break(RuntimeError(f"bad header magic {magic:#x}"), "the header", lost=False)
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
    return {"pid": os.getpid(), "node": socket.gethostname(), "device": str(device), "uuid": device_uuid(device)}


def _cast(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
    """A detached copy of `t` on `device`, floating tensors cast to `dtype` (when given)."""
    target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    return t.detach().to(device=device, dtype=target, copy=True)
