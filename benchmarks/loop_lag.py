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
* ``trainer``: a tiny GRPO run of the real trainer (``asyncrl.pipelines``, preset
  ``tiny_test("grpo")``, one rollout and one training worker): its set-up, then ``fit()``.

The table shows, per phase, the heartbeat's worst lag, its 99th percentile and the
phase's duration. Target (issue 13): worst lag < 20 ms during setup of 4 workers and
during a trainer run. On a shared machine the ``idle`` row says how much of a lag is the
machine's own.

    python benchmarks/loop_lag.py            # full
    python benchmarks/loop_lag.py --quick    # fewer calls and trainer steps

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
            await asyncio.sleep(TICK_S)
            self.lags.append(time.perf_counter() - t0 - TICK_S)

    async def measure(self, fn: Callable[[], Awaitable[Any]]) -> tuple[dict[str, Any], Any]:
        self._loop_thread = threading.get_ident()
        task = asyncio.ensure_future(self._run())
        await asyncio.sleep(0.01)  # the heartbeat is ticking before the phase starts
        self.lags, self.busy, self.waiting, self.gc_pauses = [], collections.Counter(), 0, []
        t0 = time.perf_counter()
        try:
            out = await fn()
        finally:
            took = time.perf_counter() - t0
            task.cancel()
        lags = sorted(self.lags) or [0.0]
        top = self.busy.most_common(1)
        return {"max_ms": lags[-1] * 1e3, "p99_ms": lags[int(0.99 * (len(lags) - 1))] * 1e3,
                "stalls": sum(lag > STALL_S for lag in lags), "ticks": len(lags), "phase_s": took,
                "busy_ms": sum(self.busy.values()) * WATCH_S * 1e3, "waiting_ms": self.waiting * WATCH_S * 1e3,
                "gc_ms": max(self.gc_pauses, default=0.0) * 1e3,
                "culprit": f"{top[0][0]} ({top[0][1] * WATCH_S * 1e3:.0f} ms)" if top else "-"}, out


async def measure(quick: bool) -> list[dict[str, Any]]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    hb = Heartbeat()
    rows: list[dict[str, Any]] = []

    def add(phase: str, variant: str, stats: dict[str, Any]) -> None:
        rows.append({"phase": phase, "variant": variant, **stats})
        print(f"  {phase:<22} {variant:<9} max {stats['max_ms']:7.1f} ms  p99 {stats['p99_ms']:5.1f} ms  "
              f"stalls {stats['stalls']:3d}  loop busy {stats['busy_ms']:5.0f} ms  gc {stats['gc_ms']:4.0f} ms  "
              f"({stats['phase_s']:.2f} s)  {stats['culprit']}", flush=True)

    stats, _ = await hb.measure(lambda: asyncio.sleep(3.0 if quick else 10.0))
    add("idle", "-", stats)
    stats, _ = await hb.measure(lambda: asyncrl.ainit(num_cpus=16))
    add("Ray start", "asyncrl", stats)

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

    from asyncrl.pipelines.presets import tiny_test
    from asyncrl.pipelines.trainer import make_trainer

    cfg = tiny_test("grpo")
    t = cfg.trainer
    t.steps = 3 if quick else 8
    t.colocated, t.rollout_workers, t.train_workers, t.cpus_per_worker = False, 1, 1, 1.0
    t.progress = t.plot = t.tensorboard = t.checkpoint_at_end = False
    t.output_dir = tempfile.mkdtemp(prefix="asyncrl-loop-lag-")
    trainer = make_trainer(cfg.validate())
    stats, _ = await hb.measure(trainer.setup)
    add("trainer set-up", "asyncrl", stats)
    try:
        stats, hist = await hb.measure(trainer.fit)
        add(f"trainer fit ({len(hist)} steps)", "asyncrl", stats)
    finally:
        stats, _ = await hb.measure(trainer.close)
        add("trainer close", "asyncrl", stats)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| phase | variant | worst lag ms | p99 lag ms | wake-ups > 20 ms | of which loop busy, ms | "
             "loop waiting, ms | longest GC pause ms | phase s | top code on the loop during stalls |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['variant']} | {r['max_ms']:.1f} | {r['p99_ms']:.1f} | {r['stalls']} / "
                     f"{r['ticks']} | {r['busy_ms']:.0f} | {r['waiting_ms']:.0f} | {r['gc_ms']:.0f} | "
                     f"{r['phase_s']:.2f} | {r['culprit']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="200 calls, one repetition, 3 trainer steps")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()
    load = os.getloadavg()
    try:
        rows = asyncio.run(measure(args.quick))
    finally:
        asyncrl.shutdown()
    text = "\n\n".join([
        "# Loop lag: the controller's event loop while asyncrl works",
        run_header("loop_lag.py", extra=f"; load average at start {load[0]:.1f}"),
        f"A heartbeat task sleeps {TICK_S * 1e3:g} ms in a loop; lag = how late each wake-up is. Worst and 99th "
        "percentile per phase, and the wake-ups later than 20 ms. During those, a watchdog thread looks at the "
        "loop thread every 2 ms: *loop busy* = it was running code (the top asyncrl/Ray/pipelines frame is "
        "named: the stall is that code's), *loop waiting* = it sat in its selector unable to run (the OS did not "
        "schedule the process, or another thread held the GIL); the longest garbage-collector pause (it holds "
        "the GIL, on whatever thread allocated). `idle` is the heartbeat alone (the machine's "
        "own noise). `plain Ray` = the same work written directly on Ray in asyncio (placement group, actors, "
        "calls, kill), no asyncrl. Both submit their calls yielding every 25 calls. Target: worst lag < 20 ms "
        "during setup of 4 workers and during a trainer run.",
        table(rows),
    ]) + "\n"
    write_result(args.out, text)


if __name__ == "__main__":
    sys.exit(main())
