"""10,000 calls in flight: how long the controller's event loop stalls, asyncrl vs plain Ray.

A heartbeat task sleeps ``--beat-ms`` (5 ms) in a loop on the controller's event loop and
records how late each wake-up is; the worst lateness is the loop's worst stall. While it
runs, the controller issues ``--calls`` (10,000) calls to one worker process and awaits
them all. Every submitter yields to the loop every ``--yield-every`` (200) submissions,
as a well-behaved producer does (each ``.remote()`` is ~150 µs of synchronous work, so
10,000 submissions in one go block any loop for over a second, Ray's or ours).

Variants (one run, interleaved rounds, medians):

* ``idle (heartbeat alone)``: the heartbeat for 2 s with nothing else running: the
  machine's own scheduling noise, the floor of every other row.
* ``asyncrl, asyncrl.gather``: ``wg.noop(i)`` (a concurrent ``async def`` method),
  awaited with ``asyncrl.gather`` (chunks of 64).
* ``asyncrl, asyncio.gather``: the same calls, awaited with one ``asyncio.gather``
  (what a user writes without reading the docs).
* ``asyncrl, ordered``: ``wg.noop_ordered(i)`` (a plain ``def``, ordered mode: the
  worker sequences the 10,000 calls), ``asyncrl.gather``.
* ``plain Ray, asyncio.gather``: an ordinary async Ray actor, ``a.noop.remote(i)``,
  awaited with one ``asyncio.gather`` over the ObjectRefs.
* ``plain Ray, chunked``: the same, awaited in chunks of 64.

Columns: worst heartbeat lag while submitting and while awaiting, the longest garbage
collection while awaiting (``gc.callbacks``: a full collection walks every tracked object
the calls in flight hold, with the GIL held), total wall time, and calls/s. Target: worst lag < 50 ms for asyncrl.

    python benchmarks/inflight.py            # 10,000 calls, 3 rounds
    python benchmarks/inflight.py --quick    # 1,000 calls, 1 round

Writes ``benchmarks/results/inflight.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import time
from typing import Any, Awaitable, Callable

from _common import load_note, run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)
import asyncrl  # noqa: E402
from asyncrl import Dispatch, RayWorkerGroup, Worker, register  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "inflight.md")
CHUNK = 64


class Busy(Worker):
    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def noop(self, i: int) -> int:
        return i

    @register(Dispatch.ONE_TO_ALL)
    def noop_ordered(self, i: int) -> int:
        return i


class PlainBusy:
    async def noop(self, i: int) -> int:
        return i


class Heartbeat:
    """Sleeps `period` in a loop and records how late each wake-up is, and how long each
    garbage collection took (a collection holds the GIL: while it runs the loop stalls)."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.lags: list[float] = []
        self.gc: list[tuple[float, float]] = []  # (end time, duration) of each collection
        self._gc_t0 = 0.0
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            t = time.perf_counter()
            self.gc.append((t, t - self._gc_t0))

    async def _run(self) -> None:
        while not self._stop:
            t0 = time.perf_counter()
            await asyncio.sleep(self.period)
            self.lags.append(time.perf_counter() - t0 - self.period)

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.ensure_future(self._run())

    def mark(self) -> int:
        return len(self.lags)

    async def stop(self) -> None:
        self._stop = True
        assert self._task is not None
        await self._task
        gc.callbacks.remove(self._on_gc)

    def longest_gc(self, since: float) -> float:
        return max((d for t, d in self.gc if t >= since), default=0.0)


async def _submit(make: Callable[[int], Any], n: int, every: int) -> list[Any]:
    out = []
    for i in range(n):
        out.append(make(i))
        if i % every == every - 1:
            await asyncio.sleep(0)
    return out


async def _chunked(aws: list[Any]) -> list[Any]:
    out: list[Any] = []
    for i in range(0, len(aws), CHUNK):
        out.extend(await asyncio.gather(*aws[i:i + CHUNK]))
    return out


def variants(wg: RayWorkerGroup, actor: Any) -> dict[str, tuple[Callable[[int], Any], Callable[[list[Any]], Awaitable[list[Any]]], Callable[[Any], Any]]]:
    """name -> (submit one call, await them all, one result as an int)."""
    def first(x: Any) -> Any:
        return x[0]

    async def agather(xs: list[Any]) -> list[Any]:
        return await asyncio.gather(*xs)

    return {
        "idle (heartbeat alone)": (None, None, None),
        "asyncrl, asyncrl.gather": (wg.noop, lambda fs: asyncrl.gather(*fs), first),
        "asyncrl, asyncio.gather": (wg.noop, agather, first),
        "asyncrl, ordered": (wg.noop_ordered, lambda fs: asyncrl.gather(*fs), first),
        "plain Ray, asyncio.gather": (actor.noop.remote, agather, lambda x: x),
        "plain Ray, chunked": (actor.noop.remote, _chunked, lambda x: x),
    }


