"""Streaming rollout in the trainer (``trainer.rollout_mode=stream``): an end-to-end run on real Ray with
exact invariants (staleness per trajectory within the bound, every group trained exactly once, the
step count, the metrics), and the settings it refuses before any worker starts."""

from __future__ import annotations

import json

import pytest
from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import load_config
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.pipelines.trainers.trainer import GRPOTrainer

STREAM_KEYS = {"staleness/max", "staleness/mean", "stream/multi_version_frac", "stream/tokens_staleness_0",
               "stream/tokens_staleness_1", "stream/in_flight", "stream/buffered", "stream/peak_in_flight",
               "stream/dropped_groups", "stream/admission_waits", "stream/admission_wait_s"}


def stream_config(out, steps: int = 4):
    cfg = tiny_test()
    cfg.trainer.steps = steps
    cfg.trainer.max_staleness = 1
    cfg.trainer.rollout_mode = "stream"  # rollout_weights stays auto: streaming implies latest
    cfg.trainer.output_dir = str(out)
    return cfg.validate()


def journal(out) -> list[dict]:
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


async def test_stream_mode_trains_every_group_once_within_the_staleness_bound(ray_cluster, tmp_path):
    cfg = stream_config(tmp_path)
    B = cfg.prompts_per_step
    async with GRPOTrainer(cfg) as trainer:
        history = await trainer.fit()
    assert [r["step"] for r in history] == [0, 1, 2, 3]
    assert [r["version"] for r in history] == [1, 2, 3, 4]
    for r in history:
        assert STREAM_KEYS <= set(r)
        assert 0 <= r["staleness/max"] <= 1 and r["stream/dropped_groups"] == 0
        assert r["stream/tokens_staleness_0"] + r["stream/tokens_staleness_1"] > 0
    recs = journal(tmp_path)
    admitted = {r["index"]: r for r in recs if r["kind"] == "group"}
    steps = [r for r in recs if r["kind"] == "step"]
    trained = [g for s in steps for g in s["groups"]]
    assert sorted(trained) == sorted(admitted) == list(range(4 * B))  # none lost, none twice, none extra
    for s in steps:
        assert len(s["groups"]) == B
        assert all(0 <= s["step"] - admitted[g]["version"] <= 1 for g in s["groups"])
        assert s["version"] == min(admitted[g]["version"] for g in s["groups"])
    assert all(admitted[g]["seed"] == cfg.trainer.seed * 1_000_003 + g for g in admitted)
    state = json.loads((tmp_path / "checkpoints" / "step_000004" / "state.json").read_text())
    assert state["stream"] == {"pending": [], "next_group": 4 * B}  # the end checkpoint: nothing owed
    rep = check_ledger(tmp_path)  # the per-sample ledger, measured from the trained rows themselves
    assert rep.ok, rep.render()
    assert (rep.trained, rep.measured_steps, rep.replicas) == (4 * B * cfg.group_size, 4, 1)


@pytest.mark.parametrize("overrides, match", [
    (["trainer.rollout_mode=streaming"], "trainer.rollout_mode"),
    (["trainer.rollout_mode=stream", "trainer.rollout_weights=latest", "trainer.max_staleness=0"],
     "trainer.max_staleness >= 1"),
    (["trainer.rollout_mode=stream", "trainer.rollout_weights=fixed_lag"],
     r"trainer.rollout_weights='fixed_lag' pins batch t .* Leave trainer.rollout_weights at auto"),
    (["trainer.rollout_mode=stream", "trainer.rollout_weights=latest", "trainer.stream.max_groups_in_flight=7"],
     "max_groups_in_flight=7 is below one step's 8 prompt groups"),
    (["trainer.rollout_mode=stream", "trainer.rollout_weights=latest", "trainer.colocated=true"],
     "trainer.colocated=false"),
    (["trainer.rollout_mode=stream", "trainer.rollout_weights=latest", "trainer.precompute_log_probs=true"],
     "trainer.precompute_log_probs"),
    (["trainer.rollout_mode=stream", "trainer.stream.bound=admitted", "trainer.stream.drop_stale=true"],
     "Set one of them: drop_stale=false, or bound=trained"),
    (["trainer.rollout_mode=stream", "trainer.stream.bound=tokens"], "trainer.stream.bound"),
])
def test_settings_streaming_cannot_run_are_config_errors_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)  # grpo_toy: 64 responses in groups of 8 -> 8 groups per step


def test_replaying_a_stream_journal_without_engine_rounds_is_refused(tmp_path):
    """(tests/reliability/test_stream_replay.py replays stream runs and pins the other refusals.)"""
    cfg = stream_config(tmp_path / "out")
    (tmp_path / "journal.jsonl").write_text(json.dumps({"kind": "run", "fingerprint": _fingerprint(cfg)}) + "\n")
    with pytest.raises(ConfigError, match="records no engine rounds"):
        GRPOTrainer(cfg, replay=tmp_path)


