"""The 64 MiB call across asyncrl versions, against a hand-written baseline held fixed.

``dispatch_overhead.py`` compares asyncrl with plain Ray *inside one Ray session that
asyncrl started*: both get the flags ``asyncrl.init`` sets (zero-copy torch tensors), so
its ratio cannot show a change in what those flags do, nor an asyncrl that got slower
together with its baseline. This benchmark holds the baseline fixed and swaps asyncrl:

* ``user Ray``: the hand-written split / put / ``torch.cat`` in a process of its own that
  starts Ray the way a user does (``ray.init()``, no asyncrl, Ray's defaults);
* ``user Ray + zero-copy``: the same with ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`` set
  before ``import ray`` (the flag asyncrl sets);
* one ``asyncrl@<name>`` process per asyncrl source tree (``--src name=PATH``, a tree
  holding an ``asyncrl/`` package, e.g. ``git archive <commit> asyncrl | tar -x -C PATH``):
  ``asyncrl.init()`` then ``await wg.consume(t)`` on a ``DP_COMPUTE`` method; in the same
  process and Ray session it also times the hand-written code (``same-session Ray``), as
  ``dispatch_overhead.py`` does.

Every process starts its own Ray with ``--workers`` (4) workers, makes 2 warm-up calls,
then ``--reps`` repetitions of ``k`` sequential calls; the processes run in rounds
(``--rounds``, 3), the order rotating between rounds (A/B interleaved). The table gives
each process's median time per call per round and its ratio to the fixed ``user Ray``
baseline of the same round. The asyncrl processes import asyncrl from their tree only
(``PYTHONPATH``; the driver and the workers print the file they imported, checked).

    python benchmarks/large_batch_ab.py --src now=. --src old=/tmp/ab/940cf44 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CELLS = {"64 MiB": ((64 << 20) // 4, 6), "1 MiB": ((1 << 20) // 4, 20), "32 B": (8, 40)}


def _shards(t: Any, n: int) -> list[Any]:
    size = t.shape[0] // n
    return [t[r * size:(r + 1) * size] for r in range(n)]


class PlainSink:
    """The hand-written worker: one Ray actor per rank."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)

    def consume(self, t: Any) -> Any:
        import torch

        return torch.tensor([t.shape[0]])


async def _plain(actors: list[Any], t: Any) -> Any:
    import torch

    return torch.cat(await asyncio.gather(*(a.consume.remote(s) for a, s in zip(actors, _shards(t, len(actors))))))


async def _time(fns: dict[str, Any], t: Any, k: int, reps: int, expected: list[int]) -> dict[str, float]:
    for name, fn in fns.items():  # warm-up; every variant computes the same thing
        for _ in range(2):
            got = await fn(t)
        assert got.tolist() == expected, (name, got, expected)
    times: dict[str, list[float]] = {v: [] for v in fns}
    order = list(fns)
    for rep in range(reps):
        for v in order[rep % len(order):] + order[:rep % len(order)]:
            t0 = time.perf_counter()
            for _ in range(k):
                await fns[v](t)
            times[v].append((time.perf_counter() - t0) / k)
    return {v: statistics.median(ts) for v, ts in times.items()}


