"""What the per-sample ledger costs the controller, per trained sample, at large batch sizes.

The real :class:`~asyncrl.pipelines.run.run_journal.RunJournal` of a streaming run is driven for
``--steps`` steps of ``--rows`` rows each (``B = rows / G`` prompt groups of ``G = 8``): per step ``B`` ``group``
records, one ``step`` record and its ledger measurement (the training pool's answer, a small per-row
``TensorDict``, arrives as a resolved future: the worker's side is not the controller's), then ``end`` with its
``left`` record. Measured: CPU seconds of the event-loop thread (what the loop pays) and of the whole process
(the writer threads too), per trained sample. Beside it, what a user would write instead: one JSON line per
sample (group, row, seed, replica, versions, step), written and flushed on the loop as each step trains.

    python benchmarks/ledger_cost.py --rows 1024 8192 32768 --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from _common import load_note, run_header, write_result
from tensordict import TensorDict

from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.pipelines.run.run_journal import RunJournal
from asyncrl.pipelines.loop.loop_state import LoopState, RolloutBatch

G = 8


class _Advantage:
    """The training pool's side of the measurement: answers at once with the rows' facts (built before the
    clock starts; the `batch` it is asked about is the step number)."""

    def __init__(self, rows: int, steps: int) -> None:
        self.facts = [TensorDict({"replica": torch.arange(rows, dtype=torch.int32) % 64,
                                  "lo": torch.full((rows,), max(0, s - 1), dtype=torch.int32),
                                  "hi": torch.full((rows,), s, dtype=torch.int32),
                                  "tokens": torch.full((rows,), 512, dtype=torch.int32)}, batch_size=[rows])
                      for s in range(steps)]

    def ledger_rows(self, batch: Any) -> asyncio.Future[Any]:
        f = asyncio.get_running_loop().create_future()
        f.set_result(self.facts[int(batch)])
        return f


class _Policy:
    async def weights_checksum(self) -> dict[str, str]:
        return {"w": "0"}


def _owner(rows: int, steps: int, out: Path) -> SimpleNamespace:
    cfg = tiny_test()
    cfg.trainer.batch_size, cfg.algorithm.group_size = rows, G
    cfg.trainer.steps, cfg.trainer.max_staleness, cfg.trainer.rollout_mode = steps, 1, "stream"
    cfg.trainer.output_dir = str(out)
    cfg.validate()
    return SimpleNamespace(config=cfg, groups=SimpleNamespace(advantage=_Advantage(rows, steps), policy=_Policy()),
                           state=LoopState.new(2, 1), loader=None,
                           rollout=SimpleNamespace(untrained=lambda: ([], [])))


async def _ledger(rows: int, steps: int, out: Path) -> None:
    tr = _owner(rows, steps, out)
    journal = RunJournal(tr.config, lambda: tr.groups)
    journal.open(None, tr.state, tr.loader)
    B = rows // G
    for step in range(steps):
        for g in range(step * B, (step + 1) * B):
            journal.group(g, seed=g, version=max(0, step - 1))
        item = RolloutBatch(step=step, version=max(0, step - 1), batch=step, scores=None, reward_mean=0.0,
                            groups=list(range(step * B, (step + 1) * B)))
        journal.step(step, item)
        await asyncio.sleep(0)  # the train step's awaits: the measurement task runs beside it
    await journal.end(tr.state, tr.rollout)
    journal.close()


async def _naive(rows: int, steps: int, out: Path) -> None:
    B = rows // G
    with (out / "samples_ledger.jsonl").open("w") as f:
        for step in range(steps):
            for g in range(step * B, (step + 1) * B):
                for r in range(G):
                    f.write(json.dumps({"group": g, "row": r, "seed": g, "replica": (g * G + r) % 64,
                                        "versions": [0, 1], "tokens": 512, "step": step}) + "\n")
                    f.flush()
            await asyncio.sleep(0)


def measure(kind: str, rows: int, steps: int) -> dict[str, float]:
    """Loop-thread and process CPU microseconds per trained sample of one run of `kind`."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        t_loop, t_proc, t_wall = time.thread_time(), time.process_time(), time.perf_counter()
        asyncio.run(_ledger(rows, steps, out) if kind == "ledger" else _naive(rows, steps, out))
        loop = time.thread_time() - t_loop
        proc = time.process_time() - t_proc
        wall = time.perf_counter() - t_wall
        if kind == "ledger":
            rep = check_ledger(out)
            assert rep.ok and rep.trained == rows * steps, rep.render()
        size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    n = rows * steps
    return {"loop_us": loop / n * 1e6, "proc_us": proc / n * 1e6, "wall_s": wall, "bytes": size / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 8192, 32768], help="rows (samples) per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/ledger_cost.md")
    p.add_argument("--quick", action="store_true", help="one small size, 3 steps (the test runs this)")
    a = p.parse_args()
    if a.quick:
        a.rows, a.steps = [256], 3
    load0 = os.getloadavg()[0]
    lines = ["| rows per step | ledger: loop µs/sample | ledger: process µs/sample | per-sample lines on the loop: "
             "µs/sample | ratio (loop) | ledger bytes/sample |", "|---|---|---|---|---|---|"]
    for rows in a.rows:
        led = measure("ledger", rows, a.steps)
        naive = measure("naive", rows, a.steps)
        lines.append(f"| {rows} | {led['loop_us']:.2f} | {led['proc_us']:.2f} | {naive['loop_us']:.2f} | "
                     f"{naive['loop_us'] / max(led['loop_us'], 1e-9):.1f}x | {led['bytes']:.0f} |")
    note = load_note(load0, os.getloadavg()[0])
    text = "\n".join([run_header("ledger_cost.py", note), "", *lines, ""])
    write_result(a.out, text)


if __name__ == "__main__":
    main()
