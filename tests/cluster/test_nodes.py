"""Runs across nodes on real raylets (:mod:`tests.cluster.harness`): pools land where their bundles say,
in rank order; a pool the cluster cannot hold fails with the resources it misses (at once, or at the
deadline when it waits for capacity); a job trains with its rollout on one node and its fsdp2 ranks
across two others (over gloo), and replays from its journal there. Lost nodes:
``tests/reliability/test_lost_node.py``.

The cluster (``conftest.py``, one for the folder) costs 10-20 s to start on the 2-core machine. The default suite's
runs across nodes are ``test_lost_nodes.py``'s; the training run and replay here are ``slow``."""

from __future__ import annotations

import time

import pytest
import ray

import asyncrl
from asyncrl import Dispatch, RayWorkerGroup, ResourcePool, Worker, register
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.commands.replay import replay
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles import PolicyWorker, RolloutWorker


class Where(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def where(self) -> tuple[str, str, str]:
        """(node id, MASTER_ADDR, LOCAL_RANK) of this rank."""
        import os

        return ray.get_runtime_context().get_node_id(), os.environ["MASTER_ADDR"], os.environ["LOCAL_RANK"]


class WherePolicy(PolicyWorker, Where):
    pass


class WhereRollout(RolloutWorker, Where):
    pass


async def test_pools_land_on_the_nodes_their_bundles_name_in_rank_order(nodes):
    names = nodes.names()
    async with ResourcePool([1], resources_per_bundle={"roll_a": 1}) as roll, \
            ResourcePool([1, 1], resources_per_bundle={"train": 1}) as train:
        async with RayWorkerGroup(Where, roll, name="r") as r, RayWorkerGroup(Where, train, name="t") as t:
            (rn, _, _), = await r.where()
            ranks = await t.where()
        bundles = [ray.util.placement_group_table(s.placement_group)["bundles_to_node_id"][s.bundle_index]
                   for s in train.slots]
    assert names[rn] == "roll_a"
    assert sorted(names[n] for n, _, _ in ranks) == ["t1", "t2"]  # one rank on each node
    assert [n for n, _, _ in ranks] == bundles  # rank i sits in bundle i
    assert [lr for _, _, lr in ranks] == ["0", "0"]  # each alone on its node
    assert len({addr for _, addr, _ in ranks}) == 1  # every rank is told rank 0's address


async def test_a_pool_the_cluster_cannot_hold_fails_with_what_it_misses(nodes):
    # no node advertises "gpu_node": at once, before anything waits
    with pytest.raises(asyncrl.PlacementError, match=r"needs \{'gpu_node': 1\.0\} but the Ray cluster has"):
        async with RayWorkerGroup(Where, ResourcePool([1], resources_per_bundle={"gpu_node": 1.0})):
            pass
    # waiting for capacity (a lost node that may come back): up to the deadline, then the resources it misses
    t0 = time.monotonic()
    with pytest.raises(asyncrl.PlacementError, match=r"not placed within 1s: missing 2 x \{'CPU': 1\.0, 'roll_a': 1\.0\}"):
        async with RayWorkerGroup(Where, ResourcePool([2], resources_per_bundle={"roll_a": 1.0}, wait_for_capacity=True,
                                                      placement_timeout=1.0)):
            pass
    assert time.monotonic() - t0 < 10


def _job(tmp_path, **trainer):
    cfg = tiny_test()
    t = cfg.trainer
    t.train_workers = 2
    t.rollout_placement, t.train_placement = [1], [1, 1]
    t.rollout_resources, t.train_resources = {"rollout": 1.0}, {"train": 1.0}
    t.output_dir = str(tmp_path / "run")
    for k, v in trainer.items():
        setattr(t, k, v)
    cfg.actor.strategy = "fsdp2"
    return cfg.validate()


@pytest.mark.slow  # two training runs and a replay on four raylets: about 40 s here
async def test_rollout_on_one_node_fsdp2_ranks_across_two_and_the_journal_replays(nodes, tmp_path):
    cfg = _job(tmp_path, steps=4, max_staleness=1, rollout_weights="latest")
    overrides = {"policy": WherePolicy, "rollout": WhereRollout}
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:
        names = nodes.names()
        policy = [names[n] for n, _, _ in await tr.groups.policy.where()]
        rollout = [names[n] for n, _, _ in await tr.groups.rollout.where()]
        history = await tr.fit()
    assert rollout[0] in ("roll_a", "roll_b") and sorted(policy) == ["t1", "t2"]
    assert [m["step"] for m in history] == [0, 1, 2, 3]
    result = await replay(tr.output_dir, reporting={"plot": False, "tensorboard": False, "progress": False})
    assert result.identical, result
