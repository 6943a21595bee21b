"""Same-process hand-off of pipelined inputs (asyncrl._deferred, ``LocalShard``; same-process-window of
docs/protocol.md): an ordered consumer whose matched-layout input is the result of an
earlier ordered call on its own worker process takes it from the host's memory, with the
same value and the same errors as the paths through Ray, on every host kind."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import pytest_asyncio
import torch
from tensordict import TensorDict

from asyncrl import (
    CallCancelledError,
    CallTimeoutError,
    GroupClosedError,
    RemoteError,
    UpstreamError,
    WorkerDiedError,
)
from tests.core import kinds
from tests.core.kinds import BACKENDS, cancelled_and_timed_out, expect_top, until
from tests.core.workers import Probe


def batch(n: int) -> TensorDict:
    td = TensorDict({"x": torch.arange(n)}, batch_size=[n])
    td["prompt"] = [f"p{i}" for i in range(n)]
    return td


def rows(n: int, f=lambda i: 2 * i + 1) -> list[int]:
    return [f(i) for i in range(n)]


class Local:
    """Counts the same-process inputs a group's calls sent (``stats.inputs_local``)."""

    def __init__(self, g) -> None:
        self.g, self.seen = g, g.stats.inputs_local

    def sent(self) -> int:
        now = self.g.stats.inputs_local
        out, self.seen = now - self.seen, now
        return out


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=BACKENDS)
async def groups(request, ray_cluster):
    """On one backend: `pair` (2 ranks, hand-off on), `flat` (2 ranks, hand-off off: the
    paths through Ray, for the same values), `mesh` (2 ranks, one DP rank of tp 2)."""
    G = kinds.group_class(request.param)
    pair = G(Probe, world_size=2, name="pair")
    flat = G(Probe, world_size=2, name="flat", local_results=0)
    mesh = G(Probe, world_size=2, name="mesh", kwargs={"tp": 2})
    with kinds.forced(request.param):
        await asyncio.gather(pair.setup(), flat.setup(), mesh.setup())
    try:
        yield pair, flat, mesh
    finally:
        for g in (pair, flat, mesh):
            await g.close()


async def _blocked(g) -> bool:
    return await g.is_blocked() == [True] * g.world_size


def same(a: TensorDict, b: TensorDict) -> None:
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        va, vb = a[k], b[k]
        if isinstance(va, torch.Tensor):
            assert va.dtype == vb.dtype and va.tolist() == vb.tolist(), k
        else:
            assert list(va) == list(vb), k


