"""The staleness rule's own ceiling: the cluster twin's workload with a controller that costs nothing.

``benchmarks/cluster_twin.py`` runs the real controller on Ray against simulated GPU workers. With the profile's
log-normal response lengths it trains 0.50 of N x one replica's samples/s at 64 replicas (docs/scale.md). Is
the limit the controller, or the rule it keeps -- every trained token at most ``max_staleness`` versions old,
every admitted group trained exactly once, ``B`` groups a step (``pipelines/rollout/admission.py``)?

This runs the same workload in one process on a **virtual clock**: the real :class:`Admission` (the rule,
unchanged), N real :class:`SimEngine` s (the twin's engine, unchanged, with the profile's costs through the same
``engine_kwargs``), each prompt group routed to the replica with the fewest groups in flight, and a trainer
that waits what the twin's ``TwinPolicy`` sleeps (``train_costs``: the old log-probs' forward, then forward,
backward and the optimizer on each rank's share, then the export), after which every replica loads the version
inside a ``keep`` pause (partial rollout, as the twin). No Ray, no messages, no CPU: every event happens at the
simulated time it is due, so the controller costs nothing and nothing is late. Left out: reward scoring,
``balance_batch`` (every rank gets an equal share of the tokens here) and evaluation.

Its samples/s is what the rule allows on this workload with a free controller: an upper bound for any
controller that keeps the rule. The twin's efficiency over this one's is the share the real controller keeps.

    python benchmarks/admission_ceiling.py --replicas 1,64,256                 # the twin's tail, k = 2
    python benchmarks/admission_ceiling.py --replicas 1,64 --staleness 1,2,4,8
    python benchmarks/admission_ceiling.py --replicas 1,64 --fixed-lengths
    python benchmarks/admission_ceiling.py --replicas 1,64,256 --bound admitted   # AReaL's bound: no tail wait
    python benchmarks/admission_ceiling.py --quick                              # the mechanism only, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import selectors
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import run_header, write_result  # noqa: E402

from asyncrl.pipelines.rollout.admission import BOUNDS, Admission  # noqa: E402
from asyncrl.pipelines.twin.profile import (  # noqa: E402
    Profile, TwinConfig, engine_kwargs, load_profile, max_new_ids, tokens_per_id)
from asyncrl.pipelines.twin.workers import train_costs  # noqa: E402
from asyncrl.roles.engines import sim  # noqa: E402
from asyncrl.roles.engines.base import SamplingParams  # noqa: E402

RESULTS = str(Path(__file__).resolve().parent / "results" / "admission_ceiling.md")


class _Clock:
    """The virtual clock: what the loop and the simulated engines read as the time."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:  # SimEngine.load_weights (the synchronous load; unused here)
        self.now += seconds


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks: a wait for the next timer moves the virtual clock to it instead."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("virtual clock: nothing is scheduled and nothing can wake the loop (a deadlock)")
        if timeout > 0:
            self.clock.now += timeout
        return super().select(0)


def run_virtual(coro: Any) -> Any:
    """Run `coro` on an event loop whose clock (and the simulated engines') is virtual."""
    clock = _Clock()
    loop = asyncio.SelectorEventLoop(_VirtualSelector(clock))
    loop.time = clock.monotonic  # type: ignore[method-assign]
    real_time, sim.time = sim.time, clock  # type: ignore[assignment]
    try:
        return loop.run_until_complete(coro)
    finally:
        sim.time = real_time  # type: ignore[assignment]
        loop.close()


