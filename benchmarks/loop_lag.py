"""Loop lag: how long the controller's event loop is blocked while asyncrl works.

A heartbeat task sleeps 1 ms in a loop; its lag (how late each wake-up is) is what
every other task on the controller (a second trainer loop, a metrics server, a
heartbeat to a cluster manager) would feel. One run, side by side:

* ``idle``: the heartbeat alone (the machine's own scheduling noise: the floor).
* ``Ray start``: ``await asyncrl.ainit()`` (the start runs on Ray's owner thread).
* ``setup, 4 workers``: ``await RayWorkerGroup(Sink, world_size=4).setup()`` (Ray
  running): placement (in a thread), actor start, constructors — vs ``plain Ray``, what
  a user writes in asyncio without asyncrl: a placement group awaited with
  ``await pg.ready()``, four actors, ``await`` of a ready call on each.
* ``1,000 calls``: 1,000 group calls on the 4 workers issued at once and awaited with
  ``asyncrl.gather`` — vs ``plain Ray``: 4,000 actor calls awaited with ``asyncio.gather``.
* ``close``: ``await wg.close()`` (graceful close, kill and placement removal off the
  loop) — vs ``plain Ray``: ``ray.kill`` of each actor and ``remove_placement_group``.
* ``trainer``: the real trainer as ``examples/fit_in_app.py`` runs it (preset ``grpo_toy``: 64
  responses per step, one rollout and one training worker, both busy): its set-up, ``fit()``, close.
* ``64 episodes in flight``: ``benchmarks/agents.py``'s rollout worker running 64 multi-turn
  episodes at once (target: loop lag < 50 ms).

Why a wake-up was late, per late wake-up (> 20 ms), from the loop thread's own scheduler counters
(``/proc/thread-self/schedstat``: time on a CPU, time runnable in the run queue):

* *held*: the loop thread ran most of the interval: code held the loop (ours, Ray's, the GC's);
* *starved*: it waited most of it in the run queue: no core for it (the machine's load; our workers
  run at Ray's worker niceness 15, so it is other processes' load, see
  ``tests/roles/test_worker_priority.py``);
* *blocked*: neither: it slept past its timer, on the GIL or a lock another thread of the controller
  held (e.g. Ray's ``CoreWorker`` constructor, which holds the GIL while it connects: the
  ``Ray start`` row).

The table shows, per phase, the heartbeat's worst lag, its 99th percentile and the
phase's duration. Targets: worst lag < 20 ms during setup of 4 workers and during a trainer
run; < 50 ms with 64 episodes in flight. On a shared machine the ``idle`` row says how much of a lag is the
machine's own.

    python benchmarks/loop_lag.py                          # full
    python benchmarks/loop_lag.py --quick                  # fewer calls and trainer steps
    python benchmarks/loop_lag.py --phases trainer,agents  # only the trainer and the 64 episodes

Writes ``benchmarks/results/loop_lag.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Awaitable, Callable

os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")  # as the other benchmarks (see dispatch_overhead.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from _common import run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)
import asyncrl  # noqa: E402
from asyncrl import Dispatch, RayWorkerGroup, Worker, register  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "loop_lag.md")
TICK_S = 0.001
STALL_S = 0.020  # the target: no wake-up later than this
WATCH_S = 0.002


class Sink(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def ping(self, i: int) -> int:
        return i


class PlainSink:
    def ready(self) -> bool:
        return True

    def ping(self, i: int) -> int:
        return i


def _schedstat() -> tuple[float, float]:
    """This thread's seconds on a CPU and waiting in the run queue (Linux ``/proc/thread-self/schedstat``;
    elsewhere the thread's CPU time and 0)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
        return int(on_cpu) * 1e-9, int(waiting) * 1e-9
    except OSError:
        return time.thread_time(), 0.0