@pytest.mark.parametrize("n", [3, 5, 8])
async def test_a_same_process_input_has_the_ray_paths_value_padding_and_selection(groups, n):
    pair, flat, _ = groups
    local = Local(pair)
    produced = pair.tag(batch(n))
    whole, selected, both = pair.inc(produced), pair.inc(produced.select("y")), pair.tag_fields(produced)
    per_rank = pair.shard_rows(produced)  # DP_COMPUTE_METRIC: a consumer that is not data-parallel
    assert local.sent() == 8  # 2 ranks x 4 consumers
    twin = flat.tag(batch(n))
    twins = flat.inc(twin), flat.inc(twin.select("y")), flat.tag_fields(twin)
    twin_rows = flat.shard_rows(twin)
    assert flat.stats.inputs_local == 0
    got = [await f for f in (whole, selected, both)]
    want = [await f for f in twins]
    for a, b in zip(got, want):
        same(a, b)
    assert await per_rank == await twin_rows == [-(-n // 2)] * 2  # each rank's shard, its padding rows included
    assert got[0]["y"].tolist() == rows(n)  # padding rows (n = 3, 5) stripped by the producer's meta
    assert got[2]["fields"].tolist() == [3] * n  # y, rank, prompt
    assert (await produced)["prompt"] == [f"P{i}" for i in range(n)]


async def test_field_selections_and_their_errors(groups):
    pair, _, _ = groups
    local = Local(pair)
    produced = pair.tag(batch(4))
    two = pair.tag_fields(produced.select("y", "rank"))
    missing = pair.inc(produced.select("nope"))
    assert local.sent() == 4
    assert (await two)["fields"].tolist() == [2, 2, 2, 2]
    with pytest.raises(RemoteError, match=r"pair.tag has no field\(s\) \['nope'\]") as info:
        await missing
    assert (info.value.group, info.value.method, info.value.exc_type) == ("pair", "inc", "asyncrl.errors.DispatchError")
    listed = pair.square_list([1, 2, 3])
    not_a_td = pair.unwrap(listed.select("y"))
    with pytest.raises(RemoteError, match="a field selection of pair.square_list needs it to return a TensorDict"):
        await not_a_td
    assert local.sent() == 2


async def test_each_consumer_gets_its_own_container(groups):
    """Key assignments in one consumer reach neither another consumer nor the producer
    (a TensorDict, nested ones too, and a list); tensor storage is shared."""
    pair, _, _ = groups
    local = Local(pair)
    produced = pair.tag(batch(4))
    first, second = pair.grab(produced), pair.grab(produced)
    listed = pair.square_list([1, 2, 3, 4])
    l1, l2 = pair.grab_list(listed), pair.grab_list(listed)
    assert local.sent() == 8
    for f in (first, second):
        out = await f
        assert out["y"].tolist() == [3, 3, 3, 3] and out["seen"].tolist() == [0, 0, 0, 0]
    assert sorted((await produced).keys()) == ["prompt", "rank", "y"]
    assert await l1 == await l2 == [2, 2, 2, 2]
    assert await listed == [1, 4, 9, 16]


async def test_a_consumer_reads_the_container_as_it_was_returned(groups):
    """A producer that returns a container it keeps, and gives that container's key a new
    tensor in its next call: the first call's consumer reads what the first call returned
    (the kept outcome is the container as it was when the call returned), not the refilled
    container. (Through Ray the same holds only if Ray serialized the first result before
    the next call changed it: not ordered on either host kind, so the contract is to
    return objects the worker no longer changes; README, Pipelining.)"""
    pair, _, _ = groups
    local = Local(pair)
    first = pair.refill(batch(4), 10)
    second = pair.refill(batch(4), 100)  # runs before `after` on each worker
    after = pair.inc(first)
    assert local.sent() == 2
    assert (await after)["y"].tolist() == [1, 11, 21, 31]
    assert (await second)["y"].tolist() == [0, 100, 200, 300]


async def test_many_consumers_of_one_producer_and_the_window(groups):
    """Within `local_results` (4) ordered numbers of the producer the input is handed over;
    past it, it takes the Ray path — the same values either way."""
    pair, _, _ = groups
    local = Local(pair)
    produced = pair.tag(batch(5))
    near = [pair.inc(produced) for _ in range(4)]  # numbers +1 .. +4
    assert local.sent() == 8
    far = pair.inc(produced)  # +5: past the window
    assert local.sent() == 0
    for f in [*near, far]:
        assert (await f)["y"].tolist() == rows(5)
    later = pair.tag(batch(3))
    for i in range(3):
        assert await pair.record(i) == [i, i]  # other ordered calls (any role) count too
    at_edge = pair.inc(later)  # +4
    assert local.sent() == 2
    past = pair.inc(later)  # +5
    assert local.sent() == 0
    assert (await at_edge)["y"].tolist() == (await past)["y"].tolist() == rows(3)
    await pair.get_log()


async def test_two_inputs_by_two_paths_agree_on_padding(groups):
    """One input handed over in the process, the other (another group's) through Ray."""
    pair, flat, _ = groups
    local = Local(pair)
    mine, theirs = pair.tag(batch(5)), flat.tag(batch(5))
    summed = pair.add_fields(mine, theirs)
    assert local.sent() == 2  # `theirs` ran on other processes
    assert (await summed)["y"].tolist() == [4 * i for i in range(5)]


async def test_a_failed_producer_fails_its_consumer_as_the_nested_path_does(groups):
    pair, flat, _ = groups
    errors = []
    for g in (pair, flat):
        await g.get_log()
        local = Local(g)
        b = batch(4)
        b["y"] = b["x"] * 10
        failed = g.boom_on_rank(b, 1)  # rank 0 returns its rows as they are
        consumer = g.log_rows(failed)
        assert local.sent() == (2 if g is pair else 0)
        with pytest.raises(UpstreamError) as info:
            await consumer
        errors.append(info.value)
        assert await g.record(3) == [3, 3]  # the lanes kept their order: the next ordered call runs
        assert await g.get_log() == [[0, 10, 3], [3]]  # rank 0's input was fine
    (mine, theirs) = errors
    for e, name in ((mine, "pair"), (theirs, "flat")):
        assert (e.group, e.method, e.rank) == (name, "log_rows", 1)
        assert (e.upstream.group, e.upstream.method, e.upstream.rank) == (name, "boom_on_rank", 1)
    assert type(mine.upstream) is type(theirs.upstream) is RemoteError
    assert mine.upstream.exc_type == theirs.upstream.exc_type == "builtins.KeyError"
    assert mine.upstream.message == theirs.upstream.message == "'rank 1 failed'"


async def test_a_consumer_that_succeeded_makes_its_producer_known_ok(groups):
    """A same-process read counts towards the producer's ``ok`` (as a read through Ray does):
    the producer's result then reaches another process's consumer top-level on Ray."""
    pair, flat, _ = groups
    local = Local(pair)
    produced = pair.tag(batch(5))
    consumer = pair.inc(produced)
    assert local.sent() == 2
    assert (await consumer)["y"].tolist() == rows(5)
    assert produced._call.ok
    elsewhere = flat.inc(produced)
    expect_top(pair, elsewhere, ("pair", "tag"))
    assert (await elsewhere)["y"].tolist() == rows(5)
    # A consumer that failed proves nothing: the producer stays nested.
    unproven = pair.tag(batch(4))
    failed = pair.boom_on_rank(unproven, 1)
    assert local.sent() == 2
    with pytest.raises(RemoteError, match="rank 1 failed"):
        await failed
    assert not unproven._call.ok
    nested = flat.inc(unproven)
    assert nested._call.top_from is None
    assert (await nested)["y"].tolist() == rows(4)


async def test_a_result_ray_cannot_store_read_only_in_its_process(groups):
    """The producer's host returns a value that cannot be serialized: its same-process
    consumer succeeds (and makes it known ok), so on Ray another process's consumer gets it
    top-level, and Ray fails that call before its host runs (input-failed-before-host of docs/protocol.md);
    the local backend (which round-trips results through pickle as Ray would) keeps it
    nested. Either way: an UpstreamError naming the producer, and that lane goes on.
    Awaiting the producer raises the serialization error."""
    pair, flat, _ = groups
    await flat.get_log()
    produced = pair.tag_unpicklable(batch(4))
    assert (await pair.inc(produced))["y"].tolist() == rows(4)
    assert produced._call.ok
    consumer = flat.log_rows(produced)
    expect_top(pair, consumer, ("pair", "tag_unpicklable"))
    with pytest.raises(UpstreamError) as info:
        await consumer
    e = info.value
    assert (e.group, e.method) == ("flat", "log_rows")
    upstream = (e.upstream.group, e.upstream.method, e.upstream.exc_type)
    assert upstream == ("pair", "tag_unpicklable", "builtins.TypeError")
    assert "Unpicklable cannot be pickled" in e.upstream.message
    if pair._hostset.backend.name == "ray":
        assert "not serializable" in e.upstream.message
    assert await flat.record(7) == [7, 7]  # nobody awaits the failed call's number: it was released
    assert await flat.get_log() == [[7], [7]]  # the failed call never ran
    with pytest.raises(RemoteError, match="Unpicklable cannot be pickled") as raised:
        await produced
    assert (raised.value.group, raised.value.method, raised.value.exc_type) == ("pair", "tag_unpicklable",
                                                                               "builtins.TypeError")


async def test_cancelled_or_timed_out_producer(groups):
    pair, flat, _ = groups
    for g in (pair, flat):
        await g.get_log()
        local = Local(g)
        holding = g.block()
        await until(lambda: _blocked(g))
        cancelled = g.tag(batch(4))
        timed = g.tag.options(timeout=0.2)(batch(4))
        after_cancel, after_timeout = g.log_rows(cancelled), g.log_rows(timed)
        assert local.sent() == (4 if g is pair else 0)
        assert cancelled.cancel()
        with pytest.raises(CallTimeoutError):
            await timed
        await g.unblock()
        assert await holding == [0, 1]
        for f, producer in ((after_cancel, cancelled), (after_timeout, timed)):
            with pytest.raises(UpstreamError) as info:
                await f
            assert (info.value.group, info.value.method) == (g.name, "log_rows")
            assert isinstance(info.value.upstream, CallCancelledError)
            assert str(info.value.upstream) == f"{g.name}.tag was cancelled"
        assert await g.record(5) == [5, 5]
        assert await g.get_log() == [[5], [5]]  # neither producer nor consumer ran


async def test_a_consumer_cancelled_or_timed_out_while_waiting_its_turn(groups):
    pair, _, _ = groups
    await pair.get_log()
    local = Local(pair)
    produced = pair.tag(batch(4))
    holding = pair.block()
    await until(lambda: _blocked(pair))
    cancelled = pair.log_rows(produced)
    timed = pair.log_rows.options(timeout=0.2)(produced)
    assert local.sent() == 4
    await cancelled_and_timed_out(cancelled, timed)
    await pair.unblock()
    assert await holding == [0, 1]
    after = pair.log_rows(produced)  # still within the window
    assert local.sent() == 2
    assert (await after)["y"].tolist() == [1, 3, 5, 7]
    assert await pair.get_log() == [[0, 2], [4, 6]]  # the cancelled and timed-out consumers never ran


async def test_concurrent_producers_and_consumers_are_not_handed_over(groups):
    pair, _, _ = groups
    local = Local(pair)
    conc = pair.tag_concurrent(batch(5))
    consumer = pair.inc(conc)
    assert local.sent() == 0
    assert (await consumer)["y"].tolist() == rows(5)
    ordered = pair.tag(batch(5))
    conc_consumer = pair.inc_concurrent(ordered)
    assert local.sent() == 0
    assert (await conc_consumer)["y"].tolist() == rows(5)


async def test_a_rank_whose_producer_rank_kept_nothing_reads_through_ray(groups):
    """tp=2: rank 1's results are not kept (rank 0 collects); both ranks read rank 0's
    output, rank 0 from its own memory, rank 1 through Ray."""
    _, _, mesh = groups
    local = Local(mesh)
    produced = mesh.mesh_tag(batch(3))
    consumer = mesh.mesh_inc(produced)
    assert local.sent() == 1
    assert (await consumer)["y"].tolist() == [10 * i + 1 for i in range(3)]


async def test_another_groups_producer_is_not_handed_over(groups):
    pair, flat, _ = groups
    local = Local(flat)
    pair_local = Local(pair)
    consumer = pair.inc(flat.tag(batch(4)))
    back = flat.inc(pair.tag(batch(4)))
    assert local.sent() == pair_local.sent() == 0
    assert (await consumer)["y"].tolist() == (await back)["y"].tolist() == rows(4)


@pytest.mark.parametrize("kind", ["ray", "ray-threaded"])
async def test_worker_killed_between_producer_and_consumer(ray_cluster, kind):
    async with kinds.group(kind, Probe, world_size=1, name="dies") as g:
        holding = g.block()
        await until(lambda: _blocked(g))
        produced = g.tag(batch(3))
        consumer = g.log_rows(produced)
        assert g.stats.inputs_local == 1
        [pid] = await g.concurrent_pid()  # (the ordered lane is blocked; a concurrent call still runs)
        os.kill(pid, signal.SIGKILL)
        for f in (holding, produced, consumer):
            with pytest.raises(WorkerDiedError):
                await asyncio.wait_for(f, 60)
        assert g.broken


async def test_a_closed_groups_future_is_refused(ray_cluster):
    """A host set replaced by a new one (a restart): the old one's futures cannot feed the new one."""
    async with kinds.group("ray-threaded", Probe, world_size=1, name="old") as old:
        produced = old.tag(batch(2))
        await produced
    async with kinds.group("ray-threaded", Probe, world_size=1, name="new") as new:
        with pytest.raises(GroupClosedError, match="was passed on after its group closed"):
            new.inc(produced)
        assert (await new.inc(new.tag(batch(2))))["y"].tolist() == rows(2)
        assert new.stats.inputs_local == 1


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_local_results_must_be_a_non_negative_int(value):
    with pytest.raises(ValueError, match="local_results must be a non-negative int"):
        kinds.group_class("local")(Probe, world_size=1, local_results=value)


def test_the_environment_sets_the_default(monkeypatch):
    from asyncrl.host_set import default_local_results

    monkeypatch.setenv("ASYNCRL_LOCAL_RESULTS", "0")
    assert default_local_results() == 0
    monkeypatch.setenv("ASYNCRL_LOCAL_RESULTS", "x")
    with pytest.raises(ValueError, match="ASYNCRL_LOCAL_RESULTS must be a non-negative int, got 'x'"):
        default_local_results()
    monkeypatch.delenv("ASYNCRL_LOCAL_RESULTS")
    assert default_local_results() == 4


def test_shallow_gives_containers_of_their_own_and_shares_tensors_and_text_columns():
    """What the lane keeps of a result and what each same-process consumer gets (``_lanes.shallow``): a TensorDict
    of its own at every level, its batch size and dim names kept; the tensors and the text columns are the
    producer's own objects (a text column cloned per row cost 24x as much as the rest of the copy)."""
    from tensordict import LazyStackedTensorDict

    from asyncrl._lanes import shallow

    td = batch(4)
    td["one"] = "same for every row"
    td["nested"] = TensorDict({"z": torch.zeros(4)}, batch_size=[4])
    td.refine_names("rows")
    out = shallow(td)
    assert out is not td and out["nested"] is not td["nested"]
    assert out.batch_size == td.batch_size and out.names == ["rows"]
    for key in ("x", "prompt", "one", ("nested", "z")):
        assert out.get(key) is td.get(key), key
    out["new"], out["nested", "new"] = torch.ones(4), torch.ones(4)
    assert "new" not in td.keys() and "new" not in td["nested"].keys()
    assert out["prompt"] == ["p0", "p1", "p2", "p3"] and out["one"] == "same for every row"
    stacked = LazyStackedTensorDict(*[TensorDict({"a": torch.zeros(2)}, [2]) for _ in range(3)], stack_dim=0)
    copied = shallow(stacked)  # a stack of TensorDicts: tensordict's own one-level copy
    assert isinstance(copied, LazyStackedTensorDict) and copied.tensordicts[0] is not stacked.tensordicts[0]
    assert shallow({"a": 1}) == {"a": 1} and shallow([1]) == [1] and shallow(3) == 3