async def one_round(name: str, spec: tuple, n: int, every: int, beat_ms: float) -> dict[str, float]:
    make, wait, unwrap = spec
    hb = Heartbeat(beat_ms / 1e3)
    hb.start()
    await asyncio.sleep(3 * beat_ms / 1e3)
    if make is None:  # the machine's own noise: the same heartbeat with nothing else to do
        m = hb.mark()
        await asyncio.sleep(2.0)
        await hb.stop()
        return {"submit_lag": 0.0, "await_lag": max(hb.lags[m:], default=0.0), "wall": 2.0, "submit": 0.0,
                "gc_await": 0.0}
    t0 = time.perf_counter()
    pending = await _submit(make, n, every)
    t1 = time.perf_counter()
    m = hb.mark()
    results = await wait(pending)
    t2 = time.perf_counter()
    await asyncio.sleep(3 * beat_ms / 1e3)
    await hb.stop()
    assert [unwrap(r) for r in results] == list(range(n)), name
    lags = hb.lags
    return {"submit_lag": max(lags[:m], default=0.0), "await_lag": max(lags[m:], default=0.0),
            "wall": t2 - t0, "submit": t1 - t0, "gc_await": hb.longest_gc(t1)}


async def measure(n: int, rounds: int, every: int, beat_ms: float) -> dict[str, dict[str, float]]:
    import ray

    wg = RayWorkerGroup(Busy, world_size=1, name="busy")
    actor = ray.remote(PlainBusy).options(num_cpus=1, max_concurrency=100_000).remote()
    try:
        await wg.setup()
        await actor.noop.remote(0)
        vs = variants(wg, actor)
        for name, spec in vs.items():  # warm-up
            await one_round(name, spec, min(n, 500), every, beat_ms)
        res: dict[str, list[dict[str, float]]] = {v: [] for v in vs}
        order = list(vs)
        for r in range(rounds):
            for v in order[r % len(order):] + order[:r % len(order)]:
                res[v].append(await one_round(v, vs[v], n, every, beat_ms))
                x = res[v][-1]
                print(f"  round {r} {v:28s} lag submit {x['submit_lag'] * 1e3:6.1f} ms  await {x['await_lag'] * 1e3:6.1f} ms"
                      f"  (longest GC {x['gc_await'] * 1e3:5.1f} ms)  wall {x['wall']:.2f} s", flush=True)
        return {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} | {"worst": max(max(x["submit_lag"], x["await_lag"]) for x in rs)}
                for v, rs in res.items()}
    finally:
        await wg.close()
        ray.kill(actor)


def table(res: dict[str, dict[str, float]], n: int) -> str:
    head = ["variant", "worst lag, submitting (ms)", "worst lag, awaiting (ms)", "worst lag, all rounds (ms)",
            "longest GC pause, awaiting (ms)", "wall s", "calls/s"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for v, r in res.items():
        if v.startswith("idle"):
            lines.append(f"| {v} | — | {r['await_lag'] * 1e3:.1f} | {r['worst'] * 1e3:.1f} | — | — | — |")
            continue
        lines.append(f"| {v} | {r['submit_lag'] * 1e3:.1f} | {r['await_lag'] * 1e3:.1f} | {r['worst'] * 1e3:.1f} | "
                     f"{r['gc_await'] * 1e3:.1f} | {r['wall']:.2f} | {n / r['wall']:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1,000 calls, 1 round")
    p.add_argument("--calls", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--yield-every", type=int, default=200)
    p.add_argument("--beat-ms", type=float, default=5.0)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args()
    n = args.calls or (1000 if args.quick else 10_000)
    rounds = args.rounds or (1 if args.quick else 3)
    load0 = os.getloadavg()[0]
    asyncrl.init(num_cpus=16)
    try:
        res = asyncio.run(measure(n, rounds, args.yield_every, args.beat_ms))
        text = "\n\n".join([
            f"# {n:,} calls in flight: event-loop lag, asyncrl vs plain Ray",
            run_header("inflight.py", machine_note=load_note(load0, os.getloadavg()[0])),
            f"{n:,} calls to one worker process, submitted with a yield to the loop every {args.yield_every}, then "
            f"awaited; a heartbeat sleeps {args.beat_ms:g} ms in a loop and the lag is how late it wakes. "
            f"Medians over {rounds} round(s), variant order rotating; 'all rounds' is the worst of every round.",
            table(res, n),
        ]) + "\n"
    finally:
        asyncrl.shutdown()
    write_result(args.out, text)


if __name__ == "__main__":
    main()