class Heartbeat:
    """Sleeps TICK_S in a loop and records how late each wake-up is.

    A watchdog thread looks at the loop thread every 2 ms while a wake-up is more than
    STALL_S late: either the loop thread is running code (the stall is that code's: the
    innermost asyncrl/Ray/pipelines frame is recorded), or it is waiting in its selector
    and could not run (the OS did not schedule the process, or another thread held the
    GIL: the machine's share, which also shows in the ``idle`` row).
    """

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.late: list[tuple[float, float, float]] = []  # (wall, on a CPU, in the run queue) s per late wake-up
        self._last = time.perf_counter()
        self._loop_thread: int | None = None
        self.busy: collections.Counter[str] = collections.Counter()
        self.waiting = 0
        self.gc_pauses: list[float] = []
        self._gc_t0 = 0.0
        gc.callbacks.append(self._gc)
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="loop-lag-watchdog", daemon=True).start()

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        # A collection runs on whichever thread allocates, holding the GIL: it stalls the loop too.
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_pauses.append(time.perf_counter() - self._gc_t0)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):
            ident = self._loop_thread
            if ident is None or time.perf_counter() - self._last < STALL_S:
                continue
            frame = sys._current_frames().get(ident)
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)
            if stack[-1].name == "select" and stack[-1].filename.endswith("selectors.py"):
                self.waiting += 1
                continue
            ours = [f for f in reversed(stack) if any(k in f.filename for k in ("asyncrl", "/ray/", "pipelines", "roles"))]
            where = ours[0] if ours else stack[-1]
            self.busy[f"{os.path.basename(where.filename)}:{where.lineno} {where.name}"] += 1

    async def _run(self) -> None:
        while True:
            t0 = self._last = time.perf_counter()
            # The loop thread's time on a CPU and waiting in the run queue (the kernel's schedstat):
            # during a stall, did the loop run, wait for a core, or sleep past its timer (blocked on
            # the GIL or a lock that another thread held)?
            c0, q0 = _schedstat()
            await asyncio.sleep(TICK_S)
            dt = time.perf_counter() - t0
            self.lags.append(dt - TICK_S)
            if dt - TICK_S > STALL_S:
                c1, q1 = _schedstat()
                self.late.append((dt, c1 - c0, q1 - q0))

    async def measure(self, fn: Callable[[], Awaitable[Any]]) -> tuple[dict[str, Any], Any]:
        self._loop_thread = threading.get_ident()
        task = asyncio.ensure_future(self._run())
        await asyncio.sleep(0.01)  # the heartbeat is ticking before the phase starts
        self.lags, self.busy, self.waiting, self.gc_pauses, self.late = [], collections.Counter(), 0, [], []
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            out = await fn()
        finally:
            took, cpu = time.perf_counter() - t0, time.thread_time() - c0
            task.cancel()
        lags = sorted(self.lags) or [0.0]
        top = self.busy.most_common(1)
        # A late wake-up is "held" when the loop thread spent most of it on a CPU (code held the loop:
        # ours, Ray's or the GC's), "starved" when it spent most of it runnable in the run queue (no core
        # for it: the machine's load), else "blocked" (it slept past its timer: waiting for the GIL or a
        # lock another thread of the controller held).
        kinds: dict[str, list[float]] = {"held": [], "starved": [], "blocked": []}
        for w, c, q in self.late:
            kinds["held" if c >= 0.5 * w else "starved" if q >= 0.5 * w else "blocked"].append(w)
        return {"max_ms": lags[-1] * 1e3,
                **{k: len(v) for k, v in kinds.items()},
                **{f"{k}_max_ms": max(v, default=0.0) * 1e3 for k, v in kinds.items()},
                "loop_cpu": cpu / took if took > 0 else 0.0, "p99_ms": lags[int(0.99 * (len(lags) - 1))] * 1e3,
                "stalls": sum(lag > STALL_S for lag in lags), "ticks": len(lags), "phase_s": took,
                "busy_ms": sum(self.busy.values()) * WATCH_S * 1e3, "waiting_ms": self.waiting * WATCH_S * 1e3,
                "gc_ms": max(self.gc_pauses, default=0.0) * 1e3,
                "culprit": f"{top[0][0]} ({top[0][1] * WATCH_S * 1e3:.0f} ms)" if top else "-"}, out


