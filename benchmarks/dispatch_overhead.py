"""Dispatch overhead: one asyncrl group call vs what a user writes instead (plain Ray, verl).

Every cell times the same work, side by side in one run, on ``--workers`` workers (4):

* ``tiny``: a ``ONE_TO_ALL`` call with one int argument; every rank returns an int.
* ``tiny async``: the same call to an ``async def`` worker method (ordered as well; it
  runs on the worker's event loop, without the thread hop of a plain ``def``). The
  plain-Ray and verl variants call their same sync method: the floor does not change.
* ``32 B`` / ``1 MiB`` / ``64 MiB``: a ``DP_COMPUTE`` call on an int32 tensor, split into one
  shard per rank; every rank returns a one-row tensor and the caller concatenates them.

Variants:

* ``asyncrl``: ``await wg.ping(1)`` / ``await wg.consume(t)`` (ordered mode, the default).
* ``plain Ray`` (**the floor**; the headline ratio is against it): what a user writes
  with ordinary Ray actors, one per rank (sync, ``OMP_NUM_THREADS=1``):
  ``await asyncio.gather(*(a.ping.remote(1) for a in actors))``; for DP the hand-written
  split/put/cat: shards ``t[r*size:(r+1)*size]`` (views) passed to ``a.consume.remote`` (Ray
  puts each into the object store), gathered, ``torch.cat``.
* ``host path`` (a breakdown, not a baseline): asyncrl's own worker processes called the
  way the group submits them (its sequencer: numbers, call ids, the backend's submit),
  awaited with ``asyncio.gather``: no dispatch, no futures, no collect.
  ``host path / plain`` is what asyncrl's worker host costs (ordering, argument
  resolution, the method's thread hop, the second return); ``asyncrl / host path`` is the
  controller's share.
* ``async host`` (a breakdown): the same asyncrl call to a second group of the same
  worker class forced onto the async host (an async Ray actor, the host every group had
  before the threaded host; a group now gets it only when a worker has a concurrent
  method). ``async host / asyncrl`` is what the threaded host saves.
* ``verl`` (where ``verl`` is importable): verl 0.9.1's ``RayWorkerGroup`` with a worker
  registered ``ONE_TO_ALL`` / ``DP_COMPUTE_PROTO`` (a ``DataProto`` built once outside the
  timing), called the blocking way verl's trainer calls it. Install beside asyncrl with
  ``.venv/bin/pip install --no-deps verl==0.9.1 omegaconf`` (verl's own pins,
  tensordict<=0.10 and transformers<5.11, would replace ours; its single controller runs
  with ours).

Per cell: warm-up calls for each variant, then ``--reps`` repetitions; in each
repetition every variant runs ``k`` sequential calls back to back, variant order rotating
between repetitions (ABAB...); the table shows the median time per call and the ratios.
It also checks that the controller's split makes no copy of the tensor (every shard
handed to the backend shares the input's storage).

    python benchmarks/dispatch_overhead.py            # 4 workers, all cells (~3 min)
    python benchmarks/dispatch_overhead.py --workers 1 2 4 8
    python benchmarks/dispatch_overhead.py --quick    # 1 worker, tiny and 1 MiB, a few seconds after Ray starts

Writes the table to ``benchmarks/results/dispatch_overhead.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any, Awaitable, Callable

# asyncrl.init() makes Ray zero-copy torch tensors in the controller too; set it before
# anything imports ray so the plain-Ray and verl variants get it as well.
if "--late-zero-copy" not in sys.argv:
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")

import torch  # noqa: E402

from _common import load_note, run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)
import asyncrl  # noqa: E402
from asyncrl import Dispatch, RayWorkerGroup, Worker, register  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dispatch_overhead.md")

# cell -> number of int32 elements (4 bytes each), None for the tiny ONE_TO_ALL call;
# all divisible by 8 so every shard is an equal view
CELLS: dict[str, int | None] = {"tiny": None, "tiny async": None, "32 B": 8, "1 MiB": (1 << 20) // 4,
                                 "64 MiB": (64 << 20) // 4}
CALLS_PER_REP = {"tiny": 40, "tiny async": 40, "32 B": 40, "1 MiB": 20, "64 MiB": 6}
# the worker method each cell calls (asyncrl and host path; plain Ray and verl always call their sync `ping`)
TINY_METHOD = {"tiny": "ping", "tiny async": "ping_async"}


def _cpu_seconds() -> float:
    """CPU time of this whole process so far (every thread: Ray's included), user + system."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Sink(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def ping(self, x: int) -> int:
        return x

    @register(Dispatch.ONE_TO_ALL)
    def cpu(self) -> float:
        return _cpu_seconds()

    @register(Dispatch.ONE_TO_ALL)
    async def ping_async(self, x: int) -> int:  # ordered too; runs on the worker's loop, no thread hop
        return x

    @register(Dispatch.DP_COMPUTE)
    def consume(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.shape[0]])  # one row per rank: the controller fetches a few bytes


