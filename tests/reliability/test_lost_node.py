"""A lost node, survived by default (``trainer.rollout_placement``/``train_placement``: pools of their own).

On a one-host cluster of real raylets (:mod:`tests.cluster.harness`: a head without CPUs, two 1-CPU nodes
``roll_a``/``roll_b`` tagged ``rollout`` and a 2-CPU node ``train``), the node that holds the rollout pool
is removed mid-run while training goes on on its own node:

* with capacity left (the other rollout node): the pool is placed again there, the lost batch is issued
  again, and the run completes every step once, within the staleness bound;
* with none left: the pool waits for capacity; the node that comes back is used;
* with none left and none coming back: the run fails at ``trainer.restart.placement_wait_s`` with a
  ``PlacementError`` naming what the pool misses, and releases everything.

The training node lost (alone, or with the rollout node at once) restarts the run from its newest checkpoint
once the training pool can be placed again (the node comes back).

The rollout node lost in the middle of a weight sync is the first case (the sync fails with the pool, which is
placed again; the batch is issued again). The training node lost while a checkpoint is being written restarts
from the last checkpoint written whole. Streaming with ``rollout_workers=1..2``: the node of a pool that is
draining after a resize lost, its groups go to the new pool with their seeds, and no recovery is counted.

The GCS here declares a lost raylet dead after about 1.5 s (``FAST_HEALTH_CHECKS``; Ray's default: about
15 s, which adds to every interruption below). Each case is a slow run (20-40 s on the 2-core machine); the default
suite's twins (a rollout node and a training node lost, each against a fault-free run's metrics and weights) are
``tests/cluster/test_lost_nodes.py``."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import ray

import asyncrl
from asyncrl import Dispatch, register
from asyncrl.pipelines.journaling.journal import read_journal
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.commands.replay import compare_metrics
from asyncrl.pipelines.rollout.rollout_loop import batch_seed
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles import PolicyWorker, RolloutWorker
from tests.cluster.harness import OneHostCluster
from tests.reliability.conftest import live_actors, settled, until
from tests.reliability.faults import Fault, FaultyPolicy, FaultyRollout

pytestmark = pytest.mark.slow

STEPS = 12


@pytest.fixture(scope="module")
def cluster():
    cluster = OneHostCluster({"roll_a": 1, "roll_b": 1, "train": 2},
                             tags={"roll_a": {"rollout": 1}, "roll_b": {"rollout": 1}})
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def nodes(cluster):
    """The module's cluster, whole again: each case starts with every node, whatever the case before it did."""
    return cluster.restore()


def _job(tmp_path, name: str, **restart):
    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.train_workers = STEPS, 1, 2
    t.rollout_placement, t.train_placement = [1], [2]
    t.rollout_resources, t.train_resources = {"rollout": 1.0}, {"train": 1.0}
    t.output_dir = str(tmp_path / name)
    for k, v in restart.items():
        setattr(t.restart, k, v)
    return cfg.validate()


def _rollout_node(nodes, tr) -> str:
    (slot,) = tr.workers.pools[0].slots
    return nodes.names()[ray.util.placement_group_table(slot.placement_group)["bundles_to_node_id"][slot.bundle_index]]


def _hold(cfg, point: str, call: int) -> tuple[type, dict]:
    """A worker override that hangs the `call`-th ``generate`` or ``update`` of a process, once a run (in
    ``<output_dir>.hold``): the node is lost while the run needs it, whatever the machine's timing."""
    Path(cfg.trainer.output_dir + ".hold").mkdir(parents=True)
    fault = Fault(dir=cfg.trainer.output_dir + ".hold", point=point, call=call)
    return (FaultyRollout if point == "generate" else FaultyPolicy), {"fault": fault}


async def _held(cfg) -> None:
    """Until a worker hangs in its held call (see :func:`_hold`)."""
    await until(Path(cfg.trainer.output_dir + ".hold", "pid").exists, "the held call")


