"""Dispatch overhead: one asyncrl group call vs the same Ray actor calls made by hand.

For each worker count and payload, one run times three ways of doing the same work:

* ``asyncrl``: ``await wg.consume(t)``, a ``DP_COMPUTE`` method (ordered, the default):
  the tensor is split into one shard per rank, every rank returns a one-row tensor,
  the controller collects (strips padding, concatenates) the rows.
* ``raw``: the floor. ``asyncio.gather`` over the *same actors* (the group's own
  ``wg._hostset.hosts[r]``) called exactly as the Ray backend calls them:
  ``host.call.options(num_returns=2).remote("worker", "consume", seq, [call_id,] (shard,), {}, 0, True, True)``
  with the shards cut the same way (views ``t[r*size:(r+1)*size]``) and the per-worker
  sequence numbers taken from the group's counters. The worker-side work is identical
  byte for byte, so ``asyncrl / raw`` is the cost of the controller path alone
  (signature check, dispatch, futures, collect, stats).
* ``plain``: plain ``ray.remote`` actors (one per rank, sync, ``OMP_NUM_THREADS=1``)
  with a trivial ``consume(t)``, called with the same shards: everything asyncrl adds,
  controller *and* worker host (ordering, argument resolution, the method's thread hop,
  the meta return). Shown for context; the targets are about ``asyncrl / raw``.

Per cell: warm-up calls for each variant, then ``--reps`` repetitions; in each
repetition every variant runs ``k`` sequential calls back to back (variant order
rotates between repetitions); the table shows the median time per call and the ratio.
It also checks that the controller's split makes no copy of the tensor (every shard
handed to the backend shares the input's storage).

    python benchmarks/dispatch_overhead.py            # full run (a few minutes)
    python benchmarks/dispatch_overhead.py --quick    # tiny sizes, a few seconds after Ray starts

Writes the table to ``benchmarks/results/dispatch_overhead.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import statistics
import sys
import time
from typing import Any

# asyncrl.init() sets RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1, but only after `import ray`,
# and Ray reads it when ray is imported: the workers get zero-copy, this controller
# process does not (it pickles a tensor view with torch's reducer, which writes the
# view's whole storage). Set it before anything imports ray, as asyncrl intends;
# --late-zero-copy leaves it to asyncrl.init() to show today's behaviour.
if "--late-zero-copy" not in sys.argv:
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")

import torch  # noqa: E402

from _common import run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)
import asyncrl  # noqa: E402
import asyncrl.worker_group as _wg  # noqa: E402
from asyncrl import Dispatch, RayWorkerGroup, Worker, register  # noqa: E402
from asyncrl._host import WorkerHost  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dispatch_overhead.md")

# name -> number of int32 elements (4 bytes each); all divisible by 8 so every shard is an equal view
PAYLOADS = {"32 B": 8, "1 MiB": (1 << 20) // 4, "64 MiB": (64 << 20) // 4}
CALLS_PER_REP = {"32 B": 40, "1 MiB": 20, "64 MiB": 6}


class Sink(Worker):
    @register(Dispatch.DP_COMPUTE)
    def consume(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.shape[0]])  # one row per rank: the controller fetches a few bytes


class PlainSink:
    def __init__(self) -> None:
        from asyncrl.runtime import quiet_tensor_warnings

        quiet_tensor_warnings()
        torch.set_num_threads(1)

    def consume(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.shape[0]])


def shards(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    size = t.shape[0] // n
    return [t[r * size:(r + 1) * size] for r in range(n)]


async def call_asyncrl(wg: RayWorkerGroup, t: torch.Tensor, n: int, _: Any) -> Any:
    return await wg.consume(t)


# WorkerHost.call's parameters, in order (the host protocol is internal and may gain
# parameters, e.g. a call id; build the positional arguments by name so the floor keeps
# calling the actor exactly as the backend does).
_HOST_PARAMS = list(inspect.signature(WorkerHost.call).parameters)[1:]


def host_args(seq: int, shard: torch.Tensor) -> list[Any]:
    values = {"role": "worker", "method": "consume", "seq": seq, "args": (shard,), "kwargs": {}, "in_pad": 0,
              "want_meta": True, "keep": True}
    if "call_id" in _HOST_PARAMS:
        values["call_id"] = next(_wg._call_ids)  # the group's own id counter: ids stay unique per host
    return [values[p] for p in _HOST_PARAMS]


async def call_raw(wg: RayWorkerGroup, t: torch.Tensor, n: int, _: Any) -> Any:
    hs = wg._hostset
    refs, metas = [], []
    for r, shard in enumerate(shards(t, n)):
        seq = hs.next_seq[r]
        hs.next_seq[r] += 1
        ref, meta = hs.hosts[r].call.options(num_returns=2).remote(*host_args(seq, shard))
        refs.append(ref)
        metas.append(meta)
    out = await asyncio.gather(*refs, *metas)
    return out[:n]


async def call_plain(wg: RayWorkerGroup, t: torch.Tensor, n: int, actors: list[Any]) -> Any:
    return await asyncio.gather(*(a.consume.remote(s) for a, s in zip(actors, shards(t, n))))


VARIANTS = {"asyncrl": call_asyncrl, "raw": call_raw, "plain": call_plain}


def check_no_copy(wg: RayWorkerGroup, t: torch.Tensor) -> tuple[Any, bool, int]:
    """Run one group call with the backend's submit wrapped; every shard it is handed
    must share the input's storage (a view, not a new allocation). Also returns the
    bytes Ray's serializer makes of those shards (what is written to the object store)."""
    import ray

    ctx = ray._private.worker.global_worker.get_serialization_context()
    backend = wg._hostset.backend
    seen: list[tuple[int, int]] = []
    serialized = 0
    orig = backend.submit

    def spy(*call_args):
        nonlocal serialized
        for x in call_args:
            for a in x if isinstance(x, tuple) else ():
                if isinstance(a, torch.Tensor):
                    seen.append((a.untyped_storage().data_ptr(), a.data_ptr()))
                    serialized += ctx.serialize(a).total_bytes
        return orig(*call_args)

    backend.submit = spy  # type: ignore[method-assign]
    try:
        fut = wg.consume(t)
    finally:
        del backend.submit  # back to the class's method
    base = t.untyped_storage().data_ptr()
    size = t.shape[0] // wg.world_size
    ok = len(seen) == wg.world_size and all(
        sp == base and dp == t.data_ptr() + r * size * t.element_size() for r, (sp, dp) in enumerate(seen)
    )
    return fut, ok, serialized


