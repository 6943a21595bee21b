"""Bad-input sweep (hypothesis): dispatch/collect round trips over random batch sizes,
world sizes, nested TensorDicts and non-tensor fields equal row-by-row application in the
original order; malformed call arguments, config overrides and corrupt or truncated
checkpoint files always give a clear typed error -- never a crash or a hang."""

from __future__ import annotations

import asyncio
import json
import shutil
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

import asyncrl
from asyncrl import Dispatch, LocalWorkerGroup, Worker, register
from asyncrl import batch as B
from asyncrl.dispatch import World, collect_dp, dispatch_dp
from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import load_config
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer

CALL_BOUND_S = 10.0
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class RowWise(Worker):
    """A DP method that transforms each row on its own (so the expected result is row by row)."""

    @register(Dispatch.DP_COMPUTE)
    def apply(self, batch: TensorDict) -> TensorDict:
        return TensorDict({
            "y": batch["x"] * 2 + 1,
            "inner": TensorDict({"z": batch["inner", "z"].flip(-1)}, batch_size=batch.batch_size),
            "tag": NonTensorStack(*[f"{t}!" for t in batch["tag"]]),
        }, batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE)
    def echo(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


def make_batch(n: int, width: int) -> TensorDict:
    return TensorDict({
        "x": torch.arange(n * width, dtype=torch.float32).reshape(n, width),
        "inner": TensorDict({"z": torch.arange(n * 3).reshape(n, 3)}, batch_size=[n]),
        "tag": NonTensorStack(*[f"row{i}" for i in range(n)]),
    }, batch_size=[n])


def expected(td: TensorDict) -> TensorDict:
    return TensorDict({
        "y": td["x"] * 2 + 1,
        "inner": TensorDict({"z": td["inner", "z"].flip(-1)}, batch_size=td.batch_size),
        "tag": NonTensorStack(*[f"{t}!" for t in td["tag"]]),
    }, batch_size=td.batch_size)


def same(a: TensorDict, b: TensorDict) -> bool:
    return (a.batch_size == b.batch_size and torch.equal(a["y"], b["y"]) and torch.equal(a["inner", "z"], b["inner", "z"])
            and list(a["tag"]) == list(b["tag"]))


@SETTINGS
@given(n=st.integers(1, 23), world=st.integers(1, 6), width=st.integers(1, 4))
def test_dp_round_trip_equals_row_by_row_application_in_order(n, world, width):
    td = make_batch(n, width)

    async def body() -> TensorDict:
        async with LocalWorkerGroup(RowWise, world_size=world) as wg:
            async with asyncio.timeout(CALL_BOUND_S):
                return await wg.apply(td)

    out = asyncio.run(body())
    want = TensorDict({}, batch_size=[n])
    for i in range(n):  # row by row, in the original order
        row = td[i:i + 1]
        want = torch.cat([want, expected(row)]) if i else expected(row)
    assert same(out, want)


@SETTINGS
@given(n=st.integers(1, 40), world=st.integers(1, 9))
def test_pure_split_then_unpad_and_concat_restores_the_batch(n, world):
    td = make_batch(n, 2)
    sharded = dispatch_dp(World(world, "g", {}), td, 3, scale=asyncrl.Broadcast([1, 2]))
    shards, pads = sharded.args[0], sharded.pad
    assert len(shards) == world and len(pads) == world
    assert len({B.batch_len(s) for s in shards}) == 1  # equal shards
    assert sum(B.batch_len(s) - p for s, p in zip(shards, pads)) == n
    assert sharded.args[1] == [3] * world and sharded.kwargs["scale"] == [[1, 2]] * world
    back = collect_dp(World(world, "g", {}), [B.strip_tail(s, p) for s, p in zip(shards, pads)])
    assert torch.equal(back["x"], td["x"]) and list(back["tag"]) == list(td["tag"])


junk = st.one_of(
    st.just(object()), st.sets(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
    st.just(torch.tensor(3.0)), st.just([]), st.just(torch.zeros(0, 2)), st.just(TensorDict({}, batch_size=[])),
    st.builds(lambda n: torch.zeros(n, 2), st.integers(1, 5)), st.lists(st.integers(), min_size=1, max_size=5),
    st.just(None), st.integers(), st.text(max_size=5),
)


@SETTINGS
@given(args=st.lists(junk, max_size=3), world=st.integers(1, 4))
def test_malformed_call_arguments_give_a_typed_error_or_a_correct_result_never_a_hang(args, world):
    async def body() -> Any:
        async with LocalWorkerGroup(RowWise, world_size=world) as wg:
            async with asyncio.timeout(CALL_BOUND_S):  # no hang
                return await wg.echo(*args)

    try:
        out = asyncio.run(body())
    except (asyncrl.DispatchError, asyncrl.RemoteError) as e:  # asyncrl's own errors: a TypeError here is a bug
        assert str(e)  # a message that says what is wrong
        return
    batches = [a for a in args if B.is_batch(a) and not isinstance(a, (str, bytes))]
    assert batches, f"a call without a batch argument must fail, got {out!r}"
    first = args[0]
    if isinstance(first, torch.Tensor):
        assert torch.equal(out, first)
    else:
        assert out == first


def _override_keys() -> list[str]:
    """Every key and section of the config, read from its dataclasses (a field added later is fuzzed too), and
    keys that are not there."""
    from tests.pipelines.test_config_fuzz import DECLARED

    leaves = [k for k, _ in DECLARED]
    sections = sorted({k.rpartition(".")[0] for k in leaves if "." in k})
    return leaves + sections + ["nope", "trainer.nope", "trainer.steps.x", "", ".", "a..b"]


def _out_of_range_overrides() -> list[str]:
    """``key=value`` for every value just outside its key's declared range (see test_config_fuzz.py)."""
    import yaml

    from tests.pipelines.test_config_fuzz import OUT_OF_RANGE

    return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
            for k, v in OUT_OF_RANGE]


keys = st.sampled_from(_override_keys())
raw_values = st.one_of(st.sampled_from(["3", "-1", "0", "1e-3", "true", "null", "[1, 2]", "{a: 1}", "grpo", "ppo",
                                        "'", "[", "{", "nan", "inf", "1.5", "x: [", "", "!!python/object:os.system"]),
                       st.text(max_size=8))


@settings(max_examples=150, deadline=None)
@given(overrides=st.lists(st.tuples(keys, raw_values).map(lambda kv: f"{kv[0]}={kv[1]}") | st.text(max_size=10)
                          | st.sampled_from(_out_of_range_overrides()), max_size=3))
@example(overrides=["trainer.restart=3", "trainer.restart.max_restarts=3"])  # was a TypeError (found by this test)
def test_random_config_overrides_load_or_raise_config_error(overrides):
    try:
        cfg = load_config(None, overrides, base=tiny_test())
    except ConfigError as e:
        assert str(e)
    else:
        assert cfg.validate() is cfg


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=60) | st.sampled_from(["trainer: 3", "trainer: {steps: x}", "[1, 2]", "a: !!python/name:os.system",
                                                     "trainer: {restart: {max_restarts: -1}}", "{{{{", "model: null"]))
