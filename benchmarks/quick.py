"""Every benchmark's ``--quick`` run (tiny sizes), one after another in one process: a smoke
test that each still runs end to end and writes its table (what ``tests/benchmarks`` runs).

Each benchmark runs as its own script would (``__main__``, its own argv, its own embedded
Ray, stopped after it); the process start and the imports (about 4 s each on the 2-core
machine) are paid once instead of once per benchmark. With ``--one-ray`` the benchmarks
share one embedded Ray instead (their own ``asyncrl.init`` finds it running, their
``asyncrl.shutdown`` leaves it up; it stops after the last one): Ray's start and stop, about
5 s each time on the 2-core machine, are paid once too. ``loop_lag`` (it measures Ray's
start) and ``weight_sync`` (a bigger object store) always get a Ray of their own. Quick runs
measure nothing worth reading: their tables only show that the benchmark works.

    python benchmarks/quick.py --out-dir /tmp/quick                 # all of them
    python benchmarks/quick.py --out-dir /tmp/quick overlap inflight
    python benchmarks/quick.py --out-dir /tmp/quick --one-ray dispatch_overhead pipelining

Writes ``<name>.md`` (the benchmark's table; overlap and offpolicy also a PNG), ``<name>.log``
(what it printed) and ``status.json`` (per benchmark: ok, seconds, the error's traceback)
into ``--out-dir``; prints one line per benchmark; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent

QUICK: dict[str, tuple[str, ...]] = {  # benchmark (its script's name) -> extra arguments of its quick run
    "dispatch_overhead": (),
    "pipelining": (),
    "inflight": (),
    "fetch_wakeups": (),
    "loop_lag": (),
    "pipelined_hop": ("--after-ms", "1"),
    "local_chain": (),
    "overlap": (),
    "offpolicy": (),
    "weight_sync": (),
    "engine_throughput": (),
    "longtail": (),
    "token_budget": (),
    "cluster_twin": (),
}

OWN_RAY = frozenset({"loop_lag", "weight_sync"})
"""Benchmarks that start a Ray of their own even under ``--one-ray``: loop_lag times Ray's start;
weight_sync asks for a 3 GiB object store."""
ONE_RAY_CPUS = 64
"""Logical CPUs of the shared Ray: the most any benchmark's own ``asyncrl.init`` asks for."""


def run_one(name: str, out_dir: Path, one_ray: bool = False) -> dict[str, object]:
    """Run benchmark `name` with ``--quick --out <out_dir>/<name>.md`` as ``__main__``;
    `one_ray`: on the shared Ray (started here if it is not running), unless `name` is in OWN_RAY."""
    import asyncrl

    shared = one_ray and name not in OWN_RAY
    stop = asyncrl.shutdown
    if shared:
        asyncrl.init(num_cpus=ONE_RAY_CPUS)
    else:
        stop()  # a Ray of its own: not the shared one
    script = HERE / f"{name}.py"
    argv = [str(script), "--quick", "--out", str(out_dir / f"{name}.md"), *QUICK[name]]
    t0 = time.perf_counter()
    status: dict[str, object] = {"ok": False, "error": None}
    saved_argv = sys.argv
    with open(out_dir / f"{name}.log", "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        sys.argv = argv
        if shared:
            asyncrl.shutdown = lambda: None  # type: ignore[assignment] # the benchmark's own stop leaves it up
        try:
            runpy.run_path(str(script), run_name="__main__")
            status["ok"] = True
        except SystemExit as e:  # argparse, or a benchmark's own exit code
            status["ok"] = e.code in (0, None)
            if not status["ok"]:
                status["error"] = f"SystemExit({e.code!r})"
        except BaseException:  # noqa: BLE001 - reported per benchmark; the others still run
            status["error"] = traceback.format_exc()
        finally:
            sys.argv = saved_argv
            asyncrl.shutdown = stop  # type: ignore[assignment]
            if not shared:
                stop()  # the next benchmark starts its own Ray, whatever this one left
    status["seconds"] = round(time.perf_counter() - t0, 1)
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of them: {', '.join(QUICK)})")
    p.add_argument("--out-dir", required=True, help="folder for the tables, logs and status.json")
    p.add_argument("--one-ray", action="store_true",
                   help=f"one embedded Ray for every benchmark but {', '.join(sorted(OWN_RAY))} (see above)")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in QUICK]
    if unknown:
        p.error(f"no quick run for {', '.join(map(repr, unknown))}; choose from {', '.join(QUICK)}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # What each benchmark sets before it imports ray; in one process only the first import counts.
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
    os.environ.pop("RAY_ADDRESS", None)  # an embedded Ray of its own, never a running cluster
    sys.path.insert(0, str(HERE))  # `from _common import ...`, as in the script's own folder
    statuses: dict[str, dict[str, object]] = {}
    for name in args.names or QUICK:
        statuses[name] = run_one(name, out_dir, args.one_ray)
        (out_dir / "status.json").write_text(json.dumps(statuses, indent=1))
        s = statuses[name]
        print(f"{name:18s} {'ok' if s['ok'] else 'FAILED'} {s['seconds']:6.1f} s", flush=True)
    if args.one_ray:
        import asyncrl

        asyncrl.shutdown()
    return 0 if all(s["ok"] for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
