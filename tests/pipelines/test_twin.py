"""The cluster twin (asyncrl.pipelines.twin): profiles load with a source for every number and bad ones are
refused naming the key; ``twin.profile`` runs the real trainer against simulated workers on real Ray, within
the staleness bound, every group trained once."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from asyncrl.pipelines.datasets.data import get_task
from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import load_config, twin
from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.pipelines.twin.profile import (PROFILES, ProfileError, TwinConfig, dump_profile, engine_kwargs,
                                            load_profile)
from asyncrl.pipelines.twin.workers import train_costs
from asyncrl.roles.engines.sim import draw_length
from asyncrl.roles.modeling.models import tokenizer_for


def test_every_shipped_profile_loads_with_a_source_for_every_number():
    assert "qwen2_7b_h100_vllm" in PROFILES
    for name in PROFILES:
        p = load_profile(name)
        assert p.name == name
        numbers = [f"{section}.{k}" for section in ("model", "rollout", "training", "lengths")
                   for k, v in vars(getattr(p, section)).items() if not isinstance(v, str)]
        given = [k for k in numbers if k in p.sources]
        assert given and all(p.source(k) for k in given)
        raw = yaml.safe_load(Path(p.path).read_text())
        in_file = [f"{s}.{k}" for s in ("model", "rollout", "training", "lengths") for k in raw[s] if k != "kind"]
        assert sorted(in_file) == sorted(p.sources)  # every number in the file has its source


def test_the_twin_presets_prompts_are_distinct_so_each_draws_its_own_median():
    """The engine draws a response's length around its prompt's own median (the profile's ``prompt_sigma``,
    from the prompt's ids). ``char_class`` has two prompts, so a twin on it drew every length around two medians;
    the preset's ``echo_number`` gives each prompt its own, spread as the profile says."""
    cfg = twin()
    tok, lengths = tokenizer_for(cfg.model), load_profile(cfg.twin.profile).lengths

    def factors(task: str) -> list[float]:  # each prompt's median over the profile's, from a draw without spread
        prompts = [p for p, _ in get_task(task).make(256, 0)]
        return [draw_length(0, tok(p)["input_ids"], 10**12, median_tokens=1e9, sigma=0.0,
                            prompt_sigma=lengths.prompt_sigma) / 1e9 for p in prompts]

    assert cfg.data.task == "echo_number" and lengths.prompt_sigma == 0.5
    assert len(set(factors("char_class"))) == 2
    ours = factors(cfg.data.task)
    assert len(set(ours)) == 256
    spread = statistics.stdev(math.log(f) for f in ours)
    assert 0.4 < spread < 0.6, spread  # the profile's 0.5


def test_a_profile_written_by_dump_loads_back_equal(tmp_path):
    p = load_profile("qwen2_7b_h100_vllm")
    again = load_profile(str(dump_profile(p, tmp_path / "mine.yaml")))
    assert again == p and again.sources == p.sources


def _write(tmp_path, edit) -> str:
    raw = yaml.safe_load(Path(load_profile("qwen2_7b_h100_vllm").path).read_text())
    edit(raw)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("edit, match", [
    (lambda r: r["rollout"]["decode_base_ms"].pop("source"), "rollout.decode_base_ms must be a mapping"),
    (lambda r: r["rollout"]["decode_base_ms"].update(source=" "), "rollout.decode_base_ms.source must say"),
    (lambda r: r["rollout"].pop("kv_cache_tokens"), "rollout.kv_cache_tokens is missing"),
    (lambda r: r["rollout"].update(kv_tokens={"value": 1, "source": "x"}), "unknown key rollout.kv_tokens"),
    (lambda r: r["training"]["mfu"].update(value=1.5), r"training.mfu must be in \(0, 1\]"),
    (lambda r: r["rollout"]["max_num_seqs"].update(value=2.5), "rollout.max_num_seqs.value must be a whole number"),
    (lambda r: r["rollout"]["kv_cache_tokens"].update(value=100), "cannot hold one request"),
    (lambda r: r["lengths"].update(kind="gamma"), "lengths.kind must be 'lognormal' or 'histogram'"),
    (lambda r: r["rollout"].update(join_round_steps={"value": -1, "source": "x"}),
     "rollout.join_round_steps must be >= 0, got -1"),
    (lambda r: r["lengths"].update(kind="histogram", edges={"value": [1, 10], "source": "x"},
                                   counts={"value": [1, 2], "source": "x"}), "one more entry than"),
])
def test_a_bad_profile_is_refused_naming_the_key(tmp_path, edit, match):
    with pytest.raises(ProfileError, match=match):
        load_profile(_write(tmp_path, edit))


def _shared(raw: dict, **devices) -> None:
    raw["devices"] = {"kind": "shared", **{k: {"value": v, "source": "derived: a test"} for k, v in devices.items()}}


@pytest.mark.parametrize("edit, match", [
    (lambda r: r.update(devices={"kind": "gpu"}), "devices.kind must be 'separate' .* or 'shared' .*, got 'gpu'"),
    (lambda r: _shared(r), r"devices.kind=shared needs devices.threads >= 1 .*, got 0"),
    (lambda r: _shared(r, threads=1.5), "devices.threads.value must be a whole number, got 1.5"),
    (lambda r: _shared(r, threads=1, work_per_s=0), r"devices.work_per_s must be in \(0, 10\] .*, got 0.0"),
    (lambda r: r.update(devices={"threads": {"value": 2, "source": "x"}}),
     "devices.threads and devices.work_per_s are for devices.kind=shared"),
    (lambda r: r.update(devices={"kind": "shared", "cores": {"value": 2, "source": "x"}}),
     "unknown key devices.cores"),
    (lambda r: r.update(devices={"kind": "shared", "threads": 1}), "devices.threads must be a mapping"),
])
def test_a_bad_devices_section_is_refused_naming_the_key(tmp_path, edit, match):
    with pytest.raises(ProfileError, match=match):
        load_profile(_write(tmp_path, edit))


def test_a_shared_devices_profile_loads_dumps_back_equal_and_burns_in_the_engine(tmp_path):
    sep = load_profile("qwen2_7b_h100_vllm")
    assert not sep.devices.shared and "devices" not in yaml.safe_load(Path(sep.path).read_text())  # the default
    kw = engine_kwargs(sep, TwinConfig(profile=sep.name))
    assert kw["burn_threads"] is None and kw["join_rounds"] is False  # costs slept; vLLM's continuous batching
    p = load_profile(_write(tmp_path, lambda r: _shared(r, threads=2, work_per_s=0.75)))
    assert (p.devices.kind, p.devices.threads, p.devices.work_per_s) == ("shared", 2, 0.75)
    assert p.source("devices.threads") == "derived: a test"
    again = load_profile(str(dump_profile(p, tmp_path / "again.yaml")))
    assert again == p and again.sources == p.sources
    kw = engine_kwargs(p, TwinConfig(profile=p.path, time_scale=0.01))
    assert (kw["burn_threads"], kw["burn_work"]) == (2, 0.75)
    assert kw["step_ms"] == pytest.approx(4.54 * 0.01)  # the costs are the profile's, burned instead of slept


def test_an_unknown_profile_is_a_config_error_naming_the_shipped_ones():
    with pytest.raises(ConfigError, match=r"twin.profile='nope' is not a shipped profile .*qwen2_7b_h100_vllm"):
        load_config(None, ["twin.profile=nope"])
    with pytest.raises(ConfigError, match="no such file"):
        load_config(None, ["twin.profile=/no/such/profile.yaml"])
    with pytest.raises(ConfigError, match=r"^twin.time_scale must be > 0, got 0.0$"):
        load_config(None, ["twin.profile=qwen2_7b_h100_vllm", "twin.time_scale=0"])
    with pytest.raises(ConfigError, match="cannot simulate trainer.colocated=true"):
        load_config(None, ["twin.profile=qwen2_7b_h100_vllm", "trainer.colocated=true"])


def test_the_engine_costs_are_the_profiles_times_the_time_scale():
    p = load_profile("qwen2_7b_h100_vllm")
    kw = engine_kwargs(p, TwinConfig(profile=p.name, time_scale=0.01, tokens_per_id=64))
    assert kw["step_ms"] == pytest.approx(4.54 * 0.01) and kw["step_ms_per_seq"] == pytest.approx(0.0154 * 0.01)
    assert kw["step_ms_per_1k_kv"] == pytest.approx(0.0171 * 0.01)
    assert kw["max_batch_size"] == 1024 and kw["kv_capacity_tokens"] == 920_000 and kw["tokens_per_step"] == 64
    assert kw["load_ms"] == pytest.approx((15.22 / 50 + 15.22 / 64) * 1e3 * 0.01)
    c = train_costs(p, tokens=1e6, ranks=2)  # forward 2 * params * tokens / (peak * mfu)
    assert c["forward"] == pytest.approx(2 * 7.61e9 * 1e6 / (989e12 * 0.40))
    assert c["backward"] == pytest.approx(2 * c["forward"])
    assert c["optimizer"] == pytest.approx(7.61e9 * 28 / (2 * 3350e9))


async def test_sixteen_replicas_train_every_group_once_within_the_staleness_bound(ray_cluster, tmp_path):
    cfg = twin()  # 16 replicas in one process, 2 simulated training ranks, the 7B profile at a time scale of 0.01
    t = cfg.trainer
    t.steps, t.rollout_workers, t.batch_size, t.output_dir = 4, 16, 128, str(tmp_path)
    cfg.validate()
    k, B = t.max_staleness, cfg.prompts_per_step
    async with GRPOTrainer(cfg) as trainer:
        history = await trainer.fit()
        rollout = await trainer.groups.rollout.statistics()
        ranks = [s.args["rank"] for s in trainer.tracer.spans if s.name == "generate"]
    assert [r["step"] for r in history] == [0, 1, 2, 3] and [r["version"] for r in history] == [1, 2, 3, 4]
    assert all(0 <= r["staleness/max"] <= k for r in history)
    assert all(set(int(key.rpartition("_")[2]) for key in r if key.startswith("stream/tokens_staleness_")) <=
               set(range(k + 1)) for r in history)  # no trained token older than the bound
    assert all(r["actor/rows"] * t.train_workers == t.batch_size and r["actor/tokens"] > 0 for r in history)
    assert len(rollout) == 16 and sorted(set(ranks)) == list(range(16))  # every replica took groups
    recs = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    admitted = {r["index"]: r for r in recs if r["kind"] == "group"}
    steps = [r for r in recs if r["kind"] == "step"]
    trained = [g for r in steps for g in r["groups"]]
    assert len(trained) == len(set(trained)) == 4 * B and set(trained) <= set(admitted)  # once each, none made up
    assert all(0 <= s["step"] - admitted[g]["version"] <= k for s in steps for g in s["groups"])
    ledger = check_ledger(tmp_path)  # per sample: 0 lost, 0 trained twice, every token measured within the bound
    assert ledger.ok and ledger.trained == 4 * t.batch_size and ledger.replicas == 16, ledger.render()


async def test_a_shared_devices_twin_burns_its_costs_in_the_workers_and_trains_every_group_once(ray_cluster, tmp_path):
    cfg = twin()  # the 7B profile, made a twin of shared cores: its costs burned on the workers' one thread each
    cfg.twin.profile = _write(tmp_path, lambda r: _shared(r, threads=1, work_per_s=0.5))
    t = cfg.trainer
    t.steps, t.rollout_workers, t.batch_size, t.output_dir = 2, 2, 16, str(tmp_path / "run")
    cfg.validate()
    async with GRPOTrainer(cfg) as trainer:
        history = await trainer.fit()
        rollout = await trainer.groups.rollout.statistics()
    assert [r["step"] for r in history] == [0, 1] and all(r["actor/gpu_s"] > 0 for r in history)
    assert len(rollout) == 2 and all(r["sim_burned_s"] > 0 for r in rollout)  # each replica burned, none slept
    ledger = check_ledger(tmp_path / "run")
    assert ledger.ok and ledger.trained == 2 * t.batch_size, ledger.render()


def test_a_group_goes_to_the_replica_with_the_fewest_groups_in_flight():
    from asyncrl.pipelines.rollout.stream_rollout import StreamRollout, _Attempt

    class Pool:
        def __init__(self, n: int) -> None:
            self.world_size = n

    class Services:
        config = twin()

    route = StreamRollout._route.__get__(StreamRollout.__new__(StreamRollout))
    unload = StreamRollout._unload.__get__(StreamRollout.__new__(StreamRollout))
    route.__self__._services = Services()
    a = _Attempt.__new__(_Attempt)
    a.load, a.load_epoch, a.dead = [], -1, set()
    assert [route(a, Pool(3), 0) for _ in range(4)] == [0, 1, 2, 0]  # the lowest rank of the least loaded
    unload(a, 1, 0)
    unload(a, 2, 0)
    assert route(a, Pool(3), 0) == 1 and a.load == [2, 1, 0]
    unload(a, 0, 7)  # a group of a replaced pool: nothing of the new one
    assert a.load == [2, 1, 0]
    assert route(a, Pool(2), 1) == 0 and a.load == [1, 0]  # a new pool starts empty
    a.dead.add(1)  # a replica being replaced is not routed to, however idle
    assert [route(a, Pool(2), 1) for _ in range(2)] == [0, 0] and a.load == [3, 0]
