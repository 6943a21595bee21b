"""The built-in (dispatch, collect) pairs, as plain functions.

A dispatch function has verl's shape: ``dispatch(world, *args, **kwargs)`` returns
``(args, kwargs)`` where every value is a list with one entry per rank (or a
:class:`Sharded`, which also reports padding). A collect function is
``collect(world, results)`` with the results of the collecting ranks in order.
Padding rows are stripped before ``collect`` runs for data-parallel modes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

from tensordict import TensorDictBase

from asyncrl import batch as B
from asyncrl._wire import DeferredShard, Source
from asyncrl.errors import DispatchError

__all__ = [
    "World",
    "MeshRank",
    "Sharded",
    "Broadcast",
    "dispatch_one_to_all",
    "dispatch_all_to_all",
    "dispatch_dp",
    "dispatch_mesh",
    "collect_list",
    "collect_dp",
]


@dataclass(frozen=True)
class MeshRank:
    """One worker's place in a named mesh."""

    dp_rank: int
    dp_size: int
    collect: bool


@dataclass(frozen=True)
class World:
    """What dispatch and collect functions know about the group."""

    world_size: int
    group: str = ""
    meshes: dict[str, tuple[MeshRank, ...]] = field(default_factory=dict)
    """Mesh name -> the registration of every rank (index = rank)."""

    def mesh(self, name: str) -> tuple[MeshRank, ...]:
        """Per-rank registration of mesh `name`; a clear error when no worker registered it."""
        try:
            return self.meshes[name]
        except KeyError:
            known = sorted(self.meshes) or "none"
            raise DispatchError(
                f"no worker of group {self.group!r} registered mesh {name!r} (registered: {known}); "
                f"call self.register_mesh({name!r}, dp_rank=..., dp_size=...) in the worker's __init__"
            ) from None


@dataclass
class Sharded:
    """Per-rank arguments plus the trailing padding rows in each rank's shard."""

    args: tuple[list[Any], ...]
    kwargs: dict[str, list[Any]]
    pad: list[int] | None = None


@dataclass(frozen=True)
class Broadcast:
    """Wrap an argument of a data-parallel call to send it whole to every rank."""

    value: Any


class DispatchFn(Protocol):
    def __call__(self, world: World, /, *args: Any, **kwargs: Any) -> Any: ...


CollectFn = Callable[[World, list[Any]], Any]


def _source_of(x: Any) -> Source | None:
    to_source = getattr(x, "_as_source", None)
    return to_source() if to_source is not None else None


def dispatch_one_to_all(world: World, *args: Any, **kwargs: Any) -> Sharded:
    n = world.world_size
    return Sharded(tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()})


def dispatch_all_to_all(world: World, *args: Any, **kwargs: Any) -> Sharded:
    n = world.world_size
    for name, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if _source_of(value) is not None:
            raise DispatchError(
                f"ALL_TO_ALL {name} is a future; it needs a concrete list of {n} items. "
                "Await the future first, or use DP_COMPUTE to pipeline it"
            )
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"a {type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            raise DispatchError(
                f"ALL_TO_ALL {name} must be a list with one item per rank ({n} items), got {got}"
            )
    return Sharded(tuple(list(a) for a in args), {k: list(v) for k, v in kwargs.items()})


_REPLICATED = (type(None), bool, int, float, str, bytes)