class PlainSink:
    def __init__(self) -> None:
        from asyncrl.runtime import quiet_tensor_warnings

        quiet_tensor_warnings()
        torch.set_num_threads(1)

    def ping(self, x: int) -> int:
        return x

    def consume(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.shape[0]])

    def cpu(self) -> float:
        return _cpu_seconds()


def _verl_worker_class() -> type | None:
    """verl's Worker with the same two methods, or None when verl is not installed."""
    try:
        from verl import DataProto
        from verl.single_controller.base import Worker as VerlWorker
        from verl.single_controller.base.decorator import Dispatch as VDispatch
        from verl.single_controller.base.decorator import register as vregister
    except Exception as e:  # noqa: BLE001 - any import failure means: no verl column
        global VERL_MISSING
        VERL_MISSING = f"{type(e).__name__}: {e}"
        return None

    class VerlSink(VerlWorker):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            torch.set_num_threads(1)

        @vregister(dispatch_mode=VDispatch.ONE_TO_ALL)
        def ping(self, x: int) -> int:
            return x

        @vregister(dispatch_mode=VDispatch.DP_COMPUTE_PROTO)
        def consume(self, data: Any) -> Any:
            return DataProto.from_dict({"n": torch.tensor([len(data)])})

    return VerlSink


VERL_MISSING = ""


