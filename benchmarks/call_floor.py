"""The controller's CPU per trained sample against plain Ray making the same calls: what Ray's own calls cost.

The cluster twin (``cluster_twin.py``) reports the controller's CPU per trained sample; its target is 100 us. A
Ray actor call costs its caller CPU of its own (the submit on the caller's thread, the reply on Ray's
``worker.io`` thread), whatever framework issues it. This benchmark separates the two: for each N it runs the twin
(``GRPOTrainer.fit()``, variant ``after``, the flags of ``cluster_twin.py``), counts the Ray calls the controller
issued per step, by worker method, and then has a plain Ray driver make **the same calls**: the same number per
step of each kind, the same argument and reply shapes, paced over the twin's step time, on actors laid out as
the twin's processes (``--per-process`` replicas or ranks each). What a user would write instead of asyncrl to
issue those calls; no staleness rule, no admission, journal, ledger or supervision.

The plain driver's calls per step, as the twin's controller makes them:

* a prompt group's ``generate``: its prompts (token ids, attention mask and text of ``--group`` rows) to one
  replica, two returns (the rows, left in the object store, and the reply the controller reads: scores,
  lengths, version), each group's reply awaited as it comes (the replica answers after a random share of the
  step: the replies spread over it as the twin's do);
* each training rank's chain of calls (one per method the twin called on the ranks, as many per step): the
  first takes the rank's groups' rows (top-level refs), each later one the previous call's result;
* ``update_weights`` on each replica, with the exported version (a ref).

Figures: Ray calls per step and per trained sample; each side's controller CPU per trained sample (process CPU
time over the steady steps, every thread) and per call; asyncrl over plain Ray; and the CPU by thread.

    python benchmarks/call_floor.py --replicas 64 --steps 8 --set trainer.stream.bound=admitted

Writes ``benchmarks/results/call_floor.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from _common import load_note, run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "call_floor.md")
PROMPT_IDS = 32  # token ids per prompt row (the twin's prompt groups carry about as many)
RESPONSE_IDS = 64

COLUMNS = ["N", "samples/step", "Ray calls/step (generate + ranks + weights)", "calls/sample", "side",
           "ctrl CPU us/sample", "us/call", "asyncrl / plain Ray", "CPU by thread (us/sample)"]


def counting() -> tuple[collections.Counter[str], Any]:
    """Count the Ray calls the asyncrl controller issues, by ``role.method`` (the Ray backend's `submit`);
    returns the counter and the undo."""
    from asyncrl.backends import ray as ray_backend

    counts: collections.Counter[str] = collections.Counter()
    submit = ray_backend.RayBackend.submit

    def counted(self: Any, host: Any, msg: Any) -> Any:
        counts[f"{msg.role}.{msg.method}"] += 1
        return submit(self, host, msg)

    ray_backend.RayBackend.submit = counted  # type: ignore[method-assign]

    def undo() -> None:
        ray_backend.RayBackend.submit = submit  # type: ignore[method-assign]

    return counts, undo


def call_plan(counts: collections.Counter[str], steps: int) -> dict[str, Any]:
    """Per step: the generate calls, the training ranks' methods (each rank's calls per step), the weight loads."""
    per_step = {k: v / steps for k, v in counts.items()}
    gen = round(sum(v for k, v in per_step.items() if k.startswith("rollout.generate")))
    weights = round(sum(v for k, v in per_step.items() if k == "rollout.update_weights"))
    rank = {k: round(v) for k, v in per_step.items()
            if not k.startswith("rollout.") and round(v) > 0}
    return {"generate": gen, "weights": weights, "rank": rank}


def make_host_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class PlainHost:
        """A process of `per_process` replicas (or ranks), as the twin lays them out; every method names its
        replica. Nothing is computed: what is measured is the caller's side of each call."""

        def __init__(self) -> None:
            import torch

            self._rows = {"responses": torch.zeros(8, RESPONSE_IDS, dtype=torch.int64),
                          "response_mask": torch.ones(8, RESPONSE_IDS, dtype=torch.int64)}

        async def generate(self, replica: int, prompts: Any, pace: float, version: int) -> tuple[Any, Any]:
            import torch

            await asyncio.sleep(random.uniform(0.0, pace))
            n = len(prompts["text"])
            return self._rows, {"scores": torch.rand(n), "response_length": torch.full((n,), RESPONSE_IDS),
                                "version": version}

        async def rank_call(self, rank: int, *inputs: Any) -> Any:
            return self._rows

        async def update_weights(self, replica: int, weights: Any) -> dict[str, int]:
            return {"version": int(weights["version"])}

        async def generate_many(self, replica: int, many: list[Any]) -> Any:
            """Several groups in one call, each yielded as it is done (a Ray streaming generator)."""
            for prompts in many:
                yield {"scores": prompts["input_ids"][:, 0].float(), "version": 0}

        async def generate_one(self, replica: int, prompts: Any) -> Any:
            return {"scores": prompts["input_ids"][:, 0].float(), "version": 0}

    return PlainHost


