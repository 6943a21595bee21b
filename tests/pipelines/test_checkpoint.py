"""Checkpoint and resume: a run interrupted after step k and resumed ends identical to an
uninterrupted one; a crash while writing leaves the previous checkpoint usable."""

from __future__ import annotations

import json

import pytest

from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer


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


# Slow: the default suite pins the same promise end to end in tests/reliability/test_fail_fast.py
# (test_a_signal_checkpoints_the_run_and_resume_continues_it_in_place: a stopped run, its checkpoint with the
# batch generated ahead, `--resume`, then weights and every step's metrics equal to the uninterrupted run),
# and the buffered batch's round trip here (test_a_buffered_batch_keeps_its_sampling_metrics_through_a_checkpoint).
@pytest.mark.slow
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


def _fake_checkpoint(run, cfg, **extra):
    """A complete-looking checkpoint of `cfg` at step 1 (files are placeholders: only the controller's
    resume checks read them)."""
    from asyncrl.pipelines.job.config import config_fingerprint
    from asyncrl.pipelines.configlib import to_dict

    d = ckpt.checkpoint_dir(run, 1)
    (d / "policy").mkdir(parents=True)
    for f in ("buffer.pt", "policy/model.safetensors", "policy/optimizer.pt", "policy/meta.json"):
        (d / f).write_bytes(b"x")
    state = {"step": 1, "policy_version": 1, "next_gen": 2, "rng": {}, "config": to_dict(cfg),
             "fingerprint": config_fingerprint(cfg), **extra}
    (d / "state.json").write_text(json.dumps(state))
    ckpt.write_manifest(d)
    return d


def _data_cfg(path, out):
    from asyncrl.pipelines.job.presets import load_config

    return load_config(None, ["trainer.batch_size=8", "algorithm.group_size=4", f"data.train_files={path}",
                              f"trainer.output_dir={out}"])


def test_a_resume_on_an_edited_data_file_is_refused_naming_the_file_and_the_fix(tmp_path):
    from asyncrl.pipelines.datasets.datafiles import content_digest, data_digests
    from tests.pipelines.datafiles_util import ROWS, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    cfg = _data_cfg(data, tmp_path / "run")
    digests = data_digests(cfg.data)
    assert digests == {f"data.train_files:{data}": content_digest(str(data))}
    assert content_digest(str(data)).startswith("sha256:")  # small: the whole file is hashed
    _fake_checkpoint(tmp_path / "run", cfg, data_digests=digests)
    GRPOTrainer(cfg, resume=tmp_path / "run")  # the same data: accepted
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(data.read_bytes())  # a copy (new mtime) has the same digest
    assert content_digest(str(copy)) == content_digest(str(data))

    edited = [dict(r) for r in ROWS]
    edited[3] = {**edited[3], "reward_model": {"style": "rule", "ground_truth": "7"}}
    write_jsonl(data, edited)
    with pytest.raises(ConfigError) as e:
        GRPOTrainer(_data_cfg(data, tmp_path / "run"), resume=tmp_path / "run")
    msg = str(e.value)
    assert msg.startswith(f"data.train_files: '{data}' changed since checkpoint ")
    assert "put the original file back, or start a new run in a new trainer.output_dir (without --resume)" in msg


async def test_in_a_running_loop_the_data_check_runs_in_setups_thread(tmp_path):
    from asyncrl.pipelines.datasets.datafiles import data_digests
    from tests.pipelines.datafiles_util import ROWS, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    cfg = _data_cfg(data, tmp_path / "run")
    _fake_checkpoint(tmp_path / "run", cfg, data_digests=data_digests(cfg.data))
    write_jsonl(data, ROWS[:5])
    trainer = GRPOTrainer(_data_cfg(data, tmp_path / "run"), resume=tmp_path / "run")  # no hashing on the loop
    with pytest.raises(ConfigError, match=r"^data\.train_files: .* changed since checkpoint"):
        await trainer.checkpoints.verify_resume()


def test_a_large_file_is_digested_by_size_and_its_first_and_last_mib(tmp_path):
    from asyncrl.pipelines.datasets.datafiles import FULL_HASH_BYTES, content_digest

    big = tmp_path / "big.jsonl"
    body = bytearray(b"a" * (FULL_HASH_BYTES + 3 * (1 << 20)))
    big.write_bytes(body)
    d = content_digest(str(big))
    assert d.startswith(f"size={len(body)},edges-sha256:")
    body[-1:] = b"b"
    big.write_bytes(body)
    assert content_digest(str(big)) != d  # the last MiB changed
    body[-1:] = b"a"
    body[len(body) // 2] = ord("b")
    big.write_bytes(body)
    assert content_digest(str(big)) == d  # documented: a same-size edit in the middle is not seen


def test_a_buffered_batch_keeps_its_sampling_metrics_through_a_checkpoint(tmp_path):
    import torch
    from tensordict import TensorDict

    from asyncrl.pipelines.checkpoints.checkpointing import buffered_record, restored_batch
    from asyncrl.pipelines.loop.loop_state import RolloutBatch

    td = TensorDict({"responses": torch.tensor([[1, 2], [3, 4]]), "scores": torch.tensor([0.5, 1.0])}, batch_size=[2])
    metrics = {"sampling/gen_batches": 2.0, "sampling/filtered_groups": 3.0, "sampling/kept_groups": 1.0}
    item = RolloutBatch(step=5, version=4, batch=None, scores=None, reward_mean=0.75, gen_time=1.25, metrics=metrics)
    torch.save([buffered_record(item, td)], tmp_path / "buffer.pt")
    [b] = torch.load(tmp_path / "buffer.pt", weights_only=True)
    back = restored_batch(b, ckpt.plain_to_batch(b["batch"]))
    assert (back.step, back.version, back.reward_mean, back.gen_time, back.metrics) == (5, 4, 0.75, 1.25, metrics)
    assert back.scores["scores"].tolist() == [0.5, 1.0] and back.batch["responses"].tolist() == [[1, 2], [3, 4]]
    old = {k: v for k, v in b.items() if k != "metrics"}  # written before the metrics were kept
    assert restored_batch(old, ckpt.plain_to_batch(b["batch"])).metrics == {}
