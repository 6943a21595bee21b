"""Elastic rollout in streaming mode on a real local Ray: ``scale_rollout`` grows the rollout pool 1 -> 2 and
shrinks it 2 -> 1 mid-run, beside the groups in flight. The new pool loads the newest weight version before it
takes work; the old pool's groups drain, or past ``trainer.rollout_drain_s`` are handed over and generated
again on the new pool with their own seeds; a preemption notice (``preempt_rollout``) hands over at once. Each
run completes every step, trains every prompt group exactly once, within the staleness bound. (Slow; the default
suite's resizes, by the autoscaler both ways and by a SIGTERM, keep their rows' tokens:
``test_stream_hand_over.py``.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from asyncrl import Dispatch, register
from asyncrl.pipelines.job.elastic import RolloutRangeError
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.rollout.rollout_loop import batch_seed
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.roles import RolloutWorker
from asyncrl.roles.errors import PreemptedError
from asyncrl.roles.generation.rollout_requests import RequestCall

from tests.reliability.conftest import live_actors, settled

STEPS = 8


class LoggedRollout(RolloutWorker):
    """A rollout worker that appends each group call (seed, process, its weight version at the call) to
    `calls`, and hangs (until cancelled) the calls made in a process listed in `hang` once that file exists."""

    def __init__(self, *args, calls: str, hang: str, delay: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._calls, self._hang, self._delay = calls, hang, delay

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        """This rank's process id."""
        return os.getpid()

    @register(Dispatch.DP_COMPUTE, concurrent=True, summary=("scores", "response_length"))
    async def generate_requests(self, batch, max_new_tokens=None, temperature=None, seed=None, resume=None,
                                compute_reward=False):
        hang = os.path.exists(self._hang) and str(os.getpid()) in Path(self._hang).read_text().split()
        with open(self._calls, "a") as f:
            f.write(json.dumps({"seed": seed, "pid": os.getpid(), "version": self.version, "hung": hang}) + "\n")
        if self.requests._preempted:
            raise PreemptedError("told to stop")
        try:
            await asyncio.sleep(self._delay)  # simulated generation time (the autoscaler's test: generation-bound)
            if hang:
                await self._hanging()  # a generation that never ends here: only a hand-over finishes it
            return await super().generate_requests(batch, max_new_tokens, temperature, seed, resume, compute_reward)
        except PreemptedError:
            with open(self._calls, "a") as f:
                f.write(json.dumps({"seed": seed, "pid": os.getpid(), "preempted": True}) + "\n")
            raise

    async def _hanging(self) -> None:
        """Wait forever inside a request-level generation (so a preemption notice reaches it)."""
        me = asyncio.current_task()
        self.requests._request_calls[me] = RequestCall(asyncio.get_running_loop(), None)  # no rows: nothing to hand over
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.requests._preempted:
                raise PreemptedError("told to stop while hanging") from None
            raise


def _cfg(out: Path, **trainer):
    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.rollout_mode, t.output_dir = STEPS, 1, "stream", str(out)
    t.rollout_workers, t.rollout_placement = "1..2", [1]
    for k, v in trainer.items():
        setattr(t, k, v)
    return cfg.validate()


