"""What an async Ray actor costs a plain call, against a sync actor: the premise of one worker host.

One worker host would be an async actor whose default event loop runs every plain ``def``
method inline (no thread hop). This times Ray alone, no asyncrl: ``--calls`` sequential
calls of a method that returns its argument (a short list, which Ray encodes with msgpack,
as asyncrl's call message is), on

* ``sync``: a plain actor, ``def ping`` (what the threaded host is; the baseline);
* ``async inline``: an async actor, ``async def ping`` that runs its sync code on the loop;
* ``async inline, max_concurrency=100k``: the same with the async host's ``max_concurrency``;
* ``async hop``: an async actor that hops to a one-thread executor and back (the async
  host's plain ``def`` today);
* ``async group``: an async actor whose ``ping`` is in a named concurrency group;
* ``async actor, def``: a plain ``def ping`` on an async actor, in a one-thread group (Ray itself
  runs it on that group's thread: the other route to one host, with Ray doing the hop).

Rounds interleave the variants, their order rotating; the table is the median per call and
its ratio to ``sync``.

    python benchmarks/async_actor_cost.py                 # 300 calls, 7 rounds
    python benchmarks/async_actor_cost.py --calls 100 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import time
from typing import Any

import ray


class Sync:
    def ping(self, x: Any) -> Any:
        return x


class AsyncInline:
    async def ping(self, x: Any) -> Any:
        return x

    async def control(self) -> int:  # a second group, as the host's control messages would have
        return 0


class AsyncHop:
    def __init__(self) -> None:
        self.ex = concurrent.futures.ThreadPoolExecutor(1)

    async def ping(self, x: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.ex, lambda: x)


class AsyncGroup:
    @ray.method(concurrency_group="ordered")
    async def ping(self, x: Any) -> Any:
        return x


class AsyncWithDef:
    async def control(self) -> int:  # an async method makes the actor async
        return 0

    @ray.method(concurrency_group="ordered")
    def ping(self, x: Any) -> Any:
        return x


async def per_call(actor: Any, calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        await actor.ping.remote([i, "role", "method", None])
    return (time.perf_counter() - t0) / calls


async def main(calls: int, rounds: int) -> None:
    groups = {"concurrency_groups": {"ordered": 1, "control": 1}}
    actors = {
        "sync": ray.remote(Sync).remote(),
        "async inline": ray.remote(**groups)(AsyncInline).remote(),
        "async inline, max_concurrency=100k": ray.remote(**groups)(AsyncInline).options(max_concurrency=100_000).remote(),
        "async hop": ray.remote(**groups)(AsyncHop).remote(),
        "async group": ray.remote(**groups)(AsyncGroup).remote(),
        "async actor, def": ray.remote(**groups)(AsyncWithDef).remote(),
    }
    names = list(actors)
    for a in actors.values():
        await a.ping.remote(0)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(await per_call(actors[k], calls))
    base = statistics.median(times["sync"])
    print(f"Command: `python benchmarks/async_actor_cost.py --calls {calls} --rounds {rounds}`\n")
    print("| actor | µs per call | / sync |\n|---|---:|---:|")
    for k in names:
        med = statistics.median(times[k])
        print(f"| {k} | {med * 1e6:.0f} | {med / base:.2f}x |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300, help="sequential calls per variant per round")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    asyncio.run(main(args.calls, args.rounds))
