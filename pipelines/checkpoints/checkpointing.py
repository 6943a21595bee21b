"""Checkpoint save and restore of a training run (the directory format and its atomic
commit: :mod:`asyncrl.pipelines.checkpoints.checkpoint`).

A checkpoint holds the state after a finished step: the policy's (and critic's) weights and
optimizer, the batches generated but not yet trained on, the data position, the RNG states,
the metrics history and the evaluations. Restoring it into a fresh loop state lets the run
continue exactly where it was (resume) or recompute the steps after it (restart).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import anyio.to_thread
import structlog
import torch

from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.job.config import config_fingerprint, fingerprint_diff
from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.datasets.datafiles import check_code_digests, code_digests, data_digests
from asyncrl.pipelines.loop.loop_state import RolloutBatch

if TYPE_CHECKING:
    from asyncrl.pipelines.job.config import JobConfig
    from asyncrl.pipelines.datasets.evaluation import Evaluator
    from asyncrl.pipelines.loop.loop_state import LoopState, Rollout
    from asyncrl.pipelines.loop.stages import Groups
    from asyncrl.pipelines.observe.trace import Tracer
    from asyncrl.pipelines.loop.weights import WeightSync

__all__ = ["Checkpointer", "buffered_record", "checkpoint_due", "restored_batch"]


log = structlog.get_logger("asyncrl.pipelines")


class Checkpointer:
    """Saves the run's state after a step and restores it into a fresh loop state.

    Args:
        config: the run's configuration (the checkpoint's directory, schedule and fingerprint).
        resume: the checkpoint the run starts from (already resolved), if any; its files are
            checked here, before any worker starts.
        groups: the current attempt's groups, whose weights a save writes (a restart or a rollout replacement
            swaps them; :meth:`restore` is given the new attempt's).
        rollout: the current rollout producer (what it keeps in a checkpoint, and when that is complete).
        evaluator: the run's held-out evaluation, once set up (its records are saved and restored).
        weights: the weight sync (a restored checkpoint's weights go to the rollout engines through it).
        tracer: the run's tracer (a save is a span).
    """

    def __init__(self, config: JobConfig, resume: Path | None, *, groups: Callable[[], Groups | None],
                 rollout: Callable[[], Rollout], evaluator: Callable[[], Evaluator | None], weights: WeightSync,
                 tracer: Tracer) -> None:
        self._config, self._groups, self._rollout, self._evaluator = config, groups, rollout, evaluator
        self._weights, self._tracer = weights, tracer
        self._out = Path(config.trainer.output_dir)
        self.resume = resume
        """The checkpoint this run resumed from."""
        self.last_written: Path | None = None
        """The newest checkpoint this trainer wrote."""
        self.last_save_t = 0.0
        """``time.perf_counter()`` of the newest checkpoint this trainer wrote (0: none yet)."""
        self._verified = False  # checkpoint file hashes checked
        self._data_digests: dict[str, str] | None = None  # the data files', hashed at the first save only
        self._code_digests = code_digests(to_dict(config))  # the code files it imports, as it starts
        if resume is not None:
            self._check_resume(resume)

    @property
    def latest(self) -> Path | None:
        """The newest checkpoint of this run: the last one it wrote, else the one it resumed from."""
        return self.last_written or self.resume

    def _check_resume(self, path: Path) -> None:
        cfg = self._config
        state = ckpt.read_state(path)
        saved = state.get("config") if isinstance(state.get("config"), dict) else {}
        if state.get("fingerprint") != config_fingerprint(cfg):
            diff = fingerprint_diff(saved, to_dict(cfg))
            if not diff:
                raise ckpt.CheckpointError(f"checkpoint {str(path)!r} was edited: its config does not hash to the "
                                           "fingerprint it records, so it is refused; resume from another checkpoint")
            hint = ""
            strategies = [k for k in ("actor.strategy", "critic.strategy") if k in diff]
            if strategies:
                section, _, key = strategies[0].partition(".")
                hint = (f"; resume with {strategies[0]}={saved.get(section, {}).get(key)!r} (at any number of training "
                        "ranks), or export its weights (asyncrl export) to start a new run from them")
            raise ckpt.CheckpointError(
                f"checkpoint {str(path)!r} was written by a different config (differs in: {', '.join(diff)}); "
                "resume with the same settings (only trainer.steps, output_dir, train_workers, checkpointing and "
                f"reporting may change){hint}"
            )
        check_code_digests(state.get("code_digests"), saved, f"checkpoint {str(path)!r}")
        was = saved.get("trainer", {}).get("train_workers", cfg.trainer.train_workers)
        if cfg.trainer.colocated and was != cfg.trainer.train_workers:
            raise ckpt.CheckpointError(
                f"checkpoint {str(path)!r} was written with trainer.train_workers={was} and this resume asks for "
                f"{cfg.trainer.train_workers}: with trainer.colocated=true that is the rollout pool's size too, which "
                f"decides how each step's prompts are generated; resume with trainer.train_workers={was}")
        # Every file present with its recorded size, before any worker starts; the sha256 of each
        # is checked here too, unless an event loop is running (then setup() hashes in a thread).
        try:
            asyncio.get_running_loop()
            in_loop = True
        except RuntimeError:
            in_loop = False
        ckpt.verify(path, hashes=not in_loop)
        if not in_loop:
            _check_data(path, state, cfg)
        self._verified = not in_loop
        if state["step"] > cfg.trainer.steps:
            raise ckpt.CheckpointError(
                f"checkpoint {str(path)!r} is at step {state['step']}, past trainer.steps={cfg.trainer.steps}"
            )

    async def verify_resume(self) -> None:
        """Hash the resume checkpoint's files and the data files (in a thread), if construction could not."""
        if self.resume is not None and not self._verified:
            await anyio.to_thread.run_sync(ckpt.verify, self.resume)
            state = ckpt.read_state(self.resume)
            await anyio.to_thread.run_sync(_check_data, self.resume, state, self._config)
            self._verified = True

    async def after_step(self, step: int, s: LoopState, history: list[dict[str, Any]], started_at: float) -> bool:
        """Save (:meth:`save`) when ``trainer.checkpoint_every`` steps are done or ``trainer.checkpoint_every_s``
        seconds passed since the last save or the run's start `started_at` (not after the last step: the final
        checkpoint is the run's); True when it saved."""
        t = self._config.trainer
        if checkpoint_due(t, step, now=time.perf_counter(), last=self.last_save_t or started_at):
            await self.save(s, history)
            return True
        return False

    async def save(self, s: LoopState, history: list[dict[str, Any]]) -> Path:
        """Write a checkpoint of the loop state `s` after its last finished step, with the metrics `history`
        (atomic). Waits until the rollout loop has generated every batch the current versions allow, so the
        saved buffer is complete."""
        g, cfg, rollout, evaluator = self._groups(), self._config, self._rollout(), self._evaluator()
        t = cfg.trainer
        assert g is not None
        step = s.policy_version  # steps done == versions
        await rollout.settle_for_checkpoint(step)
        final = ckpt.checkpoint_dir(self._out, step)
        tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
        await anyio.to_thread.run_sync(_fresh_dir, tmp)
        with self._tracer.span("checkpoint", step=step):
            saves = [g.policy.save(str(tmp / "policy"))]
            if g.critic is not None:
                saves.append(g.critic.save(str(tmp / "critic")))
            await asyncio.gather(*saves)
            buffered = []
            for it in s.buffer.peek_all():
                td = await it.batch
                td.update(await it.scores)
                buffered.append(buffered_record(it, td))
            state = {
                "step": step, "policy_version": s.policy_version, "rollout_version": s.rollout_version,
                "next_gen": s.next_gen, "dropped": s.buffer.statistics().dropped,
                "rng": ckpt.rng_state(), "config": to_dict(cfg),
                "fingerprint": config_fingerprint(cfg), "history": list(history),
                "evals": list(evaluator.records) if evaluator is not None else [],
            }
            mode_state = rollout.checkpoint_state()
            if mode_state is not None:
                state[t.rollout_mode] = mode_state  # under the mode's name: "stream" as checkpoints always had

            def write() -> None:  # serialising, hashing, fsync: off the event loop
                if self._data_digests is None:  # the run read its data once: hash it once, not every save
                    self._data_digests = data_digests(cfg.data)
                state["data_digests"] = self._data_digests
                state["code_digests"] = self._code_digests
                torch.save(buffered, tmp / "buffer.pt")
                (tmp / "state.json").write_text(json.dumps(state))
                ckpt.commit(tmp, final)
                ckpt.prune(self._out, t.keep_checkpoints)

            await anyio.to_thread.run_sync(write)
            self.last_written = final
            self.last_save_t = time.perf_counter()  # trainer.checkpoint_every_s counts from here
        log.info("checkpoint.saved", step=step, path=str(final))
        return final

    async def restore(self, path: Path, g: Groups, s: LoopState) -> list[dict[str, Any]]:
        """Load `path` into the new attempt's groups `g` and fresh loop state `s`: weights, versions, data position,
        RNG, evaluations, and the buffered batches (re-homed on the training pool, put back in the buffer when the
        rollout loop starts). Returns the metrics history up to the checkpoint's step."""
        evaluator = self._evaluator()
        state = ckpt.read_state(path)
        loads = [g.policy.load(str(path / "policy"))]
        if g.critic is not None:
            loads.append(g.critic.load(str(path / "critic")))
        await asyncio.gather(*loads)
        step = int(state["step"])
        ckpt.set_rng_state(state["rng"])
        if evaluator is not None:
            evaluator.restore(state.get("evals", []), step)
        if step > 0:  # the rollout engines start at version 0: give them the restored weights
            await self._weights.restore(g, s, step)
        buffered = await anyio.to_thread.run_sync(lambda: torch.load(path / "buffer.pt", weights_only=True))
        s.resume_at(step, int(state["next_gen"]),
                    [restored_batch(b, g.advantage.echo(ckpt.plain_to_batch(b["batch"]))) for b in buffered])
        self._rollout().restore(state.get(self._config.trainer.rollout_mode), s)
        log.info("checkpoint.restored", step=step, path=str(path), buffered=len(buffered))
        return [h for h in state.get("history", []) if h["step"] < step]


def buffered_record(item: RolloutBatch, td: Any) -> dict[str, Any]:
    """The ``buffer.pt`` entry of a buffered batch whose generated rows and scores are `td`: everything
    :func:`restored_batch` needs to put it back, its ``sampling/*`` metrics included."""
    return {"step": item.step, "version": item.version, "reward_mean": item.reward_mean, "gen_time": item.gen_time,
            "metrics": dict(item.metrics), "batch": ckpt.batch_to_plain(td)}


def restored_batch(record: dict[str, Any], batch: Any) -> RolloutBatch:
    """The buffered batch of a ``buffer.pt`` entry (:func:`buffered_record`), its data now `batch` (a
    future of the rows re-homed on the training pool, or the rows); entries written before the metrics
    were kept restore with none."""
    return RolloutBatch(step=record["step"], version=record["version"], batch=batch, scores=batch.select("scores"),
                        reward_mean=record["reward_mean"], gen_time=record["gen_time"],
                        metrics=dict(record.get("metrics", {})))


def _check_data(path: Path, state: dict[str, Any], cfg: Any) -> None:
    """Refuse a resume whose data files' contents differ from those the checkpoint was trained on
    (``data_digests`` in its state; a checkpoint without it is not checked)."""
    saved = state.get("data_digests")
    if not isinstance(saved, dict):
        return
    now = data_digests(cfg.data)
    for name in sorted(saved):
        if now.get(name) != saved[name]:
            key, _, file = name.partition(":")
            raise ckpt.CheckpointError(
                f"{key}: {file!r} changed since checkpoint {str(path)!r} was written (content digest "
                f"{saved[name]} then, {now.get(name, 'missing')} now), so the resumed run would continue at the same "
                "data position on different data; put the original file back, or start a new run in a new "
                "trainer.output_dir (without --resume)")


def _fresh_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def checkpoint_due(trainer: Any, step: int, *, now: float, last: float) -> bool:
    """True when a checkpoint is due after step `step` (0-based, just finished) of a run with
    `trainer` (a ``TrainerConfig``): ``checkpoint_every`` divides ``step + 1``, or at least
    ``checkpoint_every_s`` seconds passed between `last` (the previous checkpoint, or the start of
    the run) and `now` (same clock). Never after the last step: the end checkpoint
    (``checkpoint_at_end``) covers it."""
    if step + 1 >= trainer.steps:
        return False
    if trainer.checkpoint_every and (step + 1) % trainer.checkpoint_every == 0:
        return True
    every_s = trainer.checkpoint_every_s
    return every_s is not None and now - last >= every_s
