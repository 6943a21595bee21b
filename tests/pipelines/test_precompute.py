"""``trainer.precompute_log_probs``: the next step's old_log_prob / ref_log_prob / values issued
before its batch leaves the buffer, right behind the current step's export on the training
workers. Same numbers as the canonical order; used only by the step and batch it was issued
for; discarded (never awaited, never logged) when the batch is regenerated, or the run stops.

Real local Ray with the tiny-model presets (two pools: rollout, training), and the in-process
fakes of fakes.py for the failure paths that need a worker to misbehave on cue.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from asyncrl import Dispatch, LocalWorkerGroup, register
from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.loop.loop_state import Generating
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.loop.stages import AdvantageWorker, Groups
from asyncrl.pipelines.trainers.trainer import GRPOTrainer, PPOTrainer, RolloutBatch

from .fakes import FakePolicy, FakeReward, FakeRollout, Recorder

NOISE = ("never retrieved", "Unhandled error")


def _strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "buffer/"))} for r in rows]


def _cfg(out: Path, algorithm: str = "grpo", *, steps: int = 4, precompute: bool = True, k: int = 1):
    cfg = tiny_test(algorithm)
    t = cfg.trainer
    t.steps, t.max_staleness, t.precompute_log_probs = steps, k, precompute
    t.checkpoint_at_end = False
    t.output_dir = str(out)
    if algorithm == "grpo":
        cfg.actor.kl_coef = 0.05  # a reference too: all three precomputed stages
    return cfg.validate()


async def _fit(cfg, cls=GRPOTrainer, **kwargs: Any) -> tuple[list[dict[str, Any]], Any, dict[str, int]]:
    async with cls(cfg, **kwargs) as t:
        history = await t.fit()
        return history, await t.groups.policy.weights_checksum(), dict(t.precompute_stats)


@pytest.mark.parametrize("algorithm", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
async def test_training_is_identical_with_and_without_precomputed_log_probs(ray_cluster, tmp_path, algorithm):
    """Every metric of every step and the final weights are bit-identical: the precomputed calls
    run on each training worker at the same place in its ordered lane (right after the export of
    the previous step) as the canonical ones, so they read the same weights; nothing is reduced
    in another order. GRPO with a KL term (reference) and PPO (critic values) cover all three."""
    cls = GRPOTrainer if algorithm == "grpo" else PPOTrainer
    steps = 4 if algorithm == "grpo" else 3
    on, on_sum, on_stats = await _fit(_cfg(tmp_path / "on", algorithm, steps=steps), cls)
    off, off_sum, off_stats = await _fit(_cfg(tmp_path / "off", algorithm, steps=steps, precompute=False), cls)
    assert on_sum == off_sum
    assert _strip(on) == _strip(off)
    assert [r["staleness/max"] for r in on] == [0] + [1] * (steps - 1)
    assert on_stats == {"issued": steps, "used": steps, "discarded": 0}  # every step, none past the last
    assert off_stats == {"issued": 0, "used": 0, "discarded": 0}


@pytest.mark.slow  # precompute is opt-in; its default tests: equality with and without it, the in-process cases
async def test_a_stop_discards_the_precomputed_step_and_the_resumed_run_ends_identical(ray_cluster, tmp_path,
                                                                                      caplog, capfd):
    """request_stop after step 1: step 2's precomputed calls are cancelled (the checkpoint behind
    them on the training worker's lane is written), and a run resumed from that checkpoint (whose
    first step has no precomputed calls: its batch comes from the checkpoint) ends bit-identical
    to an uninterrupted run without precomputation."""
    full, full_sum, _ = await _fit(_cfg(tmp_path / "full", precompute=False))

    pending: list[bool] = []

    def stop_after_step_1(trainer: GRPOTrainer, step: int, metrics: dict[str, Any]) -> None:
        if step == 1:  # step 2's calls are issued once batch 2's generate is (almost always by now)
            pre = trainer.state.precomputed
            pending.append(pre is not None)
            assert pre is None or (pre.step, pre.batch_index) == (2, 2)
            trainer.request_stop("test")

    cut = _cfg(tmp_path / "cut")
    async with GRPOTrainer(cut, on_step=stop_after_step_1) as t:
        await t.fit()
        assert t.interrupted is not None and t.interrupted.steps_done == 2
        n = int(pending[0])  # none is issued after the stop request
        assert t.precompute_stats == {"issued": 2 + n, "used": 2, "discarded": n}
        assert t.state.precomputed is None
    saved = ckpt.latest_checkpoint(tmp_path / "cut")
    assert saved is not None and saved.name == "step_000002"
    resumed, resumed_sum, stats = await _fit(_cfg(tmp_path / "cut"), resume=tmp_path / "cut")
    assert resumed_sum == full_sum
    assert _strip(resumed) == _strip(full)
    # step 2's batch and step 3's come from the checkpoint; step 3's first stages are issued
    # behind step 2's export, on its restored batch
    assert stats == {"issued": 1, "used": 1, "discarded": 0}
    logged = caplog.text + "".join(capfd.readouterr())
    assert not any(n in logged for n in NOISE), logged


@pytest.mark.slow  # precompute is opt-in; its default tests: equality with and without it, the in-process cases
async def test_a_regenerated_batch_discards_the_precompute_of_the_lost_one(ray_cluster, tmp_path, caplog, capfd):
    """A rollout worker SIGKILLed mid-generation of batch 2, after step 2's first stages were issued
    on that generate: they fail (their input died), the replacement regenerates batch 2, its new
    generate is precomputed from and used, and the failed calls are dropped without an error or a
    "never retrieved" log. The run ends bit-identical to a fault-free run without precomputation."""
    from tests.reliability.conftest import wait_for_file
    from tests.reliability.faults import Fault, FaultyRollout

    base, base_sum, _ = await _fit(_cfg(tmp_path / "base", precompute=False))
    d = tmp_path / "fault"
    d.mkdir()
    fault = Fault(dir=str(d), point="generate", call=3)  # the third generate: batch 2
    cfg = _cfg(tmp_path / "run")
    cfg.trainer.restart.max_restarts = 1
    stepped = asyncio.Event()

    def on_step(trainer: GRPOTrainer, step: int, metrics: dict[str, Any]) -> None:
        if step == 1:
            stepped.set()

    trainer = GRPOTrainer(cfg, worker_overrides={"rollout": (FaultyRollout, {"fault": fault})}, on_step=on_step)

    async def run() -> tuple[list[dict[str, Any]], Any]:
        async with trainer:
            history = await trainer.fit()
            return history, await trainer.groups.policy.weights_checksum()

    task = asyncio.create_task(run())
    await wait_for_file(d / "pid", 120)  # batch 2's generate hangs on the worker
    await stepped.wait()  # step 1 done: its export published version 2, step 2's batch is batch 2
    pre = trainer.state.precomputed
    assert pre is not None and (pre.step, pre.batch_index) == (2, 2) and not pre.old.done()
    os.kill(int((d / "pid").read_text()), signal.SIGKILL)
    history, checksum = await asyncio.wait_for(task, 180)
    [r] = trainer.restarts
    assert r["kind"] == "replace"
    assert checksum == base_sum
    assert _strip(history) == _strip(base)
    assert trainer.precompute_stats == {"issued": 5, "used": 4, "discarded": 1}
    logged = caplog.text + "".join(capfd.readouterr())
    assert not any(n in logged for n in NOISE), logged


# ---- in-process fakes ----------------------------------------------------------------------------


class PickyPolicy(FakePolicy):
    """Fails ``compute_log_prob`` of the batch of step `fail_step` (a worker bug, not a fault); its update of
    step `hold_update` waits until :class:`StalledRollout`'s stalled generate has begun."""

    def __init__(self, *args: Any, fail_step: int = -1, hold_update: int = -1) -> None:
        super().__init__(*args)
        self.fail_step = fail_step
        self.hold_update = hold_update

    @register(Dispatch.DP_COMPUTE_METRIC)
    async def update(self, batch):
        if int(batch["uid"][0]) // self.pps == self.hold_update and StalledRollout.stalled is not None:
            await StalledRollout.stalled.wait()
        return await super().update(batch)

    @register(Dispatch.DP_COMPUTE)
    async def compute_log_prob(self, batch):
        if int(batch["uid"][0]) // self.pps == self.fail_step:
            raise ValueError(f"cannot score batch {self.fail_step}")
        return await super().compute_log_prob(batch)


