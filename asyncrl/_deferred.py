"""Values that are resolved on the worker, not in the controller (futures pipelining).

When a :class:`~asyncrl.GroupFuture` is passed into another group's call, the
controller sends a small descriptor holding the producer's per-rank ObjectRefs; the
worker that receives it fetches what it needs straight from the object store.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from asyncrl import batch as B
from asyncrl._backend import public_error
from asyncrl.errors import DispatchError


@dataclass(frozen=True)
class Source:
    """What a worker needs to rebuild a producer future's value."""

    group: str
    method: str
    refs: tuple[Any, ...]
    """Payload refs of the collecting ranks, in DP (or rank) order."""
    metas: tuple[Any, ...] | None
    """Refs of ``(rows, pad)`` per payload, for data-parallel producers."""
    collect: Callable[..., Any] | None
    """The producer's collect function; None in a matched-layout shard (rank r reads rank r)."""
    world: Any
    data_parallel: bool
    select: tuple[str, ...] | None = None


@dataclass(frozen=True)
class DeferredValue:
    """Resolves to the producer's whole collected value (every rank fetches all shards)."""

    source: Source


@dataclass(frozen=True)
class DeferredShard:
    """Resolves to shard `index` of `count` of a data-parallel producer's batch.

    When the producer had `count` shards too, shard i is the producer's rank-i output
    as it is (padding included); otherwise the worker fetches the metadata of every
    producer shard (a few bytes each), then only the shards that overlap its rows.
    """

    source: Source
    index: int
    count: int


Awaiter = Callable[[Any], Awaitable[Any]]


def _named(s: Source, wait: Awaiter) -> Awaiter:
    """`wait`, with a failure of the producer named after it (group and method)."""

    async def named_wait(ref: Any) -> Any:
        try:
            return await wait(ref)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise public_error(e, group=s.group, method=s.method, rank=None) from None

    return named_wait


def _select(value: Any, fields: tuple[str, ...] | None, source: Source) -> Any:
    if fields is None:
        return value
    from tensordict import TensorDictBase

    if not isinstance(value, TensorDictBase):
        raise DispatchError(
            f"a field selection of {source.group}.{source.method} needs it to return a TensorDict, "
            f"it returned {type(value).__name__}"
        )
    missing = [f for f in fields if f not in value.keys(include_nested=True)]
    if missing:
        raise DispatchError(
            f"{source.group}.{source.method} has no field(s) {missing}; "
            f"it returned fields {sorted(map(str, value.keys()))}"
        )
    return value.select(*fields)


async def resolve_value(d: DeferredValue, wait: Awaiter) -> Any:
    s = d.source
    wait = _named(s, wait)
    outs = await asyncio.gather(*(wait(r) for r in s.refs))
    if s.data_parallel:
        metas = await asyncio.gather(*(wait(m) for m in s.metas))  # type: ignore[union-attr]
        outs = [B.strip_tail(o, pad) for o, (_, pad) in zip(outs, metas)]
    assert s.collect is not None  # a Source always carries its producer's collect
    return _select(s.collect(s.world, list(outs)), s.select, s)


async def resolve_shard(d: DeferredShard, wait: Awaiter) -> tuple[Any, int]:
    """Returns ``(shard, trailing padding rows in it)``."""
    s = d.source
    wait = _named(s, wait)
    if not s.data_parallel:
        whole = await resolve_value(DeferredValue(s), wait)
        _, rows, pads = B.shard_plan(B.batch_len(whole), d.count)
        return B.take_rows(whole, rows[d.index]), pads[d.index]
    if len(s.refs) == d.count:
        out, meta = await asyncio.gather(wait(s.refs[d.index]), wait(s.metas[d.index]))  # type: ignore[index]
        return _select(out, s.select, s), int(meta[1])
    metas = await asyncio.gather(*(wait(m) for m in s.metas))  # type: ignore[union-attr]
    valid = [rows - pad for rows, pad in metas]
    total = sum(valid)
    _, plan, pads = B.shard_plan(total, d.count)
    wanted = plan[d.index]
    starts, acc = [], 0
    for v in valid:
        starts.append(acc)
        acc += v
    # global valid row -> (producer shard, row in it)
    loc = []
    for g in wanted:
        i = max(k for k in range(len(valid)) if starts[k] <= g and valid[k] > 0)
        loc.append((i, g - starts[i]))
    needed = sorted({i for i, _ in loc})
    fetched = await asyncio.gather(*(wait(s.refs[i]) for i in needed))
    by_shard = dict(zip(needed, fetched))
    pieces: list[Any] = []  # one take per run of consecutive rows from one shard
    run_shard, run_rows = loc[0][0], list[int]()
    for i, r in loc:
        if i != run_shard:
            pieces.append(B.take_rows(by_shard[run_shard], run_rows))
            run_shard, run_rows = i, []
        run_rows.append(r)
    pieces.append(B.take_rows(by_shard[run_shard], run_rows))
    return _select(B.concat(pieces), s.select, s), pads[d.index]


async def resolve_args(
    args: Sequence[Any], kwargs: dict[str, Any], wait: Awaiter
) -> tuple[list[Any], dict[str, Any], int | None]:
    """Replace deferred values in a call's arguments; also returns the input padding
    reported by deferred shards (None when there are none)."""
    pads: list[int] = []

    async def one(x: Any) -> Any:
        if isinstance(x, DeferredShard):
            value, pad = await resolve_shard(x, wait)
            pads.append(pad)
            return value
        if isinstance(x, DeferredValue):
            return await resolve_value(x, wait)
        if isinstance(x, list) and any(isinstance(i, (DeferredShard, DeferredValue)) for i in x):
            return list(await asyncio.gather(*(one(i) for i in x)))
        if isinstance(x, dict) and any(isinstance(i, (DeferredShard, DeferredValue)) for i in x.values()):
            vals = await asyncio.gather(*(one(v) for v in x.values()))
            return dict(zip(x.keys(), vals))
        return x

    new_args = list(await asyncio.gather(*(one(a) for a in args)))
    keys = list(kwargs)
    new_vals = await asyncio.gather(*(one(kwargs[k]) for k in keys))
    pad = None
    if pads:
        if len(set(pads)) != 1:
            raise DispatchError(
                f"pipelined inputs disagree on padding ({pads}); pass futures of the same batch to one call"
            )
        pad = pads[0]
    return new_args, dict(zip(keys, new_vals)), pad