async def measure(quick: bool, phases: set[str]) -> list[dict[str, Any]]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    hb = Heartbeat()
    rows: list[dict[str, Any]] = []

    def add(phase: str, variant: str, stats: dict[str, Any]) -> None:
        rows.append({"phase": phase, "variant": variant, **stats})
        print(f"  {phase:<22} {variant:<9} max {stats['max_ms']:7.1f} ms  p99 {stats['p99_ms']:5.1f} ms  "
              f"late: held {stats['held']} (max {stats['held_max_ms']:.0f} ms) starved {stats['starved']} "
              f"(max {stats['starved_max_ms']:.0f} ms) blocked {stats['blocked']} "
              f"(max {stats['blocked_max_ms']:.0f} ms)  loop CPU {100 * stats['loop_cpu']:.0f}%  "
              f"stalls {stats['stalls']:3d}  loop busy {stats['busy_ms']:5.0f} ms  gc {stats['gc_ms']:4.0f} ms  "
              f"({stats['phase_s']:.2f} s)  {stats['culprit']}", flush=True)

    stats, _ = await hb.measure(lambda: asyncio.sleep(3.0 if quick else 10.0))
    add("idle", "-", stats)
    stats, _ = await hb.measure(lambda: asyncrl.ainit(num_cpus=16))
    add("Ray start", "asyncrl", stats)

    if "core" in phases:
        n_calls = 200 if quick else 1000
        n = 2 if quick else 4  # workers per group
        for rep in range(1 if quick else 2):
            wg = RayWorkerGroup(Sink, world_size=n, name=f"lag{rep}")
            stats, _ = await hb.measure(wg.setup)
            add(f"setup, {n} workers", "asyncrl", stats)
            async def asyncrl_calls() -> None:
                futures = []
                for i in range(n_calls):  # a well-behaved producer yields while it submits
                    futures.append(wg.ping(i))
                    if i % 25 == 24:
                        await asyncio.sleep(0)
                await asyncrl.gather(*futures)

            stats, _ = await hb.measure(asyncrl_calls)
            add(f"{n_calls:,} calls", "asyncrl", stats)
            stats, _ = await hb.measure(wg.close)
            add("close", "asyncrl", stats)

            actor_cls = ray.remote(PlainSink)
            state: dict[str, Any] = {}

            async def plain_setup() -> None:
                pg = state["pg"] = placement_group([{"CPU": 1}] * n, strategy="STRICT_PACK")
                await pg.ready()
                state["actors"] = actors = [actor_cls.options(
                    num_cpus=1, scheduling_strategy=ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(n)]
                await asyncio.gather(*(a.ready.remote() for a in actors))

            async def plain_calls() -> None:
                refs = []
                for i in range(n_calls):  # submitted as the asyncrl variant is
                    refs.extend(a.ping.remote(i) for a in state["actors"])
                    if i % 25 == 24:
                        await asyncio.sleep(0)
                await asyncio.gather(*refs)

            async def plain_close() -> None:
                for a in state["actors"]:
                    ray.kill(a)
                remove_placement_group(state["pg"])

            stats, _ = await hb.measure(plain_setup)
            add(f"setup, {n} workers", "plain Ray", stats)
            stats, _ = await hb.measure(plain_calls)
            add(f"{n_calls:,} calls", "plain Ray", stats)
            stats, _ = await hb.measure(plain_close)
            add("close", "plain Ray", stats)
    if "trainer" in phases:  # examples/fit_in_app.py's run: grpo_toy, 64 responses per step, two workers
        from asyncrl.pipelines.job.presets import grpo_toy
        from asyncrl.pipelines.trainers.trainer import make_trainer

        cfg = grpo_toy()
        t = cfg.trainer
        t.steps = 3 if quick else 10
        t.progress = t.tensorboard = False
        t.plot = t.checkpoint_at_end = True  # as the example: the report and the final checkpoint are part of fit()
        t.output_dir = tempfile.mkdtemp(prefix="asyncrl-loop-lag-")
        trainer = make_trainer(cfg.validate())
        stats, _ = await hb.measure(trainer.setup)
        add("trainer set-up", "grpo_toy", stats)
        try:
            stats, hist = await hb.measure(trainer.fit)
            add(f"trainer fit ({len(hist)} steps)", "grpo_toy", stats)
        finally:
            stats, _ = await hb.measure(trainer.close)
            add("trainer close", "grpo_toy", stats)
    if "agents" in phases:  # benchmarks/agents.py's worker: 64 multi-turn episodes in flight on one rollout worker
        import agents

        from asyncrl.roles import ModelConfig, RolloutConfig

        a = agents.Args()
        width = a.turns * a.tokens_per_turn + (a.turns - 1) * 12
        rcfg = RolloutConfig(max_new_tokens=width, episode="char_class_retry",
                             episode_kwargs={"max_turns": a.turns, "tokens_per_turn": a.tokens_per_turn})
        model = ModelConfig(seed=0, device="cpu", dtype="float32", autocast="off", num_threads=1)
        g = RayWorkerGroup(agents.BenchRollout, world_size=1, args=(model, rcfg), name="loop-lag-agents")
        stats, _ = await hb.measure(g.setup)
        add("agents worker set-up", "1 rollout", stats)
        try:
            prompts = agents.batch(a.episodes)
            await g.generate_episodes(prompts[:2], seed=99, max_in_flight=a.episodes)  # warm-up
            for rep in range(1 if quick else 3):
                stats, _ = await hb.measure(lambda: g.generate_episodes(prompts, seed=rep, max_in_flight=a.episodes))
                add(f"{a.episodes} episodes in flight", "1 rollout", stats)
        finally:
            await g.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| phase | variant | worst lag ms | p99 lag ms | wake-ups > 20 ms | held: loop thread on the CPU "
             "(worst ms) | starved: waiting for a core (worst ms) | blocked: asleep past its timer, on the GIL or "
             "a lock (worst ms) | loop thread CPU % of the phase | "
             "watchdog: loop busy, ms | loop waiting, ms | longest GC pause ms | phase s | "
             "top code on the loop during stalls |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['variant']} | {r['max_ms']:.1f} | {r['p99_ms']:.1f} | {r['stalls']} / "
                     f"{r['ticks']} | {r['held']} ({r['held_max_ms']:.0f}) | {r['starved']} ({r['starved_max_ms']:.0f}) | {r['blocked']} ({r['blocked_max_ms']:.0f}) | "
                     f"{100 * r['loop_cpu']:.0f} | {r['busy_ms']:.0f} | {r['waiting_ms']:.0f} | {r['gc_ms']:.0f} | "
                     f"{r['phase_s']:.2f} | {r['culprit']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="200 calls, one repetition, 3 trainer steps")
    p.add_argument("--phases", default="core,trainer,agents",
                   help="comma-separated: core (setup/calls/close vs plain Ray), trainer (grpo_toy as "
                        "examples/fit_in_app.py runs it), agents (64 episodes in flight on one rollout worker)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()
    phases = set(args.phases.split(","))
    if phases - {"core", "trainer", "agents"}:
        p.error(f"unknown phase(s) {sorted(phases - {'core', 'trainer', 'agents'})}; choose from core, trainer, agents")
    load = os.getloadavg()
    try:
        rows = asyncio.run(measure(args.quick, phases))
    finally:
        asyncrl.shutdown()
    text = "\n\n".join([
        "# Loop lag: the controller's event loop while asyncrl works",
        run_header("loop_lag.py", extra=f"; load average at start {load[0]:.1f}"),
        f"A heartbeat task sleeps {TICK_S * 1e3:g} ms in a loop; lag = how late each wake-up is. Worst and 99th "
        "percentile per phase, and the wake-ups later than 20 ms, each classified from the loop thread's "
        "scheduler counters (/proc/thread-self/schedstat): *held* = the loop thread was on a CPU most of the "
        "interval (code held the loop), *starved* = it waited in the run queue for a core (the machine's load), "
        "*blocked* = it slept past its timer (the GIL or a lock held by another thread of the controller). "
        "Meanwhile a watchdog thread looks at the "
        "loop thread every 2 ms: *loop busy* = it was running code (the top asyncrl/Ray/pipelines frame is "
        "named: the stall is that code's), *loop waiting* = it sat in its selector unable to run (the OS did not "
        "schedule the process, or another thread held the GIL); the longest garbage-collector pause (it holds "
        "the GIL, on whatever thread allocated). `idle` is the heartbeat alone (the machine's "
        "own noise). `plain Ray` = the same work written directly on Ray in asyncio (placement group, actors, "
        "calls, kill), no asyncrl. Both submit their calls yielding every 25 calls. Targets: worst lag < 20 ms "
        "during setup of 4 workers and during a trainer run; < 50 ms with 64 episodes in flight.",
        table(rows),
    ]) + "\n"
    write_result(args.out, text)


if __name__ == "__main__":
    sys.exit(main())
