"""One pipelined hop whose input has already finished: issue -> start on the worker.

The trainer issues ``old_log_prob`` with the generated batch's GroupFuture after that batch
has finished (the rollout loop awaited its scores first). This measures that hop alone: a
one-rank producer group returns a small TensorDict (``--fields`` fields of 16 x 8 floats),
the controller awaits it, then calls a one-rank consumer group (threaded host) three ways,
interleaved; the consumer's method records ``time.monotonic()`` when it starts (one clock
for every process on the machine):

- **asyncrl, pipelined**: ``await c.use(f)`` with the finished future: the controller
  awaited it, so it is known to have succeeded and goes as a top-level Ray argument
  (Ray inlines the small value into the task; see ``asyncrl/_deferred.py``);
- **asyncrl, pipelined nested**: the same call with the future nested in the call's
  payload, as for a future the controller does not know finished (the backend's
  top-level path switched off for this call): the worker fetches the value through its
  owner, the controller;
- **asyncrl, value**: ``await c.use(value)`` (the value the controller already holds);
- **plain Ray**: ``await actor.use.remote(ref)`` with the producer's ObjectRef top-level (Ray
  inlines a small finished value into the task).

With ``--after-ms N`` each variant runs three times more: right after issuing the call, the
controller's thread runs N ms of Python (``busy``: what the trainer does when it issues the
rest of a step's stages in one go), sleeps N ms (``asleep``), or runs N ms of small
``torch.mm`` calls, which release the GIL (``nogil``: busy on a core without holding the
GIL), before it awaits the result.

    python benchmarks/pipelined_hop.py                  # 100 repetitions
    python benchmarks/pipelined_hop.py --after-ms 4     # + the busy / asleep variants
    python benchmarks/pipelined_hop.py --quick          # 5 repetitions (tests)

Writes ``benchmarks/results/pipelined_hop.md`` (``--out``).
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
from asyncrl import Dispatch, RayWorkerGroup, Worker, register  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipelined_hop.md")
VARIANTS = ("asyncrl, pipelined", "asyncrl, pipelined nested", "asyncrl, value", "plain Ray")


class Producer(Worker):
    """Returns a copy of its batch."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def make(self, td: TensorDict) -> TensorDict:
        return td.clone()


def _started(td: TensorDict) -> TensorDict:
    return TensorDict({"t": torch.full((td.batch_size[0],), time.monotonic(), dtype=torch.float64)},
                      batch_size=td.batch_size)


class Consumer(Worker):
    """Records when its method starts."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def use(self, td: TensorDict) -> TensorDict:
        return _started(td)


class PlainConsumer:
    """The same, as an ordinary sync Ray actor."""

    def use(self, td: TensorDict) -> TensorDict:
        return _started(td)


def _then(kind: str, seconds: float) -> None:
    """What the controller's thread does between issuing the call and awaiting it."""
    if kind == "busy":
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            pass
    elif kind == "asleep":
        time.sleep(seconds)
    elif kind == "nogil":
        a = torch.ones(128, 128)
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            torch.mm(a, a)


async def measure(reps: int, fields: int, after_ms: float = 0.0, warmup: int = 5) -> dict[str, list[float]]:
    import ray

    await asyncrl.ainit()
    p = RayWorkerGroup(Producer, world_size=1, name="hop_producer")
    c = RayWorkerGroup(Consumer, world_size=1, name="hop_consumer")
    await p.setup()
    await c.setup()
    plain = ray.remote(PlainConsumer).options(num_cpus=0).remote()
    backend = c._hostset.backend
    has_top = hasattr(backend, "top_level_inputs")  # (older code: every pipelined input is nested)
    td = TensorDict({f"x{i}": torch.zeros(16, 8) for i in range(fields)}, batch_size=[16])
    thens = ("",) if after_ms <= 0 else ("", "busy", "asleep", "nogil")
    names = [v + (f", then {after_ms:g} ms {k}" if k else "") for k in thens for v in VARIANTS]
    lags: dict[str, list[float]] = {n: [] for n in names}
    try:
        for i in range(warmup + reps):
            f = p.make(td)
            value = await f
            ref = f.refs[0]
            k = i % len(names)
            for name in names[k:] + names[:k]:  # rotate the variant order
                v = next(x for x in sorted(VARIANTS, key=len, reverse=True) if name.startswith(x))
                then = name.rsplit(" ", 1)[1] if name != v else ""
                t = time.monotonic()
                if v == "asyncrl, pipelined":
                    pending = c.use(f)
                elif v == "asyncrl, pipelined nested":
                    if has_top:
                        backend.top_level_inputs = False
                    try:
                        pending = c.use(f)
                    finally:
                        if has_top:
                            del backend.top_level_inputs  # back to the class's True
                elif v == "asyncrl, value":
                    pending = c.use(value)
                else:
                    pending = plain.use.remote(ref)
                _then(then, after_ms / 1e3)
                out = await pending
                if i >= warmup:
                    lags[name].append((float(out["t"][0]) - t) * 1e3)
    finally:
        ray.kill(plain)
        await c.close()
        await p.close()
    return lags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 repetitions")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 100)")
    ap.add_argument("--fields", type=int, default=6, help="fields of the TensorDict passed on")
    ap.add_argument("--after-ms", type=float, default=0.0,
                    help="also run each variant with N ms of Python (busy) or of sleep after the issue")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 100)
    load0 = os.getloadavg()[0]
    lags = asyncio.run(measure(reps, args.fields, args.after_ms))
    load1 = os.getloadavg()[0]
    plain = statistics.median(lags["plain Ray"])
    rows = [f"| {n} | {statistics.median(x):.2f} | {min(x):.2f}–{max(x):.2f} | {statistics.median(x) / plain:.2f}x |"
            for n, x in lags.items()]
    text = "\n".join([
        "# One pipelined hop with a finished input: issue -> start on the worker",
        "",
        run_header("pipelined_hop.py", machine_note=load_note(load0, load1)),
        "",
        f"A {args.fields}-field TensorDict (16 rows) produced by a one-rank group and awaited, then passed to a "
        "one-rank consumer group (threaded host) as the finished future (pipelined: top-level, as it is known to "
        "have finished; pipelined nested: the same call with the future nested in the payload), as the value, or "
        f"to a plain Ray actor as the ObjectRef (top level). Medians of {reps} repetitions, variant order rotating. "
        "'then N ms busy / asleep / nogil': after the issue the controller's thread runs Python / sleeps / runs "
        "torch.mm calls (which release the GIL) for N ms.",
        "",
        "| variant | issue -> start ms | min–max ms | vs plain Ray |",
        "|---|---:|---:|---:|",
        *rows,
        "",
    ])
    write_result(args.out, text)


if __name__ == "__main__":
    main()
