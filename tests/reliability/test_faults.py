"""Fault injection on a real local Ray: a worker SIGKILLed mid-generation, mid-update and
mid-weight-sync, a reward function that raises, a stage that hangs, and the controller
SIGKILLed (test_controller_kill.py). Each test pins the outcome (recovered, or a typed
error within a bound), that no worker process or placement group is left, and, where the
restart policy promises it, that the final state equals a fault-free run's.

The faults fire at an exact point inside the worker (see faults.py), then the test kills
the process with ``os.kill(pid, SIGKILL)``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import asyncrl
from asyncrl.pipelines.metrics import read_jsonl
from asyncrl.pipelines.presets import tiny_test
from asyncrl.pipelines.trainer import GRPOTrainer, is_worker_fault
from tests.reliability.conftest import live_actors, settled, wait_for_file
from tests.reliability.faults import BuggyReward, Fault, FaultyPolicy, FaultyRollout

STEPS = 4
DEATH_BOUND_S = 15.0
"""A killed worker fails the run within this many seconds (C5 promises seconds; the bound
leaves room for a loaded 2-core machine)."""
STAGE_TIMEOUT_S = 4.0


def fault_cfg(out: Path, *, restarts: int = 0, stage_timeout_s: float | None = None):
    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.checkpoint_every = STEPS, 1, 1
    t.output_dir = str(out)
    t.restart.max_restarts = restarts
    t.stage_timeout_s = stage_timeout_s
    return cfg.validate()


def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "buffer/"))} for r in rows]


@pytest.fixture(scope="module")
async def baseline(ray_cluster, tmp_path_factory):
    """The fault-free run every recovered run must equal: (history, final weight checksums)."""
    async with GRPOTrainer(fault_cfg(tmp_path_factory.mktemp("baseline"))) as t:
        history = await t.fit()
        checksum = await t.groups.policy.weights_checksum()
    return strip(history), checksum


class Outcome:
    def __init__(self, trainer: GRPOTrainer, error: BaseException | None, seconds: float, history: Any) -> None:
        self.trainer, self.error, self.seconds, self.history = trainer, error, seconds, history


async def run_with_fault(cfg, fault: Fault, overrides: dict[str, Any], *, kill: bool, bound: float,
                         checksum: bool = False) -> Outcome:
    """Run a trainer until `fault` fires, SIGKILL the process it fired in (when `kill`), and
    return how the run ended and how long after the fault."""
    trainer = GRPOTrainer(cfg, worker_overrides=overrides)
    sums: dict[str, Any] = {}

    async def run() -> list[dict[str, Any]]:
        async with trainer:
            history = await trainer.fit()
            if checksum:
                sums.update(await trainer.groups.policy.weights_checksum())
            return history

    task = asyncio.create_task(run())
    fired = asyncio.create_task(wait_for_file(Path(fault.dir) / "pid", 120))
    done, _ = await asyncio.wait({task, fired}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        fired.cancel()
        task.result()
        pytest.fail("the run ended before the fault fired")
    await fired
    if kill:
        os.kill(int((Path(fault.dir) / "pid").read_text()), signal.SIGKILL)
    t0 = time.monotonic()
    error: BaseException | None = None
    history = None
    done, _ = await asyncio.wait({task}, timeout=bound)  # the no-hang guarantee
    if not done:
        task.cancel()
        raise AssertionError(f"the run neither failed nor finished within {bound} s of the fault")
    try:
        history = task.result()
    except Exception as e:  # CallTimeoutError is a TimeoutError: only the result tells them apart
        error = e
    out = Outcome(trainer, error, time.monotonic() - t0, history)
    out.checksum = sums  # type: ignore[attr-defined]
    return out


def _fault(tmp_path: Path, point: str, call: int, action: str = "hang") -> Fault:
    d = tmp_path / "fault"
    d.mkdir()
    return Fault(dir=str(d), point=point, call=call, action=action)  # type: ignore[arg-type]


def _point(restart: dict[str, Any]) -> str:
    return f"the step-{restart['from_step']} checkpoint" if restart["from_checkpoint"] else "the run's start"


# (point, role, worker class, call, table label)
KILLS = {
    "generate": ("rollout", FaultyRollout, 3, "rollout worker SIGKILLed mid-generation (batch 2)"),
    "update": ("policy", FaultyPolicy, 3, "training worker SIGKILLed mid-update (step 2, after backward)"),
    "load_weights": ("rollout", FaultyRollout, 2, "rollout worker SIGKILLed mid-weight-sync (loading version 2)"),
}


@pytest.mark.parametrize("point", list(KILLS))
async def test_a_killed_worker_fails_the_run_fast_with_a_typed_error_and_releases_everything(
        ray_cluster, tmp_path, point, fault_row):
    role, cls, call, label = KILLS[point]
    before = await asyncio.to_thread(live_actors)
    fault = _fault(tmp_path, point, call)
    out = await run_with_fault(fault_cfg(tmp_path / "run"), fault, {role: (cls, {"fault": fault})},
                               kill=True, bound=DEATH_BOUND_S)
    assert isinstance(out.error, asyncrl.WorkerDiedError | asyncrl.GroupBrokenError | asyncrl.UpstreamError), out.error
    assert is_worker_fault(out.error)
    assert out.trainer.restarts == []
    after = await settled(before)
    assert after == before
    fault_row(order=list(KILLS).index(point) * 2, fault=label, policy="none (default)",
              outcome=f"`{type(out.error).__name__}` raised by `fit()`", seconds=out.seconds,
              bound=f"< {DEATH_BOUND_S:g} s", leaks="none" if after == before else f"LEAK {after} vs {before}",
              state=f"{len(out.trainer.history)} of {STEPS} steps done; checkpoints up to the last finished step")


@pytest.mark.parametrize("point", [pytest.param(p, marks=[] if p == "generate" else [pytest.mark.slow]) for p in KILLS])
async def test_a_killed_worker_is_restarted_and_the_run_ends_identical_to_a_fault_free_run(
        ray_cluster, tmp_path, point, baseline, fault_row):
    role, cls, call, label = KILLS[point]
    before = await asyncio.to_thread(live_actors)
    fault = _fault(tmp_path, point, call)
    out = await run_with_fault(fault_cfg(tmp_path / "run", restarts=1), fault, {role: (cls, {"fault": fault})},
                               kill=True, bound=120, checksum=True)
    assert out.error is None, out.error
    assert len(out.trainer.restarts) == 1
    r = out.trainer.restarts[0]
    assert r["error_type"] in ("WorkerDiedError", "GroupBrokenError", "UpstreamError")
    assert 0 <= r["from_step"] <= call  # the newest checkpoint before the fault
    want_history, want_sum = baseline
    assert out.checksum == want_sum  # no step lost or applied twice
    assert strip(out.history) == want_history  # every batch consumed once, same versions and staleness
    assert [row["step"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == list(range(STEPS))
    after = await settled(before)
    assert after == before
    fault_row(order=list(KILLS).index(point) * 2 + 1, fault=label, policy="`restart.max_restarts=1`",
              outcome=f"restarted once from {_point(r)}, run completed",
              seconds=r["time_s"], bound="-", leaks="none" if after == before else f"LEAK {after} vs {before}",
              state="weights and per-step metrics == fault-free run")


async def test_a_raising_reward_function_fails_fast_and_is_not_restarted(ray_cluster, tmp_path, fault_row):
    before = await asyncio.to_thread(live_actors)
    cfg = fault_cfg(tmp_path / "run", restarts=2)
    cfg.reward.fn = "raises_on_third_batch"
    t0 = time.monotonic()
    trainer = GRPOTrainer(cfg, worker_overrides={"reward": BuggyReward})
    with pytest.raises(asyncrl.RemoteError) as info:
        async with asyncio.timeout(60):
            async with trainer:
                await trainer.fit()
    e = info.value
    assert (e.group, e.method, e.exc_type) == ("rollout.reward", "compute_reward", "asyncrl.roles.errors.RewardFnError")
    assert "raises_on_third_batch" in e.message and "ZeroDivisionError" in e.message
    assert not is_worker_fault(e) and trainer.restarts == []  # a bug in user code is not retried
    after = await settled(before)
    assert after == before
    fault_row(order=6, fault="reward function raises (3rd batch)", policy="`restart.max_restarts=2`",
              outcome="`RemoteError` (RewardFnError, names the function) raised by `fit()`; no restart",
              seconds=time.monotonic() - t0, bound="(whole run)", leaks="none" if after == before else "LEAK",
              state=f"{len(trainer.history)} of {STEPS} steps done")


async def test_a_hung_stage_misses_its_deadline_and_fails_with_call_timeout(ray_cluster, tmp_path, fault_row):
    before = await asyncio.to_thread(live_actors)
    fault = _fault(tmp_path, "update", 2)
    bound = STAGE_TIMEOUT_S + DEATH_BOUND_S
    out = await run_with_fault(fault_cfg(tmp_path / "run", stage_timeout_s=STAGE_TIMEOUT_S), fault,
                               {"policy": (FaultyPolicy, {"fault": fault})}, kill=False, bound=bound)
    assert isinstance(out.error, asyncrl.CallTimeoutError), out.error
    assert out.error.__class__.__mro__[1:3] == (asyncrl.errors.AsyncRLError, TimeoutError)
    after = await settled(before)  # the hung process (a plain `def` never returns) was killed on close
    assert after == before
    fault_row(order=7, fault="training worker hangs mid-update (step 1)",
              policy=f"`stage_timeout_s={STAGE_TIMEOUT_S:g}`, no restart",
              outcome="`CallTimeoutError` raised by `fit()`; the hung process is killed on close",
              seconds=out.seconds, bound=f"< stage_timeout_s + {DEATH_BOUND_S:g} s",
              leaks="none" if after == before else "LEAK", state=f"{len(out.trainer.history)} of {STEPS} steps done")


@pytest.mark.slow
async def test_a_hung_stage_is_restarted_when_the_policy_covers_timeouts(ray_cluster, tmp_path, baseline, fault_row):
    before = await asyncio.to_thread(live_actors)
    fault = _fault(tmp_path, "generate", 3)
    out = await run_with_fault(fault_cfg(tmp_path / "run", restarts=1, stage_timeout_s=STAGE_TIMEOUT_S), fault,
                               {"rollout": (FaultyRollout, {"fault": fault})}, kill=False, bound=120, checksum=True)
    assert out.error is None, out.error
    assert [r["error_type"] for r in out.trainer.restarts] == ["CallTimeoutError"]
    assert out.checksum == baseline[1] and strip(out.history) == baseline[0]
    after = await settled(before)
    assert after == before
    fault_row(order=8, fault="rollout worker hangs mid-generation (batch 2)",
              policy=f"`stage_timeout_s={STAGE_TIMEOUT_S:g}`, `restart.max_restarts=1`",
              outcome=f"deadline fired, restarted once from {_point(out.trainer.restarts[0])}, run completed",
              seconds=out.trainer.restarts[0]["time_s"], bound="-", leaks="none" if after == before else "LEAK",
              state="weights and per-step metrics == fault-free run")
