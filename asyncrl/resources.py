"""`ResourcePool`: the bundles a group's workers are placed on; `AsyncResource`: the
``async with`` base of every object with ``setup()`` and ``close()`` (groups, pools' users,
the trainer).

A pool lists bundles per node (``ResourcePool([4])``: four bundles on one node;
``ResourcePool([2, 2])``: two on each of two nodes). On Ray each node's bundles
become one STRICT_PACK placement group; worker i of a group takes bundle i. With
``max_colocate_count=k`` up to k groups can share every bundle (each worker takes
1/k of its CPUs and GPUs). Pools can be split into sub-pools and merged.

Lifecycle: a pool is placed (its placement groups created) by the first group that
sets up on it, and released by its owner. A group that made its own pool (no pool
given, only ``world_size``) releases it when it closes; a pool you pass to groups is
yours: release it with ``await pool.release()`` after closing its groups, or use it as
``async with ResourcePool([4]) as pool:``, which releases it on every path.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Sequence

from asyncrl._backend import Backend, Slot

__all__ = ["AsyncResource", "ResourcePool", "Slot"]


class AsyncResource:
    """`async with` for objects with `setup()` and `close()`: close on every path."""

    async def setup(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    async def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def __aenter__(self) -> Any:
        try:
            return await self.setup()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ResourcePool:
    """Bundles per node that groups are placed on.

    Placed by the first group that sets up on it; released by its owner with
    ``await pool.release()`` (close its groups first), or by ``async with pool:``.

    Args:
        bundles_per_node: how many bundles (workers) on each node.
        cpus_per_bundle: CPUs reserved by each bundle.
        gpus_per_bundle: GPUs reserved by each bundle (0 for a CPU-only pool).
        max_colocate_count: how many groups may share each bundle.
        name: prefix of the placement groups' names.
        placement_timeout: seconds to wait for the placement groups before raising
            :class:`~asyncrl.PlacementError` (an infeasible request fails at once).
        resources_per_bundle: custom Ray resources each bundle reserves besides its CPUs and GPUs
            (``{"rollout_node": 1}``): the pool goes only to nodes that advertise them.
        wait_for_capacity: keep waiting, up to `placement_timeout`, when the cluster cannot hold the
            pool now (a lost node that may come back), instead of failing at once.
    """

    def __init__(
        self,
        bundles_per_node: Sequence[int],
        *,
        cpus_per_bundle: float = 1.0,
        gpus_per_bundle: float = 0.0,
        max_colocate_count: int = 1,
        name: str = "asyncrl",
        placement_timeout: float = 60.0,
        resources_per_bundle: Mapping[str, float] | None = None,
        wait_for_capacity: bool = False,
    ) -> None:
        counts = list(bundles_per_node)
        if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts):
            raise ValueError(f"bundles_per_node must be a non-empty list of positive ints, got {bundles_per_node!r}")
        if cpus_per_bundle < 0 or gpus_per_bundle < 0 or (cpus_per_bundle == 0 and gpus_per_bundle == 0):
            raise ValueError("a bundle needs some CPUs or GPUs: set cpus_per_bundle > 0 or gpus_per_bundle > 0")
        if not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be a positive int, got {max_colocate_count!r}")
        if placement_timeout <= 0:
            raise ValueError("placement_timeout must be positive")
        custom = dict(resources_per_bundle or {})
        if any(k in ("CPU", "GPU") or not v > 0 for k, v in custom.items()):
            raise ValueError(f"resources_per_bundle takes positive amounts of custom resources (CPUs and GPUs: "
                             f"cpus_per_bundle, gpus_per_bundle), got {custom}")
        self.bundles_per_node = counts
        self.cpus_per_bundle = float(cpus_per_bundle)
        self.gpus_per_bundle = float(gpus_per_bundle)
        self.max_colocate_count = max_colocate_count
        self.name = name
        self.placement_timeout = placement_timeout
        self.resources_per_bundle = custom
        self.wait_for_capacity = wait_for_capacity
        self._slots: list[Slot] | None = None
        self._handles: list[Any] = []
        self._backend: Backend | None = None
        self._parent: tuple[ResourcePool, int, int] | None = None
        self._members: list[ResourcePool] | None = None
        self._lock: asyncio.Lock | None = None

    @property
    def world_size(self) -> int:
        """Total number of bundles."""
        return sum(self.bundles_per_node)

    @property
    def bundle(self) -> dict[str, float]:
        """What one bundle reserves: ``CPU``, ``GPU`` and the custom resources (zero amounts left out)."""
        out = {"CPU": self.cpus_per_bundle, "GPU": self.gpus_per_bundle, **self.resources_per_bundle}
        return {k: v for k, v in out.items() if v}

    @property
    def cpus_per_actor(self) -> float:
        """CPUs each worker takes from its bundle."""
        return self.cpus_per_bundle / self.max_colocate_count

    @property
    def gpus_per_actor(self) -> float:
        """GPUs each worker takes from its bundle."""
        return self.gpus_per_bundle / self.max_colocate_count

    @property
    def placed(self) -> bool:
        """True once the pool's placement groups exist."""
        return self._slots is not None

    @property
    def slots(self) -> list[Slot]:
        """The placed bundles, in rank order."""
        if self._slots is None:
            raise RuntimeError("the pool is not placed yet; a group places it in `await wg.setup()`")
        return self._slots

    async def __aenter__(self) -> "ResourcePool":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    def __repr__(self) -> str:
        return (f"ResourcePool({self.bundles_per_node}, cpus_per_bundle={self.cpus_per_bundle}, "
                f"gpus_per_bundle={self.gpus_per_bundle}, max_colocate_count={self.max_colocate_count}"
                + (f", resources_per_bundle={self.resources_per_bundle})" if self.resources_per_bundle else ")"))

    async def place(self, backend: "Backend") -> None:
        """Create the placement groups (idempotent; groups call it in `setup`)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._slots is not None:
                return
            if self._parent is not None:
                parent, start, stop = self._parent
                await parent.place(backend)
                self._slots = parent.slots[start:stop]
            elif self._members is not None:
                for m in self._members:
                    await m.place(backend)
                self._slots = [s for m in self._members for s in m.slots]
            else:
                self._slots, self._handles = await backend.place(self)
                self._backend = backend

    async def release(self) -> None:
        """Remove the pool's placement groups (idempotent; sub-pools and merged pools
        release through the pools that own them). Workers still placed on it lose
        their resources: close their groups first."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            handles, self._handles, self._slots = self._handles, [], None
            if self._backend is not None and handles:
                await self._backend.remove_placement(handles)
        if self._members is not None:
            for m in self._members:
                await m.release()

    def split(self, sizes: Sequence[int]) -> list["ResourcePool"]:
        """Split into sub-pools of `sizes` bundles (in rank order; they must add up to
        the pool's size). Sub-pools share this pool's placement groups."""
        if sum(sizes) != self.world_size or any(s < 1 for s in sizes):
            raise ValueError(f"split sizes {list(sizes)} must be positive and add up to the pool size {self.world_size}")
        out, start = [], 0
        for s in sizes:
            sub = ResourcePool([s], cpus_per_bundle=self.cpus_per_bundle, gpus_per_bundle=self.gpus_per_bundle,
                               max_colocate_count=self.max_colocate_count, name=self.name,
                               placement_timeout=self.placement_timeout, resources_per_bundle=self.resources_per_bundle,
                               wait_for_capacity=self.wait_for_capacity)
            sub._parent = (self, start, start + s)
            out.append(sub)
            start += s
        return out

    @staticmethod
    def merge(pools: Sequence["ResourcePool"]) -> "ResourcePool":
        """One pool over the bundles of `pools`, in order (they must have the same
        bundle shape). Releasing the merged pool releases its members."""
        if not pools:
            raise ValueError("merge() needs at least one pool")
        shape = {(p.cpus_per_bundle, p.gpus_per_bundle, p.max_colocate_count, tuple(sorted(p.resources_per_bundle.items())))
                 for p in pools}
        if len(shape) != 1:
            raise ValueError(f"cannot merge pools with different bundle shapes: {sorted(shape)}")
        first = pools[0]
        merged = ResourcePool([c for p in pools for c in p.bundles_per_node], cpus_per_bundle=first.cpus_per_bundle,
                              gpus_per_bundle=first.gpus_per_bundle, max_colocate_count=first.max_colocate_count,
                              name=first.name, placement_timeout=first.placement_timeout,
                              resources_per_bundle=first.resources_per_bundle,
                              wait_for_capacity=first.wait_for_capacity)
        merged._members = list(pools)
        return merged