async def plain_run(n: int, ranks: int, plan: dict[str, Any], steps: int, warmup: int, pace: float,
                    group: int, per_process: int) -> dict[str, Any]:
    """The plain Ray driver: `steps` steps of `plan`'s calls; CPU over the steps after `warmup`."""
    import cluster_twin as ct
    import ray
    import torch

    Host = make_host_class()
    rollout = [Host.remote() for _ in range(-(-n // per_process))]
    train = [Host.remote() for _ in range(-(-ranks // per_process))]
    await asyncio.gather(*[h.rank_call.remote(0) for h in rollout + train])
    prompts = {"input_ids": torch.randint(0, 1000, (group, PROMPT_IDS)),
               "attention_mask": torch.ones(group, PROMPT_IDS, dtype=torch.int64),
               "text": [f"prompt {i}: what is {i} + {i}?" for i in range(group)]}
    methods = list(plan["rank"].items())
    marks: list[tuple[float, float, dict[str, float]]] = []
    for step in range(steps):
        gens = []
        for g in range(plan["generate"]):
            r = g % n
            gens.append(rollout[r // per_process].generate.options(num_returns=2).remote(
                r % per_process, prompts, pace, step))
        await asyncio.gather(*[meta for _, meta in gens])  # each reply awaited as it comes
        rows = [ref for ref, _ in gens]
        last: list[Any] = []
        for rank in range(ranks):
            mine = rows[rank::ranks]
            host, i = train[rank // per_process], rank % per_process
            prev = None
            for _, calls in methods:
                for _ in range(calls // ranks or (1 if rank == 0 else 0)):
                    prev = host.rank_call.remote(i, *(mine if prev is None else [prev]))
            last.append(prev)
        await asyncio.gather(*[x for x in last if x is not None])
        weights = ray.put({"version": step + 1, "w": torch.zeros(16)})
        await asyncio.gather(*[rollout[r // per_process].update_weights.remote(r % per_process, weights)
                               for r in range(plan["weights"])])
        if step == warmup or step == steps - 1:
            marks.append((time.monotonic(), time.process_time(), ct.thread_cpu()))
    (t0, c0, th0), (t1, c1, th1) = marks
    samples = (steps - 1 - warmup) * plan["generate"] * group
    for h in rollout + train:
        ray.kill(h)
    return {"cpu_us": (c1 - c0) / samples * 1e6, "threads": ct.cpu_by_thread(th0, th1, samples),
            "step_s": (t1 - t0) / (steps - 1 - warmup)}


async def per_group(group: int, groups: int = 2048, per_call: int = 4, rounds: int = 2) -> list[dict[str, Any]]:
    """Plain Ray, replies as fast as they come: the caller's CPU per prompt group with one call per group, and with
    `per_call` groups per call whose replies stream back one by one (``num_returns="streaming"``), alternating
    `rounds` times. Whether several groups per call would cut the controller's CPU per group."""
    import ray
    import torch

    Host = make_host_class()
    hosts = [Host.remote() for _ in range(2)]
    await asyncio.gather(*[h.rank_call.remote(0) for h in hosts])
    prompts = {"input_ids": torch.randint(0, 1000, (group, PROMPT_IDS)),
               "attention_mask": torch.ones(group, PROMPT_IDS, dtype=torch.int64),
               "text": [f"prompt {i}: what is {i} + {i}?" for i in range(group)]}

    async def drain(gen: Any) -> list[Any]:
        return [await ref async for ref in gen]

    out = []
    for _ in range(rounds):
        for mode in ("one call per group", f"{per_call} groups per call, streamed"):
            c0 = time.process_time()
            for _ in range(0, groups, 128):
                if mode == "one call per group":
                    await asyncio.gather(*[hosts[j % 2].generate_one.remote(j, prompts) for j in range(128)])
                else:
                    await asyncio.gather(*[drain(hosts[j % 2].generate_many.options(num_returns="streaming").remote(
                        j, [prompts] * per_call)) for j in range(128 // per_call)])
            out.append({"mode": mode, "us_per_group": (time.process_time() - c0) / groups * 1e6})
    for h in hosts:
        ray.kill(h)
    return out


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    import cluster_twin as ct

    rows: list[dict[str, Any]] = []
    args.per_group = await per_group(args.group)
    print("plain Ray per group:", args.per_group, flush=True)
    for n in args.replicas:
        counts, undo = counting()
        try:
            twin = await ct.run_one(args, n, "after")
        finally:
            undo()
        plan = call_plan(counts, args.steps)
        ranks = twin["train_ranks"]
        plain = await plain_run(n, ranks, plan, args.steps, args.warmup, pace=twin["step_s"] * 0.8,
                                group=args.group, per_process=args.per_process)
        calls = plan["generate"] + sum(plan["rank"].values()) + plan["weights"]
        rows.append({"n": n, "batch": twin["batch"], "plan": plan, "calls": calls, "twin": twin, "plain": plain})
        print(f"N={n}: {calls} Ray calls/step; asyncrl {twin['cpu_us']:.0f} us/sample ({twin['threads']}), "
              f"plain Ray {plain['cpu_us']:.0f} us/sample ({plain['threads']})", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        p, per_sample = r["plan"], r["calls"] / r["batch"]
        kinds = f"{r['calls']} ({p['generate']} + {sum(p['rank'].values())} + {p['weights']})"
        for side in ("twin", "plain"):
            x = r[side]
            ratio = f"{r['twin']['cpu_us'] / r['plain']['cpu_us']:.2f}x" if side == "twin" else "1.00x"
            out.append("| " + " | ".join([
                str(r["n"]), str(r["batch"]), kinds, f"{per_sample:.3f}",
                "asyncrl (the twin)" if side == "twin" else "plain Ray, the same calls",
                f"{x['cpu_us']:.0f}", f"{x['cpu_us'] / per_sample:.0f}", ratio, x["threads"]]) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    import cluster_twin as ct

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", default="64", help="comma-separated rollout replica counts")
    ct.add_twin_args(p, steps=8)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.replicas = [int(x) for x in args.replicas.split(",")]
    if args.warmup + 2 > args.steps:
        p.error("--steps must exceed --warmup + 1")
    rows, load0 = ct.run_on_ray(args, amain)
    write_result(args.out or RESULTS, "\n\n".join([
        "# The controller's CPU against plain Ray making the same calls",
        run_header("call_floor.py", load_note(load0, os.getloadavg()[0])),
        f"The twin: profile `{args.profile}`, time scale {args.time_scale:g}, {args.groups_per_replica} prompt groups "
        f"of {args.group} per replica per step, one training rank per {args.replicas_per_rank} replicas, "
        f"max_staleness {args.staleness}, overrides {args.set or 'none'}; {args.steps} steps, CPU over steps "
        f"{args.warmup + 1}..{args.steps - 1}. Plain Ray: the twin's calls per step, by kind (generate + the "
        "training ranks' + weight loads), issued by a plain Ray driver on actors laid out as the twin's processes, "
        "the generate replies spread over 0.8 of the twin's step time (module docstring). us/call: CPU per "
        "trained sample / Ray calls per trained sample.",
        table(rows),
        "Plain Ray, every reply at once (no pacing): the caller's CPU per prompt group of "
        f"{args.group}, 2,048 groups a row, alternating: " + "; ".join(
            f"{x['mode']} {x['us_per_group']:.0f} us" for x in args.per_group) + "."]) + "\n")


if __name__ == "__main__":
    main()