def _fingerprint(cfg):
    from asyncrl.pipelines.job.config import config_fingerprint

    return config_fingerprint(cfg)


@pytest.mark.parametrize("k, seed, drop", [(1, 0, False), (2, 1, False), (1, 3, True)])
async def test_under_random_delays_every_trajectory_is_within_the_bound_and_no_group_is_lost(k, seed, drop, tmp_path):
    """The trainer's real scheduling on in-process fake workers with random generate, score, update and
    weight-sync delays: the fake policy refuses any row older than the bound (by its first token's
    version), each admitted group is trained once (or, with drop_stale, dropped and counted)."""
    from .fakes import Recorder, fake_groups

    cfg = tiny_test()
    cfg.trainer.steps, cfg.trainer.max_staleness, cfg.trainer.rollout_weights = 8, k, "latest"
    cfg.trainer.rollout_mode, cfg.trainer.stream.drop_stale = "stream", drop
    cfg.trainer.checkpoint_at_end = False
    cfg.trainer.output_dir = str(tmp_path)
    cfg.validate()
    B = cfg.prompts_per_step
    rec = Recorder()
    async with fake_groups(rec, seed, B, 0.01, k) as groups, GRPOTrainer(cfg, groups=groups) as trainer:
        history = await trainer.fit()
    assert [r["version"] for r in history] == list(range(1, 9))
    assert all(0 <= r["staleness/max"] <= k for r in history)
    recs = journal(tmp_path)
    admitted = {r["index"]: r["version"] for r in recs if r["kind"] == "group"}
    trained = [g for r in recs if r["kind"] == "step" for g in r["groups"]]
    dropped = [r["index"] for r in recs if r["kind"] == "group_drop"]
    assert len(trained) == len(set(trained)) == 8 * B and not set(trained) & set(dropped)
    assert sum(r["stream/dropped_groups"] for r in history[-1:]) == len(dropped)
    if not drop:
        assert dropped == [] and sorted(trained) == sorted(admitted) == list(range(8 * B))
    updates = [v for name, _, v in rec.events if name == "actor_update"]
    assert updates == list(range(8))
    rep = check_ledger(tmp_path)
    assert rep.ok, rep.render()
    G = cfg.group_size
    assert rep.trained == 8 * B * G and rep.dropped.get("stale", 0) == len(dropped) * G
    assert rep.samples == len(admitted) * G and sum(rep.staleness.values()) == rep.trained


async def test_drop_stale_drops_a_group_that_finished_past_the_bound_and_counts_it(tmp_path):
    """``trainer.stream.drop_stale``: group 0 (admitted at version 0) finishes only once version 2 is loaded,
    and step 3's update waits for it (fakes.HeldRollout, HeldPolicy), so a take at step >= 2 finds it
    finished and too stale (max_staleness=1): it is dropped, journaled, counted, and never trained."""
    from .fakes import HeldPolicy, HeldRollout, Recorder, fake_groups

    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.rollout_mode, t.stream.drop_stale = 6, 1, "stream", True
    t.checkpoint_at_end, t.output_dir = False, str(tmp_path)
    cfg.validate()
    B = cfg.prompts_per_step
    rec = Recorder()
    async with fake_groups(rec, 0, B, 0.01, 1, rollout=HeldRollout, policy=HeldPolicy) as groups, \
            GRPOTrainer(cfg, groups=groups) as trainer:
        history = await trainer.fit()
    assert [r["version"] for r in history] == list(range(1, 7))
    recs = journal(tmp_path)
    drops = {r["index"]: r for r in recs if r["kind"] == "group_drop"}
    trained = [g for r in recs if r["kind"] == "step" for g in r["groups"]]
    assert drops[0]["version"] == 0 and drops[0]["at_version"] >= 2  # dropped at a step it could not join
    assert 0 not in trained and len(trained) == len(set(trained)) == 6 * B and not set(trained) & set(drops)
    assert history[-1]["stream/dropped_groups"] == len(drops) >= 1
    assert all(0 <= r["staleness/max"] <= 1 for r in history)
    rep = check_ledger(tmp_path)
    assert rep.ok, rep.render()
    assert rep.dropped["stale"] == len(drops) * cfg.group_size and rep.trained == 6 * B * cfg.group_size