class StalledRollout(FakeRollout):
    """Generates batch `stall` only once the test sets `release` (a slow generate)."""

    release: asyncio.Event | None = None
    stalled: asyncio.Event | None = None
    """Set when the stalled generate begins (its call, and what the trainer issues with it, are out)."""

    def __init__(self, *args: Any, stall: int = -1) -> None:
        super().__init__(*args)
        self.stall = stall

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate(self, batch, seed: int | None = None):
        if int(batch["uid"][0]) // self.pps == self.stall and StalledRollout.release is not None:
            if StalledRollout.stalled is not None:
                StalledRollout.stalled.set()
            await StalledRollout.release.wait()
        return await super().generate(batch, seed=seed)


async def _fake_run(tmp_path: Path, *, precompute: bool, policy_kwargs: dict[str, Any] | None = None,
                    rollout_kwargs: dict[str, Any] | None = None, on_step: Any = None, steps: int = 5, k: int = 1):
    cfg = tiny_test()
    t = cfg.trainer
    t.steps, t.max_staleness, t.checkpoint_at_end, t.precompute_log_probs = steps, k, False, precompute
    t.output_dir = str(tmp_path / f"fake-{precompute}")
    rec = Recorder()
    pps = cfg.prompts_per_step
    args = (rec, 0, pps, 0.002)
    groups = Groups(
        rollout=LocalWorkerGroup(StalledRollout, world_size=1, args=args, kwargs=rollout_kwargs or {}),
        reward=LocalWorkerGroup(FakeReward, world_size=1, args=args),
        policy=LocalWorkerGroup(PickyPolicy, world_size=1, args=(*args, k), kwargs=policy_kwargs or {}),
        advantage=LocalWorkerGroup(AdvantageWorker, world_size=1),
    )
    members = (groups.rollout, groups.reward, groups.policy, groups.advantage)
    for g in members:
        await g.setup()
    trainer = GRPOTrainer(cfg, groups=groups, on_step=on_step)
    try:
        async with trainer:
            await trainer.fit()
    finally:
        for g in members:
            await g.close()
    return trainer, rec.events