def _calls(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _journal(out: Path) -> tuple[dict[int, int], list[dict]]:
    recs = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    return {r["index"]: r["version"] for r in recs if r["kind"] == "group"}, [r for r in recs if r["kind"] == "step"]


def _assert_every_group_once_within_the_bound(out: Path, B: int, steps_done: int = STEPS) -> None:
    admitted, steps = _journal(out)
    assert [s["step"] for s in steps] == list(range(steps_done))
    trained = [g for s in steps for g in s["groups"]]
    assert sorted(trained) == list(range(steps_done * B))  # nothing trained twice, nothing lost
    assert all(0 <= s["step"] - admitted[g] <= 1 for s in steps for g in s["groups"])
    ledger = check_ledger(out)  # per sample, the handed-over rows' tokens measured within the bound too
    assert ledger.ok, ledger.render()


async def _history_reaches(tr, n: int) -> None:
    while len(tr.history) < n:
        await asyncio.sleep(0.02)


async def _hang_pool(tr, hang: Path, calls: Path) -> set[int]:
    """Make the rollout pool's new groups hang from now on; returns its pids once one of them hangs (so the run
    cannot finish before a resize hands them over)."""
    pids = set(await tr.groups.rollout.pid())
    hang.write_text(" ".join(map(str, pids)))
    while not any(c.get("hung") and c["pid"] in pids for c in _calls(calls)):
        await asyncio.sleep(0.02)
    return pids


@pytest.mark.slow  # one streaming run with three rollout pools: about 40 s on the loaded 2-core machine
async def test_grow_then_shrink_mid_stream_loads_newest_weights_and_hands_over_with_the_same_seeds(
        ray_cluster, tmp_path):
    calls, hang = tmp_path / "calls.jsonl", tmp_path / "hang"
    cfg = _cfg(tmp_path / "run", rollout_drain_s=1.0)
    B = cfg.prompts_per_step
    overrides = {"rollout": (LoggedRollout, {"calls": str(calls), "hang": str(hang)})}
    before = live_actors()
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> list[set[int]]:
            await _history_reaches(tr, 2)
            one = await _hang_pool(tr, hang, calls)
            await tr.scale_rollout(2)  # grow: the hung groups are handed over to the new pool after the drain
            two = await _hang_pool(tr, hang, calls)
            await tr.scale_rollout(1)  # shrink: likewise
            return [one, two, set(await tr.groups.rollout.pid())]

        async with asyncio.TaskGroup() as tg:  # a failed drive() cancels the run instead of leaving it hung
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, pools = fit.result(), task.result()
        resizes = tr.rollout.scaler.resizes
        regenerated = tr.rollout.regenerated
        assert tr.restarts == []  # a resize is no recovery
    assert await settled(before) == before  # every pool's workers and placement groups released
    assert [(r.size_before, r.size_after) for r in resizes] == [(1, 2), (2, 1)]
    assert len(history) == STEPS and max(m["staleness/max"] for m in history) <= 1
    _assert_every_group_once_within_the_bound(tmp_path / "run", B)
    log = _calls(calls)
    assert pools[0].isdisjoint(pools[1]) and pools[1].isdisjoint(pools[2])
    handed = 0
    for rec, old, new in ((resizes[0], pools[0], pools[1]), (resizes[1], pools[1], pools[2])):
        # the new pool held the newest weights before its first group: every call it got ran at >= that version
        assert rec.version >= 2 and all(c["version"] >= rec.version for c in log if c["pid"] in new)
        # exactly the groups hung on the old pool were handed over, and each ran again on the new pool with its
        # own seed (the seed of its index)
        hung = sorted({c["seed"] for c in log if c.get("hung") and c["pid"] in old})
        assert hung and [batch_seed(cfg, g) for g in rec.handed_over] == hung
        for seed in hung:
            assert {c["pid"] in new for c in log if c["seed"] == seed and c["pid"] not in old} == {True}
        handed += len(hung)
    assert regenerated == handed


@pytest.mark.slow  # one streaming run with three rollout pools: about 40 s on the loaded 2-core machine
async def test_a_sigterm_or_a_preempt_call_hands_the_groups_in_flight_over_with_their_seeds(ray_cluster, tmp_path):
    calls, hang = tmp_path / "calls.jsonl", tmp_path / "hang"
    cfg = _cfg(tmp_path / "run")
    overrides = {"rollout": (LoggedRollout, {"calls": str(calls), "hang": str(hang)})}
    before = live_actors()
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> list[set[int]]:
            await _history_reaches(tr, 2)
            first = await _hang_pool(tr, hang, calls)
            os.kill(next(iter(first)), signal.SIGTERM)  # a real preemption notice to the real process
            while tr.rollout.scaler.resizes == [] and not tr.restarts:
                await asyncio.sleep(0.02)
            second = await _hang_pool(tr, hang, calls)
            await tr.preempt_rollout(0)  # the API's notice
            return [first, second, set(await tr.groups.rollout.pid())]

        async with asyncio.TaskGroup() as tg:  # a failed drive() cancels the run instead of leaving it hung
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, pools = fit.result(), task.result()
        resizes = tr.rollout.scaler.resizes
        assert tr.restarts == []  # a preemption is no fault: nothing counts against trainer.restart
    assert await settled(before) == before
    assert [(r.size_before, r.size_after, r.reason) for r in resizes] == [(1, 1, "preempt"), (1, 1, "preempt")]
    assert len(history) == STEPS and max(m["staleness/max"] for m in history) <= 1
    _assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    log = _calls(calls)
    for rec, old, new in ((resizes[0], pools[0], pools[1]), (resizes[1], pools[1], pools[2])):
        hung = sorted({c["seed"] for c in log if c.get("hung") and c["pid"] in old})
        # the SIGTERMed process ended its calls itself (PreemptedError); the API's notice cancelled them. They (and
        # any call the exiting process took with it) ran again on the new pool, each with its own seed
        ended = sorted({c["seed"] for c in log if c.get("preempted") and c["pid"] in old})
        assert hung and ended == (hung if rec is resizes[0] else [])
        handed = [batch_seed(cfg, g) for g in rec.handed_over]
        assert set(hung) <= set(handed)
        for seed in handed:
            assert {c["pid"] in new for c in log if c["seed"] == seed and c["pid"] not in old
                    and not c.get("preempted")} == {True}
    with pytest.raises(ProcessLookupError):
        os.kill(next(iter(pools[0])), 0)  # the SIGTERMed process is gone


async def test_preempt_and_out_of_range_calls_are_typed_errors(tmp_path):
    tr = GRPOTrainer(_cfg(tmp_path / "a"))
    with pytest.raises(RolloutRangeError, match=r"scale_rollout\(3\) is outside trainer.rollout_workers=1..2; ask "
                                                 r"for 1 to 2 workers"):
        await tr.scale_rollout(3)
    with pytest.raises(RuntimeError, match="preempt_rollout acts while fit"):
        await tr.preempt_rollout(0)
    batch = GRPOTrainer(_cfg(tmp_path / "b", rollout_mode="batch"))
    with pytest.raises(RuntimeError, match="preempt_rollout hands generations in flight over .* needs "
                                           "trainer.rollout_mode=stream"):
        await batch.preempt_rollout(0)
