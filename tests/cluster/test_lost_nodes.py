"""Runs across nodes on real raylets, the default suite's proof (the cluster of ``conftest.py``: rollout nodes
``roll_a``/``roll_b``, training nodes ``t1``/``t2``; the rollout pool on one rollout node, fsdp2 ranks on both
training nodes, over gloo):

* a fault-free run places its pools so, and is the reference of the two cases below;
* the rollout pool's node lost during ``fit()``: the pool is placed again on the other rollout node and its
  batch issued again; training goes on in the same processes (no restart), and the run ends with the fault-free
  run's metrics and final weights;
* a training node lost during ``fit()``: the run restarts from its newest checkpoint once the node is back, and
  ends with the fault-free run's final weights.

Each loss happens while the run needs the lost node: the rollout holds its batch of step 2, the training ranks
hold the update after checkpoint 2, until the node is gone (a tiny step takes 40 ms: without the hold, a run could
end before the loss reaches it, and the case would test nothing). Each case is one short run; the slow siblings (every step checked, capacity waits and deadlines, two nodes at
once, a node lost mid-sync or mid-checkpoint, a draining pool's node) are ``tests/reliability/test_lost_node.py``."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from asyncrl import Dispatch, register
from asyncrl.pipelines.checkpoints.checkpoint import checkpoint_dir
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.journaling.journal import read_journal
from asyncrl.pipelines.journaling.replay import compare_metrics
from asyncrl.pipelines.loop.trainer import GRPOTrainer
from asyncrl.roles import PolicyWorker, RolloutWorker
from tests.reliability.conftest import until
from tests.reliability.faults import BeforeStepEngine

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

HOLD_S = 120.0
"""Longest a held update waits (only the lost node's restart, which kills the held ranks, is meant to end it)."""


class HoldingPolicy(PlacedPolicy):
    """A policy worker whose first update after the checkpoint `ckpt` exists holds, between backward and the
    optimizer step, once a run per rank (marker file ``held-<rank>`` in `gate`): the training node is lost while
    the run's training is pending, whatever the machine's timing (a tiny step takes 40 ms, so an unheld run can
    finish before the node's loss reaches it)."""

    def __init__(self, *args: Any, ckpt: str, gate: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

        def before_step() -> None:
            if not Path(ckpt).exists():
                return
            try:
                os.close(os.open(Path(gate, f"held-{self.rank}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return  # held once already: a restarted rank trains freely
            deadline = time.monotonic() + HOLD_S
            while time.monotonic() < deadline:
                time.sleep(0.05)

        self.engine = BeforeStepEngine(self.engine, before_step)


class HoldingRollout(PlacedRollout):
    """A rollout worker whose third generation (the batch of step 2) holds, once a run (marker file ``held-rollout``
    in `gate`): the rollout node is lost while the run still needs it, whatever the machine's timing."""

    def __init__(self, *args: Any, gate: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hold_dir, self._jobs_run = gate, 0

    async def _run_job(self, job: Any) -> None:
        self._jobs_run += 1
        if self._jobs_run == 3:
            try:
                os.close(os.open(Path(self._hold_dir, "held-rollout"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass  # held once already: the replacement generates freely
            else:
                await asyncio.sleep(HOLD_S)  # (only the node's loss is meant to end it)
        await super()._run_job(job)


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
    tr = GRPOTrainer(_job(out), worker_overrides={**OVERRIDES, "rollout": (HoldingRollout, {"gate": str(tmp_path)})})
    async with tr:
        policy = await _where(nodes, tr.groups.policy)
        [(lost, _)] = await _where(nodes, tr.groups.rollout)

        async def lose_the_rollout_node() -> None:
            await until((tmp_path / "held-rollout").exists, "the rollout held in the batch of step 2")
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
    holding = (HoldingPolicy, {"ckpt": str(checkpoint_dir(out, 2)), "gate": str(tmp_path)})
    tr = GRPOTrainer(_job(out), worker_overrides={**OVERRIDES, "policy": holding})

    async def lose_a_training_node() -> None:
        held = [tmp_path / f"held-{rank}" for rank in range(2)]
        await until(lambda: all(h.exists() for h in held), "both ranks held in the update after checkpoint 2")
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