async def _run_losing_the_rollout_node(nodes, cfg, *, comes_back_after: float | None):
    """Fit `cfg`, removing the rollout pool's node while it generates the batch of step 4 (and starting it again
    after `comes_back_after` seconds); returns (trainer, history or the error, the lost node's name, the
    rollout pool's node at the end, seconds from the loss to the end of `fit`)."""
    tr = GRPOTrainer(cfg, worker_overrides={"rollout": _hold(cfg, "generate", 5)})
    lost: list[str] = []
    t_lost: list[float] = []

    async def lose_the_rollout_node() -> None:
        await _held(cfg)
        lost.append(_rollout_node(nodes, tr))
        nodes.remove(lost[0])
        t_lost.append(time.monotonic())
        if comes_back_after is not None:
            await asyncio.sleep(comes_back_after)  # training goes on from the buffer; the pool waits
            nodes.add(lost[0], 1)  # on this thread: Ray's node start installs signal handlers

    async with tr:
        chaos = asyncio.create_task(lose_the_rollout_node())
        try:
            out: object = await tr.fit()
        except Exception as e:  # noqa: BLE001 - the case under test
            out = e
        t_end = time.monotonic()
        await chaos
        where = _rollout_node(nodes, tr) if not isinstance(out, Exception) else None
    return tr, out, lost[0], where, t_end - t_lost[0]


def _completed(history, run: Path | None = None) -> None:
    assert [m["step"] for m in history] == list(range(STEPS))  # every step, each once
    assert max(m["staleness/max"] for m in history) <= 1  # the staleness bound kept
    if run is not None:  # each step trained once on its own batch, one metrics row each
        journal = read_journal(run)
        assert [journal.steps[t]["batch"] for t in range(STEPS)] == list(range(STEPS))
        assert [row["step"] for row in read_jsonl(run / "metrics.jsonl")] == list(range(STEPS))


async def test_a_lost_rollout_node_is_replaced_on_the_capacity_left(nodes, tmp_path, fault_row):
    before = await asyncio.to_thread(live_actors)
    async with GRPOTrainer(_job(tmp_path, "fault_free")) as clean:
        baseline = await clean.fit()
    tr, history, lost, where, _ = await _run_losing_the_rollout_node(nodes, _job(tmp_path, "left"),
                                                                   comes_back_after=None)
    assert not isinstance(history, Exception), history
    _completed(history, tr.output_dir)
    assert compare_metrics(baseline, history) == []  # the same seeds, versions and so the same steps
    [r] = tr.restarts
    # the rollout and reward workers share the lost node's pool: whichever death the trainer sees first names it
    assert r["kind"] == "replace" and r["origin"] in {"rollout.rollout", "rollout.reward"}
    assert r["from_checkpoint"] is None
    assert {lost, where} == {"roll_a", "roll_b"}  # placed again on the other rollout node
    after = await settled(before)
    assert after == before
    nodes.add(lost, 1)  # for the next case
    fault_row(order=40, fault="the node holding the rollout pool lost while it generates the batch of step 4 (training on another node)",
              policy="none (the defaults), `rollout_placement=[1]`, `train_placement=[2]`",
              outcome="rollout pool placed again on the other rollout node, batch re-issued, run completed",
              seconds=r["time_s"], bound="node death detection + recovery", interrupted=r["interrupted_s"],
              leaks="none" if after == before else f"LEAK {after} vs {before}",
              state="every step once, staleness <= 1; per-step metrics == fault-free run")


async def test_a_rollout_pool_with_no_capacity_left_waits_and_uses_the_node_that_comes_back(nodes, tmp_path,
                                                                                          fault_row):
    nodes.remove("roll_b")  # one rollout node only: its loss leaves no capacity for the pool
    try:
        before = await asyncio.to_thread(live_actors)
        tr, history, lost, where, _ = await _run_losing_the_rollout_node(nodes, _job(tmp_path, "back"),
                                                                      comes_back_after=2.0)
        assert not isinstance(history, Exception), history
        _completed(history)
        [r] = tr.restarts
        assert r["kind"] == "replace" and lost == where == "roll_a"  # the same name: the node that came back
        after = await settled(before)
        assert after == before
    finally:
        nodes.add("roll_b", 1)
    fault_row(order=41, fault="the node holding the rollout pool lost generating the batch of step 4, no capacity left; "
                              "a node comes back 2 s later",
              policy="none (the defaults; `restart.placement_wait_s=60`)",
              outcome="rollout pool waited, placed on the node that came back, batch re-issued, run completed",
              seconds=r["time_s"], bound="< placement_wait_s + recovery", interrupted=r["interrupted_s"],
              leaks="none" if after == before else f"LEAK {after} vs {before}",
              state="every step once, staleness <= 1")


