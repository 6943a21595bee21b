"""The data-parallel group of a trained role's ranks: its torch.distributed process group and the small
collectives (reductions, agreement) the ranks run besides their training strategy's."""

from __future__ import annotations

import os
from typing import Any

import torch

from asyncrl.roles.modeling.device import device_uuid

__all__ = ["DataParallel"]


class DataParallel:
    """Collectives over the ranks of a group with torch.distributed when the group has several
    workers in separate processes; every method is the identity otherwise.

    It owns the group's process group; gradients travel over it through the role's training strategy
    (:mod:`asyncrl.roles.modeling.strategy`: DDP or FSDP2), metrics and agreement through the methods here.
    Every rank must call the same collectives in the same order (the group's ordered calls guarantee
    it for methods that all ranks run). The process group comes from the group's environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, set by asyncrl per worker). Gloo carries the small control
    traffic; on GPUs gradients go through NCCL when every rank has a GPU of its own, and through gloo
    when ranks share one GPU (fractional GPU pools), since NCCL refuses two ranks on one device."""

    def __init__(self, rank: int, world_size: int, device: torch.device | None = None) -> None:
        self.active = False
        self.device = device or torch.device("cpu")
        self.backend = "none"
        self._group: Any = None
        if world_size > 1 and os.environ.get("MASTER_ADDR") and os.environ.get("RANK") == str(rank):
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo", rank=rank, world_size=world_size)
            self.active = True
            self.backend = "gloo"
            if self.device.type == "cuda":
                self._group = _nccl_group(self.device, world_size)
                if self._group is not None:
                    self.backend = "nccl"
        self.rank = rank
        self.world_size = world_size

    def _reduce(self, t: torch.Tensor, op: Any) -> None:
        """In-place all-reduce of `t` wherever it lives (NCCL on a GPU of its own, else gloo)."""
        import torch.distributed as dist

        if t.device.type == "cpu":
            dist.all_reduce(t, op=op)
        elif self._group is not None:
            dist.all_reduce(t, op=op, group=self._group)
        else:
            host = t.cpu()
            dist.all_reduce(host, op=op)
            t.copy_(host)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`t` reduced over the ranks (``"sum"`` or ``"max"``), as a new tensor."""
        out = t.detach().clone()
        if not self.active:
            return out
        import torch.distributed as dist

        self._reduce(out, dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out

    def grad_group(self) -> Any:
        """The process group gradients and FSDP2 shards travel over: NCCL when every rank has a GPU of
        its own, else the default (gloo) group."""
        import torch.distributed as dist

        return self._group if self._group is not None else dist.group.WORLD

    def agree(self, kind: int, problem: str | None) -> tuple[int, str | None]:
        """Every rank learns whether any rank found a problem (one collective), so all ranks raise
        together instead of some waiting forever in the next collective.

        `kind` is 0 when this rank's shard is fine, else a caller-defined error code (> 0) with
        its `problem` message. Returns ``(kind, message)``: this rank's own, or the code of the
        first rank that found one and a message naming it; ``(0, None)`` when every rank is fine."""
        if not self.active:
            return kind, problem
        flags = torch.zeros(self.world_size, dtype=torch.float64)
        flags[self.rank] = float(kind)
        flags = self.all_reduce(flags)
        if kind or not flags.any():
            return kind, problem
        bad = [r for r in range(self.world_size) if flags[r] > 0]
        return int(flags[bad[0]]), (f"rank(s) {bad} rejected their shard of this batch (see the error of rank "
                                    f"{bad[0]}); nothing was applied on any rank")

    def mean(self, value: float) -> float:
        """Average of a scalar over the ranks."""
        return float(self.all_reduce(torch.tensor([value], dtype=torch.float64))) / self.world_size


_NCCL_GROUPS: dict[str, Any] = {}


def _nccl_group(device: torch.device, world_size: int) -> Any:
    """An NCCL group over the default group's ranks when they all have distinct GPUs, else None.

    Decided from every rank's GPU UUID (gathered over gloo), so all ranks agree; created once per
    process (colocated trained roles share it)."""
    import torch.distributed as dist

    if "group" in _NCCL_GROUPS:
        return _NCCL_GROUPS["group"]
    uuids: list[Any] = [None] * world_size
    dist.all_gather_object(uuids, device_uuid(device))
    group = None
    if len(set(uuids)) == world_size and all(str(u).startswith("cuda") for u in uuids):
        group = dist.new_group(backend="nccl")  # pragma: no cover - needs several GPUs
    _NCCL_GROUPS["group"] = group
    return group