async def test_the_admitted_bound_trains_on_past_a_long_group_and_trains_it_once_when_it_finishes(tmp_path):
    """``trainer.stream.bound=admitted``: group 0 (admitted at version 0) finishes only once version 2 is loaded,
    and step 3's update waits for it (fakes.HeldRollout, HeldPolicy). Under the trained bound step 1 would wait for
    it (a deadlock here); under this one step 1 trains the groups that finished, and group 0 is trained once, at
    step 2 or later, older than max_staleness=1 (the policy is told the run's steps as its refusal bound). The
    ledger holds: nothing lost, nothing trained twice."""
    from .fakes import HeldPolicy, HeldRollout, Recorder, fake_groups

    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.rollout_mode, t.stream.bound = 6, 1, "stream", "admitted"
    t.checkpoint_at_end, t.output_dir = False, str(tmp_path)
    cfg.validate()
    B = cfg.prompts_per_step
    rec = Recorder()
    async with fake_groups(rec, 0, B, 0.01, t.steps, rollout=HeldRollout, policy=HeldPolicy) as groups, \
            GRPOTrainer(cfg, groups=groups) as trainer:
        history = await trainer.fit()
    assert [r["version"] for r in history] == list(range(1, 7))
    recs = journal(tmp_path)
    trained = [g for r in recs if r["kind"] == "step" for g in r["groups"]]
    at = [r["step"] for r in recs if r["kind"] == "step" and 0 in r["groups"]]
    assert len(trained) == len(set(trained)) == 6 * B and len(at) == 1 and at[0] >= 2  # once, after version 2 loaded
    assert not [r for r in recs if r["kind"] == "group_drop"] and history[-1]["stream/dropped_groups"] == 0
    assert history[at[0]]["staleness/max"] == at[0] > t.max_staleness
    rep = check_ledger(tmp_path)
    assert rep.ok, rep.render()
    assert rep.trained == 6 * B * cfg.group_size and at[0] in rep.staleness  # group 0's rows: step - 0 old


@pytest.mark.parametrize("mode, bound, refused_past", [("stream", "trained", 2), ("stream", "admitted", 40),
                                                       ("batch", "admitted", 2)])
def test_the_policy_refuses_rows_past_the_bound_the_run_keeps(mode, bound, refused_past):
    """The PolicyWorker's refusal of old rows (StaleBatchError) follows the bound: max_staleness, or, in stream mode
    with bound=admitted (a long group is trained when it finishes), only rows older than the run's 40 steps."""
    from asyncrl.pipelines.run.build import role_specs

    cfg = load_config(None, ["trainer.steps=40", "trainer.max_staleness=2", f"trainer.rollout_mode={mode}",
                             f"trainer.stream.bound={bound}"])
    _, train = role_specs(cfg, None)
    assert train["policy"][2] == {"max_staleness": refused_past}


@pytest.mark.slow
@pytest.mark.parametrize("partial", ["off", "recompute"])
def test_stream_mode_learns_char_class(ray_cluster, tmp_path, partial):
    """The main job (grpo_toy, 60 steps) in stream mode reaches the reward batch mode reaches
    (tests/pipelines/test_main_job.py: first 5 steps < 0.3, last 5 > 0.8), within the bound."""
    from asyncrl.pipelines.commands.cli import main
    from asyncrl.pipelines.observe.metrics import read_jsonl

    out = tmp_path / "run"
    partial_key = [] if partial == "off" else [f"rollout.partial_rollout={partial}"]  # (YAML reads `off` as false)
    assert main(["train", f"trainer.output_dir={out}", "trainer.steps=60", "trainer.progress=false",
                 "trainer.rollout_mode=stream", *partial_key]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(60))
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.3 and last > 0.8, (first, last)
    assert all(r["staleness/max"] <= 1 for r in rows)


def test_the_token_staleness_histogram_reaches_the_oldest_token_when_one_is_past_the_bound():
    """``stream/tokens_staleness_{d}`` for d = 0..max_staleness, and on to the oldest token's age when a row is older
    (bound=admitted); masked tokens are not counted."""
    import torch
    from asyncrl.pipelines.loop.stream_batch import version_stats
    from tensordict import TensorDict

    batch = TensorDict({"response_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
                        "version": torch.tensor([1, 4]),
                        "token_versions": torch.tensor([[1, 2, 4, 0], [4, 4, 0, 0]])}, batch_size=[2])
    out = version_stats(batch, 5, 1)
    assert {k: v for k, v in out.items() if k.startswith("stream/tokens_staleness_")} == {
        "stream/tokens_staleness_0": 0.0, "stream/tokens_staleness_1": 3.0, "stream/tokens_staleness_2": 0.0,
        "stream/tokens_staleness_3": 1.0, "stream/tokens_staleness_4": 1.0}
    assert (out["staleness/max"], out["stream/multi_version_frac"]) == (4.0, 0.5)
    assert set(version_stats(batch, 4, 4)) == set(version_stats(batch, 4, 1)) | {"stream/tokens_staleness_4"}
