"""Release on every path, for the trainer: `async with` releases every worker process and placement group on
success, on a loop failure and on cancellation; the first failure cancels the other loop."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.util import placement_group_table

from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer


def _alive() -> tuple[int, int]:
    hosts = sum(1 for a in ray._private.state.actors().values()
                if a["State"] == "ALIVE" and a["ActorClassName"].endswith("WorkerHost"))
    pgs = sum(1 for pg in placement_group_table().values() if pg["state"] in ("CREATED", "PENDING", "RESCHEDULING"))
    return hosts, pgs


def _cfg(tmp_path, steps=4):
    cfg = tiny_test()
    cfg.trainer.steps, cfg.trainer.max_staleness = steps, 1
    cfg.trainer.output_dir = str(tmp_path)
    cfg.trainer.checkpoint_at_end = False
    return cfg


async def test_a_loop_failure_cancels_the_other_loop_and_releases_everything(ray_cluster, tmp_path):
    before = await asyncio.to_thread(_alive)

    def fail(trainer, step, metrics):
        if step == 1:
            raise ValueError("boom in the train loop")

    trainer = GRPOTrainer(_cfg(tmp_path), on_step=fail)
    with pytest.raises(ValueError, match="boom in the train loop"):  # raised as itself, not a group
        async with trainer:
            await trainer.fit()
    assert len(trainer.history) == 2
    assert await asyncio.to_thread(_alive) == before
    assert (tmp_path / "trace.json").is_file()  # reports are still written for the post-mortem


async def test_cancelling_fit_releases_everything(ray_cluster, tmp_path):
    before = await asyncio.to_thread(_alive)
    first_step = asyncio.Event()
    trainer = GRPOTrainer(_cfg(tmp_path, steps=50), on_step=lambda t, s, m: first_step.set())

    async def run():
        async with trainer:
            await trainer.fit()

    task = asyncio.create_task(run())
    await first_step.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 1 <= len(trainer.history) < 50
    assert await asyncio.to_thread(_alive) == before