async def test_a_rollout_pool_that_finds_no_capacity_by_the_deadline_fails_naming_what_it_misses(nodes, tmp_path,
                                                                                               fault_row):
    nodes.remove("roll_b")
    try:
        before = await asyncio.to_thread(live_actors)
        tr, error, lost, _, seconds = await _run_losing_the_rollout_node(
            nodes, _job(tmp_path, "gone", placement_wait_s=3.0), comes_back_after=None)
        assert isinstance(error, asyncrl.PlacementError), error
        assert "not placed within 3s: missing 1 x {'CPU': 1.0, 'rollout': 1.0} on one node" in str(error)
        after = await settled(before)
        assert after == before  # every worker and placement group released
        done = len(tr.history)
    finally:
        nodes.add("roll_a", 1)
        nodes.add("roll_b", 1)
    fault_row(order=42, fault="the node holding the rollout pool lost generating the batch of step 4, no capacity left, none coming back",
              policy="`restart.placement_wait_s=3` (60 by default)",
              outcome="`PlacementError` raised by `fit()`, naming the resources the pool misses",
              seconds=seconds, bound="placement_wait_s + detection + recovery", interrupted="the run stops",
              leaks="none" if after == before else f"LEAK {after} vs {before}",
              state=f"{done} of {STEPS} steps done")


async def test_a_lost_training_node_restarts_from_the_newest_checkpoint_once_it_is_back(nodes, tmp_path, fault_row):
    cfg = _job(tmp_path, "train")
    cfg.trainer.checkpoint_every = 2
    before = await asyncio.to_thread(live_actors)
    tr = GRPOTrainer(cfg, worker_overrides={"policy": _hold(cfg, "update", 4)})  # step 3's, after checkpoint 2

    async def lose_the_training_node() -> None:
        await _held(cfg)
        nodes.remove("train")
        await asyncio.sleep(2.0)  # the restart waits for the training pool's capacity
        nodes.add("train", 2)

    async with tr:
        chaos = asyncio.create_task(lose_the_training_node())
        history = await tr.fit()
        await chaos
    _completed(history)
    [r] = tr.restarts
    assert r["kind"] == "restart" and r["from_checkpoint"] is not None and r["from_step"] >= 2
    after = await settled(before)
    assert after == before
    fault_row(order=43, fault="the node holding the training pool lost during step 3's update; it comes back 2 s later",
              policy="none (the defaults), `checkpoint_every=2` here",
              outcome=f"restarted from the step-{r['from_step']} checkpoint once the training pool was placed again, "
                      "run completed",
              seconds=r["time_s"], bound="< placement_wait_s + restart", interrupted=r["interrupted_s"],
              leaks="none" if after == before else f"LEAK {after} vs {before}", state="every step once")


async def test_two_nodes_lost_at_once_restart_the_run_once_the_training_node_is_back(nodes, tmp_path, fault_row):
    cfg = _job(tmp_path, "two")
    cfg.trainer.checkpoint_every = 2
    before = await asyncio.to_thread(live_actors)
    tr = GRPOTrainer(cfg, worker_overrides={"policy": _hold(cfg, "update", 4)})  # step 3's, after checkpoint 2
    lost: list[str] = []

    async def lose_two_nodes() -> None:
        await _held(cfg)
        lost.append(_rollout_node(nodes, tr))
        nodes.remove(lost[0])  # the rollout node and the training node together
        nodes.remove("train")
        await asyncio.sleep(2.0)
        nodes.add("train", 2)

    async with tr:
        chaos = asyncio.create_task(lose_two_nodes())
        history = await tr.fit()
        await chaos
        where = _rollout_node(nodes, tr)
    nodes.add(lost[0], 1)
    _completed(history, tr.output_dir)
    assert tr.restarts[-1]["kind"] == "restart" and len(tr.restarts) <= 2  # a replacement may come first
    assert {lost[0], where} == {"roll_a", "roll_b"}  # the rollout pool on the rollout node left
    after = await settled(before)
    assert after == before
    r = tr.restarts[-1]
    fault_row(order=44, fault="the rollout node and the training node lost at once during step 3's update; the training node "
                              "comes back 2 s later",
              policy="none (the defaults), `checkpoint_every=2` here",
              outcome=f"{' then '.join(x['kind'] for x in tr.restarts)}: from the step-{r['from_step']} checkpoint, "
                      "rollout pool on the rollout node left, run completed",
              seconds=sum(x["time_s"] for x in tr.restarts), bound="< placement_wait_s + restart",
              interrupted=r["interrupted_s"], leaks="none" if after == before else f"LEAK {after} vs {before}",
              state="every step once")


