"""`Worker`: the base class of everything that runs in a group.

A worker is an ordinary Python class. In a group, asyncrl constructs it inside a
worker process after setting the torch.distributed environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); constructed directly, it is a plain local
object whose registered methods can be called (and debugged) like any method.
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass, field
from typing import Any

from asyncrl.dispatch import MeshRank

__all__ = ["Worker", "WorkerContext", "RoleSpec", "PROTECTED_ENV"]

PROTECTED_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
"""Environment variables asyncrl sets per worker; a group's `env` may not override them."""


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker sits: its rank in the group and the resources it was given."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: str = "local"
    role: str = "worker"
    num_cpus: float = 1.0
    num_gpus: float = 0.0

    @classmethod
    def from_env(cls) -> "WorkerContext":
        """The context of a worker constructed outside a group: from RANK/WORLD_SIZE if set."""
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )


@dataclass
class RoleSpec:
    """How to build one worker object in a host (the controller sends one per role to each host)."""

    role: str
    group: str
    cls: type
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    context: WorkerContext = field(default_factory=WorkerContext)
    env: dict[str, str] = field(default_factory=dict)


_CONTEXT: contextvars.ContextVar[WorkerContext | None] = contextvars.ContextVar("asyncrl_worker_context", default=None)


class Worker:
    """Base class of remote workers.

    Subclasses define methods decorated with :func:`asyncrl.register`. No call to
    ``super().__init__()`` is needed: rank and world size are set before ``__init__``.
    """

    _asyncrl_ctx: WorkerContext
    _asyncrl_meshes: dict[str, MeshRank]
    _asyncrl_colocated: dict[str, "Worker"]

    def __new__(cls, *args: object, **kwargs: object) -> "Worker":
        self = super().__new__(cls)
        self._asyncrl_ctx = _CONTEXT.get() or WorkerContext.from_env()
        self._asyncrl_meshes = {}
        self._asyncrl_colocated = {}
        return self

    @property
    def rank(self) -> int:
        """This worker's rank in its group (0 when constructed locally)."""
        return self._asyncrl_ctx.rank

    @property
    def world_size(self) -> int:
        """Number of workers in the group (1 when constructed locally)."""
        return self._asyncrl_ctx.world_size

    @property
    def local_rank(self) -> int:
        """Rank among the group's workers on this node."""
        return self._asyncrl_ctx.local_rank

    @property
    def context(self) -> WorkerContext:
        """The full placement context (group name, role, CPUs and GPUs given)."""
        return self._asyncrl_ctx

    def colocated(self, role: str) -> "Worker":
        """The worker object of `role` that shares this worker's process and rank (groups made together by
        ``colocate``), for work that must not cross a process: call its methods directly, as plain functions
        (no group contract, no ordered lane; the caller keeps them from running at once where that matters).
        Raises :class:`LookupError` naming the roles here when none is `role`."""
        peer = self._asyncrl_colocated.get(role)
        if peer is None:
            here = sorted(self._asyncrl_colocated) or ["none (not built by a group)"]
            raise LookupError(f"no {role!r} worker shares this process with rank {self.rank}; roles here: "
                              f"{', '.join(here)} (colocate the groups to give it one)")
        return peer

    def register_mesh(self, name: str, *, dp_rank: int, dp_size: int, collect: bool = True) -> None:
        """Declare this worker's place in mesh `name` (e.g. a dp x tp layout).

        Calls dispatched with ``Dispatch.mesh(name)`` send DP shard `dp_rank` to this
        worker; its result is collected only when `collect` is true (typically for
        tp_rank == 0 and the last pipeline stage).
        """
        if name in self._asyncrl_meshes:
            raise ValueError(f"mesh {name!r} is already registered on rank {self.rank}; register each mesh once")
        if not (isinstance(dp_size, int) and dp_size >= 1 and isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
            raise ValueError(f"mesh {name!r}: need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        self._asyncrl_meshes[name] = MeshRank(dp_rank, dp_size, bool(collect))

    @property
    def meshes(self) -> dict[str, MeshRank]:
        """The meshes this worker registered."""
        return dict(self._asyncrl_meshes)

    def on_close(self) -> None:
        """Called in the worker process when its group closes gracefully. Override to release resources."""
