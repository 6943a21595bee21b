"""Chaos at scale, in the twin: seeded fault schedules at N simulated rollout replicas, and what must hold.

Each run is the real trainer (``GRPOTrainer.fit()`` on a local Ray, streaming, ``max_staleness`` 2, partial rollout
``keep``) against ``--replicas`` simulated replicas (``--per-process`` per process) of the 7B/H100 profile, with
one fault schedule of :mod:`asyncrl.pipelines.commands.chaos` (``kill``: 10 % of the replicas die at random times,
simulated; ``slow``: one replica 10x slower, simulated; ``node``: the process hosting 8 replicas SIGKILLed;
``preempt``: a quarter of the rollout processes SIGTERMed within a step; ``train``: a training rank's process
SIGKILLed), ``--seeds`` seeds each. Must hold, per run: it completes every step; its ledger holds (0 samples lost,
0 trained twice, every trained token within the staleness bound); no call lasts longer than twice its deadline.

Each finished run is appended to ``<--work-dir>/chaos_runs.jsonl`` (a later call with the same work dir skips the
runs already there), and the table is written from all of them.

    python benchmarks/chaos.py --replicas 64 --per-process 8 --seeds 20          # the table of docs/scale.md
    python benchmarks/chaos.py --replicas 4 --per-process 2 --seeds 1 --steps 6  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from _common import load_note, run_header, write_result

import asyncrl
from asyncrl.pipelines.job.presets import twin
from asyncrl.pipelines.commands.chaos import ENGINE_START_S, KINDS, REAL, plan, run_chaos


VARIANTS = ("after", "before", "before_process")
"""``after``: the code as it is; ``before``: a lost replica replaces the whole pool (``REPLACE_REPLICAS`` off);
``before_process``: a lost process replaces the whole pool (``REPLACE_PROCESSES`` off)."""


def config(a: argparse.Namespace, out: Path) -> Any:
    cfg = twin()
    t = cfg.trainer
    t.steps, t.rollout_workers, t.output_dir = a.steps, a.replicas, str(out)
    t.rollout_placement = [a.replicas]  # a pool of its own: a preemption resizes it (groups handed over)
    t.batch_size = a.groups_per_replica * cfg.algorithm.group_size * a.replicas
    t.train_workers = max(2, a.replicas // 16)
    t.rollout_timeout_s = a.deadline_s
    t.restart.max_restarts = 20  # every fault of a schedule may cost a recovery: the table tests them, not the budget
    t.checkpoint_every = 2  # a lost training rank restarts from a checkpoint at most 2 steps old
    t.keep_checkpoints = 1
    t.num_cpus = 4 * (a.replicas + t.train_workers)
    cfg.twin.replicas_per_process, cfg.twin.time_scale = a.per_process, a.time_scale
    return cfg.validate()


def one(a: argparse.Namespace, kind: str, seed: int, work: Path, variant: str = "after") -> dict[str, Any]:
    from asyncrl.pipelines.rollout import stream_rollout

    out = work / f"{kind}_{seed:02d}{'' if variant == 'after' else '_' + variant}"
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
    cfg = config(a, out)
    stream_rollout.REPLACE_REPLICAS = variant != "before"
    stream_rollout.REPLACE_PROCESSES = variant != "before_process"
    chaos = plan(kind, seed, replicas=a.replicas, replicas_per_process=a.per_process,
                 train_ranks=cfg.trainer.train_workers, steps=a.steps, node=a.per_process)
    r = asyncrl.run(run_chaos(cfg, chaos))
    led = r.ledger
    steps = [h["time/step"] for h in r.history]
    return {
        "kind": kind, "seed": seed, "variant": variant, "ok": r.ok, "steps_s": sum(steps),
        "max_step_s": max(steps, default=0.0), "completed": r.completed, "error": r.error, "wall_s": r.wall_s,
        "fired": r.fired, "restarts": [{k: x.get(k) for k in ("kind", "origin", "time_s", "interrupted_s", "failed")}
                                       for x in r.restarts],
        "processes_replaced": sum(1 for p in set(r.pids[0]) if r.pids[1] and p not in r.pids[1]),
        "process_starts": r.process_starts,
        "resizes": r.resizes, "overruns": r.overruns, "max_wait_ratio": r.max_wait_ratio,
        "ledger": None if led is None else {"ok": led.ok, "samples": led.samples, "trained": led.trained,
                                            "lost": led.lost, "trained_twice": led.trained_twice,
                                            "dropped": led.dropped, "rewinds": led.rewinds,
                                            "staleness": {str(k): v for k, v in led.staleness.items()},
                                            "violations": led.violations[:3]},
    }


def table(rows: list[dict[str, Any]], k: int) -> list[str]:
    out = ["| fault | real? | runs | completed | ledger holds | lost | trained twice | max staleness (bound "
           f"{k}) | longest wait / deadline | recoveries (replica / process / pool / restart / resize) | "
           "recovery s (mean) | "
           "faults fired |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind in [x for x in (*KINDS, "none") if any(r["kind"] == x for r in rows)]:
        rs = [r for r in rows if r["kind"] == kind]
        led = [r["ledger"] for r in rs if r["ledger"]]
        stale = max((int(d) for x in led for d, n in x["staleness"].items() if n), default=0)
        rec = [x for r in rs for x in r["restarts"]]
        times = [x["time_s"] for x in rec if x.get("time_s") is not None]
        kinds = "/".join(str(sum(x["kind"] == c for x in rec))
                         for c in ("replace_replica", "replace_process", "replace", "restart"))
        fired = sum(1 for r in rs for f in r["fired"] if "error" not in f)
        missed = sum(1 for r in rs for f in r["fired"] if "error" in f)
        out.append(
            f"| {kind} | {'real' if REAL.get(kind) else 'simulated' if kind != 'none' else '-'} | {len(rs)} | "
            f"{sum(r['completed'] for r in rs)} | {sum(x['ok'] for x in led)} | {sum(x['lost'] for x in led)} | "
            f"{sum(x['trained_twice'] for x in led)} | {stale} | {max(r['max_wait_ratio'] for r in rs):.2f} | "
            f"{kinds}/{sum(r['resizes'] for r in rs)} | {_recovery(times, rs)} | "
            f"{fired}{f' ({missed} missed: target gone)' if missed else ''} |")
    return out


def _recovery(times: list[float], rows: list[dict[str, Any]]) -> str:
    """The mean recovery time of `rows`' recoveries (`times`: those that ended while their run went on); a process
    replacement that ended after its run (its replicas' groups served by the others meanwhile) shows its new
    process's start time instead."""
    starts = [x for r in rows for x in r.get("process_starts", [])]
    if times:
        return f"{statistics.fmean(times):.1f}"
    return f"after the run (new process up in {statistics.fmean(starts):.1f})" if starts else "-"


def before_after(rows: list[dict[str, Any]]) -> list[str]:
    """The ``kill`` runs with and without per-replica replacement, side by side."""
    out = ["| variant | runs | ledger holds | recoveries | recovery s (mean) | slowest step s (mean) | "
           "steps s (mean) |",
           "|---|---|---|---|---|---|---|"]
    for variant, what in (("before", "the whole pool replaced"), ("after", "the replica replaced alone")):
        rs = [r for r in rows if r["kind"] == "kill" and r.get("variant", "after") == variant]
        if not rs:
            continue
        rec = [x for r in rs for x in r["restarts"]]
        times = [x["time_s"] for x in rec if x.get("time_s") is not None]
        out.append(f"| {variant}: {what} | {len(rs)} | {sum(bool(r['ledger'] and r['ledger']['ok']) for r in rs)} | "
                   f"{len(rec)} | {statistics.fmean(times) if times else 0:.1f} | "
                   f"{statistics.fmean(r['max_step_s'] for r in rs):.1f} | "
                   f"{statistics.fmean(r['steps_s'] for r in rs):.1f} |")
    return out


def process_before_after(rows: list[dict[str, Any]]) -> list[str]:
    """The ``node`` and ``preempt`` runs with and without per-process replacement, side by side."""
    out = ["| fault | variant | runs | ledger holds | recoveries | processes restarted (mean) | recovery s (mean) | "
           "new process start s (mean) | slowest step s (mean) | steps s (mean) | wall s (mean) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind in ("node", "preempt"):
        for variant, what in (("before_process", "the whole pool replaced"), ("after", "the process replaced alone")):
            rs = [r for r in rows if r["kind"] == kind and r.get("variant", "after") == variant]
            if not rs or not any(r.get("variant") == "before_process" for r in rows if r["kind"] == kind):
                continue
            rec = [x for r in rs for x in r["restarts"]]
            times = [x["time_s"] for x in rec if x.get("time_s") is not None]
            procs = [r["processes_replaced"] for r in rs if "processes_replaced" in r]
            starts = [x for r in rs for x in r.get("process_starts", [])]
            out.append(f"| {kind} | {'before' if variant != 'after' else 'after'}: {what} | {len(rs)} | "
                       f"{sum(bool(r['ledger'] and r['ledger']['ok']) for r in rs)} | "
                       f"{'/'.join(sorted({x['kind'] for x in rec})) or '-'} ({len(rec)}) | "
                       f"{statistics.fmean(procs) if procs else float('nan'):.1f} | "
                       f"{f'{statistics.fmean(times):.1f}' if times else 'after the run'} | "
                       f"{f'{statistics.fmean(starts):.1f}' if starts else '-'} | "
                       f"{statistics.fmean(r['max_step_s'] for r in rs):.1f} | "
                       f"{statistics.fmean(r['steps_s'] for r in rs):.1f} | "
                       f"{statistics.fmean(r['wall_s'] for r in rs):.0f} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--per-process", type=int, default=8, help="replicas per process (a lost node: one process)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}, none")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--groups-per-replica", type=int, default=2, help="prompt groups per replica per step")
    p.add_argument("--time-scale", type=float, default=0.01)
    p.add_argument("--deadline-s", type=float, default=120.0, help="trainer.rollout_timeout_s of every run")
    p.add_argument("--before", type=int, default=0, metavar="N",
                   help="also run the first N kill seeds with per-replica replacement off (the whole pool replaced)")
    p.add_argument("--before-process", type=int, default=0, metavar="N",
                   help="also run the first N node and preempt seeds (of --kinds) with per-process replacement off "
                        "(the whole pool replaced)")
    p.add_argument("--work-dir", default="runs/chaos")
    p.add_argument("--out", default="benchmarks/results/chaos.md")
    a = p.parse_args()
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "chaos_runs.jsonl"
    done = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
    have = {(r["kind"], r["seed"], r.get("variant", "after")) for r in done}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    # seed-major (each seed's before runs beside its after runs): a call stopped part-way leaves every kind with as
    # many seeds as the others
    kinds = a.kinds.split(",")
    todo = []
    for seed in range(max(a.seeds, a.before, a.before_process)):
        todo += [(k, seed, "after") for k in kinds if seed < a.seeds]
        todo += [("kill", seed, "before")] if seed < a.before else []
        todo += [(k, seed, "before_process") for k in kinds if k in ("node", "preempt") and seed < a.before_process]

    def report() -> None:  # the table of every run so far (rewritten after each run: a long call is readable)
        rows = [r for r in done if r["kind"] in a.kinds.split(",") and r["seed"] < a.seeds
                and r.get("variant", "after") == "after"]
        note = load_note(load0, os.getloadavg()[0])
        text = "\n".join([run_header("chaos.py", note), "",
                          f"{a.replicas} simulated replicas ({a.per_process} per process), streaming, max_staleness 2, "
                          f"{a.steps} steps of {a.groups_per_replica * 8 * a.replicas} responses, twin.time_scale "
                          f"{a.time_scale}; {len(rows)} runs ({time.perf_counter() - t0:.0f} s this call).", "",
                          *table(rows, 2), "",
                          f"Per-replica replacement, before and after ({ENGINE_START_S:g} s simulated engine start, "
                          "an assumption):", "", *before_after(done), "",
                          "Per-process replacement, before and after (a real SIGKILL or SIGTERM; a real process "
                          "start, no simulated engine start):", "", *process_before_after(done), ""])
        write_result(a.out, text)

    for kind, seed, variant in todo:
        if (kind, seed, variant) not in have:
            row = one(a, kind, seed, work, variant)
            done.append(row)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{kind} seed {seed} ({variant}): ok={row['ok']} wall {row['wall_s']:.0f} s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
            report()
    report()


if __name__ == "__main__":
    main()
