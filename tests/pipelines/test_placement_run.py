"""Where the workers sit does not change what a step computes: a run whose pools have placement groups
of their own (``trainer.rollout_placement``/``train_placement``, here on the session's one node) trains
step for step like the default layout (one placement group split between the pools), so a resume may
move the pools (the placements are resume-free keys)."""

from __future__ import annotations

import pytest

from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.commands.replay import compare_metrics
from asyncrl.pipelines.trainers.trainer import GRPOTrainer


@pytest.mark.slow  # two runs: about 25 s on the loaded 2-core machine
async def test_pools_of_their_own_train_like_the_shared_pool(ray_cluster, tmp_path):
    histories = []
    for name, placement in (("shared", None), ("own", ([1], [1, 1]))):
        cfg = tiny_test()
        cfg.trainer.train_workers, cfg.trainer.max_staleness = 2, 1
        if placement is not None:
            cfg.trainer.rollout_placement, cfg.trainer.train_placement = placement
        cfg.trainer.output_dir = str(tmp_path / name)
        async with GRPOTrainer(cfg.validate()) as tr:
            assert len(tr.workers.pools) == (1 if placement is None else 2)
            histories.append(await tr.fit())
    assert compare_metrics(*histories) == []
