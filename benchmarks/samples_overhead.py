"""What writing ``samples.jsonl`` costs a step: the main job (grpo_toy) with ``trainer.samples_per_step``
0 and 8, runs alternated (A B B A ...) in one Ray session, median ``time/step`` and ``time/train`` per arm;
the parts: ``time/samples`` (the train loop awaiting the cut trajectories and their write), the
``sample_trajectories`` call on the advantage worker as the worker timed it (trace.json), and the
controller-side write alone (decode + append of one step's 8 trajectories, done in a thread).

    python benchmarks/samples_overhead.py --steps 30 --pairs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import load_note, run_header, write_result

from asyncrl.pipelines.job.presets import grpo_toy
from asyncrl.pipelines.observe.samples import SamplesWriter, read_samples
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles.modeling.models import tokenizer_for


async def one(steps: int, n: int, out: Path) -> list[dict]:
    cfg = grpo_toy()
    cfg.trainer.steps, cfg.trainer.samples_per_step, cfg.trainer.output_dir = steps, n, str(out)
    cfg.trainer.progress = cfg.trainer.plot = cfg.trainer.tensorboard = False
    cfg.trainer.trace = True
    async with GRPOTrainer(cfg) as tr:
        return await tr.fit()


def write_cost(run: Path, repeats: int = 200) -> float:
    """Median seconds of SamplesWriter.write for one step's trajectories of `run` (decode + append)."""
    lines, _ = read_samples(run / "samples.jsonl")
    step = [r for r in lines if r["step"] == lines[-1]["step"]]
    rows = [{"uid": r["uid"], "index": r["index"], "row": r["row"], "prompt_ids": r["tokens"]["id"][:8],
             "ids": r["tokens"]["id"], "mask": r["tokens"]["mask"], "versions": r["tokens"]["version"],
             "logp_rollout": r["tokens"]["logp_rollout"], "logp_old": r["tokens"]["logp_old"],
             "advantage": r["tokens"]["advantage"], **{k: r[k] for k in ("reward", "version", "staleness",
                                                                          "stop_reason", "length")}} for r in step]
    w = SamplesWriter(Path(tempfile.mkdtemp()), tokenizer_for(grpo_toy().model))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        w.write(0, rows)
        times.append(time.perf_counter() - t)
    w.close()
    return statistics.median(times)


async def main(args: argparse.Namespace) -> None:
    load0 = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp())
    arms: dict[int, list[dict]] = {0: [], 8: []}
    for p in range(args.pairs):
        for n in ((0, 8) if p % 2 == 0 else (8, 0)):  # A B B A ...: neither arm always runs second
            hist = await one(args.steps, n, root / f"n{n}_{p}")
            arms[n] += hist[2:]  # the first steps include start-up
    cost = write_cost(root / "n8_0")
    exec_s = [e["dur"] / 1e6 for p in range(args.pairs)
              for e in json.loads((root / f"n8_{p}" / "trace.json").read_text())["traceEvents"]
              if e.get("name") == "sample_trajectories" and e.get("args", {}).get("part") == "exec"]
    rows = ["| samples_per_step | steps timed | median time/step (s) | median time/train (s) |", "|---|---|---|---|"]
    for n, h in arms.items():
        rows.append(f"| {n} | {len(h)} | {statistics.median(r['time/step'] for r in h):.4f} | "
                    f"{statistics.median(r['time/train'] for r in h):.4f} |")
    text = (f"# samples.jsonl overhead\n\n{run_header('samples_overhead.py', load_note(load0, os.getloadavg()[0]))}\n\n"
            + "\n".join(rows) + f"\n\nWith 8: the train loop's `time/samples` (awaiting the cut trajectories, then the "
            f"write in a thread) median {statistics.median(r['time/samples'] for r in arms[8]) * 1e3:.2f} ms a step; "
            f"`sample_trajectories` on the advantage worker (exec, trace.json) median "
            f"{statistics.median(exec_s) * 1e3:.2f} ms over {len(exec_s)} calls; the write alone (decode + append) "
            f"median {cost * 1e3:.2f} ms over 200 writes.\n")
    write_result(args.out, text)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/samples_overhead.md")
    asyncio.run(main(ap.parse_args()))
