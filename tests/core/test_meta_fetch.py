"""Which `(rows, padding)` metadata a data-parallel call's own result fetches.

A rank whose input the controller split itself with no padding rows returns none, so the
controller does not await its metadata (the second return object); a padded rank's is
awaited and its padding stripped exactly; a pipelined input's padding comes from its
producer, so every rank's metadata is awaited. The same holds for ``await``,
``result()`` and ``as_completed()``, and a failing rank is named on every path.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from tensordict import TensorDict

from asyncrl import RemoteError

from tests.core import kinds
from tests.core.kinds import BACKENDS
from tests.core.workers import Probe


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=BACKENDS)
async def wg(request, ray_cluster):
    async with kinds.group(request.param, Probe, world_size=2, name=f"meta-{request.param}") as group:
        yield group


def rows(n: int) -> TensorDict:
    td = TensorDict({"x": torch.arange(n)}, batch_size=[n])
    td["prompt"] = [f"p{i}" for i in range(n)]
    return td


async def blocking(wg, fut):
    """`result()` from a thread without a loop (the Ray backends only: the local one has none)."""
    if wg.name.startswith("meta-local"):
        return await fut
    return await asyncio.to_thread(fut.result, 30)


async def test_an_even_split_fetches_no_metadata_and_collects_exactly(wg):
    fut = wg.tag(rows(4))
    assert tuple(fut._call.fetch_metas) == ()
    out = await fut
    assert out["y"].tolist() == [0, 2, 4, 6] and out["rank"].tolist() == [0, 0, 1, 1]
    again = wg.tag(rows(4))
    assert (await blocking(wg, again))["y"].tolist() == [0, 2, 4, 6]
    streamed = {r: v["y"].tolist() async for r, v in wg.tag(rows(4)).as_completed()}
    assert streamed == {0: [0, 2], 1: [4, 6]}


async def test_a_padded_last_rank_fetches_its_metadata_only_and_strips_its_padding(wg):
    fut = wg.tag(rows(3))  # rank 0: rows 0, 1; rank 1: row 2 and one padding row
    assert tuple(fut._call.fetch_metas) == (1,)
    out = await fut
    assert out["y"].tolist() == [0, 2, 4] and out["prompt"] == ["P0", "P1", "P2"]
    assert (await blocking(wg, wg.tag(rows(3))))["y"].tolist() == [0, 2, 4]
    streamed = {r: v["y"].tolist() async for r, v in wg.tag(rows(3)).as_completed()}
    assert streamed == {0: [0, 2], 1: [4]}


async def test_padding_of_a_method_that_returns_more_rows_is_stripped_in_proportion(wg):
    fut = wg.repeat_rows(rows(3))  # rank 1 returns 4 rows, 2 of them padding
    assert tuple(fut._call.fetch_metas) == (1,)
    out = await fut
    assert out["x"].tolist() == [0, 0, 1, 1, 2, 2]
    assert (await blocking(wg, wg.repeat_rows(rows(3))))["x"].tolist() == [0, 0, 1, 1, 2, 2]


async def test_a_pipelined_input_fetches_every_metadata_its_producer_padded(wg):
    produced = wg.tag(rows(3))
    fut = wg.inc(produced)  # rank 1's padding is known only to the producer's rank 1
    assert tuple(fut._call.fetch_metas) == (0, 1)
    assert (await fut)["y"].tolist() == [1, 3, 5]
    assert (await blocking(wg, wg.inc(wg.tag(rows(3)))))["y"].tolist() == [1, 3, 5]
    streamed = {r: v["y"].tolist() async for r, v in wg.inc(wg.tag(rows(3))).as_completed()}
    assert streamed == {0: [1, 3], 1: [5]}


@pytest.mark.parametrize("n", [4, 3], ids=["no-padding", "padded"])
async def test_a_failing_rank_is_named_with_or_without_its_metadata(wg, n):
    fut = wg.boom_on_rank(rows(n), 1)
    assert tuple(fut._call.fetch_metas) == (() if n == 4 else (1,))
    with pytest.raises(RemoteError) as info:
        await fut
    assert (info.value.method, info.value.rank, info.value.exc_type) == ("boom_on_rank", 1, "builtins.KeyError")
    with pytest.raises(RemoteError) as info:
        await blocking(wg, wg.boom_on_rank(rows(n), 1))
    assert (info.value.method, info.value.rank) == ("boom_on_rank", 1)
    with pytest.raises(RemoteError) as info:
        async for _ in wg.boom_on_rank(rows(n), 1).as_completed():
            pass
    assert info.value.rank == 1


async def test_a_rank_that_returns_no_batch_fails_the_call_without_its_metadata_being_awaited(wg):
    fut = wg.no_batch_on_rank(rows(4), 1)  # the worker still checks the result while making its metadata
    assert tuple(fut._call.fetch_metas) == ()
    with pytest.raises(RemoteError) as info:
        await fut
    assert (info.value.rank, info.value.exc_type) == (1, "asyncrl.errors.DispatchError")
    assert "must return a batch" in str(info.value) and "got int" in str(info.value)