async def measure(workers: list[int], payloads: list[str], reps: int, quick: bool) -> tuple[list[dict], list[str]]:
    import ray

    rows, checks = [], []
    plain_cls = ray.remote(PlainSink)
    for n in workers:
        wg = RayWorkerGroup(Sink, world_size=n, name=f"sink{n}")
        actors = [plain_cls.options(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote()
                  for _ in range(n)]
        try:
            await wg.setup()
            await asyncio.gather(*(a.consume.remote(torch.zeros(1)) for a in actors))
            for name in payloads:
                t = torch.arange(PAYLOADS[name], dtype=torch.int32)
                fut, ok, ser = check_no_copy(wg, t)
                got = await fut
                assert got.tolist() == [t.shape[0] // n] * n, got
                checks.append(f"{n} workers, {name}: {'every shard is a view of the input' if ok else 'COPY MADE'}; "
                              f"Ray serializes the shards to {ser:,} bytes for {t.numel() * t.element_size():,} "
                              f"payload bytes")
                k = max(1, CALLS_PER_REP[name] // (4 if quick else 1))
                for fn in VARIANTS.values():  # warm-up
                    for _ in range(2):
                        await fn(wg, t, n, actors)
                times: dict[str, list[float]] = {v: [] for v in VARIANTS}
                order = list(VARIANTS)
                for rep in range(reps):
                    for v in order[rep % len(order):] + order[:rep % len(order)]:
                        fn = VARIANTS[v]
                        t0 = time.perf_counter()
                        for _ in range(k):
                            await fn(wg, t, n, actors)
                        times[v].append((time.perf_counter() - t0) / k)
                med = {v: statistics.median(ts) for v, ts in times.items()}
                rows.append({"workers": n, "payload": name, **med})
                print(f"  {n} workers {name:>6}: asyncrl {med['asyncrl'] * 1e6:9.0f} us  raw {med['raw'] * 1e6:9.0f} us"
                      f"  ratio {med['asyncrl'] / med['raw']:.2f}x  plain {med['plain'] * 1e6:9.0f} us", flush=True)
        finally:
            await wg.close()
            for a in actors:
                ray.kill(a)
    return rows, checks


def table(rows: list[dict]) -> str:
    lines = [
        "| workers | payload | asyncrl µs/call | raw µs/call | asyncrl / raw | plain-actor µs/call | asyncrl / plain |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['payload']} | {r['asyncrl'] * 1e6:.0f} | {r['raw'] * 1e6:.0f} | "
            f"{r['asyncrl'] / r['raw']:.2f}x | {r['plain'] * 1e6:.0f} | {r['asyncrl'] / r['plain']:.2f}x |"
        )
    return "\n".join(lines)


def _driver_zero_copy() -> bool:
    from ray._private import ray_constants

    return bool(ray_constants.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS)


def header(args: argparse.Namespace) -> str:
    return run_header("dispatch_overhead.py",
                      extra=f"; zero-copy torch tensors in the controller: {_driver_zero_copy()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 and 2 workers, 32 B and 1 MiB, 2 repetitions")
    p.add_argument("--workers", type=int, nargs="+", default=None)
    p.add_argument("--payloads", nargs="+", default=None, choices=list(PAYLOADS))
    p.add_argument("--reps", type=int, default=None, help="repetitions per cell (median reported)")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--late-zero-copy", action="store_true",
                   help="do not set RAY_ENABLE_ZERO_COPY_TORCH_TENSORS before importing ray (leave it to asyncrl.init)")
    args = p.parse_args()
    workers = args.workers or ([1, 2] if args.quick else [1, 2, 4, 8])
    payloads = args.payloads or (["32 B", "1 MiB"] if args.quick else list(PAYLOADS))
    reps = args.reps or (2 if args.quick else 9)
    asyncrl.init(num_cpus=64)
    try:
        rows, checks = asyncio.run(measure(workers, payloads, reps, args.quick))
        text = "\n\n".join([
            "# Dispatch overhead: asyncrl group call vs raw Ray",
            header(args),
            f"Median time per call over {reps} repetitions (each of {', '.join(f'{k} calls for {p}' for p, k in CALLS_PER_REP.items() if p in payloads)}"
            f"{', divided by 4 in --quick' if args.quick else ''}), after 2 warm-up calls per variant. "
            "`raw` = the same actors called exactly as the Ray backend calls them (same shards, same "
            "sequence numbers, same worker-side work): its ratio is the controller's overhead. `plain` = "
            "plain sync `ray.remote` actors with a trivial method: the ratio includes asyncrl's worker host too.",
            table(rows),
            "No-copy check (the shards handed to the backend share the input tensor's storage, at the expected "
            "offsets) and the bytes Ray's serializer makes of them in the controller:\n\n" + "\n".join(f"- {c}" for c in checks),
        ]) + "\n"
    finally:
        asyncrl.shutdown()
    write_result(args.out, text)


if __name__ == "__main__":
    main()
