"""``@register(summary=...)``: the named fields of a data-parallel result ride in the call's reply, and
``GroupFuture.summary()`` reads them without fetching the result (the fields exactly, padding rows left out,
in collect order); a failed call raises its error there; ``Worker.colocated(role)`` is the worker object of
another role in the same process and rank."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from asyncrl import Dispatch, RemoteError, UpstreamError, Worker, colocate, register
from asyncrl.errors import RegistrationError

from tests.core import kinds
from tests.core.kinds import BACKENDS
from tests.core.workers import PARTS


def _parity(result: TensorDict) -> dict[str, torch.Tensor]:
    """A summary function: per row of the result, whether its ``sq`` is odd (computed in the worker)."""
    return {"odd": result["sq"] % 2}


class Scorer(Worker):
    """Scores rows; its ``double`` result is large (``big``) and small (``score``, ``rank``)."""

    @register(Dispatch.DP_COMPUTE, summary=("score", "rank", "absent"))
    def double(self, batch: TensorDict) -> TensorDict:
        n = batch.batch_size[0]
        return TensorDict({"score": batch["x"].double() * 2, "rank": torch.full((n,), self.rank),
                           "big": torch.zeros(n, 4096)}, batch_size=[n])

    @register(Dispatch.DP_COMPUTE, summary=_parity)
    def square(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"sq": batch["x"] ** 2}, batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE, concurrent=True, summary=("score",))
    async def fail(self, batch: TensorDict) -> TensorDict:
        raise ValueError(f"rank {self.rank} cannot score")

    @register(PARTS)
    def totals(self, parts: list) -> TensorDict:
        """Data-parallel over its own list of parts (each whole: pipelined futures): a row per part, its scores'
        sum."""
        return TensorDict({"total": torch.tensor([float(p["score"].sum()) for p in parts])}, batch_size=[len(parts)])

    @register(Dispatch.DP_COMPUTE)
    def plain(self, batch: TensorDict) -> TensorDict:
        return batch

    @register(Dispatch.DP_COMPUTE)
    def via_peer(self, batch: TensorDict) -> TensorDict:
        peer = self.colocated("helper")
        return TensorDict({"y": peer.add_rank(batch["x"]), "pid": torch.full((batch.batch_size[0],), peer.pid())},
                          batch_size=batch.batch_size)

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        import os

        return os.getpid()


class Helper(Worker):
    """A colocated role whose methods :class:`Scorer` calls directly."""

    def add_rank(self, x: torch.Tensor) -> torch.Tensor:
        return x + 100 * self.rank

    def pid(self) -> int:
        import os

        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank


def rows(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n)}, batch_size=[n])


@pytest.mark.parametrize("backend", BACKENDS)
async def test_summary_fields_arrive_without_fetching_the_result_padding_left_out(backend, ray_cluster):
    async with kinds.group(backend, Scorer, world_size=2, name=f"summary-{backend}") as wg:
        fut = wg.double(rows(5))  # 3 + 3 rows, the last one padding
        got = await fut.summary()
        assert wg.stats.results_fetched == 0 and wg.stats.bytes_fetched == 0  # the result stayed remote
        assert set(got) == {"score", "rank"}  # a field the result lacks is left out
        assert got["score"].dtype == torch.float64 and got["score"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
        assert got["rank"].tolist() == [0, 0, 0, 1, 1]
        whole = await fut
        assert torch.equal(whole["score"], got["score"]) and torch.equal(whole["rank"], got["rank"])
        one = await wg.double.options(rank=1)(rows(3)).summary()  # a call to one rank
        assert one["score"].tolist() == [0.0, 2.0, 4.0] and one["rank"].tolist() == [1, 1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_summary_function_gives_per_row_facts_of_the_result_padding_left_out(backend, ray_cluster):
    async with kinds.group(backend, Scorer, world_size=2, name=f"summary-fn-{backend}") as wg:
        fut = wg.square(rows(5))  # 3 + 3 rows, the last one padding
        got = await fut.summary()
        assert wg.stats.results_fetched == 0
        assert set(got) == {"odd"} and got["odd"].tolist() == [0, 1, 0, 1, 0]
        assert (await fut)["sq"].tolist() == [0, 1, 4, 9, 16]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_failed_call_raises_its_error_from_summary(backend, ray_cluster):
    async with kinds.group(backend, Scorer, world_size=2, name=f"summary-fail-{backend}") as wg:
        with pytest.raises(RemoteError, match="cannot score") as info:
            await wg.fail(rows(4)).summary()
        assert info.value.method.endswith("fail")
        with pytest.raises(TypeError, match="without summary fields"):
            await wg.plain(rows(2)).summary()
        with pytest.raises(TypeError, match="not a data-parallel call"):
            await wg.pid().summary()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_read_summary_makes_the_call_known_ok_its_value_then_goes_top_level(backend, ray_cluster):
    """Every collected rank's reply arrived: the call finished successfully (its task returned the result with
    it), so a later call takes its value as top-level arguments (the Ray backend), as one it awaited; a failed
    call's summary marks nothing."""
    async with kinds.group(backend, Scorer, world_size=2, name=f"summary-top-{backend}") as wg:
        fut = wg.double.options(rank=1)(rows(3))
        consumer = wg.totals([[fut], []])
        assert kinds.top_from(consumer) is None  # not known ok yet: nested
        assert (await consumer)["total"].tolist() == [6.0]
        fut = wg.double.options(rank=1)(rows(3))
        fetched = wg.stats.results_fetched
        await fut.summary()
        assert fut._call.ok and wg.stats.results_fetched == fetched  # known ok without fetching its result
        consumer = wg.totals([[fut], [fut.select("score")]])
        kinds.expect_top(wg, consumer, (wg.name, "double"))
        assert (await consumer)["total"].tolist() == [6.0, 6.0]
        failed = wg.fail.options(rank=0)(rows(2))
        with pytest.raises(RemoteError, match="cannot score"):
            await failed.summary()
        assert not failed._call.ok
        consumer = wg.totals([[failed], []])
        assert kinds.top_from(consumer) is None
        with pytest.raises(UpstreamError):
            await consumer


def test_summary_needs_field_names_and_a_data_parallel_mode():
    with pytest.raises(RegistrationError, match="tuple of field names or a function"):
        register(Dispatch.DP_COMPUTE, summary="score")  # type: ignore[arg-type]
    with pytest.raises(RegistrationError, match="data-parallel dispatch mode"):
        register(Dispatch.ONE_TO_ALL, summary=("score",))


async def test_colocated_is_the_other_roles_worker_of_the_same_process_and_rank(ray_cluster):
    async with colocate({"scorer": Scorer, "helper": Helper}, world_size=2, name="summary-co") as groups:
        out = await groups["scorer"].via_peer(rows(4))
        pids = await groups["scorer"].pid()
        assert out["y"].tolist() == [0, 1, 102, 103]  # rank r's helper is rank r's
        assert out["pid"].tolist() == [pids[0], pids[0], pids[1], pids[1]]  # in the caller's own process
    with pytest.raises(LookupError, match="no 'helper' worker shares this process"):
        Scorer().colocated("helper")  # built outside a group: alone
