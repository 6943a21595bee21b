"""Chaos in the cluster twin (pipelines/twin/chaos.py), the default suite's fast versions of the chaos table
(benchmarks/chaos.py): seeded schedules, and real runs at 4 simulated replicas, 2 per process -- a replica that dies
is replaced alone (simulated death, the real controller's recovery), a training rank's process SIGKILLed restarts
the run from its checkpoint (a real fault); each completes with its ledger holding (nothing lost, nothing trained
twice, every token within the bound) and no call past twice its deadline. Slow: a lost node (a process of replicas
SIGKILLed), a preemption wave (SIGTERMs), a replica 10x slower, and the pool replaced whole when per-replica
replacement is off."""

from __future__ import annotations

import pytest

from asyncrl.pipelines.job.presets import twin
from asyncrl.pipelines.twin.chaos import KINDS, plan, run_chaos


def test_schedules_are_seeded_and_land_inside_the_run():
    kw = dict(replicas=64, replicas_per_process=8, train_ranks=4, steps=8)
    assert plan("kill", 3, **kw) == plan("kill", 3, **kw) != plan("kill", 4, **kw)
    kill = plan("kill", 3, **kw)
    assert len(kill.events) == 6 and len({e.target for e in kill.events}) == 6  # 10 % of 64, distinct replicas
    assert all(1 <= e.step <= 5 and 0 <= e.delay < 1 for e in kill.events) and not kill.real
    wave = plan("preempt", 0, **kw)
    assert len(wave.events) == 2 and len({e.step for e in wave.events}) == 1 and wave.real  # 8 processes / 4
    assert [e.kind for e in plan("train", 0, **kw).events] == ["train"] and plan("node", 0, **kw).real
    assert plan("slow", 0, **kw).events[0].step == 0  # slow from the start
    with pytest.raises(ValueError, match="needs twin.replicas_per_process=8"):
        plan("node", 0, **{**kw, "replicas_per_process": 16})
    with pytest.raises(ValueError, match="unknown chaos kind 'flood'"):
        plan("flood", 0, **kw)
    assert set(KINDS) == {"kill", "slow", "node", "preempt", "train"}


def chaos_config(out, steps: int = 8):
    cfg = twin()
    t = cfg.trainer
    t.steps, t.rollout_workers, t.train_workers, t.output_dir = steps, 4, 2, str(out)
    t.rollout_placement = [4]  # a pool of its own: a preemption resizes it
    t.batch_size, t.rollout_timeout_s, t.checkpoint_every, t.num_cpus = 64, 60.0, 2, 32
    cfg.twin.replicas_per_process = 2
    return cfg.validate()


def assert_holds(res, steps: int = 8) -> None:
    assert res.completed, res.error
    assert res.ledger.ok, res.ledger.render()
    assert res.ledger.trained == steps * 64 and res.ledger.lost == 0 and res.ledger.trained_twice == 0
    assert res.overruns == [] and res.max_wait_ratio <= 2.0
    assert all("error" not in f for f in res.fired), res.fired


async def test_a_replica_that_dies_is_replaced_alone_and_the_ledger_holds(ray_cluster, tmp_path):
    chaos = plan("kill", 0, replicas=4, replicas_per_process=2, train_ranks=2, steps=8)
    [ev] = chaos.events
    res = await run_chaos(chaos_config(tmp_path / "run"), chaos)
    assert_holds(res)
    assert [f["died"] for f in res.fired] == [1]
    # the replica alone: a new engine in its process, no pool replacement, no restart
    assert [r["kind"] for r in res.restarts] == ["replace_replica"] and res.restarts[0]["rank"] == ev.target
    assert res.ledger.replicas == 4  # every replica returned trained rows, the replaced one too


async def test_a_training_rank_killed_restarts_from_its_checkpoint_and_the_ledger_holds(ray_cluster, tmp_path):
    chaos = plan("train", 1, replicas=4, replicas_per_process=2, train_ranks=2, steps=8)
    res = await run_chaos(chaos_config(tmp_path / "run"), chaos)
    assert_holds(res)
    assert [r["kind"] for r in res.restarts] == ["restart"]  # a real SIGKILL: the run went back to a checkpoint
    assert res.ledger.rewinds == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["node", "preempt", "slow"])
async def test_a_lost_node_a_preemption_wave_and_a_slow_replica_are_survived(ray_cluster, tmp_path, kind):
    cfg = chaos_config(tmp_path / "run")
    chaos = plan(kind, 0, replicas=4, replicas_per_process=2, train_ranks=2, steps=8, node=2)
    res = await run_chaos(cfg, chaos)
    assert_holds(res)
    if kind == "slow":
        assert res.restarts == [] and [f["slowed"] for f in res.fired] == [1]
    else:
        assert res.restarts or res.resizes  # the lost processes' replicas were replaced or resized away


@pytest.mark.slow
async def test_without_per_replica_replacement_the_whole_pool_is_replaced(ray_cluster, tmp_path, monkeypatch):
    from asyncrl.pipelines.rollout import stream_rollout

    monkeypatch.setattr(stream_rollout, "REPLACE_REPLICAS", False)
    chaos = plan("kill", 0, replicas=4, replicas_per_process=2, train_ranks=2, steps=8)
    res = await run_chaos(chaos_config(tmp_path / "run"), chaos)
    assert_holds(res)
    assert [r["kind"] for r in res.restarts] == ["replace"]