def child(kind: str, workers: int, cells: list[str], reps: int) -> dict[str, Any]:
    """One process: start Ray, time the cells, return medians (seconds per call)."""
    if kind == "user-zc":
        os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1"
    import torch

    out: dict[str, Any] = {"kind": kind}
    if kind.startswith("user"):
        import ray

        ray.init(num_cpus=16, logging_level="WARNING", log_to_driver=False)
        try:
            actors = [ray.remote(PlainSink).options(num_cpus=1).remote() for _ in range(workers)]

            async def run() -> None:
                for cell in cells:
                    n_el, k = CELLS[cell]
                    t = torch.arange(n_el, dtype=torch.int32)
                    med = await _time({"plain": lambda x: _plain(actors, x)}, t, k, reps, [n_el // workers] * workers)
                    out[cell] = med
            asyncio.run(run())
        finally:
            ray.shutdown()
        return out

    import asyncrl
    from asyncrl import Dispatch, RayWorkerGroup, Worker, register

    class Sink(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def where(self) -> str:
            import asyncrl as a

            return a.__file__

        @register(Dispatch.DP_COMPUTE)
        def consume(self, t: torch.Tensor) -> torch.Tensor:
            return torch.tensor([t.shape[0]])

    asyncrl.init(num_cpus=16)
    import ray

    out["driver_file"] = asyncrl.__file__
    try:
        async def run() -> None:
            wg = RayWorkerGroup(Sink, world_size=workers, name="ab")
            actors = [ray.remote(PlainSink).options(num_cpus=1).remote() for _ in range(workers)]
            try:
                await wg.setup()
                out["worker_files"] = sorted(set(await wg.where()))
                for cell in cells:
                    n_el, k = CELLS[cell]
                    t = torch.arange(n_el, dtype=torch.int32)
                    fns = {"asyncrl": lambda x: wg.consume(x), "plain": lambda x: _plain(actors, x)}
                    out[cell] = await _time(fns, t, k, reps, [n_el // workers] * workers)
            finally:
                await wg.close()
        asyncio.run(run())
    finally:
        asyncrl.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", action="append", default=[], help="NAME=PATH of an asyncrl source tree (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--cells", nargs="+", default=["64 MiB"], choices=list(CELLS))
    p.add_argument("--out", default=os.path.join(HERE, "results", "large_batch_ab.md"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.workers, args.cells, args.reps)), flush=True)
        return

    procs: list[tuple[str, str | None]] = [("user Ray", None), ("user Ray + zero-copy", None)]
    procs += [(f"asyncrl@{s.split('=', 1)[0]}", os.path.abspath(s.split("=", 1)[1])) for s in args.src]
    load0 = os.getloadavg()[0]
    results: list[dict[str, dict[str, Any]]] = []
    for rnd in range(args.rounds):
        order = procs[rnd % len(procs):] + procs[:rnd % len(procs)]
        got: dict[str, dict[str, Any]] = {}
        for name, src in order:
            env = dict(os.environ)
            env.pop("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", None)
            kind = {"user Ray": "user", "user Ray + zero-copy": "user-zc"}.get(name, "asyncrl")
            if src is not None:
                env["PYTHONPATH"] = src
            cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--workers", str(args.workers),
                   "--reps", str(args.reps), "--cells", *args.cells]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp", timeout=600)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:
                raise SystemExit(f"{name} failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
            res = json.loads(line[0][len("RESULT "):])
            if src is not None:
                want = os.path.join(src, "asyncrl", "__init__.py")
                files = [res["driver_file"], *res["worker_files"]]
                assert all(os.path.realpath(f) == os.path.realpath(want) for f in files), (name, files, want)
            got[name] = res
            print(f"round {rnd + 1} {name}: " + "  ".join(
                f"{c} " + " ".join(f"{v} {s * 1e3:.1f} ms" for v, s in res[c].items()) for c in args.cells), flush=True)
        results.append(got)
    load1 = os.getloadavg()[0]

    lines = ["# The large-batch call across asyncrl versions, against a fixed hand-written baseline", "",
             f"Run {time.strftime('%Y-%m-%dT%H:%M:%S')} on {os.cpu_count()} CPUs (shared with other jobs: 1-minute "
             f"load average {load0:.1f} at the start, {load1:.1f} at the end); {args.workers} workers, "
             f"{args.reps} repetitions per process, {args.rounds} rounds, process order rotating per round.", "",
             "Command: `python benchmarks/large_batch_ab.py " + " ".join(f"--src {s}" for s in args.src)
             + f" --rounds {args.rounds} --cells {' '.join(repr(c) for c in args.cells)}`", "",
             "Median ms per call; `/ user Ray` = against the fixed hand-written baseline of the same round "
             "(its own process, `ray.init()` with Ray's defaults); `/ same-session` = against the hand-written code "
             "in the asyncrl process's own Ray session (the ratio `dispatch_overhead.py` reports).", ""]
    for cell in args.cells:
        lines += [f"## {cell} DP_COMPUTE", "",
                  "| process | " + " | ".join(f"round {i + 1} ms" for i in range(args.rounds))
                  + " | / user Ray (per round) | / same-session (per round) |",
                  "|---|" + "---:|" * (args.rounds + 2)]
        for name, _ in procs:
            ms = [results[i][name][cell]["asyncrl" if "asyncrl" in results[i][name][cell] else "plain"]
                  for i in range(args.rounds)]
            base = [results[i]["user Ray"][cell]["plain"] for i in range(args.rounds)]
            vs_user = ", ".join(f"{a / b:.2f}x" for a, b in zip(ms, base))
            same = ", ".join(f"{results[i][name][cell]['asyncrl'] / results[i][name][cell]['plain']:.2f}x"
                             for i in range(args.rounds)) if name.startswith("asyncrl") else ""
            lines.append(f"| {name} | " + " | ".join(f"{m * 1e3:.1f}" for m in ms) + f" | {vs_user} | {same} |")
        lines.append("")
    text = "\n".join(lines)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
