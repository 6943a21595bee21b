"""Where a small call's time goes: CPU per call on both sides, and profiles.

For a tiny ``ONE_TO_ALL`` call and a 1 MiB ``DP_COMPUTE`` call to ``--workers`` (4)
workers, and the same work done with plain Ray actors (``asyncio.gather`` over
``actor.method.remote``), measures per call:

* controller CPU: the event-loop thread (``time.thread_time``) and the whole process
  (``time.process_time``: adds Ray's driver threads that serialize, submit and receive);
* worker CPU: the sum over the worker processes (``/proc/<pid>/stat`` user + system),
  i.e. asyncrl's worker host (or the plain actor) plus Ray's core worker threads;
* ``.remote()`` calls issued per group call (counted with cProfile).

CPU time is what a busy machine cannot hide: wall time waits for a CPU slice, CPU time
does not. With ``--cprofile`` it also prints the controller's top functions for one
variant; with ``--pyspy DIR`` it records the rank-0 worker process of each variant with
py-spy (``pip install py-spy``) and prints the self time of the hottest frames.

With ``--timeline`` it splits instead the wall time of a data-parallel call (32 B and 1 MiB)
into segments, per variant, interleaved: the controller's issue to the first rank's
method entry, the spread of the ranks' entries, the method itself, and the last rank's
method exit to the controller holding the concatenated result (the worker methods stamp
``time.time_ns()``, one clock for every process on the machine).

    python benchmarks/profile_calls.py                 # CPU per call, both variants, both calls
    python benchmarks/profile_calls.py --cprofile asyncrl --calls 500
    python benchmarks/profile_calls.py --pyspy /tmp/prof --calls 3000
    python benchmarks/profile_calls.py --timeline --calls 20 --rounds 15   # where a DP call's wall time goes
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import io
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")

import torch  # noqa: E402

import asyncrl  # noqa: E402
from asyncrl import Dispatch, RayWorkerGroup, Worker, register  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


class Sink(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def ping(self, x: int) -> int:
        return x

    @register(Dispatch.DP_COMPUTE)
    def consume(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.shape[0]])

    @register(Dispatch.DP_COMPUTE)
    def consume_stamped(self, t: torch.Tensor) -> torch.Tensor:
        return _stamped(t)

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


def _stamped(t: torch.Tensor) -> torch.Tensor:
    """One row per rank: [rows, entry ns, exit ns] (the method's own work is reading its input's length)."""
    entry = time.time_ns()
    rows = t.shape[0]
    return torch.tensor([[rows, entry, time.time_ns()]], dtype=torch.int64)


class PlainSink:
    def __init__(self) -> None:
        torch.set_num_threads(1)

    def ping(self, x: int) -> int:
        return x

    def consume(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.shape[0]])

    def consume_stamped(self, t: torch.Tensor) -> torch.Tensor:
        return _stamped(t)

    def pid(self) -> int:
        return os.getpid()


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime + stime


VARIANTS = ("asyncrl", "async host", "plain")


async def one(variant: str, ctx: dict[str, Any], t: torch.Tensor | None) -> Any:
    if variant in ("asyncrl", "async host"):
        wg = ctx["wg" if variant == "asyncrl" else "wg_async"]
        return await (wg.ping(1) if t is None else wg.consume(t))
    actors = ctx["actors"]
    if t is None:
        return await asyncio.gather(*(a.ping.remote(1) for a in actors))
    size = t.shape[0] // len(actors)
    return torch.cat(await asyncio.gather(*(a.consume.remote(t[r * size:(r + 1) * size])
                                            for r, a in enumerate(actors))))


async def stamped(variant: str, ctx: dict[str, Any], t: torch.Tensor) -> torch.Tensor:
    if variant in ("asyncrl", "async host"):
        return await ctx["wg" if variant == "asyncrl" else "wg_async"].consume_stamped(t)
    actors = ctx["actors"]
    size = t.shape[0] // len(actors)
    return torch.cat(await asyncio.gather(*(a.consume_stamped.remote(t[r * size:(r + 1) * size])
                                            for r, a in enumerate(actors))))


async def timeline(ctx: dict[str, Any], calls: int, rounds: int) -> None:
    """Where a DP call's wall time goes, per variant (medians over calls, µs)."""
    segs = ("issue -> 1st entry", "1st -> last entry", "method (max)", "last exit -> result", "total")
    for name, t in (("32 B DP_COMPUTE", torch.arange(8, dtype=torch.int32)),
                    ("1 MiB DP_COMPUTE", torch.arange((1 << 20) // 4, dtype=torch.int32))):
        for v in VARIANTS:
            for _ in range(10):
                await stamped(v, ctx, t)
        got: dict[str, list[tuple[int, ...]]] = {v: [] for v in VARIANTS}
        load0 = os.getloadavg()[0]
        for r in range(rounds):
            for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                for _ in range(calls):
                    t0 = time.time_ns()
                    out = await stamped(v, ctx, t)
                    t1 = time.time_ns()
                    entry, exit_ = out[:, 1], out[:, 2]
                    got[v].append((int(entry.min()) - t0, int(entry.max() - entry.min()), int((exit_ - entry).max()),
                                   t1 - int(exit_.max()), t1 - t0))
        print(f"\n{name}, where the wall time goes ({rounds} x {calls} calls per variant, interleaved; load "
              f"{load0:.1f} -> {os.getloadavg()[0]:.1f}; µs, medians):")
        print(f"  {'variant':10s} " + " ".join(f"{s_:>20s}" for s_ in segs))
        for v, rows in got.items():
            print(f"  {v:10s} " + " ".join(f"{statistics.median(x[i] for x in rows) / 1e3:20.0f}" for i in range(len(segs))))


async def cpu_per_call(variant: str, ctx: dict[str, Any], t: torch.Tensor | None, calls: int) -> dict[str, float]:
    pids = ctx["pids"][variant]
    w0 = sum(proc_cpu(p) for p in pids)
    c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
    for _ in range(calls):
        await one(variant, ctx, t)
    c1, p1, t1 = time.thread_time(), time.process_time(), time.perf_counter()
    w1 = sum(proc_cpu(p) for p in pids)
    return {"wall": (t1 - t0) / calls, "thread": (c1 - c0) / calls, "process": (p1 - p0) / calls,
            "workers": (w1 - w0) / calls}


async def remotes_per_call(variant: str, ctx: dict[str, Any], t: torch.Tensor | None) -> int:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        await one(variant, ctx, t)
    prof.disable()
    st = pstats.Stats(prof)
    n = sum(v[1] for k, v in st.stats.items() if k[2] == "_remote" and "actor.py" in k[0])  # type: ignore[attr-defined]
    return n // 10


def pyspy_summary(path: str, top: int = 25) -> str:
    """Self time per frame (leaf) and inclusive time of asyncrl frames, from py-spy's raw output."""
    self_t: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            n = int(count)
            total += n
            frames = stack.split(";")
            self_t[frames[-1]] += n
            for fr in set(frames):
                incl[fr] += n
    out = [f"  {total} samples; top self time:"]
    for fr, n in self_t.most_common(top):
        out.append(f"    {100 * n / total:5.1f}%  {fr}")
    out.append("  inclusive, asyncrl / ray frames:")
    for fr, n in incl.most_common():
        if ("asyncrl" in fr or "_raylet" in fr or "concurrent" in fr) and n / total > 0.02:
            out.append(f"    {100 * n / total:5.1f}%  {fr}")
    return "\n".join(out[:80])


async def main_async(args: argparse.Namespace) -> None:
    import ray

    n = args.workers
    ctx: dict[str, Any] = {"wg": RayWorkerGroup(Sink, world_size=n, name="prof")}
    plain = ray.remote(PlainSink)
    ctx["actors"] = [plain.options(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote()
                     for _ in range(n)]
    await ctx["wg"].setup()  # no concurrent method: the threaded host
    from asyncrl import host_set as hosts

    ctx["wg_async"] = RayWorkerGroup(Sink, world_size=n, name="prof-async-host")
    hosts.HOST_KIND = "async"  # private: the host kind of a worker with a concurrent method, for comparison
    try:
        await ctx["wg_async"].setup()
    finally:
        hosts.HOST_KIND = None
    ctx["pids"] = {"asyncrl": await ctx["wg"].pid(), "async host": await ctx["wg_async"].pid(),
                   "plain": await asyncio.gather(*(a.pid.remote() for a in ctx["actors"]))}
    cells = {"tiny ONE_TO_ALL": None, "1 MiB DP_COMPUTE": torch.arange((1 << 20) // 4, dtype=torch.int32)}
    try:
        if args.timeline:
            await timeline(ctx, args.calls, args.rounds)
            cells = {}
        for name, t in cells.items():
            for v in VARIANTS:
                for _ in range(20):
                    await one(v, ctx, t)
            res: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
            for r in range(args.rounds):
                for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                    res[v].append(await cpu_per_call(v, ctx, t, args.calls))
            med = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in res.items()}
            rem = {v: await remotes_per_call(v, ctx, t) for v in res}
            print(f"\n{name}, {n} workers, {args.calls} calls x {args.rounds} rounds (µs per call, medians; "
                  f"load {os.getloadavg()[0]:.1f}):")
            print(f"  {'variant':10s} {'wall':>8s} {'ctrl thread':>12s} {'ctrl process':>13s} {'workers':>9s} {'.remote()':>10s}")
            for v, m in med.items():
                print(f"  {v:10s} {m['wall'] * 1e6:8.0f} {m['thread'] * 1e6:12.0f} {m['process'] * 1e6:13.0f} "
                      f"{m['workers'] * 1e6:9.0f} {rem[v]:10d}")
            p = med["plain"]
            for v in VARIANTS[:2]:
                m = med[v]
                print(f"  {v + ' / plain':22s} " + "  ".join(f"{k} {m[k] / p[k]:.2f}x" for k in ("wall", "thread", "process", "workers")))
            if args.cprofile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    await one(args.cprofile, ctx, t)
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
                print(f"\n  cProfile, controller, {args.cprofile}, {name}, {args.calls} calls, by self time:")
                print(s.getvalue())
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
                print(f"\n  cProfile, controller, {args.cprofile}, {name}, by cumulative time:")
                print(s.getvalue())
            if args.pyspy:
                spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
                os.makedirs(args.pyspy, exist_ok=True)
                for v in VARIANTS:
                    out = os.path.join(args.pyspy, f"{v}-{name.split()[0]}-{name.split()[1]}.txt")
                    proc = subprocess.Popen([spy, "record", "-p", str(ctx["pids"][v][0]), "-r", "500", "--threads",
                                             "-f", "raw", "-o", out, "-d", "60", "--nonblocking"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    await asyncio.sleep(1.0)
                    for _ in range(args.calls):
                        await one(v, ctx, t)
                    proc.send_signal(2)  # SIGINT: py-spy writes what it has
                    await asyncio.to_thread(proc.wait)
                    print(f"\n  py-spy, rank-0 worker process, {v}, {name} ({out}):")
                    print(pyspy_summary(out) if os.path.exists(out) else "  (no output)")
    finally:
        await ctx["wg"].close()
        await ctx["wg_async"].close()
        for a in ctx["actors"]:
            ray.kill(a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cprofile", choices=list(VARIANTS), default=None)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--pyspy", default=None, help="record the rank-0 worker of each variant with py-spy into DIR")
    p.add_argument("--timeline", action="store_true",
                   help="instead of CPU per call: split a DP call's wall time into segments (issue, entries, "
                        "method, return), per variant; --calls per variant and round, --rounds rounds")
    args = p.parse_args()
    asyncrl.init(num_cpus=16)
    try:
        asyncio.run(main_async(args))
    finally:
        asyncrl.shutdown()


if __name__ == "__main__":
    main()
