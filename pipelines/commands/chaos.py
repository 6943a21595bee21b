"""Chaos in the cluster twin: seeded fault schedules against the real controller, and what must hold after them.

::

    plan(kind, seed, replicas, ...)  ─► ChaosPlan: which replicas/processes, at which step and delay
    run_chaos(config, plan)          ─► the real GRPOTrainer.fit() on the twin, a driver task firing the faults
                                        (ChaosRollout / ChaosPolicy: the twin's workers plus the faults' hooks)
    check_chaos(trainer, history)    ─► completed? ledger (0 lost, 0 trained twice, every token in the bound)?
                                        no call longer than 2x its deadline?

The faults (``KINDS``) and which are real:

* ``kill`` -- 10 % of the replicas die at random times. **Simulated**: a replica shares its process with others
  (``twin.replicas_per_process``), so its death is its engine's: the requests in flight and every later call of
  that rank fail with :class:`~asyncrl.roles.errors.ReplicaLostError`, which the supervisor takes for that rank's
  death; the process and its other replicas live on.
* ``slow`` -- one replica 10x slower than the rest (**simulated**: its engine's costs times ten, from the start).
* ``node`` -- a node of 8 replicas lost (**real**: SIGKILL of the process hosting them; run it with
  ``replicas_per_process=8``). The rollout group has the ``"process"`` restart policy: that process alone is
  replaced, the other processes' replicas serve on.
* ``preempt`` -- a preemption wave (**real**: SIGTERM to a quarter of the rollout processes, at least two, within
  one step; a rollout worker answers a SIGTERM with its preemption notice, docs/nodes.md).
* ``train`` -- a training rank lost (**real**: SIGKILL of the process hosting it; the run restarts from its newest
  checkpoint).

A fault lands at a seeded step ``s`` (after ``s`` steps are done) plus a seeded fraction of the last step's
duration, so every schedule lands inside the run whatever its speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl import Dispatch, register
from asyncrl.roles import ReplicaLostError, RolloutWorker
from asyncrl.pipelines.twin.workers import TwinPolicy
from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.pipelines.loop.deadlines import unwrap

__all__ = ["KINDS", "ChaosEvent", "ChaosPlan", "ChaosResult", "ChaosRollout", "ChaosPolicy", "plan", "run_chaos",
           "check_chaos", "deadline_overruns"]

KINDS = ("kill", "slow", "node", "preempt", "train")
"""The fault kinds of a chaos table (module docstring)."""

REAL = {"kill": False, "slow": False, "node": True, "preempt": True, "train": True}
"""Which kinds act on real processes (SIGKILL, SIGTERM); the others are simulated inside a shared process."""

RETRIES = 240
"""Tries (0.5 s apart) to reach a fault's target while its pool is being replaced."""

ENGINE_START_S = 60.0
"""Seconds (simulated, before the time scale) a replaced replica's new engine takes to start before it loads its
weights: an assumption (a vLLM engine's start -- process, CUDA context, graph capture -- is tens of seconds; the
profiles carry no such number), stated with every per-replica replacement figure."""

SLOW_FACTOR = 10.0
"""How much slower the ``slow`` fault's replica is."""


@dataclass(frozen=True)
class ChaosEvent:
    """One fault: after `step` steps are done, `delay` of the last step's duration later, act on `target` (a
    replica rank for ``kill``/``slow``, a rollout process index for ``node``/``preempt``, a training rank for
    ``train``)."""

    kind: str
    step: int
    delay: float
    target: int


@dataclass(frozen=True)
class ChaosPlan:
    """A seeded fault schedule for one run (:func:`plan`)."""

    kind: str
    seed: int
    events: tuple[ChaosEvent, ...]

    @property
    def real(self) -> bool:
        """Whether its faults act on real processes."""
        return REAL.get(self.kind, False)