def test_random_config_files_load_or_raise_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "run.yaml"
    path.write_text(text)
    try:
        load_config(path, base=tiny_test())
    except ConfigError as e:
        assert str(e)


@pytest.fixture(scope="module")
async def real_checkpoint(ray_cluster, tmp_path_factory):
    """A checkpoint of a real two-step run (policy weights, optimizer, buffered batch, state)."""
    out = tmp_path_factory.mktemp("ckpt_run")
    cfg = tiny_test()
    cfg.trainer.steps, cfg.trainer.max_staleness, cfg.trainer.checkpoint_every = 2, 1, 1
    cfg.trainer.output_dir = str(out)
    async with GRPOTrainer(cfg) as t:
        await t.fit()
    path = ckpt.checkpoint_dir(out, 1)
    assert ckpt.verify(path)["step"] == 1
    return cfg, path


CKPT_FILES = ["state.json", "buffer.pt", "policy/model.safetensors", "policy/optimizer.pt", "policy/meta.json"]


def test_corrupt_or_truncated_checkpoint_files_fail_resume_with_checkpoint_error_before_any_worker(
        real_checkpoint, tmp_path_factory):
    cfg, good = real_checkpoint

    @settings(max_examples=40, deadline=None)
    @given(name=st.sampled_from(CKPT_FILES), cut=st.floats(0, 0.999), mode=st.sampled_from(["truncate", "garbage", "delete"]))
    def check(name, cut, mode):
        bad = tmp_path_factory.mktemp("bad") / good.name
        shutil.copytree(good, bad)
        f = bad / name
        data = f.read_bytes()
        if mode == "truncate":
            f.write_bytes(data[: int(len(data) * cut)])
        elif mode == "garbage":
            f.write_bytes(b"\x80\x02garbage" + data[: int(len(data) * cut)][::-1][:64])
        else:
            f.unlink()
        if mode == "delete" and name == "state.json":
            with pytest.raises(ConfigError, match="no complete checkpoint"):
                GRPOTrainer(cfg, resume=bad)
            return
        with pytest.raises(ckpt.CheckpointError, match=f"{name.split('/')[-1]}|state.json"):
            GRPOTrainer(cfg, resume=bad)  # raised by the constructor: no worker has started

    check()


def test_state_json_with_wrong_shapes_is_a_checkpoint_error(real_checkpoint, tmp_path):
    cfg, good = real_checkpoint
    for text in ["[]", "null", json.dumps({"step": "1"}), "{\"step\": 1"]:
        bad = tmp_path / f"c{abs(hash(text))}" / good.name
        shutil.copytree(good, bad)
        (bad / "state.json").write_text(text)
        with pytest.raises(ckpt.CheckpointError):
            GRPOTrainer(cfg, resume=bad)


def test_a_same_size_corruption_inside_the_weights_fails_resume_on_its_checksum(real_checkpoint, tmp_path):
    cfg, good = real_checkpoint
    bad = tmp_path / good.name
    shutil.copytree(good, bad)
    f = bad / "policy" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-64:-60] = b"\xff\xff\x7f\x7f"  # inside the last tensor: a NaN-ish float, same file size
    f.write_bytes(bytes(data))
    from safetensors.torch import load_file

    load_file(str(f))  # still a well-formed safetensors file: only the checksum can tell
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors.*sha256"):
        GRPOTrainer(cfg, resume=bad)  # before any worker starts
