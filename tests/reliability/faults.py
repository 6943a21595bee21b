"""Worker subclasses that inject one fault at a chosen point (imported by the Ray workers).

A :class:`Fault` fires once across every process and restart of a run: the first worker
to reach its trigger creates ``<dir>/fired`` atomically, writes its pid to ``<dir>/pid`` and
then hangs (``hang``) or raises (``raise``). A fault with ``after`` fires only once that other
fault has fired, and only in another process (the replacement of the one it killed). A test waits for the pid file and SIGKILLs
that process (a death at exactly that point) or leaves it hanging (a deadline must fire).
Until the trigger, the subclasses behave exactly like the real workers, so a run that
recovers must end with the same weights as a fault-free run.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from asyncrl.roles import PolicyWorker, RewardWorker, RolloutWorker
from asyncrl.roles.scoring.reward import RewardInput, register_reward_fn


@dataclass(frozen=True)
class Fault:
    """Where to fire: the `call`-th (1-based) call of hook `point` in one worker process."""

    dir: str
    point: Literal["generate", "load_weights", "update"]
    call: int = 1
    action: Literal["hang", "raise"] = "hang"
    after: str | None = None
    """The ``dir`` of a fault that must have fired first, in another process."""

    def fire(self) -> bool:
        """Claim the fault (True once per run) and publish this process's pid."""
        if self.after is not None:
            first = Path(self.after) / "pid"
            if not first.exists() or first.read_text() == str(os.getpid()):
                return False
        try:
            fd = os.open(os.path.join(self.dir, "fired"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.close(fd)
        tmp = os.path.join(self.dir, f"pid.tmp-{os.getpid()}")
        Path(tmp).write_text(str(os.getpid()))
        os.rename(tmp, os.path.join(self.dir, "pid"))
        return True


class InjectedFault(RuntimeError):
    """Raised by a fault whose action is ``raise``."""


class _Counter:
    def __init__(self, fault: Fault | tuple[Fault, ...] | None) -> None:
        self.faults = fault if isinstance(fault, tuple) else (fault,) if fault is not None else ()
        self.calls: dict[str, int] = {}

    def hit(self, point: str) -> bool:
        if not any(f.point == point for f in self.faults):
            return False
        self.calls[point] = n = self.calls.get(point, 0) + 1
        for f in self.faults:
            if f.point == point and n == f.call and f.fire():
                if f.action == "raise":
                    raise InjectedFault(f"injected fault at {point} call {n}")
                return True
        return False


class FaultyRollout(RolloutWorker):
    """A rollout worker that hangs inside generation (``generate``) or inside loading new
    weights (``load_weights``) when its fault fires."""

    def __init__(self, *args: Any, fault: Fault | tuple[Fault, ...] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fault = _Counter(fault)

    async def _run_job(self, job: Any) -> None:
        if self._fault.hit("generate"):
            await asyncio.Event().wait()  # mid-generation until killed (or cancelled by a deadline)
        await super()._run_job(job)

    async def _engine_load(self, state: Any) -> None:
        if self._fault.hit("load_weights"):
            await asyncio.Event().wait()
        await super()._engine_load(state)


class BeforeStepEngine:
    """Wraps a policy's training engine: `before()` runs in its gradient clipping, the point between backward and the
    optimizer step of each update (on the worker's thread: a plain ``def`` method, so only killing the process
    interrupts what `before` does there)."""

    def __init__(self, engine: Any, before: Any) -> None:
        self._engine, self._before = engine, before

    def clip_grad_norm(self, max_norm: Any) -> float:
        self._before()
        return self._engine.clip_grad_norm(max_norm)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _hang_when_hit(counter: _Counter) -> None:
    if counter.hit("update"):
        while True:  # only killing the process ends it
            time.sleep(0.05)


class FaultyPolicy(PolicyWorker):
    """A policy worker that hangs in the middle of ``update`` (gradients computed, optimizer
    step not taken) when its fault fires."""

    def __init__(self, *args: Any, fault: Fault | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        counter = _Counter(fault)
        self.engine = BeforeStepEngine(self.engine, lambda: _hang_when_hit(counter))


@register_reward_fn("raises_on_third_batch", replace=True)
def raises_on_third_batch(x: RewardInput) -> list[float]:
    """A buggy reward function: fine for two batches, then a ZeroDivisionError."""
    _calls[0] += 1
    if _calls[0] >= 3:
        return [1 / 0]
    return [0.0] * len(x.responses)


_calls = [0]


class BuggyReward(RewardWorker):
    """The reward worker, imported from this module so the buggy function is registered."""


class DelayedRollout(RolloutWorker):
    """A rollout worker that waits a random time (uniform in [0, max_delay], seeded) before each
    generation: the timing changes, what is computed does not."""

    def __init__(self, *args: Any, delay_seed: int = 0, max_delay: float = 0.2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rng, self._max_delay = random.Random(delay_seed), max_delay

    async def _run_job(self, job: Any) -> None:
        await asyncio.sleep(self._rng.uniform(0, self._max_delay))
        await super()._run_job(job)


class DelayedPolicy(PolicyWorker):
    """A policy worker whose update waits a random time (seeded) between backward and step."""

    def __init__(self, *args: Any, delay_seed: int = 0, max_delay: float = 0.2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rng = random.Random(delay_seed)
        self.engine = BeforeStepEngine(self.engine, lambda: time.sleep(rng.uniform(0, max_delay)))
