"""Streaming rollout's failure protocol on a real local Ray (slow): a rollout worker killed while a weight
update reaches its groups in flight is replaced and the lost groups are generated again; a stop
requested while a new version loads ends with a checkpoint that lists the untrained groups, and the
resumed run trains exactly those, with the same seeds. Each ends in completion (never a hang), with
every prompt group trained exactly once and every trajectory within the staleness bound."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from asyncrl.pipelines.presets import tiny_test
from asyncrl.pipelines.trainer import GRPOTrainer

from tests.reliability.conftest import live_actors, settled, wait_for_file
from tests.reliability.faults import Fault, FaultyRollout

STEPS = 4


class SlowFaultyRollout(FaultyRollout):
    """A faulty rollout whose requests each cost 0.5 s more (simulated generation time), so prompt groups
    are still generating when a step's new weights arrive."""

    def _request_engine(self):
        submit = super()._request_engine()

        async def slow(ids, params):
            await asyncio.sleep(0.5)
            return await submit(ids, params)

        return slow


def stream_cfg(out: Path, *, restarts: int = 0, partial: str = "off"):
    cfg = tiny_test()
    cfg.rollout.partial_rollout = partial
    t = cfg.trainer
    t.steps, t.max_staleness, t.rollout_weights, t.rollout_mode = STEPS, 1, "latest", "stream"
    t.output_dir = str(out)
    t.restart.max_restarts = restarts
    return cfg.validate()


def groups_trained(out: Path) -> tuple[dict[int, int], list[dict]]:
    recs = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    admitted = {r["index"]: r["version"] for r in recs if r["kind"] == "group"}
    return admitted, [r for r in recs if r["kind"] == "step"]


def assert_every_group_once_within_the_bound(out: Path, B: int) -> None:
    admitted, steps = groups_trained(out)
    assert [s["step"] for s in steps] == list(range(STEPS))
    trained = [g for s in steps for g in s["groups"]]
    assert sorted(trained) == list(range(STEPS * B))
    for s in steps:
        assert all(0 <= s["step"] - admitted[g] <= 1 for g in s["groups"])


@pytest.mark.slow
async def test_a_rollout_worker_killed_during_an_update_mid_generation_is_replaced_and_its_groups_regenerated(
        ray_cluster, tmp_path):
    before = await asyncio.to_thread(live_actors)
    (tmp_path / "fault").mkdir()
    fault = Fault(dir=str(tmp_path / "fault"), point="load_weights", call=2)  # loading version 2
    cfg = stream_cfg(tmp_path / "run", restarts=1, partial="recompute")  # the update reaches groups in flight
    trainer = GRPOTrainer(cfg, worker_overrides={"rollout": (SlowFaultyRollout, {"fault": fault})})

    async def run():
        async with trainer:
            return await trainer.fit()

    task = asyncio.create_task(run())
    await wait_for_file(tmp_path / "fault" / "pid", 120)
    os.kill(int((tmp_path / "fault" / "pid").read_text()), signal.SIGKILL)
    history = await asyncio.wait_for(task, 180)  # completion, not a hang
    [r] = trainer.restarts
    assert r["kind"] == "replace" and r["from_checkpoint"] is None
    assert trainer.rollout.regenerated >= 1  # groups were in flight when the update killed the worker
    assert len(history) == STEPS and all(h["staleness/max"] <= 1 for h in history)
    assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    assert await settled(before) == before


@pytest.mark.slow
async def test_a_stop_during_an_update_checkpoints_the_untrained_groups_and_a_resume_trains_exactly_them(
        ray_cluster, tmp_path):
    out = tmp_path / "run"
    cfg = stream_cfg(out)
    B = cfg.prompts_per_step

    def stop(trainer, step, metrics):
        if step == 1:  # version 2 was just published: the rollout is loading it
            trainer.request_stop("test")

    async with GRPOTrainer(cfg, on_step=stop) as trainer:
        await trainer.fit()
    assert trainer.interrupted is not None and trainer.interrupted.steps_done == 2
    state = json.loads((trainer.interrupted.checkpoint / "state.json").read_text())
    _, steps = groups_trained(out)
    trained = {g for s in steps for g in s["groups"]}
    pending = state["stream"]["pending"]
    assert len(trained) == 2 * B and not trained & set(pending)
    assert sorted(trained | set(pending)) == list(range(state["stream"]["next_group"]))  # none lost
    async with GRPOTrainer(cfg, resume=out) as resumed:
        history = await resumed.fit()
    assert [h["step"] for h in history if h["step"] >= 2] == [2, 3]
    admitted, _ = groups_trained(out)
    assert [g for g in sorted(admitted) if g in pending] == pending  # re-admitted, same indices (same seeds)
    assert_every_group_once_within_the_bound(out, B)
