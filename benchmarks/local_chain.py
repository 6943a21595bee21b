"""A two-call chain in one worker process: producer -> consumer, the consumer's input pipelined.

Two colocated roles share one worker process (``colocate``, one rank, threaded host): the
``maker`` role's ``make`` returns a TensorDict, the ``user`` role's ``use`` takes it as a
pipelined GroupFuture, never awaited by the controller — as ``advantages`` feeds
``critic_update`` and ``actor_update`` on the training process of a PPO step. Three ways,
interleaved, variant order rotating:

- **asyncrl, same process**: the default (``local_results=4``): the consumer's input
  travels as a marker and the host hands it the producer's result from its own memory at
  its turn (``asyncrl/_deferred.py``, ``LocalShard``);
- **asyncrl, through the controller**: the same groups with ``local_results=0``: the input
  is nested in the call and the worker fetches it through its owner, the controller
  (worker -> controller -> the same worker);
- **plain Ray**: what a user writes instead: one Ray actor with both methods,
  ``actor.use.remote(actor.make.remote(td))`` — the ObjectRef passed top-level (Ray's
  submitter waits at the owner for the producer's result, then pushes the task with it).

Per variant: the chain (issue of ``make`` -> ``use``'s result awaited, ms) and the hop
(``make`` returned -> ``use`` started on the worker, ms, one monotonic clock). Two payloads:
``small`` (``--fields`` fields of 16 x 8 floats) and ``1 MiB`` (one 4 x 65536 float32 tensor).

    python benchmarks/local_chain.py            # 60 repetitions per variant and payload
    python benchmarks/local_chain.py --quick    # 5 (tests)

Writes ``benchmarks/results/local_chain.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from _common import load_note, run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)
import asyncrl  # noqa: E402
from asyncrl import Dispatch, Worker, colocate, register  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "local_chain.md")
VARIANTS = ("asyncrl, same process", "asyncrl, through the controller", "plain Ray")


def _made(td: TensorDict) -> TensorDict:
    out = td.clone()
    out.set("t_end", torch.full((td.batch_size[0],), time.monotonic(), dtype=torch.float64))
    return out


def _used(td: TensorDict) -> TensorDict:
    t = time.monotonic()
    n = td.batch_size[0]
    return TensorDict({"hop": (torch.full((n,), t, dtype=torch.float64) - td["t_end"]) * 1e3}, batch_size=[n])


class Maker(Worker):
    """Returns a copy of its batch, stamped with when it returned."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def make(self, td: TensorDict) -> TensorDict:
        return _made(td)


class User(Worker):
    """Reports how long after the producer returned it started (ms)."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def use(self, td: TensorDict) -> TensorDict:
        return _used(td)


class PlainChain:
    """The same two methods on one plain (sync, single-threaded) Ray actor."""

    def make(self, td: TensorDict) -> TensorDict:
        return _made(td)

    def use(self, td: TensorDict) -> TensorDict:
        return _used(td)


def payloads(fields: int) -> dict[str, TensorDict]:
    return {
        "small": TensorDict({f"x{i}": torch.zeros(16, 8) for i in range(fields)}, batch_size=[16]),
        "1 MiB": TensorDict({"x": torch.zeros(4, 65536)}, batch_size=[4]),
    }


async def measure(reps: int, fields: int, warmup: int = 5) -> dict[tuple[str, str], list[tuple[float, float]]]:
    import ray

    await asyncrl.ainit()
    on = colocate({"maker": Maker, "user": User}, world_size=1, name="chain_local")
    off = colocate({"maker": Maker, "user": User}, world_size=1, name="chain_ray", local_results=0)
    await asyncio.gather(on.setup(), off.setup())
    plain = ray.remote(PlainChain).options(num_cpus=1).remote()
    tds = payloads(fields)
    out: dict[tuple[str, str], list[tuple[float, float]]] = {(v, p): [] for p in tds for v in VARIANTS}
    names = list(out)
    try:
        for i in range(warmup + reps):
            k = i % len(names)
            for v, p in names[k:] + names[:k]:  # rotate the variant order
                td = tds[p]
                t = time.perf_counter()
                if v == "plain Ray":
                    got = await plain.use.remote(plain.make.remote(td))
                else:
                    g = on if v == "asyncrl, same process" else off
                    got = await g["user"].use(g["maker"].make(td))
                wall = (time.perf_counter() - t) * 1e3
                if i >= warmup:
                    out[(v, p)].append((wall, float(got["hop"][0])))
        assert on["user"].stats.inputs_local == len(tds) * (warmup + reps) and off["user"].stats.inputs_local == 0
    finally:
        ray.kill(plain)
        await on.close()
        await off.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 repetitions")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per variant and payload (default 60)")
    ap.add_argument("--fields", type=int, default=6, help="fields of the small TensorDict")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 60)
    load0 = os.getloadavg()[0]
    got = asyncio.run(measure(reps, args.fields))
    load1 = os.getloadavg()[0]
    rows = []
    for (v, p), xs in got.items():
        walls, hops = [w for w, _ in xs], [h for _, h in xs]
        plain = statistics.median(w for w, _ in got[("plain Ray", p)])
        plain_hop = statistics.median(h for _, h in got[("plain Ray", p)])
        rows.append(f"| {p} | {v} | {statistics.median(walls):.2f} | {min(walls):.2f}–{max(walls):.2f} | "
                    f"{statistics.median(walls) / plain:.2f}x | {statistics.median(hops):.2f} | "
                    f"{statistics.median(hops) / plain_hop:.2f}x |")
    text = "\n".join([
        "# A two-call chain in one worker process",
        "",
        run_header("local_chain.py", machine_note=load_note(load0, load1)),
        "",
        "Two colocated roles in one worker process (threaded host); the producer's GroupFuture is passed into the "
        "consumer, never awaited by the controller. 'same process': the host hands the consumer the producer's "
        "result from memory (local_results=4, the default); 'through the controller': local_results=0 (the input "
        "nested, fetched through its owner); plain Ray: one actor with both methods, the ObjectRef passed "
        f"top-level. Medians of {reps} repetitions, variant order rotating. Chain: issue of the producer -> "
        "the consumer's result awaited. Hop: the producer returned -> the consumer started (on the worker).",
        "",
        "| payload | variant | chain ms | min–max ms | chain vs plain Ray | hop ms | hop vs plain Ray |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ])
    write_result(args.out, text)


if __name__ == "__main__":
    main()