async def test_a_failed_precomputed_stage_surfaces_like_the_canonical_one(tmp_path):
    """When the precomputed old_log_prob of the batch the step trains failed, the step fails with
    that error, exactly as without precomputation (same type, same message)."""
    errors = []
    for precompute in (True, False):
        with pytest.raises(Exception) as info:
            await _fake_run(tmp_path, precompute=precompute, policy_kwargs={"fail_step": 2})
        errors.append(info.value)
    on, off = errors

    def story(e: BaseException) -> str:  # group names carry a per-process counter: PickyPolicy_2
        return re.sub(r"_\d+\.", ".", str(e).splitlines()[0])

    assert story(on) == ("PickyPolicy.update on rank 0 could not run: an input future failed: "
                         "AdvantageWorker.compute_advantages on rank 0 could not run: an input future failed: "
                         "PickyPolicy.compute_log_prob on rank 0 raised builtins.ValueError: cannot score batch 2")
    assert (type(on), story(on)) == (type(off), story(off))


async def test_max_staleness_0_keeps_the_canonical_order(tmp_path):
    """The synchronous schedule (``max_staleness=0``) never precomputes: the next batch is not generated before the
    step that produces its weights ends; on the policy worker each batch's old_log_prob runs after
    the update before it, as with precomputation."""
    trainer, events = await _fake_run(tmp_path, precompute=True, k=0)
    assert trainer.precompute_stats == {"issued": 0, "used": 0, "discarded": 0}
    where = {(name, step): i for i, (name, step, _) in enumerate(events) if step >= 0}
    assert all(where[("score", t)] < where[("old_log_prob", t)] for t in range(5))