async def test_the_node_of_a_draining_rollout_pool_lost_hands_its_groups_to_the_new_pool(nodes, tmp_path, fault_row):
    """Streaming, ``rollout_workers=1..2``: a preemption notice with a long drain starts a new pool on the other
    rollout node; the old pool's node is lost while its groups (hung) drain. Its groups are issued again on the
    new pool with their seeds; no recovery is counted; the run completes every step once."""
    from tests.pipelines.test_stream_scale import LoggedRollout, _calls, _hang_pool

    calls, hang = tmp_path / "calls.jsonl", tmp_path / "hang"
    cfg = _job(tmp_path, "drain")
    cfg.trainer.rollout_mode, cfg.trainer.rollout_workers = "stream", "1..2"
    cfg = cfg.validate()
    before = await asyncio.to_thread(live_actors)
    tr = GRPOTrainer(cfg, worker_overrides={"rollout": (LoggedRollout, {"calls": str(calls), "hang": str(hang)})})
    async with tr:

        async def lose_the_draining_node() -> str:
            await until(lambda: len(tr.history) >= 3, "step 3")
            old = _rollout_node(nodes, tr)
            await _hang_pool(tr, hang, calls)
            notice = asyncio.create_task(tr.preempt_rollout(0, drain_s=120.0))  # drains far past this test
            await until(lambda: tr.workers.retiring, "the new pool taking over")  # the old one drains
            nodes.remove(old)
            await notice
            return old

        async with asyncio.TaskGroup() as tg:
            fit, chaos = tg.create_task(tr.fit()), tg.create_task(lose_the_draining_node())
        history, lost = fit.result(), chaos.result()
        where = _rollout_node(nodes, tr)
        [rec] = tr.rollout.scaler.resizes
        assert tr.restarts == []  # the lost node held only a retiring pool: no recovery
    _completed(history, None)
    admitted = read_journal(tmp_path / "drain")
    trained = [g for t in range(STEPS) for g in admitted.steps[t]["groups"]]
    assert sorted(trained) == list(range(STEPS * cfg.prompts_per_step))  # every group once
    assert {lost, where} == {"roll_a", "roll_b"}
    log = _calls(calls)
    hung = sorted({c["seed"] for c in log if c.get("hung")})
    assert hung and {batch_seed(cfg, g) for g in rec.handed_over} >= set(hung)
    for seed in hung:  # each ran again, once, on the new pool with its own seed
        assert len([c for c in log if c["seed"] == seed and not c.get("hung") and "version" in c]) == 1
    after = await settled(before)
    assert after == before
    nodes.add(lost, 1)  # for the next case
    fault_row(order=45, fault="the node of a draining rollout pool lost during a streaming resize (its groups hung "
                              "in flight, `preempt_rollout(0, drain_s=120)`)",
              policy="none (the defaults), `rollout_workers=1..2`, `rollout_mode=stream`",
              outcome="the groups it held issued again on the new pool (other node) with their seeds, run completed",
              seconds=rec.drain_s, bound="node death detection", interrupted=rec.drain_s,
              leaks="none" if after == before else f"LEAK {after} vs {before}",
              state="every step once, staleness <= 1; no recovery counted")


