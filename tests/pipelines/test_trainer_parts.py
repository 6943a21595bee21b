"""The rebuilt trainer's seams: the train loop reaches the rollout side only through the
``Rollout`` protocol (so another producer can stand in), and the loop state is one object."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from asyncrl import WorkerDiedError
from asyncrl.pipelines.loop.loop_state import LoopState, RolloutBatch
from asyncrl.pipelines.run.run import Run
from asyncrl.pipelines.supervision.supervisor import Supervisor
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.rollout.rollout_loop import BatchRollout, Rollout
from asyncrl.pipelines.trainers.trainer import GRPOTrainer

from .fakes import Recorder, fake_groups

STEPS = 4


class RecordingRollout:
    """A stand-in producer: delegates to the trainer's own and records every call the trainer makes."""

    def __init__(self, inner: BatchRollout) -> None:
        self.inner = inner
        self.calls: list[Any] = []

    async def run(self) -> None:
        self.calls.append("run")
        await self.inner.run()

    async def take(self, step: int) -> RolloutBatch:
        item = await self.inner.take(step)
        self.calls.append(("take", step, item.step))
        return item

    def upcoming(self, step: int) -> tuple[int, Any] | None:
        return self.inner.upcoming(step)

    async def finish(self) -> None:
        self.calls.append("finish")
        await self.inner.finish()


async def test_the_train_loop_consumes_any_rollout_producer_through_take_and_finish(tmp_path: Path) -> None:
    cfg = tiny_test()
    cfg.trainer.steps, cfg.trainer.max_staleness, cfg.trainer.checkpoint_at_end = STEPS, 1, False
    cfg.trainer.output_dir = str(tmp_path)
    rec = Recorder()
    async with fake_groups(rec, 0, cfg.prompts_per_step, 0.002, 1) as groups:
        async with GRPOTrainer(cfg, groups=groups) as trainer:
            producer = RecordingRollout(trainer.rollout)  # type: ignore[arg-type]
            checked: Rollout = producer
            trainer.rollout = checked  # type: ignore[assignment]
            history = await trainer.fit()
    assert [r["step"] for r in history] == list(range(STEPS))
    assert producer.calls == ["run", *[("take", t, t) for t in range(STEPS)], "finish"]


def test_the_loop_state_is_one_fresh_object_per_attempt(tmp_path: Path) -> None:
    cfg = tiny_test()
    cfg.trainer.output_dir = str(tmp_path)
    trainer = GRPOTrainer(cfg.validate())
    first, second = trainer.state, trainer.attempts.new_state()
    assert isinstance(first, LoopState) and trainer.buffer is first.buffer
    assert second is not first and second.buffer is not first.buffer
    assert (second.policy_version, second.exported, second.next_gen, second.exports) == (0, 0, 0, {0: None})
    assert second.buffer.statistics().capacity == cfg.buffer_capacity


def test_an_attempt_is_replaced_whole_never_assigned_field_by_field(tmp_path: Path) -> None:
    cfg = tiny_test()
    cfg.trainer.output_dir = str(tmp_path)
    trainer = GRPOTrainer(cfg.validate())
    run = trainer.run
    assert (trainer.groups, trainer.state, trainer.history) == (None, run.state, run.history)
    assert trainer.state is run.state and trainer.history is run.history
    for name in ("groups", "state", "history"):
        with pytest.raises(AttributeError):
            setattr(trainer, name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.state = trainer.attempts.new_state()  # type: ignore[misc]


async def test_a_restart_hands_the_new_attempt_to_the_trainer_and_the_supervisor_needs_no_trainer(
        tmp_path: Path) -> None:
    cfg = tiny_test()
    cfg.trainer.output_dir = str(tmp_path)
    cfg = cfg.validate()
    first = Run(None, LoopState.new(cfg.buffer_capacity, cfg.trainer.max_staleness))
    second = Run(None, LoopState.new(cfg.buffer_capacity, cfg.trainer.max_staleness), [{"step": 0}])
    current, asked, resumed, tries = [first], [], [], []

    async def restart(point: Path | None) -> Run:
        asked.append(point)
        return second

    async def resume(run: Run) -> None:
        resumed.append(run)
        current[0] = run

    async def loops() -> None:
        tries.append(current[0])
        if len(tries) == 1:
            raise WorkerDiedError("policy", "actor_update", 0)

    sup = Supervisor(cfg, current=lambda: current[0], restart=restart, last_checkpoint=lambda: tmp_path / "ckpt",
                     workers=None, weights=None, owns_groups=True, fitting=lambda: True)  # type: ignore[arg-type]
    await sup.run(loops, resume)
    assert asked == [tmp_path / "ckpt"] and resumed == [second] and tries == [first, second]
    assert [(r["kind"], r["from_step"]) for r in sup.restarts] == [("restart", 0)]


def test_the_trainer_module_stays_a_readable_loop() -> None:
    source = Path(__file__).resolve().parents[2] / "pipelines" / "trainers" / "trainer.py"
    assert len(source.read_text().splitlines()) <= 400