async def test_the_next_steps_stages_wait_in_the_lane_for_a_slow_generate_without_blocking_the_step(tmp_path):
    """Step 2's precomputed old_log_prob is issued on the generate of batch 2 while that generate is
    still running (stalled): step 1 finishes meanwhile (its calls are ahead in the lane), and step 2
    uses the precomputed call once the generate finishes. On the policy worker the order is that
    of the canonical schedule: old_log_prob of a batch right after the update that precedes it."""
    StalledRollout.release, StalledRollout.stalled = asyncio.Event(), asyncio.Event()
    released: list[int] = []

    def on_step(trainer: GRPOTrainer, step: int, metrics: dict[str, Any]) -> None:
        if step == 1:
            pre = trainer.state.precomputed
            assert pre is not None and (pre.step, pre.batch_index) == (2, 2) and not pre.old.done()
            released.append(step)
            StalledRollout.release.set()

    try:
        # step 1's update waits for batch 2's generate to be out (the loader's thread hop before it can take
        # longer than step 1 on a loaded machine): then its export issues step 2's stages behind that generate
        trainer, events = await _fake_run(tmp_path, precompute=True, rollout_kwargs={"stall": 2}, on_step=on_step,
                                          policy_kwargs={"hold_update": 1})
    finally:
        StalledRollout.release = StalledRollout.stalled = None
    assert released == [1]
    assert trainer.precompute_stats == {"issued": 5, "used": 5, "discarded": 0}
    policy = [(name, step, v) for name, step, v in events if name in ("old_log_prob", "actor_update")]
    assert policy == [e for t in range(5) for e in (("old_log_prob", t, t), ("actor_update", t, t))]


async def test_the_precompute_names_the_batch_the_buffer_delivers(tmp_path):
    """Which batch the next step trains, decided before it leaves the buffer: the first buffered
    one within the staleness bound (stale ones are dropped first), else the batch being generated
    if within the bound, else none yet. Checked against what ``buffer.get`` then returns."""
    cfg = tiny_test()
    cfg.trainer.max_staleness = 1
    cfg.trainer.buffer_capacity = 4
    cfg.trainer.output_dir = str(tmp_path)
    trainer = GRPOTrainer(cfg.validate())
    items = [RolloutBatch(step=i, version=v, batch=object(), scores=None, reward_mean=0.0)
             for i, v in ((3, 1), (4, 2), (5, 3))]
    for it in items:
        trainer.buffer.put_nowait(it)
    gen = object()
    trainer.state.generating = Generating(6, 3, gen)
    assert trainer.rollout.upcoming(3) == (4, items[1].batch)  # batch 3 (version 1) is dropped at step 3
    assert (await trainer.buffer.get(3)) is items[1]
    assert trainer.rollout.upcoming(4) == (5, items[2].batch)
    assert (await trainer.buffer.get(4)) is items[2]
    assert trainer.rollout.upcoming(4) == (6, gen)  # nothing buffered: the batch in generation
    assert trainer.rollout.upcoming(5) is None  # version 3 is too stale for step 5
    trainer.state.generating = Generating(6, 2, gen)
    assert trainer.rollout.upcoming(4) is None  # it would be dropped; the one after is not issued yet
