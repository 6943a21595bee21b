"""How an awaited call reaches the loop: the getter thread, one wake-up per call, one per rank.

A tiny ``ONE_TO_ALL`` call to ``--workers`` (4) workers, awaited five ways, variant order
rotating between repetitions (so both asyncrl variants see the same machine):

* ``asyncrl``: ``await wg.ping(1)``: the backend's getter thread waits for the call in
  Ray's blocking ``ray.get`` and wakes the loop once per call
  (:meth:`asyncrl._backend.Backend.fetch`, ``_Getter`` in asyncrl/backends/_ray_fetch.py).
* ``asyncrl, callbacks only``: the same group call with the getter thread switched off:
  Ray's completion callbacks count the ranks down on Ray's thread and wake the loop once
  per call (the path of a call that arrives while the getter thread is busy).
* ``asyncrl, a wake-up per rank``: the same group call, its fetch replaced by one that
  hands every rank's outcome to the loop on its own (``call_soon_threadsafe`` per rank,
  counted down on the loop): what asyncrl did before (without its per-rank asyncio
  futures, so a lower bound of the old cost).
* ``plain Ray, asyncio.gather``: ``await asyncio.gather(*(a.ping.remote(1) for a in actors))``
  (Ray's own asyncio integration: a wake-up per ref).
* ``plain Ray, blocking ray.get``: ``ray.get([...])`` on the loop's thread, as verl's
  controller calls its workers (no event loop involved; blocks the loop, a floor only).

Median µs per call; the controller thread's CPU per call (``time.thread_time``) too.

    python benchmarks/fetch_wakeups.py            # 4 workers, 15 repetitions of 40 calls
    python benchmarks/fetch_wakeups.py --quick    # 1 worker, 2 repetitions
    python benchmarks/fetch_wakeups.py --uvloop   # the controller's loop is uvloop's
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import sys
import time
from typing import Any, Callable

from _common import load_note, run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)
import asyncrl  # noqa: E402
from asyncrl import Dispatch, RayWorkerGroup, Worker, register  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fetch_wakeups.md")


class Sink(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def ping(self, x: int) -> int:
        return x


class _PerRankFetch:
    """A fetch that wakes the loop once per ref (the count-down runs on the loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, refs: list[Any],
                 deliver: Callable[[list[Any], int, float], None]) -> None:
        from ray.exceptions import RayError

        self._error = RayError
        self._deliver = deliver
        self._out: list[Any] = [None] * len(refs)
        self._left = len(refs)
        self._live = True
        for i, ref in enumerate(refs):
            ref._on_completed(functools.partial(self._ray_thread, loop, i))

    def _ray_thread(self, loop: asyncio.AbstractEventLoop, i: int, outcome: Any) -> None:
        loop.call_soon_threadsafe(self._got, i, outcome)

    def _got(self, i: int, outcome: Any) -> None:
        if not self._live:
            return
        self._out[i] = outcome
        self._left -= 1
        failed = isinstance(outcome, self._error)
        if failed or not self._left:
            self._live = False
            self._deliver(self._out, i if failed else -1, time.perf_counter())

    def cancel(self) -> None:
        self._live = False


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 worker, 2 repetitions")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=40, help="calls per variant per repetition")
    ap.add_argument("--uvloop", action="store_true", help="run the controller on uvloop's event loop")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.workers, args.reps, args.calls = 1, 2, 10
    load0 = os.getloadavg()[0]
    await asyncrl.ainit(num_cpus=max(8, args.workers * 2))
    import ray

    @ray.remote(num_cpus=0)
    class PlainSink:
        def ping(self, x: int) -> int:
            return x

    wg = RayWorkerGroup(Sink, world_size=args.workers, name="wakeups")
    await wg.setup()
    grouped = wg
    per_rank = RayWorkerGroup(Sink, world_size=args.workers, name="wakeups-per-rank")
    await per_rank.setup()
    backend = per_rank._hostset.backend

    class PerRankBackend:  # the same backend, with the per-rank fetch
        def __getattr__(self, name: str) -> Any:
            return getattr(backend, name)

        def fetch(self, refs: Any, deliver: Any) -> _PerRankFetch:
            return _PerRankFetch(asyncio.get_running_loop(), list(refs), deliver)

    per_rank._hostset.backend = PerRankBackend()
    actors = [PlainSink.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote()
              for _ in range(args.workers)]
    ray.get([a.ping.remote(0) for a in actors])

    async def run_group(g: Any) -> None:
        for _ in range(args.calls):
            assert await g.ping(1) == [1] * args.workers

    async def run_callbacks() -> None:
        from asyncrl.backends import _ray_fetch as ray_backend

        ray_backend._GETTER.enabled = False
        try:
            await run_group(grouped)
        finally:
            ray_backend._GETTER.enabled = True

    async def run_gather() -> None:
        for _ in range(args.calls):
            await asyncio.gather(*(a.ping.remote(1) for a in actors))

    async def run_blocking() -> None:
        for _ in range(args.calls):
            ray.get([a.ping.remote(1) for a in actors])

    variants: dict[str, Callable[[], Any]] = {
        "asyncrl": lambda: run_group(grouped),
        "asyncrl, callbacks only": run_callbacks,
        "asyncrl, a wake-up per rank": lambda: run_group(per_rank),
        "plain Ray, asyncio.gather": run_gather,
        "plain Ray, blocking ray.get": run_blocking,
    }
    for fn in variants.values():  # warm-up
        await fn()
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t, c = time.perf_counter(), time.thread_time()
            await variants[name]()
            wall[name].append((time.perf_counter() - t) / args.calls * 1e6)
            cpu[name].append((time.thread_time() - c) / args.calls * 1e6)
    await wg.close()
    per_rank._hostset.backend = backend
    await per_rank.close()
    load1 = os.getloadavg()[0]
    floor = statistics.median(wall["asyncrl, a wake-up per rank"])
    lines = [
        "# Fetch wake-ups: the getter thread, one per call, one per rank",
        "",
        run_header("fetch_wakeups.py", load_note(load0, load1)),
        "",
        f"A tiny ONE_TO_ALL call to {args.workers} workers; median over {args.reps} repetitions of "
        f"{args.calls} sequential calls per variant, variant order rotating; µs per call; the controller's "
        f"event loop: {type(asyncio.get_running_loop()).__module__}.",
        "",
        "| variant | µs per call | / a wake-up per rank | controller thread CPU µs per call |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        w = statistics.median(wall[name])
        lines.append(f"| {name} | {w:.0f} | {w / floor:.2f}x | {statistics.median(cpu[name]):.0f} |")
    write_result(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    if "--uvloop" in sys.argv:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