def shards(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    size = t.shape[0] // n
    return [t[r * size:(r + 1) * size] for r in range(n)]


# ---- the variants: each is `async fn(ctx, cell_input) -> result` ------------------------------


async def v_asyncrl(ctx: dict[str, Any], t: torch.Tensor | None) -> Any:
    wg = ctx["wg"]
    return await (getattr(wg, ctx["tiny"])(1) if t is None else wg.consume(t))


async def v_plain(ctx: dict[str, Any], t: torch.Tensor | None) -> Any:
    actors = ctx["actors"]
    if t is None:
        return await asyncio.gather(*(a.ping.remote(1) for a in actors))
    return torch.cat(await asyncio.gather(*(a.consume.remote(s) for a, s in zip(actors, shards(t, len(actors))))))


def _host_submit(wg: RayWorkerGroup, rank: int, method: str, args: tuple[Any, ...], data_parallel: bool) -> Any:
    """One call of `method` on the group's worker process `rank`, submitted as the group
    submits it (its sequencer: numbering, call id, the backend's submit) but without
    dispatch, futures or collect."""
    from asyncrl._host import Payload

    hs = wg._hostset
    payload = Payload(args, {})
    built = (payload, 0 if data_parallel else None, True)
    if hasattr(payload, "sent"):  # the builder packs the payload and builds every rank at once
        wire = payload.wire()
        payload.sent = wire if wire is not payload else None
        build: Any = lambda _ranks, _numbers: [built]
    else:  # (an asyncrl tree from before: a per-rank build, packed by the backend)
        build = lambda _rank, _number: built
    refs, metas, _ = hs.sequencer.submit(wg._role, method, True, data_parallel, (rank,), build)
    return (refs[0], metas[0]) if data_parallel else (refs[0],)


async def v_host(ctx: dict[str, Any], t: torch.Tensor | None) -> Any:
    wg = ctx["wg"]
    n = wg.world_size
    if t is None:
        refs = [r for rank in range(n) for r in _host_submit(wg, rank, ctx["tiny"], (1,), False)]
        return await asyncio.gather(*refs)
    refs = [r for rank, s in enumerate(shards(t, n)) for r in _host_submit(wg, rank, "consume", (s,), True)]
    out = await asyncio.gather(*refs)
    return torch.cat(out[0::2])


async def v_verl(ctx: dict[str, Any], t: torch.Tensor | None) -> Any:
    vwg = ctx["verl"]
    if t is None:
        return vwg.ping(1)  # verl's blocking call (ray.get inside)
    return vwg.consume(ctx["protos"][t.numel()]).batch["n"]


async def v_async_host(ctx: dict[str, Any], t: torch.Tensor | None) -> Any:
    return await v_asyncrl({**ctx, "wg": ctx["wg_async"]}, t)


CPU_OF = {"asyncrl": "wg", "plain Ray": "actors", "host path": "wg", "async host": "wg_async"}
"""The worker processes each variant's calls run in (their CPU time is counted with the controller's)."""


async def _cpu_now(ctx: dict[str, Any], variant: str) -> float:
    """CPU seconds so far of the controller's process plus the worker processes `variant` calls."""
    where = CPU_OF.get(variant)
    if where is None:
        return 0.0
    if where == "actors":
        workers = sum(await asyncio.gather(*(a.cpu.remote() for a in ctx["actors"])))
    else:
        workers = sum(await ctx[where].cpu())
    return _cpu_seconds() + workers


VARIANTS: dict[str, Callable[[dict[str, Any], torch.Tensor | None], Awaitable[Any]]] = {
    "asyncrl": v_asyncrl, "plain Ray": v_plain, "host path": v_host, "async host": v_async_host, "verl": v_verl,
}


# ---- the no-copy check ---------------------------------------------------------------------------


def check_no_copy(wg: RayWorkerGroup, t: torch.Tensor) -> tuple[Any, bool, int]:
    """Run one group call with the backend's submit wrapped; every shard it is handed
    must share the input's storage (a view, not a new allocation). Also returns the
    bytes Ray's serializer makes of those shards (what is written to the object store)."""
    import ray

    sctx = ray._private.worker.global_worker.get_serialization_context()
    backend = wg._hostset.backend
    seen: list[tuple[int, int]] = []
    serialized = 0
    orig = backend.submit

    def spy(*call_args: Any, **kw: Any) -> Any:
        nonlocal serialized
        for x in [*call_args, *kw.values()]:
            x = getattr(x, "payload", x)  # the call message's payload (a tree from before: the payload itself)
            for a in getattr(x, "args", None) or (x if isinstance(x, tuple) else ()):  # a Payload's, or a tuple
                if isinstance(a, torch.Tensor):
                    seen.append((a.untyped_storage().data_ptr(), a.data_ptr()))
                    serialized += sctx.serialize(a).total_bytes
        return orig(*call_args, **kw)

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


# ---- measurement ---------------------------------------------------------------------------------


async def measure(workers: list[int], cells: list[str], reps: int, quick: bool,
                  use_verl: bool) -> tuple[list[dict], list[str]]:
    import ray

    rows, checks = [], []
    plain_cls = ray.remote(PlainSink)
    verl_cls = _verl_worker_class() if use_verl else None
    variants = [v for v in VARIANTS if v != "verl" or verl_cls is not None]
    for n in workers:
        ctx: dict[str, Any] = {"wg": RayWorkerGroup(Sink, world_size=n, name=f"sink{n}")}
        ctx["actors"] = [plain_cls.options(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote()
                         for _ in range(n)]
        ctx["wg_async"] = RayWorkerGroup(Sink, world_size=n, name=f"sink{n}-async-host")
        try:
            await ctx["wg"].setup()
            from asyncrl import host_set as hosts

            hosts.HOST_KIND = "async"  # private: the previous host kind, for the breakdown column
            try:
                await ctx["wg_async"].setup()
            finally:
                hosts.HOST_KIND = None
            await asyncio.gather(*(a.ping.remote(0) for a in ctx["actors"]))
            if verl_cls is not None:
                from verl import DataProto
                from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool
                from verl.single_controller.ray import RayWorkerGroup as VerlGroup

                pool = RayResourcePool([n], use_gpu=False, max_colocate_count=1)
                ctx["verl"] = VerlGroup(pool, RayClassWithInitArgs(cls=ray.remote(verl_cls)), device_name="cpu")
                ctx["protos"] = {}
            for cell in cells:
                ctx["tiny"] = TINY_METHOD.get(cell, "ping")
                t = None if CELLS[cell] is None else torch.arange(CELLS[cell], dtype=torch.int32)  # type: ignore[arg-type]
                if t is not None:
                    fut, ok, ser = check_no_copy(ctx["wg"], t)
                    got = await fut
                    assert got.tolist() == [t.shape[0] // n] * n, got
                    checks.append(f"{n} workers, {cell}: {'every shard is a view of the input' if ok else 'COPY MADE'}; "
                                  f"Ray serializes the shards to {ser:,} bytes for {t.numel() * t.element_size():,} "
                                  f"payload bytes")
                    if "verl" in ctx:
                        ctx["protos"][t.numel()] = DataProto.from_dict({"x": t})
                expected = [1] * n if t is None else [t.shape[0] // n] * n
                for v in variants:  # warm-up, and every variant computes the same thing
                    for _ in range(2):
                        got = await VARIANTS[v](ctx, t)
                    got = got.tolist() if isinstance(got, torch.Tensor) else list(got)
                    assert got == expected, (v, cell, got, expected)
                k = max(1, CALLS_PER_REP[cell] // (4 if quick else 1))
                times: dict[str, list[float]] = {v: [] for v in variants}
                cpus: dict[str, list[float]] = {v: [] for v in variants if v in CPU_OF}
                for rep in range(reps):
                    for v in variants[rep % len(variants):] + variants[:rep % len(variants)]:
                        fn = VARIANTS[v]
                        c0 = await _cpu_now(ctx, v)
                        t0 = time.perf_counter()
                        for _ in range(k):
                            await fn(ctx, t)
                        times[v].append((time.perf_counter() - t0) / k)
                        if v in cpus:
                            cpus[v].append((await _cpu_now(ctx, v) - c0) / k)
                med = {v: statistics.median(ts) for v, ts in times.items()}
                rows.append({"workers": n, "cell": cell, **med,
                             **{f"cpu {v}": statistics.median(cs) for v, cs in cpus.items()}})
                print(f"  {n} workers {cell:>6}: " + "  ".join(f"{v} {med[v] * 1e6:8.0f} us" for v in variants)
                      + f"  asyncrl/plain {med['asyncrl'] / med['plain Ray']:.2f}x", flush=True)
        finally:
            await ctx["wg"].close()
            await ctx["wg_async"].close()
            for a in ctx["actors"]:
                ray.kill(a)
            for w in getattr(ctx.get("verl"), "workers", []):
                ray.kill(w)
    return rows, checks


def table(rows: list[dict]) -> str:
    has_verl = any("verl" in r for r in rows)
    head = ["workers", "call", "asyncrl µs", "plain Ray µs", "asyncrl / plain Ray", "host path µs",
            "host path / plain Ray", "async host µs", "async host / plain Ray"]
    if has_verl:
        head += ["verl µs", "asyncrl / verl"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        call = {"tiny": "tiny ONE_TO_ALL", "tiny async": "tiny ONE_TO_ALL, `async def`"}.get(
            r["cell"], f"{r['cell']} DP_COMPUTE")
        cells = [str(r["workers"]), call, f"{r['asyncrl'] * 1e6:.0f}", f"{r['plain Ray'] * 1e6:.0f}",
                 f"{r['asyncrl'] / r['plain Ray']:.2f}x", f"{r['host path'] * 1e6:.0f}",
                 f"{r['host path'] / r['plain Ray']:.2f}x", f"{r['async host'] * 1e6:.0f}",
                 f"{r['async host'] / r['plain Ray']:.2f}x"]
        if has_verl:
            cells += [f"{r['verl'] * 1e6:.0f}", f"{r['asyncrl'] / r['verl']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_table(rows: list[dict]) -> str:
    """CPU time per call (the controller's process and the worker processes it calls, every
    thread), beside plain Ray's: what a call costs the machine, much less moved by other jobs
    than the wall time is."""
    head = ["workers", "call", "asyncrl CPU µs", "plain Ray CPU µs", "asyncrl / plain Ray", "host path / plain Ray",
            "async host / plain Ray"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        if "cpu plain Ray" not in r:
            continue
        call = {"tiny": "tiny ONE_TO_ALL", "tiny async": "tiny ONE_TO_ALL, `async def`"}.get(
            r["cell"], f"{r['cell']} DP_COMPUTE")
        p = r["cpu plain Ray"]
        lines.append("| " + " | ".join([str(r["workers"]), call, f"{r['cpu asyncrl'] * 1e6:.0f}", f"{p * 1e6:.0f}",
                                         f"{r['cpu asyncrl'] / p:.2f}x", f"{r['cpu host path'] / p:.2f}x",
                                         f"{r['cpu async host'] / p:.2f}x"]) + " |")
    return "\n".join(lines)


def _driver_zero_copy() -> bool:
    from ray._private import ray_constants

    return bool(ray_constants.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 worker, tiny and 1 MiB, 2 repetitions")
    p.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts (default 4)")
    p.add_argument("--cells", nargs="+", default=None, choices=list(CELLS))
    p.add_argument("--reps", type=int, default=None, help="repetitions per cell (median reported)")
    p.add_argument("--no-verl", action="store_true", help="leave verl out even when it is installed")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="the controller's event loop, for asyncrl and plain Ray alike (asyncrl.run)")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--late-zero-copy", action="store_true",
                   help="do not set RAY_ENABLE_ZERO_COPY_TORCH_TENSORS before importing ray (leave it to asyncrl.init)")
    args = p.parse_args()
    workers = args.workers or ([1] if args.quick else [4])
    cells = args.cells or (["tiny", "1 MiB"] if args.quick else list(CELLS))
    reps = args.reps or (2 if args.quick else 9)
    load0 = os.getloadavg()[0]
    asyncrl.init(num_cpus=64)
    try:
        rows, checks = asyncrl.run(measure(workers, cells, reps, args.quick, use_verl=not args.no_verl), loop=args.loop)
        has_verl = any("verl" in r for r in rows)
        verl_note = ("`verl` = verl's RayWorkerGroup, blocking call (ONE_TO_ALL / DP_COMPUTE_PROTO on a DataProto)."
                     if has_verl else
                     "verl: not measured (" + ("--no-verl" if args.no_verl else f"not importable here: {VERL_MISSING}; "
                                               "install it beside asyncrl with `.venv/bin/pip install --no-deps "
                                               "verl==0.9.1 omegaconf`") + ").")
        text = "\n\n".join([
            "# Dispatch overhead: asyncrl group call vs plain Ray actors (and verl)",
            run_header("dispatch_overhead.py", machine_note=load_note(load0, os.getloadavg()[0]),
                       extra=f"; zero-copy torch tensors in the controller: {_driver_zero_copy()}; "
                             f"controller loop: {args.loop}"),
            f"Median time per call over {reps} repetitions (each of "
            f"{', '.join(f'{CALLS_PER_REP[c]} calls for {c}' for c in cells)}"
            f"{', divided by 4 in --quick' if args.quick else ''}), variant order rotating, after 2 warm-up calls "
            "per variant. `plain Ray` (the floor) = `asyncio.gather` over `actor.method.remote` on ordinary Ray "
            "actors (for DP: the hand-written split / put / `torch.cat`). `host path` (breakdown) = asyncrl's own "
            "worker processes called as its Ray backend calls them, without the controller's dispatch, futures "
            "and collect. " + verl_note,
            table(rows),
            "CPU time per call, the same runs (the controller's process plus the worker processes the "
            "variant calls, every thread, user + system; the median over the repetitions):",
            cpu_table(rows),
            "No-copy check (the shards handed to the backend share the input tensor's storage, at the expected "
            "offsets) and the bytes Ray's serializer makes of them in the controller:\n\n"
            + "\n".join(f"- {c}" for c in checks),
        ]) + "\n"
    finally:
        asyncrl.shutdown()
    write_result(args.out, text)


if __name__ == "__main__":
    main()
