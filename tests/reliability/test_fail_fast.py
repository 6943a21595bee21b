"""Failures reach the user at once, with their own message and a non-zero exit; Ctrl-C and
SIGTERM keep the run's progress; training twice in one process works.

* bad values (an unknown reward function, a negative learning rate or temperature, a missing
  model directory) are rejected by ``asyncrl train`` and ``--print-config`` with exit status 2
  and a one-line message naming the key, before Ray starts;
* a worker SIGKILLed under ``asyncrl train`` with ``trainer.restart.max_restarts=0`` ends it with status 1,
  one line naming ``WorkerDiedError``, the resume command and ``error.log`` (no stack dump on
  the terminal), within a bound;
* a second ``fit_sync()`` in one process trains too, and an error raised by a worker in it
  reaches the caller as itself;
* SIGINT (and SIGTERM) finish the step in progress, write a checkpoint, exit 130 (143) and
  print the resume command; running it continues in the same run directory from that step
  and ends with the weights of an uninterrupted run; a second signal abandons the step.

Bounds are generous stall/hang bounds for a loaded 2-core machine, not speed claims.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.commands.cli import main
from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles.scoring.reward import RewardConfig
from tests.reliability.conftest import wait_for_file
from tests.reliability.gated_reward import gated_reward

CONFIG_ERROR_BOUND_S = 60.0
"""``asyncrl train`` with a bad value exits within this (it never starts Ray: the time is Python's
and torch's imports; measured 4-5 s on an idle 2-core machine, up to 25 s under a load of 40)."""
DEATH_EXIT_BOUND_S = 30.0
"""A killed worker ends ``asyncrl train`` within this (the error, then closing every worker)."""
RUN_BOUND_S = 300.0
"""No-hang bound of a whole tiny CLI run."""

BAD = [
    ("reward.fn=nope", "reward.fn 'nope' is not a registered reward function"),
    ("actor.lr=-1", "actor.lr must be >= 0, got -1.0"),
    ("rollout.temperature=-1", "rollout.temperature must be >= 0, got -1.0"),
    ("model.path=/nonexistent", "model.path='/nonexistent' does not exist"),
]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.pipelines.commands.cli", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_ADDRESS": ""}  # a new embedded Ray, never the test session's


def _tiny_yaml(path: Path, out: Path, *, fail_fast: bool = False, reward: RewardConfig | None = None,
               **trainer: object) -> Path:
    cfg = tiny_test()
    cfg.trainer.output_dir = str(out)
    if reward is not None:
        cfg.reward = reward
    if fail_fast:  # not the default: a dead worker is replaced or the run restarted
        cfg.trainer.restart.max_restarts = 0
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    path.write_text(yaml.safe_dump(to_dict(cfg.validate())))
    return path


