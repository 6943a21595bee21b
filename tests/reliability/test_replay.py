"""Async runs replay exactly: the run journal and ``asyncrl replay``.

* An async ``rollout_weights: latest`` run with randomised stage delays (real workers, real
  Ray) is replayed from its journal by ``asyncrl replay RUN`` -- without the delays -- and
  reaches the same final weights bit for bit and the same per-step metrics.
* With fake workers (tests/pipelines/fakes.py, random stage delays, in-process backend) a
  replay under *different* delays generates every batch with the journal's version and trains
  in the journal's order, where a fresh run under those delays would not be bound to it.
* The journal itself: records, a torn last line, and the rewind a resume or restart does.
"""

from __future__ import annotations

import json

import pytest

from asyncrl.pipelines.commands.cli import main
from asyncrl.pipelines.journaling.journal import Journal, JournalError, read_journal
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.commands.replay import compare_metrics
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from tests.pipelines.fakes import Recorder, fake_groups
from tests.reliability.faults import DelayedPolicy, DelayedRollout

STEPS = 6
K = 2


def latest_cfg(out, steps: int = STEPS):
    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.rollout_weights, t.output_dir = steps, K, "latest", str(out)
    return cfg.validate()


def test_a_latest_run_with_random_stage_delays_replays_to_identical_weights_and_metrics(ray_cluster, tmp_path,
                                                                                        capsys):
    run = tmp_path / "run"
    delays = {"rollout": (DelayedRollout, {"delay_seed": 3, "max_delay": 0.25}),
              "policy": (DelayedPolicy, {"delay_seed": 4, "max_delay": 0.25})}
    history = GRPOTrainer(latest_cfg(run), worker_overrides=delays).fit_sync()
    journal = read_journal(run)
    versions = [journal.batches[i]["version"] for i in range(STEPS)]
    assert all(max(0, i - K) <= v <= i for i, v in enumerate(versions))  # latest, within the bound
    assert journal.end is not None and journal.end["steps"] == STEPS and journal.end["weights_sha256"]
    assert [journal.steps[t]["batch"] for t in range(STEPS)] == list(range(STEPS))

    capsys.readouterr()
    assert main(["replay", str(run)]) == 0  # no delays now: the timing is different, the schedule is not
    err = capsys.readouterr().err
    assert f"replayed {STEPS} steps of {run}: same weight version for every batch, every per-step metric " \
           "identical, final weights identical" in err
    replayed = read_journal(run / "replay")
    assert [replayed.batches[i]["version"] for i in range(STEPS)] == versions
    assert replayed.end["weights_sha256"] == journal.end["weights_sha256"]  # bit for bit
    assert compare_metrics(read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "replay" / "metrics.jsonl")) == []
    assert [r["step"] for r in history] == list(range(STEPS))


async def _fake_run(cfg, delay_seed: int, *, replay=None):
    cfg.trainer.checkpoint_at_end = False  # fake workers have no weights to save
    rec = Recorder()
    async with fake_groups(rec, delay_seed, cfg.prompts_per_step, 0.01, K) as groups:
        async with GRPOTrainer(cfg, groups=groups, replay=replay) as trainer:
            await trainer.fit()
    return [(step, v) for stage, step, v in rec.events if stage == "generate"]


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_a_replay_follows_the_journal_under_different_timing(tmp_path, seed):
    steps = 16
    original = await _fake_run(latest_cfg(tmp_path / "a", steps), delay_seed=seed)
    journal = read_journal(tmp_path / "a")
    assert original == [(i, journal.batches[i]["version"]) for i in range(steps)]
    replayed = await _fake_run(latest_cfg(tmp_path / "b", steps), delay_seed=seed + 100, replay=tmp_path / "a")
    assert replayed == original  # every batch generated with the journal's version
    again = read_journal(tmp_path / "b")
    assert [again.steps[t]["batch"] for t in range(steps)] == [journal.steps[t]["batch"] for t in range(steps)]


def test_replay_refuses_a_journal_of_another_config(tmp_path):
    j = Journal(tmp_path / "journal.jsonl")
    j.start({"fingerprint": "0" * 16, "config": {}})
    j.close()
    with pytest.raises(JournalError, match="different config"):
        GRPOTrainer(latest_cfg(tmp_path / "x"), replay=tmp_path)
    with pytest.raises(JournalError, match="no run journal"):
        GRPOTrainer(latest_cfg(tmp_path / "x"), replay=tmp_path / "missing")


def test_the_journal_rewinds_to_a_restore_point_and_returns_the_versions_recorded_after_it(tmp_path):
    j = Journal(tmp_path / "journal.jsonl")
    assert j.start({"fingerprint": "f", "config": {}}) == {}
    for i, v in enumerate([0, 0, 1, 2, 2, 4]):
        j.batch(i, prompts=[i], seed=i, version=v, rows=8)
    for t in range(4):
        j.step(t, batch=t, version=[0, 0, 1, 2][t])
    j.drop(9, version=0, at_version=3)
    # a restart from the step-2 checkpoint, which had generated batches 0..3
    assert j.rewind(next_gen=4, start_step=2) == {4: 2, 5: 4}
    j.close()
    data = read_journal(tmp_path)
    assert sorted(data.batches) == [0, 1, 2, 3] and sorted(data.steps) == [0, 1] and data.drops == []
    # a resume in a new directory keeps the same records and adds a header for the new segment
    k = Journal(tmp_path / "b" / "journal.jsonl")
    assert k.start({"fingerprint": "f", "config": {}}, previous=data, next_gen=3, start_step=1) == {3: 2}
    k.close()
    lines = [json.loads(x) for x in (tmp_path / "b" / "journal.jsonl").read_text().splitlines()]
    # (each rewind is recorded for the per-sample ledger: the steps it discarded)
    assert [x["kind"] for x in lines] == ["run", "rewind", "batch", "batch", "batch", "step", "rewind", "run"]
    assert [(x["start_step"], x["discarded_steps"]) for x in lines if x["kind"] == "rewind"] == [(2, [2, 3]), (1, [1])]


def test_a_torn_last_line_is_ignored_and_a_corrupt_one_is_an_error(tmp_path):
    j = Journal(tmp_path / "journal.jsonl")
    j.start({"fingerprint": "f", "config": {}})
    j.batch(0, prompts=[0], seed=0, version=0, rows=8)
    j.close()
    path = tmp_path / "journal.jsonl"
    path.write_text(path.read_text() + '{"kind": "batch", "ind')  # killed mid-write
    assert sorted(read_journal(tmp_path).batches) == [0]
    path.write_text('{"kind": "run"}\nnot json\n{"kind": "end", "steps": 1}\n')
    with pytest.raises(JournalError, match="line 2"):
        read_journal(tmp_path)