@dataclass
class Workload:
    """One run's settings, as ``cluster_twin.py`` sets them for N replicas."""

    profile: Profile
    replicas: int
    staleness: int
    group: int = 8
    groups_per_replica: int = 4
    replicas_per_rank: int = 1
    steps: int = 6
    warmup: int = 2
    time_scale: float = 1.0
    seed: int = 0
    """Another draw of every response length per value."""
    bound: str = "trained"
    """``trainer.stream.bound``: ``trained`` (the twin's default) or ``admitted`` (AReaL's bound on admission)."""

    @property
    def groups_per_step(self) -> int:
        return self.groups_per_replica * self.replicas

    @property
    def ranks(self) -> int:
        return max(1, self.replicas // self.replicas_per_rank)


@dataclass
class Result:
    """What one run measured, steady state (the steps after the warm-up)."""

    replicas: int
    staleness: int
    samples_s: float
    step_s: float
    idle: float
    """The trainer's idle fraction: time waiting for a step's groups / step time."""
    staleness_hist: list[float] = field(default_factory=list)
    """Share of the trained response ids 0..k versions old (each id's version: the weights its last token was
    decoded with, as the twin counts)."""


async def simulate(w: Workload) -> Result:
    """One run of `w` on the virtual clock (module docstring)."""
    tw = TwinConfig(time_scale=w.time_scale)
    p = w.profile
    engines = [sim.SimEngine(**engine_kwargs(p, tw)) for _ in range(w.replicas)]
    params = SamplingParams(max_new_tokens=max_new_ids(p, tw))
    per_id = tokens_per_id(p, tw)
    B, k = w.groups_per_step, w.staleness
    adm = Admission(groups_per_step=B, max_staleness=k, max_in_flight=(k + 1) * B, bound=w.bound)
    total = w.steps * B
    version = 0  # the version every replica holds (what admission reads, as the controller's rollout_version)
    exported = 0
    changed = asyncio.Event()
    in_flight = [0] * w.replicas
    tokens: dict[int, float] = {}
    versions: dict[int, list[int]] = {}  # every response id's weight version, per group
    tasks: set[asyncio.Task[Any]] = set()

    def poke() -> None:
        changed.set()

    async def wait_change() -> None:
        await changed.wait()
        changed.clear()

    async def run_group(g: int, r: int) -> None:
        e = engines[r]
        prompt = [g % 255, g // 255]  # distinct per group (a prompt's own median, with prompt_sigma, hashes it)
        seed = 1000 * g + 10_000_019 * w.seed
        rows = await asyncio.gather(*[e.agenerate_request(prompt, replace(params, seed=seed + i),
                                                          version_fn=lambda: version) for i in range(w.group)])
        tokens[g] = sum(p.lengths.prompt_tokens + len(c.response_ids) * per_id for c in rows)
        versions[g] = [v for c in rows for v in c.versions]
        in_flight[r] -= 1
        adm.finish(g)
        poke()

    async def sampler() -> None:
        g = 0
        while g < total:
            while g < total and adm.can_admit(version):
                r = min(range(w.replicas), key=in_flight.__getitem__)
                adm.admit(g, version)
                in_flight[r] += 1
                t = asyncio.create_task(run_group(g, r))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                g += 1
            await wait_change()

    async def weights() -> None:
        nonlocal version
        while True:
            while exported <= version:
                await wait_change()
            v = exported

            async def load(e: sim.SimEngine) -> None:
                async with e.apaused("keep"):
                    await e.aload_weights([])

            await asyncio.gather(*[load(e) for e in engines])
            version = v
            poke()

    ends: list[float] = []
    waits: list[float] = []
    stale: list[int] = [0] * (k + 1)
    loop = asyncio.get_running_loop()
    background = [asyncio.create_task(sampler()), asyncio.create_task(weights())]
    for step in range(w.steps):
        t0 = loop.time()
        while (got := adm.take()) is None:
            await wait_change()
        waits.append(loop.time() - t0)
        chosen, _dropped = got
        poke()  # the take freed admission slots
        if step > w.warmup:
            for g in chosen:
                for v in versions[g]:
                    stale.extend([0] * (step - v + 1 - len(stale)))  # past k only with bound=admitted
                    stale[step - v] += 1
        share = sum(tokens[g] for g in chosen) / w.ranks
        c = train_costs(p, share, w.ranks)
        await asyncio.sleep((2 * c["forward"] + c["backward"] + c["optimizer"]) * w.time_scale)
        await asyncio.sleep(p.model.weight_gb / p.training.export_gb_per_s * w.time_scale)
        exported = step + 1
        poke()
        ends.append(loop.time())
    for t in background + list(tasks):
        t.cancel()
    await asyncio.gather(*background, *tasks, return_exceptions=True)
    for e in engines:
        e.close()
    steady = range(w.warmup + 1, w.steps)
    span = ends[-1] - ends[w.warmup]
    step_s = span / len(steady)
    n = sum(stale)
    return Result(w.replicas, k, len(steady) * B * w.group / span, step_s,
                  sum(waits[s] for s in steady) / span, [x / n for x in stale])


def pooled(runs: list[Result]) -> Result:
    """One result of several runs of a cell: every run's trained samples over all their time (samples/s), step
    time and idle time likewise, and the staleness histogram over every run's trained ids (weighted equally: the
    runs train as many ids, give or take the tail)."""
    spans = [1 / r.samples_s for r in runs]  # seconds per sample: every run trains as many samples
    idle = sum(r.idle * s for r, s in zip(runs, spans)) / sum(spans)
    hist = [statistics.fmean(h) for h in itertools.zip_longest(*(r.staleness_hist for r in runs), fillvalue=0.0)]
    return Result(runs[0].replicas, runs[0].staleness, len(runs) / sum(spans), statistics.fmean(r.step_s for r in runs),
                  idle, hist)


def fixed_lengths(p: Profile) -> Profile:
    """`p` with every response its median length (no tail), as ``cluster_twin.py --fixed-lengths``."""
    return replace(p, name=f"{p.name}_fixed_lengths", lengths=replace(p.lengths, sigma=0.0, prompt_sigma=0.0))


def main(argv: list[str] | None = None) -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--replicas", default="1,64", help="comma-separated replica counts, from 1")
    a.add_argument("--staleness", default="2", help="comma-separated max_staleness values")
    a.add_argument("--profile", default="qwen2_7b_h100_vllm")
    a.add_argument("--steps", type=int, default=33,
                   help="steps a run; the steady window (after --warmup + 1) should hold whole periods: under the rule "
                        "every (max_staleness + 1)-th step waits for the slowest group of one admission wave, so a "
                        "window of 30 steps holds whole periods for max_staleness 1, 2 and 4")
    a.add_argument("--baseline-steps", type=int, default=33,
                   help="steps of the N = 1 runs: one replica trains 32 samples a step, so its rate needs many steps "
                        "(and --seeds) before a long response's weight in it settles")
    a.add_argument("--warmup", type=int, default=2)
    a.add_argument("--group", type=int, default=8)
    a.add_argument("--groups-per-replica", type=int, default=4)
    a.add_argument("--replicas-per-rank", type=int, default=1)
    a.add_argument("--seeds", type=int, default=3,
                   help="runs per cell, each another draw of the response lengths; a cell's samples/s is all its runs' "
                        "trained samples over all their time")
    a.add_argument("--baseline-seeds", type=int, default=40, help="runs of each N = 1 cell")
    a.add_argument("--fixed-lengths", action="store_true")
    a.add_argument("--bound", choices=BOUNDS, default="trained",
                   help="trainer.stream.bound: what max_staleness bounds (admitted: AReaL's bound on admission only)")
    a.add_argument("--quick", action="store_true",
                   help="N = 1, 2 at max_staleness 2, 5 steps, 2 runs at N = 1: the mechanism only")
    a.add_argument("--out", default=None)
    args = a.parse_args(argv)
    if args.quick:
        args.replicas, args.staleness, args.steps, args.baseline_steps, args.warmup = "1,2", "2", 5, 5, 1
        args.seeds, args.baseline_seeds = 1, 2
    replicas = [int(x) for x in args.replicas.split(",")]
    ks = [int(x) for x in args.staleness.split(",")]
    if replicas[0] != 1 or args.warmup + 2 > args.steps:
        a.error("--replicas must start at 1; --steps must exceed --warmup + 1")
    prof = load_profile(args.profile)
    if args.fixed_lengths:
        prof = fixed_lengths(prof)
    rows = []
    for k in ks:
        base = None
        for n in replicas:
            w = Workload(prof, n, k, args.group, args.groups_per_replica, args.replicas_per_rank,
                         args.baseline_steps if n == 1 else args.steps, args.warmup, bound=args.bound)
            t = time.perf_counter()
            seeds = args.baseline_seeds if n == 1 else args.seeds
            runs = [run_virtual(simulate(replace(w, seed=s))) for s in range(seeds)]
            r = pooled(runs)
            base = base or r.samples_s
            rows.append((r, r.samples_s / (n * base), time.perf_counter() - t))
            print(f"k={k} N={n}: {r.samples_s:.1f} samples/s ({r.samples_s / (n * base):.2f} of N x 1), step "
                  f"{r.step_s:.1f} s, trainer idle {r.idle:.2f}, staleness {_hist(r.staleness_hist)} "
                  f"({time.perf_counter() - t:.0f} s wall)", flush=True)
    lines = ["| max_staleness | N | samples/s | vs N x 1 | step s | trainer idle "
             "| staleness of trained ids (versions: share) |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for r, eff, _ in rows:
        lines.append(f"| {r.staleness} | {r.replicas} | {r.samples_s:.1f} | {eff:.2f} | {r.step_s:.1f} | {r.idle:.2f} "
                     f"| {_hist(r.staleness_hist)} |")
    write_result(args.out or RESULTS, "\n\n".join([
        "# The staleness rule's ceiling: the twin's workload with a controller that costs nothing",
        run_header("admission_ceiling.py", f"virtual clock; profile {prof.name}"),
        f"{args.groups_per_replica} groups of {args.group} per replica per step, one training rank per "
        f"{args.replicas_per_rank} replica(s); trainer.stream.bound={args.bound}; {args.steps} steps a run "
        f"({args.baseline_steps} at N = 1), all "
        f"but the first {args.warmup + 1} measured; {args.seeds} run(s) per cell ({args.baseline_seeds} at N = 1), "
        "each another draw of the response lengths; samples/s: every run's trained samples over all their time.",
        "\n".join(lines)]) + "\n")


def _hist(h: list[float]) -> str:
    return " ".join(f"{d}:{x:.2f}" for d, x in enumerate(h))


if __name__ == "__main__":
    main()
