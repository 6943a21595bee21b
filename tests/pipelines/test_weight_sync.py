"""The trainer's weight sync fits the placement, and every transport trains the same weights.

Two pools sync through the collective channel (gloo here), a colocated process hands
weights over in-process and lets its rollout sleep (level 2: weights discarded and
restored) around every train step; both equal the sequential one-step-off reference that
syncs through the object store, step for step and bit for bit.
"""

from __future__ import annotations

import copy
import sys

import pytest
import ray

from asyncrl import Dispatch, register
from asyncrl.roles import RolloutWorker

from asyncrl.pipelines import load_config
from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import grpo_toy, tiny_test
from asyncrl.pipelines.trainers.sync import run_sequential
from asyncrl.pipelines.trainers.trainer import GRPOTrainer

class CountingRollout(RolloutWorker):
    """The rollout worker, counting the times it actually went to sleep."""

    slept = 0

    @register(Dispatch.ONE_TO_ALL)
    async def sleep(self, level: int | None = None) -> dict:
        out = await super().sleep(level)
        self.slept += int(out["asleep"])
        return out

    @register(Dispatch.ONE_TO_ALL)
    def times_slept(self) -> int:
        return self.slept


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test module is not importable by workers

COMPARED = ("version", "reward/mean", "staleness/max", "batch/version", "actor/pg_loss", "actor/grad_norm")


def test_auto_weight_sync_fits_the_placement():
    cfg = grpo_toy()
    assert cfg.weight_transport() == "object_store"  # two CPU pools
    cfg.trainer.gpus_per_worker = 0.5
    assert cfg.weight_transport() == "collective"  # two pools with GPUs
    cfg.trainer.colocated = True
    assert cfg.weight_transport() == "local"  # one process
    cfg.trainer.weight_sync = "object_store"
    assert cfg.weight_transport() == "object_store"  # explicit wins


@pytest.mark.parametrize("overrides, message", [
    (["trainer.weight_sync=local"], "weight_sync=local hands weights over inside one process: it needs "
                                    "trainer.colocated=true"),
    (["trainer.weight_sync=collective", "trainer.colocated=true"], "weight_sync=collective needs two pools"),
    (["trainer.weight_sync=nccl"], r"must be one of \['auto', 'object_store', 'local', 'collective', 'adapter'\]"),
    (["rollout.sleep_level=1"], "rollout.sleep_level=1 .* needs trainer.colocated=true"),
    (["trainer.gpus_per_worker=-1"], "gpus_per_worker must be >= 0"),
    (["trainer.weight_sync_timeout_s=0"], "weight_sync_timeout_s must be > 0"),
])
def test_bad_weight_sync_settings_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_pools_that_need_more_gpus_than_the_cluster_has_are_rejected():
    cfg = grpo_toy()
    cfg.trainer.gpus_per_worker = 0.5
    cfg.validate(cluster_cpus=8, cluster_gpus=1)  # rollout + train worker share one GPU
    cfg.trainer.gpus_per_worker = 1
    with pytest.raises(ConfigError, match="pools need 2 GPUs .* the cluster has 1; lower trainer.gpus_per_worker"):
        cfg.validate(cluster_cpus=8, cluster_gpus=1)


async def _run(cfg, tmp_path, name):
    cfg.trainer.output_dir = str(tmp_path / name)
    async with GRPOTrainer(cfg, worker_overrides={"rollout": CountingRollout}) as trainer:
        history = await trainer.fit()
        slept = await trainer.groups.rollout.times_slept()
        evals = [int(r["eval/version"]) for r in trainer.evaluator.records] if trainer.evaluator is not None else []
        return history, await trainer.groups.policy.weights_checksum(), trainer.weights.transport, (slept, evals)


def _same(a, b):
    assert [{k: r[k] for k in COMPARED} for r in a] == [{k: r[k] for k in COMPARED} for r in b]


@pytest.mark.slow  # each transport's bit-identical weights stay in the default suite (tests/roles/test_weight_transports.py)
async def test_collective_and_local_sleeping_runs_equal_the_object_store_reference(ray_cluster, tmp_path):
    cfg = tiny_test()
    cfg.trainer.steps = 3
    cfg.trainer.max_staleness = 1

    split = copy.deepcopy(cfg)  # two pools: auto is object_store on CPU, so ask for the channel
    split.trainer.weight_sync = "collective"
    split_history, split_sum, transport, (slept, _) = await _run(split, tmp_path, "collective")
    assert transport == "collective" and slept == [0]

    col = copy.deepcopy(cfg)
    col.trainer.colocated = True
    col.rollout.sleep_level = 2  # the rollout discards its weights around every train step
    col.evaluation.every, col.evaluation.at_end, col.evaluation.num_prompts = 1, True, 4  # woken to evaluate too
    col_history, col_sum, transport, (slept, evals) = await _run(col, tmp_path, "local")
    assert transport == "local" and slept == [3]  # after each of the 3 generated batches
    assert evals == [1, 2, 3]  # version 1 in the loop; 2 and 3 (the final) after it, each after a wake + reload

    ref = copy.deepcopy(cfg)
    ref.trainer.colocated = True
    ref_history, ref_sum = await run_sequential(ref, lag=1)  # object store, nothing overlaps, nothing sleeps
    assert split_sum == ref_sum and col_sum == ref_sum
    _same(split_history, ref_history)
    _same(col_history, ref_history)
    assert [r["batch/version"] for r in col_history] == [0, 0, 1]
