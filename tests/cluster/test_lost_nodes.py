"""Runs across nodes on real raylets, the default suite's proof (the cluster of ``conftest.py``: rollout nodes
``roll_a``/``roll_b``, training nodes ``t1``/``t2``; the rollout pool on one rollout node, fsdp2 ranks on both
training nodes, over gloo):

* a fault-free run places its pools so, and is the reference of the two cases below;
* the rollout pool's node lost during ``fit()``: the pool is placed again on the other rollout node and its
  batch issued again; training goes on in the same processes (no restart), and the run ends with the fault-free
  run's metrics and final weights;
* a training node lost during ``fit()``: the run restarts from its newest checkpoint once the node is back, and
  ends with the fault-free run's final weights.

Each loss happens while the run needs the lost node: the rollout hangs in its batch of step 2, a training rank in
the update of step 2 (after checkpoint 2), until the node is gone (``tests.reliability.faults``) (a tiny step takes 40 ms: without the hold, a run could
end before the loss reaches it, and the case would test nothing). Each case is one short run; the slow siblings (every step checked, capacity waits and deadlines, two nodes at
once, a node lost mid-sync or mid-checkpoint, a draining pool's node) are ``tests/reliability/test_lost_node.py``."""

from __future__ import annotations

import asyncio
import os

import pytest
import ray

from asyncrl import Dispatch, register
from asyncrl.pipelines.checkpoints.checkpoint import checkpoint_dir
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.journaling.journal import read_journal
from asyncrl.pipelines.commands.replay import compare_metrics
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles import PolicyWorker, RolloutWorker
from tests.reliability.conftest import until
from tests.reliability.faults import Fault, FaultyPolicy, FaultyRollout

STEPS = 5


class Placed:
    """A worker that says where it runs."""

    @register(Dispatch.ONE_TO_ALL)
    def placed(self) -> tuple[str, int]:
        """(Ray node id, process id) of this rank."""
        return ray.get_runtime_context().get_node_id(), os.getpid()


class PlacedPolicy(PolicyWorker, Placed):
    pass


class PlacedRollout(RolloutWorker, Placed):
    pass


OVERRIDES = {"policy": PlacedPolicy, "rollout": PlacedRollout}


class HoldingPolicy(FaultyPolicy, Placed):
    """A placed policy worker that hangs in an update when its fault fires (once a run)."""


class HoldingRollout(FaultyRollout, Placed):
    """A placed rollout worker that hangs in a generation when its fault fires (once a run)."""


def _job(out):
    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.train_workers, t.checkpoint_every = STEPS, 1, 2, 2
    t.rollout_placement, t.train_placement = [1], [1, 1]
    t.rollout_resources, t.train_resources = {"rollout": 1.0}, {"train": 1.0}
    t.output_dir = str(out)
    cfg.actor.strategy = "fsdp2"
    return cfg.validate()


async def _where(nodes, group) -> list[tuple[str, int]]:
    """(node name, pid) of each rank of `group`."""
    names = nodes.names()
    return [(names[n], pid) for n, pid in await group.placed()]


def _final_weights(out) -> str:
    end = read_journal(out).end
    assert end is not None and end["steps"] == STEPS
    return end["weights_sha256"]


@pytest.fixture(scope="module")
async def fault_free(cluster, tmp_path_factory):
    """The fault-free run: (its history, its final weights' digest, where its rollout and policy ranks ran)."""
    cluster.restore()
    out = tmp_path_factory.mktemp("clean") / "run"
    async with GRPOTrainer(_job(out), worker_overrides=OVERRIDES) as tr:
        rollout, policy = await _where(cluster, tr.groups.rollout), await _where(cluster, tr.groups.policy)
        history = await tr.fit()
    return history, _final_weights(out), [n for n, _ in rollout], [n for n, _ in policy]


def test_the_rollout_sits_on_a_rollout_node_and_the_fsdp2_ranks_across_both_training_nodes(fault_free):
    history, _, rollout, policy = fault_free
    assert rollout in (["roll_a"], ["roll_b"]) and sorted(policy) == ["t1", "t2"]
    assert [m["step"] for m in history] == list(range(STEPS))


async def test_a_lost_rollout_node_is_replaced_without_restarting_training_and_the_run_ends_fault_free(
        nodes, fault_free, tmp_path):
    clean, weights, _, _ = fault_free
    out = tmp_path / "run"
    hold = Fault(dir=str(tmp_path), point="generate", call=3)  # the batch of step 2, once a run
    tr = GRPOTrainer(_job(out), worker_overrides={**OVERRIDES, "rollout": (HoldingRollout, {"fault": hold})})
    async with tr:
        policy = await _where(nodes, tr.groups.policy)
        [(lost, _)] = await _where(nodes, tr.groups.rollout)

        async def lose_the_rollout_node() -> None:
            await until((tmp_path / "pid").exists, "the rollout held in the batch of step 2")
            nodes.remove(lost)

        async with asyncio.TaskGroup() as tg:
            fit = tg.create_task(tr.fit())
            tg.create_task(lose_the_rollout_node())
        history = fit.result()
        [(where, _)] = await _where(nodes, tr.groups.rollout)
        assert await _where(nodes, tr.groups.policy) == policy  # the training ranks never restarted
    [r] = tr.restarts
    assert (r["kind"], r["from_checkpoint"]) == ("replace", None)
    assert {lost, where} == {"roll_a", "roll_b"}  # placed again on the other rollout node
    assert [m["step"] for m in history] == list(range(STEPS)) and max(m["staleness/max"] for m in history) <= 1
    assert compare_metrics(clean, history) == []  # the re-issued batch had its seed and version
    assert _final_weights(out) == weights


async def test_a_lost_training_node_restarts_from_its_checkpoint_to_the_fault_free_weights(nodes, fault_free,
                                                                                           tmp_path):
    clean, weights, _, _ = fault_free
    out = tmp_path / "run"
    hold = Fault(dir=str(tmp_path), point="update", call=3)  # step 2's update, after checkpoint 2, once a run
    tr = GRPOTrainer(_job(out), worker_overrides={**OVERRIDES, "policy": (HoldingPolicy, {"fault": hold})})

    async def lose_a_training_node() -> None:
        await until(lambda: (tmp_path / "pid").exists() and checkpoint_dir(out, 2).exists(),
                    "a rank held in the update of step 2, after checkpoint 2")
        dead = nodes.node_id("t1")
        nodes.remove("t1")
        await asyncio.to_thread(nodes.wait_dead, dead)
        nodes.add("t1", 1)  # the restart places the training pool again once the node is back

    async with tr:
        async with asyncio.TaskGroup() as tg:
            fit = tg.create_task(tr.fit())
            tg.create_task(lose_a_training_node())
        history = fit.result()
        assert sorted(n for n, _ in await _where(nodes, tr.groups.policy)) == ["t1", "t2"]
    [r] = tr.restarts
    assert r["kind"] == "restart" and r["from_checkpoint"] is not None and r["from_step"] == 2
    assert [m["step"] for m in history] == list(range(STEPS))
    assert compare_metrics(clean, history) == []
    assert _final_weights(out) == weights  # resumed from the checkpoint to the fault-free run's weights
