"""The core contracts (dispatch/collect round trip, ordered and concurrent modes, failures, release)
on both backends: real Ray and in-process.

Every test here runs twice, once per backend, against the same worker class.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from tensordict import TensorDict

import asyncrl
from asyncrl import (
    DispatchError,
    LocalWorkerGroup,
    RemoteError,
)
from tests.core import kinds
from tests.core.kinds import BACKENDS
from tests.core.workers import Probe


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=BACKENDS)
async def wg(request, ray_cluster):
    """A group of 4 Probe workers (base=10) per backend."""
    async with kinds.group(request.param, Probe, world_size=4, kwargs={"base": 10}, env={"ASYNCRL_TEST_FLAG": "on"},
                           name=f"probe-{request.param}") as group:
        yield group


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=BACKENDS)
async def mesh_wg(request, ray_cluster):
    """dp=2 x tp=2: ranks 0,1 are DP rank 0 and ranks 2,3 DP rank 1; tp rank 0 collects."""
    async with kinds.group(request.param, Probe, world_size=4, kwargs={"tp": 2}, name=f"mesh-{request.param}") as group:
        yield group


def batch(n: int) -> TensorDict:
    td = TensorDict({"x": torch.arange(n)}, batch_size=[n])
    td["prompt"] = [f"p{i}" for i in range(n)]
    return td


async def test_one_to_all_returns_every_ranks_result(wg):
    assert await wg.add(1) == [11, 12, 13, 14]


async def test_rank_zero_returns_a_single_value(wg):
    assert await wg.whoami() == 0


async def test_all_to_all_gives_rank_i_item_i(wg):
    assert await wg.scale([1, 2, 3, 4], factor=[10, 10, 10, 10]) == [10, 21, 32, 43]


@pytest.mark.parametrize("n", [1, 7, 8, 10])
async def test_dp_compute_returns_input_rows_in_order(wg, n):
    out = await wg.tag(batch(n))
    assert out.batch_size == torch.Size([n])
    assert out["y"].tolist() == [2 * i for i in range(n)]
    assert list(out["prompt"]) == [f"P{i}" for i in range(n)]
    per_rank = -(-n // 4)  # padded to a multiple of the world size: rank r computes rows r*k .. r*k+k-1
    assert out["rank"].tolist() == [i // per_rank for i in range(n)]


async def test_dp_compute_splits_lists_and_tensors_and_broadcasts_scalars(wg):
    assert await wg.square_list([1, 2, 3, 4, 5], offset=1) == [2, 5, 10, 17, 26]
    assert (await wg.double_tensor(torch.arange(6))).tolist() == [0, 2, 4, 6, 8, 10]


async def test_dp_compute_unpads_methods_that_multiply_rows(wg):
    out = await wg.repeat_rows(batch(5))
    assert out["x"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


async def test_dp_compute_metric_returns_per_rank_list(wg):
    assert await wg.shard_rows(batch(10)) == [3, 3, 3, 3]  # 10 rows padded to 12


async def test_mesh_dispatch_collects_one_result_per_dp_rank(mesh_wg):
    results = await mesh_wg.mesh_info(batch(4))
    assert results == [(0, [0, 1]), (2, [2, 3])]


async def test_mesh_concat_matches_dp_order(mesh_wg):
    out = await mesh_wg.mesh_tag(batch(5))
    assert out["y"].tolist() == [0, 10, 20, 32, 42]


async def test_custom_mode_repeats_pair_to_world_size(wg):
    assert await wg.pair([1, 2]) == 100 + 201 + 102 + 203


async def test_named_custom_mode(wg):
    assert await wg.pair_by_name([1, 2]) == 1 + 3 + 3 + 5


async def test_ordered_calls_run_in_issue_order(wg):
    await wg.get_log()
    futures = [wg.record(i) if i % 2 else wg.record_async(i) for i in range(200)]
    await asyncio.gather(*futures)
    logs = await wg.get_log()
    assert logs == [list(range(200))] * 4


async def test_ordered_call_keeps_its_place_while_its_argument_is_produced(wg):
    await wg.get_log()
    gate = wg.gather_at_barrier(2)  # concurrent; resolves only when a second call arrives
    first = wg.record_value(gate)  # ordered, argument still being produced
    rest = [wg.record(i) for i in range(10, 15)]  # ordered, ready arguments, issued later
    release = wg.gather_at_barrier(2)
    await asyncio.gather(first, *rest, release)
    assert await wg.get_log() == [[2, 10, 11, 12, 13, 14]] * 4


async def test_concurrent_calls_overlap(wg):
    peaks = await asyncio.gather(*(wg.gather_at_barrier.options(timeout=60)(3) for _ in range(3)))
    assert peaks == [[3, 3, 3, 3]] * 3


async def test_sync_methods_run_off_the_event_loop_thread(wg):
    names = await wg.thread_name()
    assert all(n.startswith("asyncrl-ordered") for n in names)


async def test_asyncrl_gather_returns_results_in_order_and_raises_the_first_error(wg):
    async def plain(x):
        return x

    futs = [wg.add(i) for i in range(5)]
    assert await asyncrl.gather(*futs, chunk=2) == [[10 + i, 11 + i, 12 + i, 13 + i] for i in range(5)]
    # a future twice, a selection's parent beside other awaitables: each is awaited as `await` would
    f = wg.add(1)
    assert await asyncrl.gather(f, f, plain(7), chunk=3) == [[11, 12, 13, 14], [11, 12, 13, 14], 7]
    with pytest.raises(RemoteError) as info:
        await asyncrl.gather(wg.add(0), wg.boom_on_rank(batch(8), rank=1), wg.add(1))
    assert (info.value.method, info.value.rank, info.value.exc_type) == ("boom_on_rank", 1, "builtins.KeyError")
    assert await wg.add(0) == [10, 11, 12, 13]


async def test_remote_error_names_group_method_rank_and_keeps_traceback(wg):
    with pytest.raises(RemoteError) as info:
        await wg.boom_on_rank(batch(8), rank=2)
    e = info.value
    assert (e.group, e.method, e.rank) == (wg.name, "boom_on_rank", 2)
    assert e.exc_type == "builtins.KeyError"
    assert "rank 2 failed" in e.message
    assert "boom_on_rank" in e.remote_traceback and "raise KeyError" in e.remote_traceback
    assert isinstance(e.cause, KeyError)
    assert await wg.add(0) == [10, 11, 12, 13]  # a remote error does not break the group


async def test_worker_environment_is_set_before_the_constructor(wg):
    envs = await wg.env()
    assert [e["RANK"] for e in envs] == (["0", "1", "2", "3"] if wg._hostset.backend.name == "ray" else [None] * 4)
    assert [e["rank_at_init"] for e in envs] == [0, 1, 2, 3]
    if wg._hostset.backend.name == "ray":
        assert {e["WORLD_SIZE"] for e in envs} == {"4"}
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
        assert {e["ASYNCRL_TEST_FLAG"] for e in envs} == {"on"}


async def test_unregistered_method_says_how_to_register(ray_cluster):
    from tests.core.workers import Other

    group = LocalWorkerGroup(Other, world_size=1)
    with pytest.raises(AttributeError, match="not registered: decorate it with @asyncrl.register"):
        group.not_registered
    with pytest.raises(AttributeError, match="has no method 'nothing'"):
        group.nothing


# ---- bad input -------------------------------------------------------------------------


async def test_batch_arguments_that_disagree_on_rows(wg):
    with pytest.raises(DispatchError, match="disagree on the number of rows"):
        wg.square_list([1, 2, 3], offset=[1, 2])


async def test_argument_dp_cannot_split(wg):
    with pytest.raises(DispatchError, match=r"cannot split argument 0 of type dict.*asyncrl.Broadcast"):
        wg.square_list({"a": 1})


async def test_all_to_all_list_of_wrong_length(wg):
    with pytest.raises(DispatchError, match=r"one item per rank \(4 items\), got a list of length 3"):
        wg.scale([1, 2, 3], factor=[1, 1, 1, 1])


async def test_empty_batch(wg):
    with pytest.raises(DispatchError, match="empty batch"):
        wg.tag(batch(0))


async def test_mesh_name_no_worker_registered(wg):
    with pytest.raises(DispatchError, match="registered mesh 'train'"):
        wg.mesh_info(batch(4))


async def test_wrong_arguments_fail_at_the_call(wg):
    with pytest.raises(TypeError, match="add"):
        wg.add(1, 2, 3)
    with pytest.raises(TypeError, match=r"\.add: missing a required argument: 'x'"):
        wg.add()
    with pytest.raises(TypeError, match=r"\.add: too many positional arguments"):
        wg.add(1, 2)
    with pytest.raises(TypeError, match=r"\.add: got an unexpected keyword argument 'y'"):
        wg.add(1, y=1)
    # the same method called rightly, positionally (the O(1) arity check) and by keyword (bound)
    assert await wg.add(1) == await wg.add(x=1) == [11, 12, 13, 14]


async def test_worker_constructor_error_fails_setup_and_releases(ray_cluster):
    group = LocalWorkerGroup(Probe, world_size=2, kwargs={"tp": 3})  # rank // 3 ... dp_size 0 -> ValueError
    with pytest.raises(RemoteError, match="dp_rank < dp_size"):
        async with group:
            pass
    assert group.closed


def test_the_argument_fast_path_accepts_exactly_what_signature_bind_accepts():
    """The issue path checks plain signatures with a few look-ups instead of
    ``Signature.bind``; it must never accept what bind rejects (the error would then come
    from the worker, late), and for plain signatures it accepts everything bind does."""
    import itertools

    from asyncrl import register
    from asyncrl.worker_group import _positional_fits

    def a(self, x, y=1): ...
    def b(self, x, *, k, m=2): ...
    def c(self): ...
    def d(self, x, y, z=0, *, w=1): ...
    def e(self, *args, **kw): ...
    def f(self, x, /, y=0): ...

    checked = 0
    for fn, plain in [(a, True), (b, True), (c, True), (d, True), (e, False), (f, False)]:
        spec = register()(fn).spec
        names = list(spec.signature.parameters)[1:] + ["bogus"]
        for n in range(5):
            for r in range(len(names) + 1):
                for keys in itertools.combinations(names, r):
                    args, kwargs = tuple(range(n)), {k: 0 for k in keys}
                    try:
                        spec.signature.bind(None, *args, **kwargs)
                        binds = True
                    except TypeError:
                        binds = False
                    fits = _positional_fits(spec, args, kwargs)
                    assert not fits or binds, (fn.__name__, args, kwargs)
                    assert fits == (binds and plain), (fn.__name__, args, kwargs)
                    checked += 1
    assert checked == 5 * (8 + 16 + 2 + 32 + 8 + 8)  # every combination was tried


CONFIG = {"name": "grpo", "clip": [0.2, 0.28], "norm": True, "kl": None, "nested": {"gamma": 1.0, "lam": [0.95]}}
CONFIG_TYPED = ["dict", [
    [["str", "name"], ["str", "grpo"]],
    [["str", "clip"], ["list", [["float", 0.2], ["float", 0.28]]]],
    [["str", "norm"], ["bool", True]],
    [["str", "kl"], ["NoneType", None]],
    [["str", "nested"], ["dict", [[["str", "gamma"], ["float", 1.0]], [["str", "lam"], ["list", [["float", 0.95]]]]]]],
]]


async def test_plain_and_other_arguments_arrive_with_their_exact_types(wg):
    """A small str-keyed dict or list of scalars (a config) crosses as msgpack on Ray
    (`Payload.wire`); a tuple, an int-keyed dict and a dict holding a tensor take the pickled
    payload: every one arrives with the same values and the same types, on every host kind."""
    from asyncrl._host import Payload

    odd = {1: "int key", "t": (1, 2)}
    assert isinstance(Payload((CONFIG, [1, "a"]), {"algo": CONFIG}).wire(), list)
    assert isinstance(Payload((odd,), {}).wire(), Payload)
    assert isinstance(Payload((list(range(65)),), {}).wire(), Payload)  # past _PLAIN_ITEMS
    assert await wg.types_of(CONFIG, [1, "a", 2.5], algo=CONFIG) == [
        ["tuple", [CONFIG_TYPED, ["list", [["int", 1], ["str", "a"], ["float", 2.5]]]]],
        ["dict", [[["str", "algo"], CONFIG_TYPED]]],
    ]
    assert await wg.types_of((3, 4), odd, big=list(range(65)), w={"t": torch.ones(2)}) == [
        ["tuple", [["tuple", [["int", 3], ["int", 4]]],
                   ["dict", [[["int", 1], ["str", "int key"]], [["str", "t"], ["tuple", [["int", 1], ["int", 2]]]]]]]],
        ["dict", [[["str", "big"], ["list", [["int", i] for i in range(65)]]],
                  [["str", "w"], ["dict", [[["str", "t"], ["Tensor", [1.0, 1.0]]]]]]]],
    ]


async def test_a_tensordict_of_tensors_and_text_arrives_as_tensordicts_own_pickling_sends_it(wg):
    """A plain TensorDict of tensors and text columns (a prompt group's rows, here a slice of a larger batch) crosses
    as its columns (``_wire.TEXT_TENSORDICTS``) and arrives as tensordict's own reduction delivers it: the same class,
    batch size, key order, value classes and values; one it cannot take apart (nested, locked) takes that reduction."""
    from tensordict import NonTensorStack

    from asyncrl import _wire

    big = TensorDict({"ids": torch.arange(12).reshape(6, 2), "prompt": NonTensorStack(*"abcdef"),
                      "uid": torch.arange(6) + 40, "answer": NonTensorStack(*[str(i) for i in range(6)])},
                     batch_size=[6])
    rows = big[2:5]
    nested = rows.clone()
    nested["inner"] = TensorDict({"z": torch.ones(3)}, batch_size=[3])
    locked = rows.clone().lock_()
    assert _wire._reduce_text_td(rows) is not None
    assert _wire._reduce_text_td(nested) is None and _wire._reduce_text_td(locked) is None
    assert _wire._reduce_text_td(big[0:0]) is None
    want = ["TensorDict", [3], [["ids", "Tensor", [[4, 5], [6, 7], [8, 9]]],
                                ["prompt", "NonTensorStack", ["c", "d", "e"]],
                                ["uid", "Tensor", [42, 43, 44]], ["answer", "NonTensorStack", ["2", "3", "4"]]]]
    got = {}
    try:
        for flag in (True, False):
            _wire.TEXT_TENSORDICTS = flag
            got[flag] = [await wg.td_layout(rows), await wg.td_layout(nested), await wg.td_layout(locked)]
    finally:
        _wire.TEXT_TENSORDICTS = True
    assert got[True] == got[False]
    assert got[True][0] == got[True][2] == want
    assert got[True][1] == ["TensorDict", [3], [*want[2], ["inner", "TensorDict", ["TensorDict", [3], [
        ["z", "Tensor", [1.0, 1.0, 1.0]]]]]]]


async def test_a_result_of_tensors_and_text_arrives_as_it_was_returned(wg):
    """A worker's result that is a plain TensorDict of tensors and text (a generated group's rows) goes into Ray's
    object store as its columns (``_wire.as_columns``: not a pickled ``NonTensorData`` per text cell) and is read as
    that TensorDict, in key order, at the controller and by another call (worker to worker)."""
    from asyncrl import _wire

    td = TensorDict({"x": torch.arange(4)}, batch_size=[4])
    stored = _wire.as_columns(TensorDict({"t": torch.ones(2)}, batch_size=[2]))
    assert type(stored).__name__ == "_Columns" and _wire.as_columns([1]) == [1]
    got = await wg.text_rows(td)
    assert type(got) is TensorDict and list(got.keys()) == ["ids", "big", "stop"]
    assert got["ids"].tolist() == [0, 10, 20, 30] and got["stop"] == ["stop0", "stop1", "stop2", "stop3"]
    assert got["big"].shape == (4, 20_000) and got["big"][:, 7].tolist() == [0.0, 1.0, 2.0, 3.0]
    layout = await wg.td_layout(wg.text_rows(td).select("ids", "stop"))
    assert layout == ["TensorDict", [4], [["ids", "Tensor", [0, 10, 20, 30]],
                                          ["stop", "NonTensorStack", ["stop0", "stop1", "stop2", "stop3"]]]]


def test_a_small_tensor_column_crosses_as_its_bytes_and_arrives_equal_and_writable():
    """Up to ``_wire.SMALL_TENSOR_BYTES`` a tensor column of such a TensorDict is pickled in-band as its bytes, dtype
    and shape (a slice, a transposed view, bfloat16, bool, an empty column alike); a larger one goes to Ray's
    reducer as before; either way it arrives equal, and the small one writable."""
    import pickle

    from tensordict import NonTensorStack

    from asyncrl import _wire

    whole = torch.arange(40, dtype=torch.float32).reshape(4, 10)
    td = TensorDict({"ids": torch.arange(20).reshape(10, 2)[3:7], "half": whole.t()[2:6].to(torch.bfloat16),
                     "flag": torch.tensor([True, False, True, True]), "none": torch.zeros(4, 0, dtype=torch.int32),
                     "big": torch.ones(4, (1 << 14) + 1), "text": NonTensorStack(*"wxyz")}, batch_size=[4])
    fn, (n, keys, columns) = _wire._reduce_text_td(td)
    kinds = {k: type(c).__name__ for k, c in zip(keys, columns)}
    assert kinds == {"ids": "tuple", "half": "tuple", "flag": "tuple", "none": "tuple", "big": "Tensor", "text": "list"}
    back = fn(*pickle.loads(pickle.dumps((n, keys, columns))))
    assert list(back.keys()) == list(td.keys()) and back.batch_size == td.batch_size
    for k in ("ids", "half", "flag", "none", "big"):
        assert back[k].dtype == td[k].dtype and back[k].shape == td[k].shape and back[k].equal(td[k]), k
    back["ids"][0, 0] = -1  # its own memory: writable, the sender's rows untouched
    assert int(td["ids"][0, 0]) == 6 and list(back["text"]) == list("wxyz")
    try:
        _wire.SMALL_TENSOR_BYTES = 0
        assert all(type(c) is not tuple for c in _wire._reduce_text_td(td)[1][2])
    finally:
        _wire.SMALL_TENSOR_BYTES = 1 << 16


def test_a_call_crosses_as_its_typed_message_in_field_order():
    """The call message (`CallMsg`) crosses Ray as one plain list in field order, which
    Ray encodes with msgpack, and the host rebuilds the same message from it."""
    import dataclasses

    from asyncrl._wire import CallMsg, Payload

    msg = CallMsg("actor", "score", 7, 1234, Payload((1,), {}).wire(), 2, True, False, after=3)
    packed = msg.wire()
    assert type(packed) is list
    assert packed == ["actor", "score", 7, 1234, [[1], {}], 2, True, False, 3]
    assert [f.name for f in dataclasses.fields(CallMsg)] == [
        "role", "method", "seq", "call_id", "payload", "in_pad", "want_meta", "keep", "after"]
    back = CallMsg.from_wire(packed)
    assert dataclasses.astuple(back) == dataclasses.astuple(msg)
    plain, odd = Payload((1, "a"), {}), Payload(((1, 2),), {})  # the builder packs the plain one only
    plain.sent = plain.wire()
    assert CallMsg("r", "m", None, 5, plain, None, False, True).wire()[4] == [[1, "a"], {}]
    assert CallMsg("r", "m", None, 6, odd, None, False, True).wire()[4] is odd  # pickled by Ray as the Payload