def plan(kind: str, seed: int, *, replicas: int, replicas_per_process: int, train_ranks: int, steps: int,
         node: int = 8) -> ChaosPlan:
    """The schedule of fault `kind` for `seed`: targets and times drawn from ``Random(f"{kind}:{seed}")``; faults
    land after steps ``1 .. steps - 3`` (the run still has steps to recover in)."""
    if kind not in KINDS and kind != "none":
        raise ValueError(f"unknown chaos kind {kind!r}; use one of {', '.join(KINDS)} (or none)")
    if steps < 4:
        raise ValueError(f"a chaos run needs at least 4 steps (faults land after steps 1 .. steps - 3), got {steps}")
    rng = random.Random(f"{kind}:{seed}")
    processes = -(-replicas // replicas_per_process)

    def when() -> tuple[int, float]:
        return rng.randint(1, steps - 3), rng.random()

    events: list[ChaosEvent] = []
    if kind == "kill":
        for r in sorted(rng.sample(range(replicas), max(1, round(replicas / 10)))):
            events.append(ChaosEvent("kill", *when(), r))
    elif kind == "slow":
        events.append(ChaosEvent("slow", 0, 0.0, rng.randrange(replicas)))
    elif kind == "node":
        if replicas_per_process != node:
            raise ValueError(f"a lost node of {node} replicas needs twin.replicas_per_process={node}, got "
                             f"{replicas_per_process}")
        events.append(ChaosEvent("node", *when(), rng.randrange(processes)))
    elif kind == "preempt":  # the wave's signals land within half a second of each other
        wave = max(2, processes // 4)
        step, delay = when()
        for p in sorted(rng.sample(range(processes), min(wave, processes))):
            events.append(ChaosEvent("preempt", step, delay + rng.random() * 0.5, p))
    elif kind == "train":
        events.append(ChaosEvent("train", *when(), rng.randrange(train_ranks)))
    events.sort(key=lambda e: (e.step, e.delay))
    return ChaosPlan(kind, seed, tuple(events))


class ChaosRollout(RolloutWorker):
    """The twin's rollout worker with the simulated faults' hooks: :meth:`die` (a ``kill``) and :meth:`slow_down`
    (a ``slow``), and :meth:`pid` (the driver's way to the real processes)."""

    def __init__(self, *args: Any, engine_start_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dead = False
        self._engine_start_s = engine_start_s

    def _lost(self) -> ReplicaLostError:
        return ReplicaLostError(f"rollout replica {self.rank} died (simulated: the twin's chaos)")

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def pid(self) -> int:
        """This rank's process id (concurrent: not queued behind the weight loads of the ordered lane, so the
        driver notes the processes before a fault, however slow the loads)."""
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def die(self, ranks: list[int]) -> bool:
        """The ranks in `ranks` die: their requests in flight fail with ``ReplicaLostError``, as does every later
        call. Returns whether this rank died."""
        if self.rank not in ranks or self._dead:
            return False
        self._dead = True
        fail = getattr(self.engine, "fail_in_flight", None)
        if fail is not None:
            fail(self._lost())
        return True

    @register(Dispatch.ONE_TO_ALL)
    def slow_down(self, ranks: list[int], factor: float = SLOW_FACTOR) -> bool:
        """The ranks in `ranks` get an engine `factor` times slower (every cost of its cost model)."""
        if self.rank not in ranks:
            return False
        for name in ("step_s", "seq_s", "kv_s", "prefill_token_s", "prefill_s", "load_s"):
            if hasattr(self.engine, name):
                setattr(self.engine, name, getattr(self.engine, name) * factor)
        return True

    @register(Dispatch.ONE_TO_ALL)
    async def restart_engine(self) -> int:
        """``RolloutWorker.restart_engine`` after the time a new engine takes to start (``ENGINE_START_S`` times
        the time scale; the weights it then loads cost the profile's load time); the replica lives again."""
        await asyncio.sleep(self._engine_start_s)
        rank = super().restart_engine()
        self._dead = False
        return rank

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate(self, batch: Any, max_new_tokens: int | None = None, temperature: float | None = None,
                       seed: int | None = None) -> Any:
        """``RolloutWorker.generate``, failing once this replica died."""
        if self._dead:
            raise self._lost()
        return await super().generate(batch, max_new_tokens, temperature, seed)

    @register(Dispatch.DP_COMPUTE, concurrent=True, summary=("scores", "response_length"))
    async def generate_requests(self, batch: Any, max_new_tokens: int | None = None, temperature: float | None = None,
                                seed: int | None = None, resume: dict[str, dict[str, Any]] | None = None,
                                compute_reward: bool = False) -> Any:
        """``RolloutWorker.generate_requests``, failing once this replica died."""
        if self._dead:
            raise self._lost()
        return await super().generate_requests(batch, max_new_tokens, temperature, seed, resume, compute_reward)

    async def _engine_load(self, state: Any) -> None:
        if self._dead:
            raise self._lost()
        await super()._engine_load(state)


class ChaosPolicy(TwinPolicy):
    """The twin's training rank with :meth:`pid` (the driver kills its process for a ``train`` fault); it builds its
    stand-in weights when it starts, as a real policy builds its model (not in its first export, which would stall
    a step)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stand_in()

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        """This rank's process id."""
        return os.getpid()


@dataclass
class ChaosResult:
    """What one chaos run did and whether what must hold held."""

    plan: ChaosPlan
    completed: bool
    error: str | None
    steps: int
    wall_s: float
    fired: list[dict[str, Any]] = field(default_factory=list)
    """One entry per fault fired: kind, target, the time it fired (seconds since fit started), pids."""
    restarts: list[dict[str, Any]] = field(default_factory=list)
    """The trainer's recoveries (``trainer.restarts``)."""
    resizes: int = 0
    """Rollout-pool resizes (preemptions handed over)."""
    ledger: Any = None
    """The :class:`~asyncrl.pipelines.journaling.ledger.LedgerReport`."""
    overruns: list[str] = field(default_factory=list)
    """Calls that waited longer than twice their deadline."""
    max_wait_ratio: float = 0.0
    """The longest call over its deadline (a ratio; must stay <= 2)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The run's per-step metrics."""
    pids: tuple[list[int], list[int]] = ([], [])
    """Each rollout rank's process id when the run started and when it ended (a rank whose process was replaced
    has a new one; the others keep theirs; a replacement under way at the end is awaited)."""
    process_starts: list[float] = field(default_factory=list)
    """Seconds each replaced rollout process took to start (``WorkerGroup.replaced``: kill, placement, process,
    constructors; a replacement the run outlasted or that finished after it)."""

    @property
    def ok(self) -> bool:
        """Every must-hold held."""
        return self.completed and self.ledger is not None and self.ledger.ok and not self.overruns


async def _fire(trainer: Any, ev: ChaosEvent, replicas_per_process: int, t0: float) -> dict[str, Any]:
    g = trainer.groups
    rec: dict[str, Any] = {"kind": ev.kind, "target": ev.target, "at_s": round(time.perf_counter() - t0, 3),
                           "after_step": len(trainer.history)}
    if ev.kind == "kill":
        rec["died"] = sum(bool(x) for x in await g.rollout.die([ev.target]))
    elif ev.kind == "slow":
        rec["slowed"] = sum(bool(x) for x in await g.rollout.slow_down([ev.target]))
    elif ev.kind in ("node", "preempt"):
        pids = await g.rollout.pid()
        k = replicas_per_process
        procs = sorted({pids[r] for r in range(ev.target * k, min(len(pids), (ev.target + 1) * k))})
        sig = signal.SIGKILL if ev.kind == "node" else signal.SIGTERM
        for pid in procs:
            os.kill(pid, sig)
        rec["pids"] = procs
    elif ev.kind == "train":
        pids = await g.policy.pid()
        pid = pids[ev.target % len(pids)]
        os.kill(pid, signal.SIGKILL)
        rec["pids"] = [pid]
    return rec


async def _drive(trainer: Any, chaos: ChaosPlan, replicas_per_process: int, fired: list[dict[str, Any]]) -> None:
    """Fire `chaos`'s events as the run reaches them (see :class:`ChaosEvent`). A wave (the events of one step)
    takes its targets' processes as they are at its first event: a recovery its first signal starts does not move
    the rest of the wave onto the new processes."""
    t0 = time.perf_counter()
    wave_pids: dict[int, list[int]] = {}
    wave_t: dict[int, float] = {}
    for ev in chaos.events:
        while len(trainer.history) < ev.step or trainer.groups is None:
            await asyncio.sleep(0.02)
        h = trainer.history
        last = float(h[-1]["time/step"]) if h else 0.0
        if ev.kind == "preempt":
            start = min(e.delay for e in chaos.events if e.kind == "preempt" and e.step == ev.step)
            if ev.step not in wave_pids:
                wave_pids[ev.step] = list(await trainer.groups.rollout.pid())
                await asyncio.sleep(start * last)
                wave_t[ev.step] = time.perf_counter()
            pids = wave_pids[ev.step]
            # the wave's later signals: their offsets from its first, in seconds
            await asyncio.sleep(max(0.0, wave_t[ev.step] + (ev.delay - start) - time.perf_counter()))
            k = replicas_per_process
            procs = sorted({pids[r] for r in range(ev.target * k, min(len(pids), (ev.target + 1) * k))})
            for pid in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            fired.append({"kind": "preempt", "target": ev.target, "at_s": round(time.perf_counter() - t0, 3),
                          "after_step": len(trainer.history), "pids": procs})
            continue
        await asyncio.sleep(ev.delay * last)
        error = None
        for _ in range(RETRIES):  # a pool being replaced (closed, not yet new) takes no call: try again
            try:
                fired.append(await _fire(trainer, ev, replicas_per_process, t0))
                error = None
                break
            except Exception as e:  # noqa: BLE001 - a target gone meanwhile: say so, go on
                error = f"{type(e).__name__}: {e}"[:200]
                await asyncio.sleep(0.5)
        if error is not None:
            fired.append({"kind": ev.kind, "target": ev.target, "error": error})


def deadline_overruns(trainer: Any) -> tuple[list[str], float]:
    """Group calls of `trainer`'s last run that lasted longer than twice their deadline (issue to done, as the
    tracer saw them), and the largest duration-to-deadline ratio. Deadlines: ``trainer.rollout_timeout_s`` on the
    rollout pool's generate and score calls, ``trainer.stage_timeout_s`` (when set) on every call."""
    t = trainer.config.trainer
    rollout_stages = {"generate", "score"}
    out, worst = [], 0.0
    for sp in trainer.tracer.spans:
        if sp.end is None or sp.start is None:
            continue
        limits = [x for x in (t.stage_timeout_s, t.rollout_timeout_s if sp.name in rollout_stages else None)
                  if x is not None]
        if not limits or sp.name in ("train_step", "weight_sync", "checkpoint", "evaluate"):
            continue  # controller spans: they wait for calls that carry the deadlines
        limit = min(limits)
        ratio = (sp.end - sp.start) / limit
        worst = max(worst, ratio)
        if ratio > 2.0:
            out.append(f"{sp.name} on {sp.track} ({dict(sp.args)}): {sp.end - sp.start:.2f} s, deadline {limit:g} s")
    return out, worst


async def _pids_at_end(rollout: Any) -> tuple[list[int], list[float]]:
    """Each rollout rank's process id once the run ended, and the seconds each replaced process took to start; a
    process replacement still under way (the run may end before it, the others' replicas took its groups) is
    awaited first."""
    group = unwrap(rollout)
    for p in sorted({group.process_ranks(r)[0] for r in group.lost_ranks}):
        await group.replace_process(p)
    return list(await rollout.pid()), [s for _, s in group.replaced]


def _worker_override(name: str, given: tuple[type, dict[str, Any]] | None,
                     base: type) -> tuple[type, dict[str, Any]]:
    """`given` (``(a subclass of base, its keyword arguments)``, a test's hooks) or ``(base, {})``."""
    cls, kwargs = given if given is not None else (base, {})
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{name} must be (a {base.__name__} subclass, kwargs), got {given!r}")
    return cls, kwargs


async def run_chaos(cfg: Any, chaos: ChaosPlan, *,
                    rollout: tuple[type, dict[str, Any]] | None = None,
                    policy: tuple[type, dict[str, Any]] | None = None) -> ChaosResult:
    """Run `cfg` (a twin config; ``trainer.output_dir`` is the run's) under `chaos` and check it
    (:func:`check_chaos`). `rollout`: ``(a ChaosRollout subclass, its extra keyword arguments)`` in place of
    :class:`ChaosRollout`, `policy`: ``(a ChaosPolicy subclass, its keyword arguments)`` in place of
    :class:`ChaosPolicy` (a test's hooks)."""
    cls, extra = _worker_override("rollout", rollout, ChaosRollout)
    policy_cls, policy_kw = _worker_override("policy", policy, ChaosPolicy)
    overrides = {"rollout": (cls, {"engine_start_s": ENGINE_START_S * cfg.twin.time_scale, **extra}),
                 "policy": (policy_cls, dict(policy_kw))}
    trainer = GRPOTrainer(cfg, worker_overrides=overrides)
    fired: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    error: str | None = None
    t0 = time.perf_counter()
    pids: tuple[list[int], list[int]] = ([], [])
    starts: list[float] = []
    driver: asyncio.Task[None] | None = None
    driven: Any = None
    async with trainer:
        try:
            # the rollout processes as the run starts (its groups are up once the trainer is entered), noted before
            # it does: a fault the run's own workers bring about (a test's hooks) may come before an answer asked
            # for once the run had started
            pids[0].extend(await trainer.groups.rollout.pid())
            driver = asyncio.create_task(_drive(trainer, chaos, cfg.twin.replicas_per_process, fired))
            history = await trainer.fit()
            end, starts = await _pids_at_end(trainer.groups.rollout)
            pids[1].extend(end)
        except Exception as e:  # noqa: BLE001 - a run that fails is a chaos result, not a crash of the table
            error = f"{type(e).__name__}: {e}"[:300]
            Path(cfg.trainer.output_dir, "chaos_error.log").write_text(traceback.format_exc())
        finally:
            if driver is not None:
                driver.cancel()
                [driven] = await asyncio.gather(driver, return_exceptions=True)
    if isinstance(driven, Exception) and error is None:  # (its faults did not all fire: not a run that held)
        error = f"the chaos driver failed: {type(driven).__name__}: {driven}"[:300]
    res = check_chaos(trainer, history, chaos, fired=fired, error=error, wall_s=time.perf_counter() - t0)
    res.pids, res.process_starts = pids, starts
    return res


def check_chaos(trainer: Any, history: list[dict[str, Any]], chaos: ChaosPlan, *, fired: list[dict[str, Any]],
                error: str | None, wall_s: float) -> ChaosResult:
    """What must hold after a chaos run: it completed every step, its ledger holds, no call overran twice its
    deadline."""
    steps = trainer.config.trainer.steps
    completed = error is None and [h["step"] for h in history] == list(range(steps))
    out = Path(trainer.config.trainer.output_dir)
    ledger = check_ledger(out) if (out / "journal.jsonl").is_file() else None
    overruns, worst = deadline_overruns(trainer)
    resizes = len(getattr(getattr(trainer.rollout, "scaler", None), "resizes", []) or [])
    return ChaosResult(chaos, completed, error, len(history), wall_s, fired, list(trainer.restarts), resizes,
                       ledger, overruns, worst, list(history))
