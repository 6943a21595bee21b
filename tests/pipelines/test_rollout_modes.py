"""A rollout mode is a plugin: this file alone adds one (``lockstep``: batch t generated with the weights of
step t, once step t-1 is done), runs GRPO with it on real Ray, cuts the run after its checkpoint and resumes it,
and pins what the trainer asked the mode for (its batches, its checkpoint state, its journal records). It is the
example of docs/rollout_modes.md."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import load_config, tiny_test
from asyncrl.pipelines.journaling.journal import read_journal
from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.loop.loop_state import LoopState, RolloutBatch, batch_seed
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.pipelines.job.modes import RolloutMode, register_rollout_mode, rollout_mode


class LockstepRollout:
    """Generates batch t with version t once step t-1 exported it: the synchronous loop, as a producer."""

    def __init__(self, services: Any) -> None:
        self._sv = services  # a RolloutServices: the run's parts, not the trainer
        self.generated: list[int] = []
        """The batches this run generated (its checkpoint state: a resume goes on from the saved list)."""

    async def run(self) -> None:
        sv = self._sv
        run = sv.current()  # this attempt's groups and loop state (a restart starts a new one)
        s, g = run.state, run.groups
        self.generated = list((s.rollout_state or {}).get("generated", []))
        for item in s.restored:  # a checkpoint's buffered batches come first
            await s.buffer.put(item)
        s.restored_buffered()
        for i in range(s.next_gen, sv.config.trainer.steps):
            await s.wait_for(lambda: s.exported >= i)
            if i > s.rollout_version:
                await sv.weights.load(g, s.exports[i])
                sv.weights.loaded(s, i)
            t0 = time.perf_counter()
            prompts = await anyio.to_thread.run_sync(sv.loader().batch, i)
            gen = stages.generate(g, prompts, seed=batch_seed(sv.config, i))
            scores = stages.score(g, gen)
            mean = float((await scores)["scores"].float().mean())
            sv.journal.batch(i, i)
            self.generated.append(i)
            await s.buffer.put(RolloutBatch(step=i, version=i, batch=gen, scores=scores, reward_mean=mean,
                                            gen_time=time.perf_counter() - t0))
            await s.generated(i + 1)
        await s.rollout_finished()

    async def take(self, step: int) -> RolloutBatch:
        s = self._sv.current().state
        return await s.buffer.get(s.policy_version)

    def upcoming(self, step: int) -> tuple[int, Any] | None:
        return None  # never known ahead: precompute-ahead waits for the step

    async def finish(self) -> None:
        pass

    async def settle_for_checkpoint(self, step: int) -> None:
        s = self._sv.current().state  # the batch of the next step is generated from the weights being saved
        await s.wait_for(lambda: s.rollout_done or s.next_gen > step)

    def checkpoint_state(self) -> dict[str, Any] | None:
        return {"generated": list(self.generated)}

    def restore(self, saved: dict[str, Any] | None, state: LoopState) -> None:
        state.rollout_state = saved


@register_rollout_mode("lockstep")
class LockstepMode(RolloutMode):
    """``trainer.rollout_mode=lockstep``."""

    def check(self, job: Any) -> None:
        if job.trainer.max_staleness != 0:
            raise ConfigError(f"trainer.rollout_mode=lockstep generates batch t with the weights of step t: it needs "
                              f"trainer.max_staleness=0, got {job.trainer.max_staleness}")

    def build(self, services: Any) -> LockstepRollout:
        return LockstepRollout(services)


class Cut(Exception):
    pass


def _cfg(out) -> Any:
    cfg = tiny_test()
    cfg.trainer.rollout_mode = "lockstep"
    cfg.trainer.steps, cfg.trainer.checkpoint_every = 4, 2
    cfg.trainer.output_dir = str(out)
    cfg.evaluation.every, cfg.evaluation.at_start, cfg.evaluation.at_end = 0, False, False
    return cfg.validate()


async def test_a_mode_registered_in_a_test_file_trains_checkpoints_and_resumes(ray_cluster, tmp_path):
    def cut_after_step_1(trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if step == 1:  # steps 0 and 1 done, checkpoint step_000002 written
            raise Cut()

    with pytest.raises(Cut):
        async with GRPOTrainer(_cfg(tmp_path), on_step=cut_after_step_1) as t:
            assert isinstance(t.rollout, LockstepRollout)
            await t.fit()
    saved = ckpt.read_state(ckpt.checkpoint_dir(tmp_path, 2))
    assert (saved["step"], saved["next_gen"], saved["lockstep"]) == (2, 3, {"generated": [0, 1, 2]})
    assert "stream" not in saved

    async with GRPOTrainer(_cfg(tmp_path), resume=tmp_path) as t:
        history = await t.fit()
        generated = t.rollout.generated
    assert generated == [0, 1, 2, 3]  # batch 2 came back from the checkpoint's buffer, not generated again
    assert [(h["step"], h["version"], h["batch/version"], h["staleness/max"]) for h in history] == [
        (0, 1, 0, 0), (1, 2, 1, 0), (2, 3, 2, 0), (3, 4, 3, 0)]
    assert ckpt.read_state(ckpt.checkpoint_dir(tmp_path, 4))["lockstep"] == {"generated": [0, 1, 2, 3]}
    journal = read_journal(tmp_path)
    assert [r["start_step"] for r in journal.runs] == [0, 2]
    assert {i: b["version"] for i, b in journal.batches.items()} == {0: 0, 1: 1, 2: 2, 3: 3}
    assert {i: (st["batch"], st["version"]) for i, st in journal.steps.items()} == {
        0: (0, 0), 1: (1, 1), 2: (2, 2), 3: (3, 3)}
    assert journal.groups == {} and journal.drops == []


def test_a_mode_checks_its_own_config():
    with pytest.raises(ConfigError, match=r"^trainer.rollout_mode=lockstep generates batch t with the weights of "
                                          r"step t: it needs trainer.max_staleness=0, got 1$"):
        load_config(None, ["trainer.rollout_mode=lockstep", "trainer.max_staleness=1"])
    assert load_config(None, ["trainer.rollout_mode=lockstep", "trainer.max_staleness=0"]).trainer.weights_choice() \
        == "fixed_lag"


def test_an_unknown_mode_names_the_registered_ones_and_how_to_register():
    message = ("trainer.rollout_mode: no rollout mode named 'lockstpe'; known: ['batch', 'lockstep', 'stream']. "
               "Register one with @asyncrl.pipelines.job.modes.register_rollout_mode(name) on a RolloutMode "
               "subclass, in a module imported before the config is validated (docs/rollout_modes.md)")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.rollout_mode=lockstpe"])
    assert str(e.value) == message


def test_the_built_in_modes_answer_for_themselves():
    batch, stream = rollout_mode("batch"), rollout_mode("stream")
    assert (batch.name, batch.weights, batch.splits_batches, batch.hands_over) == ("batch", "fixed_lag", True, False)
    assert (stream.name, stream.weights, stream.splits_batches, stream.hands_over) == ("stream", "latest", False, True)


def test_registering_needs_a_mode_class_and_a_free_name():
    with pytest.raises(TypeError, match=r"^register_rollout_mode\('x'\) decorates a RolloutMode subclass, got 3$"):
        not_a_class: Any = 3
        register_rollout_mode("x")(not_a_class)
    with pytest.raises(ValueError, match=r"^a rollout mode named 'lockstep' is already registered; pick another "
                                         r"name or pass replace=True$"):
        register_rollout_mode("lockstep")(type("Other", (RolloutMode,), {}))
    assert rollout_mode("lockstep").build.__qualname__ == "LockstepMode.build"
