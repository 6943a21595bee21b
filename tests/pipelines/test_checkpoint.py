"""Checkpoint and resume: a run interrupted after step k and resumed ends identical to an
uninterrupted one; a crash while writing leaves the previous checkpoint usable."""

from __future__ import annotations

import json

import pytest

from asyncrl.pipelines import checkpoint as ckpt
from asyncrl.pipelines.config import ConfigError
from asyncrl.pipelines.metrics import read_jsonl
from asyncrl.pipelines.presets import tiny_test
from asyncrl.pipelines.trainer import GRPOTrainer


class Crash(Exception):
    pass


def _cfg(out):
    cfg = tiny_test()
    cfg.trainer.steps = 4
    cfg.trainer.max_staleness = 1  # the checkpoint must carry the batch generated ahead
    cfg.trainer.checkpoint_every = 2
    cfg.trainer.colocated = True
    cfg.trainer.output_dir = str(out)
    return cfg


async def test_interrupted_and_resumed_run_ends_identical_to_an_uninterrupted_run(ray_cluster, tmp_path):
    async with GRPOTrainer(_cfg(tmp_path / "full")) as t:
        full = await t.fit()
        full_sum = await t.groups.policy.weights_checksum()

    def crash_after_step_1(trainer, step, metrics):
        if step == 1:  # steps 0 and 1 done, checkpoint step_000002 written
            raise Crash()

    with pytest.raises(Crash):
        async with GRPOTrainer(_cfg(tmp_path / "cut"), on_step=crash_after_step_1) as t:
            await t.fit()
    saved = ckpt.latest_checkpoint(tmp_path / "cut")
    assert saved is not None and saved.name == "step_000002"
    state = ckpt.read_state(saved)
    assert (state["step"], state["policy_version"], state["next_gen"]) == (2, 2, 4)

    async with GRPOTrainer(_cfg(tmp_path / "cut"), resume=tmp_path / "cut") as t:
        resumed = await t.fit()
        resumed_sum = await t.groups.policy.weights_checksum()
    assert resumed_sum == full_sum
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/") and not k.startswith("buffer/")}
                          for r in rows]
    assert strip(resumed) == strip(full)
    assert [r["step"] for r in read_jsonl(tmp_path / "cut" / "metrics.jsonl")] == [0, 1, 2, 3]


def test_an_unfinished_checkpoint_is_ignored(tmp_path):
    good = ckpt.checkpoint_dir(tmp_path, 2)
    good.mkdir(parents=True)
    (good / "state.json").write_text(json.dumps({"step": 2}))
    torn = ckpt.checkpoint_dir(tmp_path, 4).with_name("step_000004.tmp-123")
    torn.mkdir()
    (torn / "state.json").write_text("{")  # the crash happened mid-write
    assert ckpt.latest_checkpoint(tmp_path) == good
    assert ckpt.resolve_resume(tmp_path) == good


def test_commit_replaces_atomically(tmp_path):
    tmp = tmp_path / "checkpoints" / "step_000001.tmp-1"
    tmp.mkdir(parents=True)
    (tmp / "state.json").write_text("{}")
    final = ckpt.commit(tmp, ckpt.checkpoint_dir(tmp_path, 1))
    assert final.is_dir() and not tmp.exists() and (final / "state.json").read_text() == "{}"


def test_resume_errors_are_raised_before_any_worker_starts(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        GRPOTrainer(tiny_test(), resume=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        GRPOTrainer(tiny_test(), resume=tmp_path / "empty")
    other = ckpt.checkpoint_dir(tmp_path / "run", 1)
    other.mkdir(parents=True)
    from asyncrl.pipelines.configlib import to_dict

    cfg = tiny_test()
    cfg.actor.lr = 0.5
    (other / "state.json").write_text(json.dumps({"step": 1, "fingerprint": "x", "config": to_dict(cfg)}))
    with pytest.raises(ConfigError, match="different config.*actor.lr"):
        GRPOTrainer(tiny_test(), resume=tmp_path / "run")