@pytest.mark.parametrize("override,message", BAD)
@pytest.mark.parametrize("print_config", [False, True])
def test_bad_values_are_rejected_before_ray_starts_with_status_2(override, message, print_config, capsys, tmp_path):
    out = tmp_path / "run"
    argv = ["train", override, f"trainer.output_dir={out}"] + (["--print-config"] if print_config else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncrl train: config error: ") and message in err
    assert err.count("\n") == 1 and "ray.started" not in err  # one line; Ray never started
    assert not out.exists()  # nothing was written: no worker, no output


def test_the_cli_names_an_unknown_reward_function_in_its_own_process_without_starting_ray(tmp_path):
    try:  # the bound: a CLI that started Ray or a run would not exit in time
        proc = subprocess.run(_cli("train", "reward.fn=nope", f"trainer.output_dir={tmp_path / 'run'}"),
                              env=_env(), capture_output=True, text=True, timeout=CONFIG_ERROR_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the CLI did not exit within {CONFIG_ERROR_BOUND_S:g} s on a config error")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("asyncrl train: config error: reward.fn 'nope' is not a registered reward function")
    assert "Traceback" not in proc.stderr and "ray" not in proc.stderr.split("registered:")[0]


def _alive_hosts() -> dict[str, int]:
    """actor id -> pid of this session's live worker processes."""
    import ray

    return {aid: int(a["Pid"]) for aid, a in ray._private.state.actors().items()
            if a["State"] == "ALIVE" and a["ActorClassName"].endswith("WorkerHost")}


async def _wait_rows(path: Path, n: int, deadline: float, ended: Callable[[], str | None]) -> None:
    """Poll until `path` has `n` lines; `ended()` returns why the run is over (a failure) or None."""
    async with asyncio.timeout(deadline):
        while not (path.exists() and len(path.read_text().splitlines()) >= n):
            why = ended()
            assert why is None, why
            await asyncio.sleep(0.1)


async def test_a_killed_worker_ends_the_cli_with_a_one_line_error_and_status_1(ray_cluster, tmp_path, capsys,
                                                                            fault_row):
    run = tmp_path / "run"
    cfg = _tiny_yaml(tmp_path / "run.yaml", run, steps=10**6, max_staleness=1, checkpoint_every=2, fail_fast=True)
    before = set(_alive_hosts())
    cli = asyncio.create_task(asyncio.to_thread(main, ["train", "--config", str(cfg)]))  # its own loop, in a thread
    await _wait_rows(run / "metrics.jsonl", 3, RUN_BOUND_S,
                     lambda: capsys.readouterr().err[-3000:] if cli.done() else None)
    mine = sorted(pid for aid, pid in _alive_hosts().items() if aid not in before)
    assert mine, "the run's worker processes were not found"
    os.kill(mine[0], signal.SIGKILL)
    t_kill = time.monotonic()
    rc = await asyncio.wait_for(cli, DEATH_EXIT_BOUND_S)
    seconds = time.monotonic() - t_kill
    stderr = capsys.readouterr().err
    assert rc == 1, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith(("asyncrl train:", "  "))]
    assert lines[0].startswith("asyncrl train: error: WorkerDiedError: worker rank 0 of group"), stderr[-3000:]
    assert any(f"asyncrl train --resume {run}" in line for line in lines)
    assert any("trainer.restart.max_restarts=0" in line for line in lines)
    assert "Traceback" not in stderr
    assert "Traceback" in (run / "error.log").read_text()  # the whole story is kept, off the terminal
    fault_row(order=3.5, fault="worker SIGKILLed under `asyncrl train`", policy="`restart.max_restarts=0`",
              outcome="exit status 1, one line naming `WorkerDiedError` + resume command + error.log",
              seconds=seconds, bound=f"< {DEATH_EXIT_BOUND_S:g} s", leaks="released",
              state="checkpoints up to the last even step")


SECOND_FIT = """
import sys
import asyncrl
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from tests.reliability.faults import BuggyReward

cfg = tiny_test()
cfg.trainer.steps, cfg.trainer.output_dir = 2, f"{sys.argv[1]}/run0"
history = GRPOTrainer(cfg).fit_sync()
print("fit", [r["step"] for r in history], flush=True)
cfg = tiny_test()  # a second fit_sync in the same process: its reward function fails on the 3rd batch
cfg.trainer.steps, cfg.trainer.output_dir = 4, f"{sys.argv[1]}/run1"
cfg.reward.fn = "raises_on_third_batch"
trainer = GRPOTrainer(cfg, worker_overrides={"reward": BuggyReward})
try:
    trainer.fit_sync()
except asyncrl.RemoteError as e:
    print("raised", type(e).__name__, e.exc_type, "after", len(trainer.history), "steps", flush=True)
"""


@pytest.mark.slow  # its own Ray and two runs; default siblings: tests/README.md (Duration)
def test_fit_sync_twice_in_one_process_and_a_worker_error_reaches_the_caller(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SECOND_FIT, str(tmp_path)], env=_env(), cwd=os.getcwd(),
                          capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("fit", "raised"))]
    assert lines[0] == "fit [0, 1]"
    assert re.fullmatch(r"raised RemoteError asyncrl\.roles\.errors\.RewardFnError after [0-2] steps", lines[1]), lines
    assert "Failed to connect to GCS" not in proc.stderr


def _weights(run: Path, step: int) -> str:
    return hashlib.sha256((ckpt.checkpoint_dir(run, step) / "policy" / "model.safetensors").read_bytes()).hexdigest()


STOP_STEPS = 12
HOLD_AT = 6
"""The reward call (one per batch) at which the signalled run is held until the signal is sent: steps 0-4 can
train before it, so the run has its 3 rows and cannot reach STOP_STEPS."""


