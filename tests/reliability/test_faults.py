"""Fault injection on a real local Ray: a worker SIGKILLed mid-generation, mid-update and
mid-weight-sync, a reward function that raises, a stage that hangs, races between faults
and recoveries (a replacement killed while it loads weights or generates, two faults in one
run), and the controller SIGKILLed (test_controller_kill.py). Each test pins the outcome
(recovered, or a typed error within a bound), that no worker process or placement group is
left, and, where the restart policy promises it, that the final state equals a fault-free
run's.

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
from asyncrl.pipelines.journaling.journal import read_journal
from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer, is_worker_fault
from tests.reliability.conftest import live_actors, placement_groups, settled, wait_for_file
from tests.reliability.faults import BuggyReward, Fault, FaultyPolicy, FaultyRollout

STEPS = 4
DEATH_BOUND_S = 15.0
"""A killed worker fails the run within this many seconds (a dead worker fails its calls within seconds; the bound
leaves room for a loaded 2-core machine)."""
STAGE_TIMEOUT_S = 4.0


def fault_cfg(out: Path, *, restarts: int = 0, stage_timeout_s: float | None = None, replace: bool = True,
              weight_sync: str = "auto"):
    cfg = tiny_test()
    t = cfg.trainer
    t.weight_sync = weight_sync
    t.steps, t.max_staleness, t.checkpoint_every = STEPS, 1, 1
    t.output_dir = str(out)
    t.restart.max_restarts = restarts
    t.restart.replace_stateless = replace
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


async def run_with_fault(cfg, fault: Fault | list[Fault], overrides: dict[str, Any], *, kill: bool, bound: float,
                         checksum: bool = False, sig: int = signal.SIGKILL) -> Outcome:
    """Run a trainer until each fault fires in turn, send `sig` (SIGKILL; SIGSTOP: a hung process)
    to the process it fired in (when `kill`), and return how the run ended and how long after the
    last fault. Records the placement groups at the first and the last step (``out.pgs``)."""
    faults = fault if isinstance(fault, list) else [fault]
    pgs: dict[int, set[str]] = {}

    def on_step(trainer: GRPOTrainer, step: int, metrics: dict[str, Any]) -> None:
        if step in (0, STEPS - 1):
            pgs[step] = placement_groups()

    trainer = GRPOTrainer(cfg, worker_overrides=overrides, on_step=on_step)
    sums: dict[str, Any] = {}

    async def run() -> list[dict[str, Any]]:
        async with trainer:
            history = await trainer.fit()
            if checksum:
                sums.update(await trainer.groups.policy.weights_checksum())
            return history

    task = asyncio.create_task(run())
    t0 = time.monotonic()
    for f in faults:
        fired = asyncio.create_task(wait_for_file(Path(f.dir) / "pid", 120))
        done, _ = await asyncio.wait({task, fired}, return_when=asyncio.FIRST_COMPLETED)
        if fired not in done:
            fired.cancel()
            error = task.exception()
            pytest.fail(f"the run ended ({error!r}) before the fault at {f.point} fired")
        if kill:
            os.kill(int((Path(f.dir) / "pid").read_text()), sig)
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
    out.pgs = pgs  # type: ignore[attr-defined]
    return out


def _fault(tmp_path: Path, point: str, call: int, action: str = "hang", *, name: str = "fault",
           after: Fault | None = None) -> Fault:
    d = tmp_path / name
    d.mkdir()
    return Fault(dir=str(d), point=point, call=call, action=action,  # type: ignore[arg-type]
                 after=after.dir if after is not None else None)


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
    fault_row(order=list(KILLS).index(point) * 3, fault=label, policy="`restart.max_restarts=0`",
              outcome=f"`{type(out.error).__name__}` raised by `fit()`", seconds=out.seconds,
              bound=f"< {DEATH_BOUND_S:g} s", leaks="none" if after == before else f"LEAK {after} vs {before}",
              state=f"{len(out.trainer.history)} of {STEPS} steps done; checkpoints up to the last finished step")


def _exactly_once(run: Path) -> None:
    """Every step trained once, each on its own batch, and metrics.jsonl has one row per step; the per-sample
    ledger holds (nothing lost, nothing trained twice, every trained token within the bound)."""
    journal = read_journal(run)
    assert sorted(journal.steps) == list(range(STEPS))
    assert [journal.steps[t]["batch"] for t in range(STEPS)] == list(range(STEPS))
    assert [row["step"] for row in read_jsonl(run / "metrics.jsonl")] == list(range(STEPS))
    ledger = check_ledger(run)
    assert ledger.ok, ledger.render()


ROLLOUT_KILLS = {p: v for p, v in KILLS.items() if v[0] == "rollout"}


@pytest.mark.parametrize("point", [pytest.param(p, marks=[] if p == "generate" else [pytest.mark.slow])
                                   for p in ROLLOUT_KILLS])
async def test_a_killed_rollout_worker_is_replaced_in_place_and_the_run_ends_identical_to_a_fault_free_run(
        ray_cluster, tmp_path, point, baseline, fault_row):
    role, cls, call, label = KILLS[point]
    before = await asyncio.to_thread(live_actors)
    fault = _fault(tmp_path, point, call)
    out = await run_with_fault(fault_cfg(tmp_path / "run", restarts=1), fault, {role: (cls, {"fault": fault})},
                               kill=True, bound=120, checksum=True)
    assert out.error is None, out.error
    [r] = out.trainer.restarts
    assert r["kind"] == "replace" and r["from_checkpoint"] is None  # no checkpoint restored
    assert r["origin"] in ("rollout.rollout", "rollout.reward") and r["interrupted_s"] is not None
    want_history, want_sum = baseline
    assert out.checksum == want_sum  # the lost batch was re-issued with the same prompts, seed and version
    assert strip(out.history) == want_history  # same versions, staleness, rewards, losses per step
    _exactly_once(tmp_path / "run")
    assert out.pgs[0] == out.pgs[STEPS - 1]  # the new processes took the same placement group
    after = await settled(before)
    assert after == before
    fault_row(order=list(KILLS).index(point) * 3 + 1, fault=label, policy="`restart.max_restarts=1` (replace)",
              outcome="rollout pool replaced in place, batch re-issued, no checkpoint restored, run completed",
              seconds=r["time_s"], bound="-", interrupted=r["interrupted_s"],
              leaks="none" if after == before else f"LEAK {after} vs {before}",
              state="weights and per-step metrics == fault-free run; every step once")


@pytest.mark.slow
async def test_a_replacement_reopens_the_collective_weight_channel(ray_cluster, tmp_path, baseline, fault_row):
    before = await asyncio.to_thread(live_actors)
    fault = _fault(tmp_path, "generate", 3)
    out = await run_with_fault(fault_cfg(tmp_path / "run", restarts=1, weight_sync="collective"), fault,
                               {"rollout": (FaultyRollout, {"fault": fault})}, kill=True, bound=120, checksum=True)
    assert out.error is None, out.error
    [r] = out.trainer.restarts
    assert r["kind"] == "replace" and r["from_checkpoint"] is None
    assert out.checksum == baseline[1] and strip(out.history) == baseline[0]  # as the object-store run
    _exactly_once(tmp_path / "run")
    after = await settled(before)
    assert after == before
    fault_row(order=1.5, fault="rollout worker SIGKILLed mid-generation (batch 2), weights over the collective "
                               "channel (gloo)", policy="`restart.max_restarts=1`, `weight_sync=collective`",
              outcome="rollout pool replaced in place, weight channel reopened, batch re-issued, run completed",
              seconds=r["time_s"], bound="-", interrupted=r["interrupted_s"],
              leaks="none" if after == before else f"LEAK {after} vs {before}",
              state="weights and per-step metrics == fault-free run")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["update", "generate"])
async def test_a_restart_recovers_from_the_last_checkpoint_in_the_same_placement_groups(
        ray_cluster, tmp_path, point, baseline, fault_row):
    role, cls, call, label = KILLS[point]
    before = await asyncio.to_thread(live_actors)
    fault = _fault(tmp_path, point, call)
    out = await run_with_fault(fault_cfg(tmp_path / "run", restarts=1, replace=False), fault,
                               {role: (cls, {"fault": fault})}, kill=True, bound=120, checksum=True)
    assert out.error is None, out.error
    [r] = out.trainer.restarts
    assert r["kind"] == "restart"
    assert r["error_type"] in ("WorkerDiedError", "GroupBrokenError", "UpstreamError")
    assert 0 <= r["from_step"] <= call  # the newest checkpoint before the fault
    want_history, want_sum = baseline
    assert out.checksum == want_sum  # no step lost or applied twice
    assert strip(out.history) == want_history  # every batch consumed once, same versions and staleness
    _exactly_once(tmp_path / "run")
    assert out.pgs[0] == out.pgs[STEPS - 1]  # actors restarted in place: the placement groups were kept
    after = await settled(before)
    assert after == before
    policy = "`restart.max_restarts=1`" + (", `replace_stateless=false`" if role == "rollout" else "")
    fault_row(order=list(KILLS).index(point) * 3 + 2, fault=label, policy=policy,
              outcome=f"restarted once from {_point(r)} in the same placement groups, run completed",
              seconds=r["time_s"], bound="-", interrupted=r["interrupted_s"],
              leaks="none" if after == before else f"LEAK {after} vs {before}",
              state="weights and per-step metrics == fault-free run")


# ---- races: faults during and after a recovery -------------------------------------------------


@pytest.mark.slow
async def test_a_replacement_killed_while_it_loads_weights_is_replaced_again(ray_cluster, tmp_path, baseline,
                                                                             fault_row):
    before = await asyncio.to_thread(live_actors)
    first = _fault(tmp_path, "generate", 3, name="first")
    second = _fault(tmp_path, "load_weights", 1, name="second", after=first)  # the replacement's first load
    out = await run_with_fault(fault_cfg(tmp_path / "run", restarts=2), [first, second],
                               {"rollout": (FaultyRollout, {"fault": (first, second)})}, kill=True, bound=120,
                               checksum=True)
    assert out.error is None, out.error
    assert [r["kind"] for r in out.trainer.restarts] == ["replace", "replace"]
    assert out.checksum == baseline[1] and strip(out.history) == baseline[0]
    _exactly_once(tmp_path / "run")
    after = await settled(before)
    assert after == before
    r = out.trainer.restarts[-1]
    fault_row(order=20, fault="rollout worker SIGKILLed mid-generation, then its replacement SIGKILLed while "
                              "loading weights", policy="`restart.max_restarts=2`",
              outcome="replaced twice, run completed", seconds=r["time_s"], bound="-",
              interrupted=out.trainer.restarts[0]["interrupted_s"], leaks="none" if after == before else "LEAK",
              state="weights and per-step metrics == fault-free run")


@pytest.mark.slow
@pytest.mark.parametrize("budget", [1, 2])
async def test_a_killed_replacement_ends_in_completion_or_a_typed_error(ray_cluster, tmp_path, budget, baseline,
                                                                        fault_row):
    before = await asyncio.to_thread(live_actors)
    first = _fault(tmp_path, "generate", 3, name="first")
    second = _fault(tmp_path, "generate", 1, name="second", after=first)  # the re-issued batch, on the replacement
    out = await run_with_fault(fault_cfg(tmp_path / "run", restarts=budget), [first, second],
                               {"rollout": (FaultyRollout, {"fault": (first, second)})}, kill=True,
                               bound=120 if budget > 1 else DEATH_BOUND_S, checksum=True)
    if budget == 1:
        assert isinstance(out.error, asyncrl.WorkerDiedError | asyncrl.UpstreamError), out.error
        assert is_worker_fault(out.error)
        outcome, state = f"`{type(out.error).__name__}` raised by `fit()` (no recovery left)", \
            f"{len(out.trainer.history)} of {STEPS} steps done"
    else:
        assert out.error is None, out.error
        assert out.checksum == baseline[1] and strip(out.history) == baseline[0]
        _exactly_once(tmp_path / "run")
        outcome, state = "replaced twice, run completed", "weights and per-step metrics == fault-free run"
    assert [r["kind"] for r in out.trainer.restarts] == ["replace"] * budget
    after = await settled(before)
    assert after == before
    fault_row(order=20 + budget, fault="rollout worker SIGKILLed mid-generation, then its replacement SIGKILLed "
                                       "mid-generation", policy=f"`restart.max_restarts={budget}`", outcome=outcome,
              seconds=out.seconds, bound=f"< {DEATH_BOUND_S:g} s" if budget == 1 else "-",
              interrupted="the run stops" if budget == 1 else out.trainer.restarts[0]["interrupted_s"],
              leaks="none" if after == before else "LEAK", state=state)


@pytest.mark.slow
async def test_two_faults_in_one_run_a_replacement_then_a_restart(ray_cluster, tmp_path, baseline, fault_row):
    before = await asyncio.to_thread(live_actors)
    first = _fault(tmp_path, "generate", 3, name="first")
    second = _fault(tmp_path, "update", 4, name="second", after=first)  # step 3, after the replacement
    out = await run_with_fault(fault_cfg(tmp_path / "run", restarts=2), [first, second],
                               {"rollout": (FaultyRollout, {"fault": first}),
                                "policy": (FaultyPolicy, {"fault": second})}, kill=True, bound=120, checksum=True)
    assert out.error is None, out.error
    assert [r["kind"] for r in out.trainer.restarts] == ["replace", "restart"]
    assert out.checksum == baseline[1] and strip(out.history) == baseline[0]
    _exactly_once(tmp_path / "run")
    after = await settled(before)
    assert after == before
    fault_row(order=23, fault="rollout worker SIGKILLed mid-generation, later a training worker SIGKILLed "
                              "mid-update", policy="`restart.max_restarts=2`",
              outcome=f"replaced, then restarted from {_point(out.trainer.restarts[1])}, run completed",
              seconds=out.trainer.restarts[1]["time_s"], bound="-",
              interrupted=sum(r["interrupted_s"] or 0.0 for r in out.trainer.restarts),
              leaks="none" if after == before else "LEAK", state="weights and per-step metrics == fault-free run")


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
    fault_row(order=10, fault="reward function raises (3rd batch)", policy="`restart.max_restarts=2`",
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
    fault_row(order=11, fault="training worker hangs mid-update (step 1)",
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
    assert [(r["kind"], r["error_type"]) for r in out.trainer.restarts] == [("replace", "CallTimeoutError")]
    assert out.checksum == baseline[1] and strip(out.history) == baseline[0]
    after = await settled(before)
    assert after == before
    r = out.trainer.restarts[0]
    fault_row(order=12, fault="rollout worker hangs mid-generation (batch 2)",
              policy=f"`stage_timeout_s={STAGE_TIMEOUT_S:g}`, `restart.max_restarts=1`",
              outcome="deadline fired, rollout pool replaced in place, batch re-issued, run completed",
              seconds=r["time_s"], bound="-", interrupted=r["interrupted_s"], leaks="none" if after == before else "LEAK",
              state="weights and per-step metrics == fault-free run")