def _split(world_size: int, names_values: list[tuple[str, Any]], group: str) -> tuple[list[list[Any]], list[int] | None]:
    """Split each value into `world_size` shards; returns (per-value shards, pad per shard)."""
    lengths: dict[str, int] = {}
    futures = []
    for name, v in names_values:
        if isinstance(v, Broadcast) or isinstance(v, _REPLICATED):
            continue
        if _source_of(v) is not None:
            futures.append(name)
            continue
        if not B.is_batch(v):
            raise DispatchError(
                f"data-parallel dispatch cannot split {name} of type {type(v).__name__}; pass a TensorDict, "
                "a tensor or a list with one entry per row, or wrap it in asyncrl.Broadcast(...) to send it "
                "whole to every rank"
            )
        lengths[name] = B.batch_len(v)
    if futures and lengths:
        raise DispatchError(
            f"{futures} are futures and {sorted(lengths)} concrete batches; a data-parallel call takes "
            "either futures or concrete batches. Await the futures first, or pass every batch as a future"
        )
    if len(set(lengths.values())) > 1:
        raise DispatchError(
            f"batch arguments disagree on the number of rows: {lengths}; every split argument of a "
            "data-parallel call must have the same batch size"
        )
    if not lengths and not futures:
        raise DispatchError(
            "a data-parallel call needs at least one batch argument (TensorDict, tensor, list or future)"
        )
    out: list[list[Any]] = []
    pads: list[int] | None = None  # futures: each worker learns its padding from the producer
    if lengths:
        n = next(iter(lengths.values()))
        picks, pads = _shard_picks(n, world_size)
    for name, v in names_values:
        if isinstance(v, Broadcast):
            out.append([v.value] * world_size)
        elif isinstance(v, _REPLICATED):
            out.append([v] * world_size)
        elif (src := _source_of(v)) is not None:
            if src.data_parallel and src.metas is not None and len(src.refs) == world_size:
                # Matched layouts: rank r needs only the producer's rank-r output (not the
                # producer's world or collect function either: half the pickling per call).
                out.append([DeferredShard(replace(src, refs=(src.refs[r],), metas=(src.metas[r],), collect=None,
                                                  world=None), 0, 1)
                            for r in range(world_size)])
            else:
                out.append([DeferredShard(src, r, world_size) for r in range(world_size)])
        else:
            if isinstance(v, TensorDictBase) or B.is_batch(v):
                # one shard of all the rows (a call to one rank): the batch itself, not a view of it (slicing a
                # TensorDict of text fields costs tens of microseconds, paid per routed call)
                whole = slice(0, B.batch_len(v))
                out.append([v if picks[r] == whole else B.take_rows(v, picks[r]) for r in range(world_size)])
    return out, pads


def _shard_picks(n_rows: int, world_size: int) -> tuple[list[slice | list[int]], list[int]]:
    """The rows of each shard as :func:`asyncrl.batch.shard_plan` lays them out, without
    building per-row lists for shards that hold no padding: those are slices (views of
    the input, no copy, O(1) work); only a shard with padding rows gets an index list."""
    if n_rows <= 0:
        B.shard_plan(n_rows, world_size)  # raises its error for an empty batch
    size = -(-n_rows // world_size)
    picks: list[slice | list[int]] = []
    pads: list[int] = []
    for r in range(world_size):
        start, stop = r * size, (r + 1) * size
        if stop <= n_rows:
            picks.append(slice(start, stop))
            pads.append(0)
        else:
            picks.append([g if g < n_rows else (g - n_rows) % n_rows for g in range(start, stop)])
            pads.append(stop - max(n_rows, start))
    return picks, pads


def dispatch_dp(world: World, *args: Any, **kwargs: Any) -> Sharded:
    names = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    shards, pads = _split(world.world_size, names, world.group)
    nargs = len(args)
    return Sharded(tuple(shards[:nargs]), dict(zip(kwargs, shards[nargs:])), pads)


def dispatch_mesh(world: World, *args: Any, mesh: str, **kwargs: Any) -> Sharded:
    ranks = world.mesh(mesh)
    dp_size = ranks[0].dp_size
    sub = dispatch_dp(World(dp_size, world.group, world.meshes), *args, **kwargs)
    pick = [r.dp_rank for r in ranks]
    return Sharded(
        tuple([a[d] for d in pick] for a in sub.args),
        {k: [v[d] for d in pick] for k, v in sub.kwargs.items()},
        [sub.pad[d] for d in pick] if sub.pad is not None else None,
    )


def collect_list(world: World, results: list[Any]) -> list[Any]:
    return list(results)


def collect_dp(world: World, results: list[Any]) -> Any:
    return B.concat(results)
