"""``await trainer.scale_rollout(n)`` in batch mode: the rollout pool (placement groups of its own, a
``rollout_workers`` range) is resized between two batches while training goes on; the new workers load the
weight version of the next batch before they generate it; the run completes every step once within the
staleness bound. Bad calls and bad ranges are one typed error (streaming: ``test_stream_scale.py``)."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.elastic import RolloutRangeError, WorkerRange
from asyncrl.pipelines.journaling.journal import read_journal
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.commands.replay import compare_metrics
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.pipelines.journaling.ledger import check_ledger

STEPS = 8


def _cfg(tmp_path, name, **trainer):
    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.output_dir = STEPS, 1, str(tmp_path / name)
    for k, v in trainer.items():
        setattr(t, k, v)
    return cfg.validate()


async def test_bad_scale_calls_are_typed_errors_naming_the_fix(tmp_path):
    own = GRPOTrainer(_cfg(tmp_path, "own", rollout_placement=[1], rollout_workers="1..2"))
    with pytest.raises(ValueError, match="a positive number of rollout workers, got 0"):
        await own.scale_rollout(0)
    with pytest.raises(RolloutRangeError, match=r"scale_rollout\(3\) is outside trainer.rollout_workers=1..2"):
        await own.scale_rollout(3)
    with pytest.raises(RuntimeError, match="this run is not generating"):
        await own.scale_rollout(2)
    fixed = GRPOTrainer(_cfg(tmp_path, "fixed", rollout_placement=[1]))  # a count is a range of one size
    with pytest.raises(RolloutRangeError, match=r"outside trainer.rollout_workers=1..1; ask for 1 to 1 workers"):
        await fixed.scale_rollout(2)
    with pytest.raises(RuntimeError, match="needs a rollout pool of its own: set trainer.rollout_placement"):
        await GRPOTrainer(_cfg(tmp_path, "shared")).scale_rollout(2)


@pytest.mark.parametrize("trainer, message", [
    ({"rollout_workers": "1..2"}, "trainer.rollout_workers=1..2 resizes the rollout pool, which needs placement "
                                  r"groups of its own: set trainer.rollout_placement=\[1\]"),
    ({"rollout_workers": "3..1"}, r"trainer.rollout_workers=3..1 needs 1 <= min <= max"),
    ({"rollout_workers": "1-3"}, r"trainer.rollout_workers must be a number of workers or a range min..max \(e.g. "
                                 r"1..3\), got '1-3'"),
    ({"rollout_workers": "1..3", "rollout_placement": [1]}, "includes 3 workers, which does not divide a step's 2 "
                                                             "prompts"),
    ({"rollout_workers": "2..2", "rollout_placement": [1]}, r"places 1 workers but trainer.rollout_workers=2; "),
    ({"rollout_workers": "1..2", "rollout_placement": [2]}, r"trainer.rollout_workers=1..2 \(a range starts at its "
                                                             r"minimum\)"),
    ({"rollout_autoscale": True}, "trainer.rollout_autoscale=true grows the rollout pool while streaming admission "
                                  "waits on generation: it needs trainer.rollout_mode=stream"),
    ({"rollout_autoscale": True, "rollout_mode": "stream"}, "rollout_autoscale=true needs a range to scale within: "
                                                            "set trainer.rollout_workers=min..max"),
    ({"rollout_drain_s": -1.0}, "trainer.rollout_drain_s must be >= 0 seconds, got -1.0"),
    ({"rollout_workers": "1..2", "rollout_placement": [1], "rollout_mode": "stream", "weight_sync": "collective"},
     "in streaming mode starts each new pool beside the old one, .* set trainer.weight_sync=object_store"),
])
def test_bad_rollout_ranges_are_one_config_error(tmp_path, trainer, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, "bad", **trainer)


def test_a_range_starts_at_its_minimum_and_must_fit_the_cluster_there(tmp_path):
    cfg = _cfg(tmp_path, "ok", rollout_workers=WorkerRange(2, 4), rollout_placement=[2], batch_size=48)
    assert (cfg.pool_sizes(), cfg.trainer.rollout_range, cfg.trainer.placements()) == (
        {"rollout": 2, "train": 1}, WorkerRange(2, 4), ([2], [1]))
    cfg.validate(cluster_cpus=3.0)  # the minimum fits; the maximum need not
    with pytest.raises(ConfigError, match=r"the pools need 3 CPUs \(\{'rollout': 2, 'train': 1\} workers x 1\) "
                                          r"\(trainer.rollout_workers=2..4 starts at 2\) but the cluster has 2"):
        cfg.validate(cluster_cpus=2.0)


@pytest.mark.slow  # three runs' worth of workers: about 40 s on the loaded 2-core machine
async def test_scale_rollout_up_and_down_mid_run_keeps_every_step_and_the_staleness_bound(ray_cluster, tmp_path):
    async with GRPOTrainer(_cfg(tmp_path, "fixed", rollout_placement=[1])) as tr:
        fixed = await tr.fit()
    sizes = []
    async with GRPOTrainer(_cfg(tmp_path, "scaled", rollout_placement=[1], rollout_workers="1..2")) as tr:

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
    ledger = check_ledger(tmp_path / "scaled")
    assert ledger.ok and ledger.replicas == 2, ledger.render()  # the 2-engine pool's rows name both replicas
    # every batch generated with the version fixed_lag gives it, by 1 or 2 engines
    assert [journal.batches[i]["version"] for i in range(STEPS)] == [max(0, i - 1) for i in range(STEPS)]
    # the steps before the resize are the unscaled run's; after it, 2 engines draw other samples (each
    # rank samples its rows from its own stream), so a scaled run is not replayed at a fixed pool size
    assert compare_metrics(fixed[:2], history[:2]) == []