class SlowLoadRollout(RolloutWorker):
    """A rollout worker whose load of weight version `version` writes `marker` (its pid) first and then takes
    3 s more, so that a test can lose its node in the middle of that weight sync."""

    def __init__(self, *args, marker: str, version: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._marker, self._slow_version = marker, version

    @register(Dispatch.ONE_TO_ALL)
    async def update_weights(self, weights, version=None, *, expected_checksums=None):
        out = await super().update_weights(weights, version, expected_checksums=expected_checksums)
        if self.version == self._slow_version and not os.path.exists(self._marker):
            Path(self._marker).write_text(str(os.getpid()))
            await asyncio.sleep(3.0)  # the sync is still in flight when the node goes
        return out


async def test_a_rollout_node_lost_during_a_weight_sync_is_replaced_and_the_batch_reissued(nodes, tmp_path, fault_row):
    marker = tmp_path / "loading"
    before = await asyncio.to_thread(live_actors)
    tr = GRPOTrainer(_job(tmp_path, "sync"),
                     worker_overrides={"rollout": (SlowLoadRollout, {"marker": str(marker), "version": 2})})
    async with tr:

        async def lose_the_node_mid_sync() -> str:
            await until(marker.exists, "the load of version 2")
            lost = _rollout_node(nodes, tr)
            nodes.remove(lost)
            return lost

        async with asyncio.TaskGroup() as tg:
            fit, chaos = tg.create_task(tr.fit()), tg.create_task(lose_the_node_mid_sync())
        history, lost = fit.result(), chaos.result()
        where = _rollout_node(nodes, tr)
    _completed(history, tr.output_dir)
    [r] = tr.restarts
    assert r["kind"] == "replace" and r["from_checkpoint"] is None  # the rollout pool replaced, no restart
    assert {lost, where} == {"roll_a", "roll_b"}  # placed again on the other rollout node
    after = await settled(before)
    assert after == before
    nodes.add(lost, 1)  # for the next case
    fault_row(order=46, fault="the node holding the rollout pool lost during a weight sync (loading version 2)",
              policy="none (the defaults), `rollout_placement=[1]`, `train_placement=[2]`",
              outcome="rollout pool placed again on the other rollout node, batch re-issued, run completed",
              seconds=r["time_s"], bound="node death detection + recovery", interrupted=r["interrupted_s"],
              leaks="none" if after == before else f"LEAK {after} vs {before}",
              state="every step once, staleness <= 1")


class SlowSavePolicy(PolicyWorker):
    """A policy worker whose `nth` checkpoint save (in this process) writes `marker` first and then takes 3 s
    more, so that a test can lose its node in the middle of writing that checkpoint."""

    def __init__(self, *args, marker: str, nth: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._marker, self._nth, self._saves = marker, nth, 0

    @register(Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> str:
        self._saves += 1
        if self._saves == self._nth and not os.path.exists(self._marker):
            Path(self._marker).write_text(str(os.getpid()))
            time.sleep(3.0)  # the checkpoint is half written when the node goes
        return super().save(path)


async def test_a_training_node_lost_during_a_checkpoint_restarts_from_the_last_whole_one(nodes, tmp_path, fault_row):
    marker = tmp_path / "saving"
    cfg = _job(tmp_path, "ckpt")
    cfg.trainer.checkpoint_every = 2
    before = await asyncio.to_thread(live_actors)
    tr = GRPOTrainer(cfg, worker_overrides={"policy": (SlowSavePolicy, {"marker": str(marker), "nth": 2})})

    async def lose_the_node_mid_checkpoint() -> None:
        await until(marker.exists, "the step-4 checkpoint being written")
        nodes.remove("train")
        await asyncio.sleep(2.0)  # the restart waits for the training pool's capacity
        nodes.add("train", 2)

    async with tr:
        async with asyncio.TaskGroup() as tg:
            fit = tg.create_task(tr.fit())
            tg.create_task(lose_the_node_mid_checkpoint())
        history = fit.result()
    _completed(history)
    [r] = tr.restarts
    # the checkpoint cut short is not used: the run restarts from the step-2 one, the last written whole
    assert r["kind"] == "restart" and r["from_step"] == 2 and r["from_checkpoint"].endswith("step_000002")
    after = await settled(before)
    assert after == before
    fault_row(order=47, fault="the node holding the training pool lost while the step-4 checkpoint is written; it "
                              "comes back 2 s later",
              policy="none (the defaults), `checkpoint_every=2` here",
              outcome="the half-written checkpoint ignored; restarted from the step-2 checkpoint once the training "
                      "pool was placed again, run completed",
              seconds=r["time_s"], bound="< placement_wait_s + restart", interrupted=r["interrupted_s"],
              leaks="none" if after == before else f"LEAK {after} vs {before}", state="every step once")
