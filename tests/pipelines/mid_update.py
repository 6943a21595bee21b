"""A rollout worker on which a weight update lands in the middle of a generation every time, whatever the machine's
timing (imported by the Ray workers): no sleeps that make it likely, a hold that makes it happen.

The rows of one chosen prompt group, once each decoded a round (``rollout.chunk_tokens`` tokens), wait -- decoding
nothing, in a round of their own that the round log records as it ran -- until the next weight update pauses the
engine (partial rollout), or a hand-over or the close stops the round; they then decode the rest under the new
version. The other groups decode as usual, so training goes on. The hold begins by writing a marker file, and
:class:`WaitingPolicy` makes the update that publishes version 2 wait for that marker, so the held rows started
under version 1 and continue under version 2, every time. The group to hold: ``hold_group(cfg)``, the first one
admitted at version 1 (with ``max_staleness=k`` and ``B`` groups a step, group ``(k + 1) * B``); no step has to
train it before version 2 exists, so the hold never stalls the run. A test of the hold's effect asserts it (a row
spanning two versions), so a hold that never ended in an update fails the test instead of passing it.

Optionally the `n`-th weight load of the process (version `n` in a run's first rollout pool) writes ``loading`` in
a directory and then waits for ``go`` there, so that a test acts while that version loads (a stop, a kill)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from asyncrl import Dispatch, register
from asyncrl.pipelines.loop.loop_state import batch_seed
from asyncrl.roles import PolicyWorker
from asyncrl.roles.engines.batcher import RequestBatcher

from tests.reliability.faults import BeforeStepEngine, FaultyRollout

LIMIT_S = 120.0
"""Longest a hold or a gated load waits before it gives up (the test then fails on what it asserts)."""


def hold_group(cfg: Any) -> int:
    """The prompt group to hold in a run of `cfg`: the first one admitted at weight version 1."""
    return (cfg.trainer.max_staleness + 1) * cfg.prompts_per_step


def mid_update_workers(cfg: Any, held: Path, **rollout: Any) -> dict[str, Any]:
    """Worker overrides for a run of `cfg` in which version 2 reaches group ``hold_group(cfg)`` mid-generation
    (`held`: the marker file; `rollout`: further :class:`MidUpdateRollout` arguments)."""
    return {"rollout": (MidUpdateRollout, {"hold_seed": batch_seed(cfg, hold_group(cfg)), "held": str(held),
                                           **rollout}),
            "policy": (WaitingPolicy, {"held": str(held)})}


class MidUpdateBatcher(RequestBatcher):
    """A request batcher that holds the rows of the prompt group with sampling seed `hold_seed` (see the module),
    once a run, creating the file `held` as the hold begins."""

    def __init__(self, engine: Any, *, hold_seed: int, held: str, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self._hold_seed, self._held = str(hold_seed), held
        self.released = False
        self._at: int | None = None

    def _claim(self, version: int) -> bool:
        """Whether this process holds the group (under weight `version`, the one its rows started with): it created
        the marker file `held`, or does now; False when a process of this run already did (one hold a run: a
        replacement worker regenerating the group decodes it freely)."""
        if self._at is None:
            try:
                os.close(os.open(self._held, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                self.released = True
                return False
            self._at = version
        return True

    def _segment(self, batch: list[Any], rnd: Any, version: int, steps: int | None = None) -> Any:
        if rnd is None and not self.released:
            held = [r for r in batch if r.key.split(":")[0] == self._hold_seed and len(r.tokens) >= self.chunk_tokens]
            if held and self._claim(version):
                if version > self._at:  # the update came (while the held rows sat out another round): decode on
                    self.released = True
                elif len(held) == len(batch):  # a round of the held rows only: no decode step
                    rnd = self._begin(batch)
                    rnd.done[:] = [True] * len(batch)  # (their finish stays None: they go on in a later round)
                    for _ in range(int(LIMIT_S / 0.01)):  # (the worker thread: an update's pause ends it)
                        if self._interrupt.wait(0.01) or self._halt.is_set() or self._abort.is_set():
                            break
                    self.released = True
                    return rnd, True
                else:
                    batch = [r for r in batch if r not in held]  # the others decode without them
        return super()._segment(batch, rnd, version, steps)


class MidUpdateRollout(FaultyRollout):
    """A (faulty, when given a fault) rollout worker over a :class:`MidUpdateBatcher` holding group `hold_seed`
    (marker file `held`); with `calls`, each group call appends its group, seed and process to that file; with
    `gate` (a directory), the `gate_load`-th weight load of this process writes ``gate/loading`` and waits for
    ``gate/go``."""

    def __init__(self, *args: Any, hold_seed: int, held: str, calls: str | None = None, gate: str | None = None,
                 gate_load: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hold_seed, self._held, self._calls = hold_seed, held, calls
        self._load_gate, self._gate_load, self._loads = gate, gate_load, 0

    def _request_engine(self) -> Any:
        if self.requests._batcher is None:
            self.requests._batcher = MidUpdateBatcher(self.engine, hold_seed=self._hold_seed, held=self._held, max_batch_size=64,
                                             chunk_tokens=self.config.chunk_tokens, version_fn=lambda: self.weights.version,
                                             partial_rollout=self.config.partial_rollout,
                                             record_rounds=self.config.record_rounds)
        return super()._request_engine()

    @register(Dispatch.DP_COMPUTE, concurrent=True, summary=("scores", "response_length"))
    async def generate_requests(self, batch: Any, max_new_tokens: Any = None, temperature: Any = None,
                                seed: Any = None, resume: Any = None, compute_reward: bool = False) -> Any:
        if self._calls is not None:
            with open(self._calls, "a") as f:
                f.write(json.dumps({"group": int(batch["uid"][0]), "seed": seed, "pid": os.getpid()}) + "\n")
        return await super().generate_requests(batch, max_new_tokens, temperature, seed, resume, compute_reward)

    async def _engine_load(self, state: Any) -> None:
        self._loads += 1
        if self._load_gate is not None and self._loads == self._gate_load:
            Path(self._load_gate, "loading").write_text(str(os.getpid()))
            async with asyncio.timeout(LIMIT_S):
                while not Path(self._load_gate, "go").exists():
                    await asyncio.sleep(0.02)
        await super()._engine_load(state)


def _wait_for(path: str) -> None:
    """Until the file `path` exists (polled; a ``TimeoutError`` naming it after ``LIMIT_S``)."""
    for _ in range(int(LIMIT_S / 0.02)):
        if os.path.exists(path):
            return
        time.sleep(0.02)
    raise TimeoutError(f"{path} did not appear within {LIMIT_S:g} s")


class WaitingPolicy(PolicyWorker):
    """A policy worker whose second update (the one that publishes version 2) waits, before its optimizer step,
    until the file `held` exists: the rollout's held group started under version 1 before version 2 exists."""

    def __init__(self, *args: Any, held: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        updates = [0]

        def before_step() -> None:
            updates[0] += 1
            if updates[0] == 2:
                _wait_for(held)

        self.engine = BeforeStepEngine(self.engine, before_step)