@pytest.mark.parametrize("sig, loop", [
    (signal.SIGINT, "auto"),  # uvloop's loop (the default), which the CLI's signal handlers run on
    pytest.param(signal.SIGINT, "asyncio", marks=pytest.mark.slow),
    pytest.param(signal.SIGTERM, "auto", marks=pytest.mark.slow),
])
async def test_a_signal_checkpoints_the_run_and_resume_continues_it_in_place(ray_cluster, tmp_path, sig, loop, capsys):
    run, full = tmp_path / "run", tmp_path / "full"
    gate = tmp_path / "gate"
    cfg_file = _tiny_yaml(tmp_path / "run.yaml", run, steps=STOP_STEPS, max_staleness=1, num_cpus=8, event_loop=loop,
                          checkpoint_every_s=None, reward=gated_reward(gate, HOLD_AT))
    # checkpoint_every stays 0 (the default) and no time-based checkpoints: only the signal writes a checkpoint.
    # The gated reward (char_class's scores) holds the run at batch HOLD_AT until the signal is sent: a run whose
    # steps take milliseconds cannot end before it.
    cfg = tiny_test()
    cfg.trainer.steps, cfg.trainer.max_staleness, cfg.trainer.output_dir = STOP_STEPS, 1, str(full)
    async with GRPOTrainer(cfg) as trainer:  # the uninterrupted run
        await trainer.fit()

    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen(_cli("train", "--config", str(cfg_file)), env=_env(), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        ended = lambda: None if proc.poll() is None else f"the run ended early with status {proc.returncode}"
        await _wait_rows(run / "metrics.jsonl", 3, RUN_BOUND_S, ended)
        await wait_for_file(gate / "reached", RUN_BOUND_S)
        os.kill(proc.pid, sig)
        (gate / "open").touch()  # the held batch (and a resume's) goes on; the signal is already on its way
        rc = await asyncio.wait_for(asyncio.to_thread(proc.wait), RUN_BOUND_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = err_path.read_text()
    assert rc == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stderr and "*** SIGTERM received" not in stderr  # no Python or native stack dump
    stopped = re.search(rf"stopped by {sig.name} after step (\d+) of {STOP_STEPS}; checkpoint written to (\S+);", stderr)
    assert stopped, stderr[-3000:]
    k = int(stopped.group(1))
    assert 3 <= k < STOP_STEPS and Path(stopped.group(2)) == ckpt.checkpoint_dir(run, k)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(k))
    command = re.search(r"resume with: (asyncrl train --resume \S+)", stderr)
    assert command and command.group(1) == f"asyncrl train --resume {run}"

    argv = shlex.split(command.group(1))[1:]  # as printed, without the config file or any override
    capsys.readouterr()
    rc = await asyncio.wait_for(asyncio.to_thread(main, argv), RUN_BOUND_S)  # this process's Ray, its own loop
    resumed = capsys.readouterr().err
    assert rc == 0, resumed[-3000:]
    assert re.search(rf"checkpoint.restored .*step={k}\b", resumed)
    assert re.search(rf"train.done .*loop={'asyncio' if loop == 'asyncio' else 'uvloop'}\b", resumed), resumed[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(STOP_STEPS))  # in RUN, once each
    assert _weights(run, STOP_STEPS) == _weights(full, STOP_STEPS)  # as if never interrupted

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "buffer/"))} for r in rows]

    # ... and every step's metrics too (the buffered batch carried over the checkpoint trained the same)
    assert strip(read_jsonl(run / "metrics.jsonl")) == strip(read_jsonl(full / "metrics.jsonl"))


ABANDON = """
import os, signal, sys, threading, time
from asyncrl.pipelines.supervision.interrupt import RunAbandoned
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from tests.reliability.faults import DelayedPolicy

cfg = tiny_test()
cfg.trainer.steps, cfg.trainer.checkpoint_every, cfg.trainer.output_dir = 50, 1, sys.argv[1]
first = threading.Event()

def signal_twice():
    first.wait()
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 30
    while trainer.stop_reason is None:  # the first signal has reached the trainer: the second is a second one
        assert time.monotonic() < deadline, "the first SIGINT never reached the trainer"
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=signal_twice, daemon=True).start()
trainer = GRPOTrainer(cfg, on_step=lambda t, s, m: first.set(),
                      worker_overrides={"policy": (DelayedPolicy, {"max_delay": 5.0, "delay_seed": 1})})
try:
    trainer.fit_sync()
except RunAbandoned as e:
    print("abandoned", e.reason, e.last_checkpoint is not None, trainer.interrupted, flush=True)
"""


@pytest.mark.slow
def test_a_second_signal_abandons_the_step_in_progress_and_releases_everything(tmp_path):
    proc = subprocess.run([sys.executable, "-c", ABANDON, str(tmp_path / "run")], env=_env(), cwd=os.getcwd(),
                          capture_output=True, text=True, timeout=RUN_BOUND_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "abandoned SIGINT True None" in proc.stdout, proc.stdout + proc.stderr[-2000:]
