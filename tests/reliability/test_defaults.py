"""Defaults that never lose work: a run with no restart or checkpoint settings survives a
SIGKILLed rollout worker (replaced in place, every step done once) and a hung one (SIGSTOPped: its
generate misses ``trainer.rollout_timeout_s`` and the pool is replaced), and writes time-based
checkpoints (``trainer.checkpoint_every_s``) so that a SIGKILLed controller resumes from a
checkpoint at most that old."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import yaml

from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.job.config import RestartConfig, TrainerConfig
from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.job.presets import tiny_test
from tests.reliability.conftest import live_actors, settled
from tests.reliability.faults import FaultyPolicy, FaultyRollout
from tests.reliability.test_faults import STEPS, _exactly_once, _fault, run_with_fault


def test_the_defaults_replace_dead_workers_and_checkpoint_every_ten_minutes():
    t = TrainerConfig()
    assert (t.restart.max_restarts, t.restart.replace_stateless, t.restart.on_timeout) == (3, True, True)
    assert (t.checkpoint_every_s, t.checkpoint_every, t.checkpoint_at_end) == (600.0, 0, True)


async def test_at_the_defaults_a_killed_rollout_worker_is_replaced_and_a_killed_training_worker_restarts_the_run(
        ray_cluster, tmp_path):
    """The default suite's proof of the recovery defaults, with nothing but the step count and output
    directory set: a SIGKILLed rollout worker (batch 0) is replaced in place without a checkpoint, then a
    SIGKILLed training worker (mid-update of step 0) restarts the run from its newest
    checkpoint -- none yet, as ``checkpoint_every_s`` (600 s) has not passed, so from the run's start -- and
    every step is trained once, with no time-based checkpoint written and nothing leaked. (The hung worker
    and the time-based checkpoint that a killed controller resumes from need minutes at the defaults:
    the slow tests below, which lower only the deadline and the interval.)"""
    cfg = tiny_test()
    cfg.trainer.steps, cfg.trainer.output_dir = STEPS, str(tmp_path / "run")
    t = cfg.trainer
    assert t.restart == RestartConfig() and (t.checkpoint_every, t.checkpoint_every_s) == (0, 600.0)
    assert t.stage_timeout_s is None and t.rollout_timeout_s == 600.0
    before = await asyncio.to_thread(live_actors)
    rollout = _fault(tmp_path, "generate", 1, name="rollout")
    policy = _fault(tmp_path, "update", 1, name="policy", after=rollout)  # after the replacement, in step 0
    out = await run_with_fault(cfg.validate(), [rollout, policy],
                               {"rollout": (FaultyRollout, {"fault": rollout}),
                                "policy": (FaultyPolicy, {"fault": policy})}, kill=True, bound=120)
    assert out.error is None, out.error
    replaced, restarted = out.trainer.restarts
    assert (replaced["kind"], replaced["from_checkpoint"]) == ("replace", None)
    assert (restarted["kind"], restarted["from_checkpoint"], restarted["from_step"]) == ("restart", None, 0)
    assert [h["step"] for h in out.history] == list(range(STEPS))
    _exactly_once(tmp_path / "run")
    ledger = check_ledger(tmp_path / "run")  # the restart went back to the start: one rewind, step 0 discarded
    assert (ledger.rewinds, ledger.discarded_steps) == (1, 1)
    assert [p.name for p in ckpt.checkpoints(tmp_path / "run")] == [f"step_{STEPS:06d}"]  # the end's only
    assert await settled(before) == before


@pytest.mark.slow  # ~85 s on the loaded 2-core machine; the default suite has test_at_the_defaults_... above
async def test_a_default_run_survives_a_killed_rollout_worker_and_completes_every_step(ray_cluster, tmp_path,
                                                                                    fault_row):
    cfg = tiny_test()
    cfg.trainer.steps, cfg.trainer.max_staleness, cfg.trainer.output_dir = STEPS, 1, str(tmp_path / "run")
    assert cfg.trainer.restart == RestartConfig() and cfg.trainer.checkpoint_every == 0  # nothing asked for
    before = await asyncio.to_thread(live_actors)
    fault = _fault(tmp_path, "generate", 3)
    out = await run_with_fault(cfg.validate(), fault, {"rollout": (FaultyRollout, {"fault": fault})}, kill=True,
                               bound=120)
    assert out.error is None, out.error
    [r] = out.trainer.restarts
    assert r["kind"] == "replace" and r["from_checkpoint"] is None
    assert [h["step"] for h in out.history] == list(range(STEPS))
    _exactly_once(tmp_path / "run")
    after = await settled(before)
    assert after == before
    fault_row(order=1.5, fault="rollout worker SIGKILLed mid-generation (batch 2)", policy="none (the defaults)",
              outcome="rollout pool replaced in place, batch re-issued, run completed", seconds=r["time_s"],
              bound="-", interrupted=r["interrupted_s"], leaks="none" if after == before else f"LEAK {after} vs {before}",
              state="every step once")


ROLLOUT_TIMEOUT_S = 5.0
"""``trainer.rollout_timeout_s`` of the hung-worker run (600 s by default; lowered for the test's time only)."""


@pytest.mark.slow  # ~60-90 s on the loaded 2-core machine
async def test_a_default_run_replaces_a_hung_rollout_worker_and_completes_every_step(ray_cluster, tmp_path,
                                                                                   fault_row):
    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.output_dir = STEPS, 1, str(tmp_path / "run")
    assert t.restart == RestartConfig() and t.stage_timeout_s is None and t.rollout_timeout_s == 600.0
    t.rollout_timeout_s = ROLLOUT_TIMEOUT_S
    before = await asyncio.to_thread(live_actors)
    fault = _fault(tmp_path, "generate", 3)
    # The worker stops inside generate (batch 2) and the test SIGSTOPs its whole process: nothing in it answers.
    out = await run_with_fault(cfg.validate(), fault, {"rollout": (FaultyRollout, {"fault": fault})}, kill=True,
                               sig=signal.SIGSTOP, bound=120)
    assert out.error is None, out.error
    [r] = out.trainer.restarts
    assert (r["kind"], r["error_type"], r["from_checkpoint"]) == ("replace", "CallTimeoutError", None)
    assert [h["step"] for h in out.history] == list(range(STEPS))
    _exactly_once(tmp_path / "run")
    after = await settled(before)  # the stopped process was killed with its pool
    assert after == before
    fault_row(order=12.5, fault="rollout worker hangs mid-generation (batch 2; its process SIGSTOPped)",
              policy=f"none (the defaults; `rollout_timeout_s={ROLLOUT_TIMEOUT_S:g}` here for speed, 600 by default)",
              outcome="the generate deadline fired, rollout pool replaced in place, batch re-issued, run completed",
              seconds=r["time_s"], bound="rollout_timeout_s + recovery", interrupted=r["interrupted_s"],
              leaks="none" if after == before else f"LEAK {after} vs {before}", state="every step once")


EVERY_S = 4.0
"""``trainer.checkpoint_every_s`` of the killed controller's run (seconds)."""


@pytest.mark.slow
async def test_a_killed_controller_resumes_from_a_checkpoint_at_most_checkpoint_every_s_old(ray_cluster, tmp_path,
                                                                                          fault_row):
    cfg = tiny_test()
    t = cfg.trainer
    # More steps than the run can train before the kill (400 took 14 s in CI): it must still be running at
    # 2.5 * EVERY_S however fast its steps are.
    t.steps, t.max_staleness, t.checkpoint_every_s, t.output_dir, t.num_cpus = 10**6, 1, EVERY_S, str(tmp_path / "run"), 8
    assert t.checkpoint_every == 0  # only the time-based checkpoints
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(to_dict(cfg.validate())))
    run = tmp_path / "run"
    cli = [sys.executable, "-m", "asyncrl.pipelines.commands.cli", "train", "--config", str(cfg_file)]
    env = {**os.environ, "RAY_ADDRESS": ""}
    with (tmp_path / "killed.log").open("w") as log:
        proc = subprocess.Popen(cli, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        try:
            async with asyncio.timeout(300):  # until the run has gone on for more than 2 * checkpoint_every_s
                while not (rows := read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []) \
                        or rows[-1]["time/elapsed"] < 2.5 * EVERY_S:
                    assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
                    await asyncio.sleep(0.2)
            os.kill(proc.pid, signal.SIGKILL)  # the controller alone; its Ray session reaps itself
            await asyncio.to_thread(proc.wait)
        finally:
            if proc.poll() is None:
                proc.kill()
    done = read_jsonl(run / "metrics.jsonl")
    saved = ckpt.latest_checkpoint(run)
    assert saved is not None  # written by time alone
    step = ckpt.read_state(saved)["step"]
    assert 1 <= step < t.steps
    # The policy: after each step, a checkpoint when >= EVERY_S passed since the last one was written. That
    # one was written right after step `step - 1` ended (it took `save_s`: the gap between that step's end and
    # the next one's, less the next one's own time). So every later step that ended had ended less than
    # EVERY_S after it was written -- except the last, whose own checkpoint the kill may have cut short.
    end_of = {r["step"]: r["time/elapsed"] for r in done}
    took = {r["step"]: r["time/step"] for r in done}
    save_s = end_of[step] - end_of[step - 1] - took[step] if step in end_of else 0.0
    lost = sorted(s for s in end_of if s >= step)
    margin = 0.5  # the two clocks are read a few statements apart
    assert all(end_of[s] - (end_of[step - 1] + save_s) < EVERY_S + margin for s in lost[:-1]), (step, save_s, end_of)

    resumed = await asyncio.to_thread(subprocess.run, cli + ["--resume", str(run), "trainer.steps=" + str(step + 2)],
                                      env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(step + 2))
    fault_row(order=31, fault=f"controller SIGKILLed after {done[-1]['time/elapsed']:.0f} s",
              policy=f"the defaults (`checkpoint_every_s={EVERY_S:g}` here for speed; 600 by default)",
              outcome=f"resumed from the time-based step-{step} checkpoint",
              seconds=max(end_of.values()) - (end_of[step - 1] + save_s),  # the training time that was lost
              bound="checkpoint < checkpoint_every_s + a step old", interrupted="until `--resume`",
              leaks="-", state=f"{len(lost)} finished steps recomputed (measured: the training time lost)")
