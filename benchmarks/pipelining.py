"""Pipelining: a 3-stage chain on one 64 MiB batch across 4 workers, three ways, one run.

Stages (every stage runs on every rank's shard; ``x`` is float32 [rows, 4096]):

1. ``plus_one``:  ``x + 1``  -> a new 64 MiB batch (16 MiB per rank)
2. ``times_two``: ``x * 2``  -> a new 64 MiB batch
3. ``checksum``:  ``float(x.sum())`` -> one Python float per rank (``DP_COMPUTE_METRIC``):
   the only thing the controller fetches at the end of every variant is these 4 floats.

Variants:

* ``pipelined`` (asyncrl): ``await wg.checksum(wg.times_two(wg.plus_one(batch)))``: each
  stage's GroupFuture goes into the next call, shards move worker to worker.
* ``collect + redispatch`` (asyncrl, what verl does): await each stage into the
  controller, pass the collected batch to the next call (split again, sent again).
* ``raw Ray`` (the floor): 4 plain sync ``ray.remote`` actors with the same three methods;
  the controller splits the batch the same way (views) and passes each stage's ObjectRef
  straight into the next stage's call on the same actor.

Zero-copy torch tensors are on (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``, set before
ray is imported, see ``dispatch_overhead.py``). Per variant: warm-up chains, then
``--reps`` repetitions in rotating variant order; the table shows the median time per
chain, the ratios, and the tensor payload bytes the controller fetched per chain
(``wg.stats.bytes_fetched`` for asyncrl; the bytes of the fetched values for raw Ray).

    python benchmarks/pipelining.py            # 64 MiB, 4 workers
    python benchmarks/pipelining.py --quick    # 1 MiB, 2 workers, a few seconds after Ray starts

Writes the table to ``benchmarks/results/pipelining.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

if "--late-zero-copy" not in sys.argv:  # see dispatch_overhead.py: asyncrl.init sets it after `import ray`
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")

import asyncio  # noqa: E402

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from _common import run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)
import asyncrl  # noqa: E402
from asyncrl import Dispatch, RayWorkerGroup, Worker, register  # noqa: E402
from asyncrl import batch as B  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipelining.md")
COLS = 4096  # float32 columns: 16 KiB per row


def plus_one(td: TensorDict) -> TensorDict:
    return TensorDict({"x": td["x"] + 1}, batch_size=td.batch_size)


def times_two(td: TensorDict) -> TensorDict:
    return TensorDict({"x": td["x"] * 2}, batch_size=td.batch_size)


def checksum(td: TensorDict) -> float:
    return float(td["x"].sum())


class Stages(Worker):
    def __init__(self) -> None:
        torch.set_num_threads(1)

    @register(Dispatch.DP_COMPUTE)
    def plus_one(self, batch: TensorDict) -> TensorDict:
        return plus_one(batch)

    @register(Dispatch.DP_COMPUTE)
    def times_two(self, batch: TensorDict) -> TensorDict:
        return times_two(batch)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def checksum(self, batch: TensorDict) -> float:
        return checksum(batch)


class PlainStages:
    def __init__(self) -> None:
        from asyncrl.runtime import quiet_tensor_warnings

        quiet_tensor_warnings()
        torch.set_num_threads(1)

    def plus_one(self, batch: TensorDict) -> TensorDict:
        return plus_one(batch)

    def times_two(self, batch: TensorDict) -> TensorDict:
        return times_two(batch)

    def checksum(self, batch: TensorDict) -> float:
        return checksum(batch)


async def pipelined(wg: RayWorkerGroup, actors: list[Any], td: TensorDict) -> tuple[list[float], int]:
    before = wg.stats.bytes_fetched
    out = await wg.checksum(wg.times_two(wg.plus_one(td)))
    return out, wg.stats.bytes_fetched - before


async def collect_redispatch(wg: RayWorkerGroup, actors: list[Any], td: TensorDict) -> tuple[list[float], int]:
    before = wg.stats.bytes_fetched
    y1 = await wg.plus_one(td)
    y2 = await wg.times_two(y1)
    out = await wg.checksum(y2)
    return out, wg.stats.bytes_fetched - before


async def raw_ray(wg: RayWorkerGroup, actors: list[Any], td: TensorDict) -> tuple[list[float], int]:
    n = len(actors)
    size = td.batch_size[0] // n
    shards = [td[r * size:(r + 1) * size] for r in range(n)]
    r1 = [a.plus_one.remote(s) for a, s in zip(actors, shards)]
    r2 = [a.times_two.remote(r) for a, r in zip(actors, r1)]
    out = await asyncio.gather(*(a.checksum.remote(r) for a, r in zip(actors, r2)))
    return list(out), B.payload_nbytes(out)


VARIANTS = {"pipelined": pipelined, "collect + redispatch": collect_redispatch, "raw Ray": raw_ray}


async def measure(mib: int, workers: int, reps: int, warmup: int) -> dict[str, dict[str, float]]:
    import ray

    rows = (mib << 20) // (COLS * 4)
    td = TensorDict({"x": torch.randn(rows, COLS)}, batch_size=[rows])
    wg = RayWorkerGroup(Stages, world_size=workers, name="stages")
    plain = ray.remote(PlainStages)
    actors = [plain.options(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote()
              for _ in range(workers)]
    try:
        await wg.setup()
        expected = None
        for name, fn in VARIANTS.items():  # warm-up, and the three agree
            for _ in range(warmup):
                out, _ = await fn(wg, actors, td)
            if expected is None:
                expected = out
            assert all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(out, expected)), (name, out, expected)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        fetched: dict[str, list[int]] = {v: [] for v in VARIANTS}
        order = list(VARIANTS)
        for rep in range(reps):
            for v in order[rep % len(order):] + order[:rep % len(order)]:
                t0 = time.perf_counter()
                _, nbytes = await VARIANTS[v](wg, actors, td)
                times[v].append(time.perf_counter() - t0)
                fetched[v].append(nbytes)
            print(f"  rep {rep}: " + "  ".join(f"{v} {times[v][-1] * 1e3:.0f} ms" for v in order), flush=True)
        return {v: {"median": statistics.median(times[v]), "min": min(times[v]), "max": max(times[v]),
                    "bytes": statistics.median(fetched[v])} for v in VARIANTS}
    finally:
        await wg.close()
        for a in actors:
            ray.kill(a)


def table(res: dict[str, dict[str, float]]) -> str:
    floor = res["raw Ray"]["median"]
    piped = res["pipelined"]["median"]
    lines = [
        "| variant | median ms/chain | min–max ms | vs raw Ray floor | pipelined speed-up | controller payload bytes/chain |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v, r in res.items():
        lines.append(
            f"| {v} | {r['median'] * 1e3:.1f} | {r['min'] * 1e3:.0f}–{r['max'] * 1e3:.0f} | {r['median'] / floor:.2f}x | "
            f"{r['median'] / piped:.2f}x | {int(r['bytes']):,} |"
        )
    return "\n".join(lines)


def header() -> str:
    from ray._private import ray_constants

    return run_header("pipelining.py", extra="; zero-copy torch tensors in the controller: "
                      f"{bool(ray_constants.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 MiB batch, 2 workers, 2 repetitions")
    p.add_argument("--mib", type=int, default=None, help="batch size in MiB (default 64)")
    p.add_argument("--workers", type=int, default=None, help="workers per stage group (default 4, --quick 2)")
    p.add_argument("--reps", type=int, default=None, help="timed chains per variant (median reported)")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--late-zero-copy", action="store_true",
                   help="do not set RAY_ENABLE_ZERO_COPY_TORCH_TENSORS before importing ray (leave it to asyncrl.init)")
    args = p.parse_args()
    mib = args.mib or (1 if args.quick else 64)
    args.workers = args.workers or (2 if args.quick else 4)
    reps = args.reps or (2 if args.quick else 11)
    warmup = 1 if args.quick else 2
    asyncrl.init(num_cpus=64)
    try:
        res = asyncio.run(measure(mib, args.workers, reps, warmup))
        text = "\n\n".join([
            f"# Pipelining: 3-stage chain, {mib} MiB TensorDict, {args.workers} workers",
            header(),
            f"Stages: `x + 1` (new {mib} MiB batch), `x * 2` (new {mib} MiB batch), `float(x.sum())` per rank "
            f"(the final fetch: {args.workers} Python floats, 0 tensor bytes). Median of {reps} chains per variant "
            f"after {warmup} warm-up chain(s) each, variant order rotating. `pipelined speed-up` = a variant's time "
            "/ the pipelined time. Controller payload bytes = tensor bytes fetched into the controller "
            "(`wg.stats.bytes_fetched` delta; for raw Ray, the bytes of what it fetched).",
            table(res),
        ]) + "\n"
    finally:
        asyncrl.shutdown()
    write_result(args.out, text)


if __name__ == "__main__":
    main()
