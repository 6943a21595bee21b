"""The controller SIGKILLed after step k: ``asyncrl train --resume`` in a new process ends
with the same weights as an uninterrupted run, and the killed run's Ray session (its
worker processes, raylet, GCS and agents) goes away by itself."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from tests.reliability.conftest import wait_for_file
from tests.reliability.gated_reward import gated_reward

STEPS = 6
KILL_AFTER = 3
HOLD_AT = KILL_AFTER + 3
"""The killed run's reward call (one per batch, 1-based) held until the kill: batch KILL_AFTER + 2. The
checkpoint after KILL_AFTER steps holds the batch then in flight (KILL_AFTER + 1, reward call KILL_AFTER + 2)
with it, so it is written; the run cannot reach STEPS first, however fast its steps are."""
REAP_BOUND_S = 120.0
"""Ray's reaper kills the dead driver's workers, raylet and GCS within seconds; its agents
(dashboard agent, runtime-env agent) notice the raylet is gone within about a minute."""


def _procs() -> dict[int, tuple[str, int, str]]:
    """pid -> (state, session id, name) of every process (from /proc; no psutil here)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            rest = stat.rsplit(")", 1)[1].split()
            out[int(d)] = (rest[0], int(rest[3]), stat.split("(", 1)[1].rsplit(")", 1)[0])
    return out


def _session(sid: int) -> dict[int, str]:
    """Live (not zombie) processes of session `sid` (the controller was started with setsid)."""
    return {pid: name for pid, (state, s, name) in _procs().items() if s == sid and state != "Z"}


def _weights(run: Path, step: int) -> str:
    return hashlib.sha256((ckpt.checkpoint_dir(run, step) / "policy" / "model.safetensors").read_bytes()).hexdigest()


def _cli(cfg_file: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.pipelines.commands.cli", "train", "--config", str(cfg_file), *extra]


@pytest.mark.slow
async def test_a_killed_controller_resumes_from_its_checkpoint_and_leaks_nothing(ray_cluster, tmp_path, fault_row):
    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.checkpoint_every, t.output_dir = STEPS, 1, 1, str(tmp_path / "cut")
    t.num_cpus = 8
    cfg_file = tmp_path / "run.yaml"
    gate = tmp_path / "gate"
    killed = to_dict(cfg)
    killed["reward"] = to_dict(gated_reward(gate, HOLD_AT))  # char_class's scores, held until the kill
    cfg_file.write_text(yaml.safe_dump(killed))

    full = tmp_path / "full"  # the uninterrupted run (in this process, same config)
    cfg.trainer.output_dir = str(full)
    async with GRPOTrainer(cfg) as trainer:
        await trainer.fit()

    env = {**os.environ, "RAY_ADDRESS": ""}
    cut = tmp_path / "cut"
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(_cli(cfg_file), cwd=os.getcwd(), env=env, start_new_session=True,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        await wait_for_file(ckpt.checkpoint_dir(cut, KILL_AFTER) / "state.json", 180)
        await wait_for_file(gate / "reached", 180)
        session = _session(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        await asyncio.to_thread(proc.wait)
    finally:
        if proc.poll() is None:
            proc.kill()
        (gate / "open").touch()  # the resumed run's held call goes on
    assert proc.returncode == -signal.SIGKILL
    assert any("WorkerHost" in n for n in session.values()) and any(n == "raylet" for n in session.values())
    saved = ckpt.latest_checkpoint(cut)
    assert saved is not None
    saved_step = ckpt.read_state(saved)["step"]
    assert KILL_AFTER <= saved_step < STEPS

    resumed = await asyncio.to_thread(subprocess.run, _cli(cfg_file, "--resume", str(cut)), cwd=os.getcwd(),
                                      env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    t_resumed = time.monotonic() - t_kill
    assert _weights(cut, STEPS) == _weights(full, STEPS)  # the same weights as never having been killed
    assert [r["step"] for r in read_jsonl(cut / "metrics.jsonl")] == list(range(STEPS))  # torn lines dropped

    deadline = t_kill + REAP_BOUND_S
    while (left := {p: n for p, n in session.items() if p in _session(proc.pid)}) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert not left, f"processes of the killed controller's Ray session still alive: {left}"
    fault_row(order=30, fault=f"controller SIGKILLed after step {KILL_AFTER}", policy="`asyncrl train --resume RUN`",
              outcome=f"new process resumed from step {saved_step}, ran to step {STEPS}",
              seconds=t_resumed, bound=f"Ray session reaped < {REAP_BOUND_S:g} s", interrupted="until `--resume`",
              leaks=f"none ({len(session)} processes of the dead session gone)",
              state="final weights == uninterrupted run; metrics.jsonl one row per step")
