"""``await trainer.scale_rollout(n)``: the rollout pool (placement groups of its own) is resized between two
batches while training goes on; the new workers load the weight version of the next batch before they
generate it; the run completes every step once within the staleness bound. Bad calls are one typed error."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.pipelines.journal import read_journal
from asyncrl.pipelines.presets import tiny_test
from asyncrl.pipelines.replay import compare_metrics
from asyncrl.pipelines.trainer import GRPOTrainer

STEPS = 8


def _cfg(tmp_path, name, **trainer):
    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.output_dir = STEPS, 1, str(tmp_path / name)
    for k, v in trainer.items():
        setattr(t, k, v)
    return cfg.validate()


async def test_bad_scale_calls_are_typed_errors_naming_the_fix(tmp_path):
    own = GRPOTrainer(_cfg(tmp_path, "own", rollout_placement=[1]))
    with pytest.raises(ValueError, match="a positive number of rollout workers, got 0"):
        await own.scale_rollout(0)
    with pytest.raises(RuntimeError, match="this run is not generating"):
        await own.scale_rollout(2)
    with pytest.raises(RuntimeError, match="needs a rollout pool of its own: set trainer.rollout_placement"):
        await GRPOTrainer(_cfg(tmp_path, "shared")).scale_rollout(2)
    stream = GRPOTrainer(_cfg(tmp_path, "stream", rollout_placement=[1], rollout_mode="stream"))
    with pytest.raises(RuntimeError, match="needs trainer.rollout_mode=batch"):
        await stream.scale_rollout(2)


@pytest.mark.slow  # three runs' worth of workers: about 40 s on the loaded 2-core machine
async def test_scale_rollout_up_and_down_mid_run_keeps_every_step_and_the_staleness_bound(ray_cluster, tmp_path):
    async with GRPOTrainer(_cfg(tmp_path, "fixed", rollout_placement=[1])) as tr:
        fixed = await tr.fit()
    sizes = []
    async with GRPOTrainer(_cfg(tmp_path, "scaled", rollout_placement=[1])) as tr:

        async def scale() -> None:
            for at, n in ((2, 2), (5, 1)):
                while len(tr.history) < at:
                    await asyncio.sleep(0.02)
                await tr.scale_rollout(n)
                sizes.append(tr.groups.rollout.world_size)

        task = asyncio.create_task(scale())
        history = await tr.fit()
        await task
        assert tr.restarts == []  # a resize is no recovery
    assert sizes == [2, 1]
    assert [m["step"] for m in history] == list(range(STEPS))
    assert max(m["staleness/max"] for m in history) <= 1
    journal = read_journal(tmp_path / "scaled")
    assert [journal.steps[t]["batch"] for t in range(STEPS)] == list(range(STEPS))  # each batch trained once
    # every batch generated with the version fixed_lag gives it, by 1 or 2 engines
    assert [journal.batches[i]["version"] for i in range(STEPS)] == [max(0, i - 1) for i in range(STEPS)]
    # the steps before the resize are the unscaled run's; after it, 2 engines draw other samples (each
    # rank samples its rows from its own stream), so a scaled run is not replayed at a fixed pool size
    assert compare_metrics(fixed[:2], history[:2]) == []
