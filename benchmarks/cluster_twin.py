"""Cluster twin: the real controller at 1 to 256 simulated rollout replicas, and where it stops scaling.

Each run is ``asyncrl train --preset twin`` in-process (``GRPOTrainer.fit()`` on a real local Ray, streaming,
``max_staleness`` 2) against simulated GPU workers whose costs come from a profile (default
``qwen2_7b_h100_vllm``, docs/scale.md), costs multiplied by ``--time-scale``. The batch per step and the
training ranks grow with N, as users scale a run: ``--groups-per-replica`` prompt groups of ``--group``
responses per replica per step, one training rank per ``--replicas-per-rank`` replicas, so the ideal is N times
one replica's throughput. Simulated replicas share processes (``--per-process`` each).

Figures per N (steady state: the steps after ``--warmup``):

* samples/s and tokens/s (simulated tokens: ids x tokens per id, plus each prompt's tokens), against N x the
  N = 1 run's; efficiency = samples/s / (N x samples/s at N = 1);
* the cost model's ideal: N x what one replica decodes when it holds as many requests as admission lets it
  (``ideal/s``; generation-bound when training keeps up), and measured / ideal;
* the controller's CPU per trained sample (its process CPU time, every thread: the loop, Ray's core worker,
  the fetch threads), its event-loop lag p99 (a 5 ms heartbeat on the loop) and its RSS (peak);
* the time for a weight version to reach every replica (its export finished on the training rank, to the
  controller holding all N replicas' receipts), median, and that over the N = 1 run's;
* the staleness histogram (response tokens 0, 1, 2 versions old) and the trainer's idle fraction (time the
  train loop waited for a batch / step time).

``--variants`` runs each N once per variant, side by side, the fixes the twin led to switched on one by one:

* ``unrouted``: the controller before the twin's first fixes: each prompt group one call to the whole rollout
  group (its rows split across every replica), the step's batch built on one training rank (every rank then
  reads it whole), the tracer sweeping every pending call at each new one;
* ``routed``: each prompt group to one replica, the least loaded (``stream_rollout.ROUTE_GROUPS``);
* ``sharded``: routed, and the step's batch built in shards, one per training rank (``SHARD_STEP_BATCH``);
* ``two-calls``: sharded, the tracer's sweep amortised, and ``trainer.balance_batch`` (each training rank about the
  same tokens; the variants above run without it): each group still a generate and a score call, the
  controller fetching its scores;
* ``before``: as ``two-calls``, and each group scored in its generate call, the controller reading the scores
  from the call's reply (``stream_rollout.SCORE_IN_GENERATE``): one Ray call per group; a step's take still
  scans every finished group at each finish, and a group's prompt rows are pickled by tensordict, a
  ``NonTensorData`` per text cell;
* ``columns``: as ``before``, and a take that is not ready answers from its per-version counts
  (``Admission._needs``), the prompt rows crossing as their columns (``_wire.TEXT_TENSORDICTS``) (the rows named
  ``after`` in docs/scale.md's tables before its section on top-level group results);
* ``top-values``: as ``columns``, and a step's ``concat_shard`` takes its groups' results as top-level Ray
  arguments, not nested refs (``_call.TOP_VALUES``), and the step's ledger facts ride in its reply instead of a
  ``ledger_rows`` call to every training rank (``run_journal.FACTS_IN_REPLY``) (the rows named ``after`` in
  docs/scale.md's tables before its section on a group's prompt rows);
* ``after``: the code: as ``top-values``, and a group's prompt rows cut from the step's batch by one split in a
  thread (``stream_rollout.SPLIT_STEP_PROMPTS``), their small tensors crossing in-band as bytes
  (``_wire.SMALL_TENSOR_BYTES``).

    python benchmarks/cluster_twin.py --variants columns,after   # N = 1,4,16,64,256
    python benchmarks/cluster_twin.py --variants unrouted,after --replicas 1,4,16,64   # the first fixes
    python benchmarks/cluster_twin.py --replicas 1,4 --steps 4 --warmup 1     # a quick look
    python benchmarks/cluster_twin.py --fixed-lengths --replicas 1,64,256      # no long tail: the controller alone
    python benchmarks/cluster_twin.py --set trainer.balance_batch=false         # any config override

Writes ``benchmarks/results/cluster_twin.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from _common import load_note, run_header, token_ages, write_result  # noqa: E402  (benchmarks/ is the script dir)

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "cluster_twin.md")
VARIANTS = ("unrouted", "routed", "sharded", "two-calls", "before", "columns", "top-values", "after")
# with the tracer's amortised sweep and balance_batch
CURRENT = ("two-calls", "before", "columns", "top-values", "after")

COLUMNS = ["N", "variant", "train ranks", "samples/step", "samples/s", "vs N x 1", "tokens/s", "ideal tokens/s",
           "vs ideal", "ctrl CPU us/sample", "loop lag p99 ms", "ctrl RSS MiB", "weight sync ms", "sync vs N=1",
           "staleness 0/1/2/.. (tokens %)", "trainer idle", "s/step", "workers CPU us/sample", "machine busy"]


def rss_mib(field: str = "VmHWM") -> float:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident memory, MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    """Reset this process's peak RSS (Linux ``clear_refs`` 5), so that each run reports its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _stat_cpu_s(path: str) -> float:
    """User + system CPU seconds of the process or thread whose ``stat`` file is `path` (OSError once it ended)."""
    with open(path) as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads so far, summed by thread name (the main thread: ``loop``)."""
    out: dict[str, float] = {}
    me = str(os.getpid())
    for tid in os.listdir("/proc/self/task"):
        try:
            cpu = _stat_cpu_s(f"/proc/self/task/{tid}/stat")
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = "loop" if tid == me else f.read().strip()
        except OSError:  # the thread ended
            continue
        out[name] = out.get(name, 0.0) + cpu
    return out


def workers_cpu() -> dict[int, float]:
    """CPU seconds so far of each of the run's worker processes on this machine (Ray actors hosting asyncrl workers:
    the simulated replicas and training ranks), by pid."""
    out: dict[int, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read(64).split(b"\0")[0]
            if cmd.startswith(b"ray::") and b"Host" in cmd:
                out[int(pid)] = _stat_cpu_s(f"/proc/{pid}/stat")
        except OSError:  # the process ended
            continue
    return out


def machine_busy_s() -> tuple[float, float]:
    """(busy CPU seconds of every core so far, the cores' count): /proc/stat's first line, idle and iowait left out."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), float(os.cpu_count() or 1)


def cpu_by_thread(before: dict[str, float], after: dict[str, float], samples: int, top: int = 4) -> str:
    """The threads that used the most CPU between two :func:`thread_cpu` readings, in us per trained sample."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    best = sorted(d.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} {v / samples * 1e6:.0f}" for k, v in best if v > 0)


class LoopLag:
    """A heartbeat on the controller's loop: how late each 5 ms timer runs. A timer callback, not a task that
    sleeps: the same lag, at a fraction of the CPU (a task's wake-up is a future, a callback and a step; counted in
    the controller's CPU, the sleeping task was 10-20 us per trained sample at 64 replicas)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (monotonic time, lag s)
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        self._due = time.perf_counter() + 0.005
        self._timer = asyncio.get_running_loop().call_later(0.005, self._beat)

    def _beat(self) -> None:
        t = time.perf_counter()
        self.samples.append((time.monotonic(), t - self._due))
        self._due = t + 0.005
        self._timer = asyncio.get_running_loop().call_later(0.005, self._beat)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def p99(self, start: float, end: float) -> float:
        lags = sorted(lag for t, lag in self.samples if start <= t <= end)
        return lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else float("nan")


def config(args: argparse.Namespace, n: int, out: str) -> Any:
    """The twin run of `n` replicas (module docstring)."""
    from asyncrl.pipelines.job.presets import twin

    cfg = twin()
    cfg.twin.profile, cfg.twin.time_scale = args.profile, args.time_scale
    cfg.twin.replicas_per_process = min(n, args.per_process)
    cfg.algorithm.group_size = args.group
    B = args.groups_per_replica * n
    t = cfg.trainer
    t.steps, t.batch_size, t.max_staleness = args.steps, B * args.group, args.staleness
    t.rollout_workers, t.train_workers = n, max(1, n // args.replicas_per_rank)
    t.checkpoint_at_end, t.checkpoint_every_s, t.samples_per_step = False, None, 0
    t.rollout_timeout_s = None
    t.output_dir = out
    cfg.data.num_prompts = max(64, 2 * B)
    if args.set:  # KEY=VALUE overrides, as `asyncrl train` takes them
        from asyncrl.pipelines.configlib import apply_overrides

        cfg = apply_overrides(cfg, args.set)
    return cfg.validate()


def ideal_tokens_s(cfg: Any, n: int, in_flight: float) -> float:
    """The cost model's ideal: n replicas each decoding `in_flight` requests without pause (every step full),
    simulated tokens per (scaled) second, and the training ranks' capacity for them (whichever is lower)."""
    from asyncrl.pipelines.twin.profile import load_profile
    from asyncrl.pipelines.twin.workers import train_costs

    p = load_profile(cfg.twin.profile)
    r, lm = p.rollout, p.lengths
    c = max(1.0, min(in_flight, r.max_num_seqs))  # every replica always holding `in_flight` requests
    mean_len = lm.median * math.exp(lm.sigma ** 2 / 2 + lm.prompt_sigma ** 2 / 2) if lm.kind == "lognormal" else 0.0
    mean_len = min(mean_len, lm.max_new_tokens)
    ctx = lm.prompt_tokens + mean_len / 2  # a running request's mean context
    step_ms = r.decode_base_ms + r.decode_ms_per_seq * c + r.decode_ms_per_1k_kv * c * ctx / 1000
    prefill_ms = r.prefill_ms_per_token * lm.prompt_tokens * c / max(mean_len, 1.0)  # per step, amortised
    gen = n * c / ((step_ms + prefill_ms) / 1e3) / cfg.twin.time_scale
    sample_tokens = lm.prompt_tokens + mean_len
    per_rank = train_costs(p, sample_tokens * 1000, 1)  # seconds per 1000 samples on one rank, by FLOPs
    train_s = 2 * per_rank["forward"] + per_rank["backward"]  # old log-prob forward + update's forward/backward
    train = cfg.trainer.train_workers * 1000 * mean_len / train_s / cfg.twin.time_scale
    return min(gen, train)


async def run_one(args: argparse.Namespace, n: int, variant: str) -> dict[str, Any]:
    from asyncrl.pipelines.trainers.trainer import GRPOTrainer

    out = tempfile.mkdtemp(prefix=f"asyncrl-twin-{n}-{variant}-")
    cfg = config(args, n, out)
    cfg.trainer.balance_batch = cfg.trainer.balance_batch and variant in CURRENT
    marks: list[tuple[float, float]] = []  # (monotonic, process CPU s) at each step's end
    threads: list[dict[str, float]] = []  # CPU per thread at the steady window's start and end
    workers: list[dict[int, float]] = []  # CPU per worker process, and the machine's, at the same two points
    machine: list[tuple[float, float]] = []
    lag = LoopLag()
    restore = set_variant(variant)
    reset_peak_rss()

    def on_step(tr: Any, step: int, m: Any) -> None:
        marks.append((time.monotonic(), time.process_time()))
        if step in (args.warmup, args.steps - 1):
            threads.append(thread_cpu())
            workers.append(workers_cpu())
            machine.append(machine_busy_s())

    try:
        trainer = GRPOTrainer(cfg, on_step=on_step)
        async with trainer:
            lag.start()
            hist = await trainer.fit()
            lag.stop()
            spans = [s for s in trainer.tracer.spans if s.name == "weight_sync"]
            exports = {s.args["step"] + 1: s for s in trainer.tracer.spans if s.name == "export_weights"}
    finally:
        restore()
    w = args.warmup
    steady = hist[w + 1:]
    (t0, c0), (t1, c1) = marks[w], marks[-1]
    samples = len(steady) * cfg.trainer.batch_size
    from asyncrl.pipelines.twin.profile import load_profile, tokens_per_id

    per_id = tokens_per_id(load_profile(cfg.twin.profile), cfg.twin)
    tokens = sum(h["actor/tokens"] * cfg.trainer.train_workers for h in steady)
    stale = token_ages(steady, cfg.trainer.max_staleness)  # past max_staleness only with trainer.stream.bound=admitted
    in_flight = (cfg.trainer.max_staleness + 1) * args.groups_per_replica * cfg.group_size  # admission's bound
    sync = reach_times(spans, exports, w)
    return {
        "n": n, "variant": variant, "train_ranks": cfg.trainer.train_workers, "batch": cfg.trainer.batch_size,
        "samples_s": samples / (t1 - t0), "tokens_s": tokens / (t1 - t0),
        "ideal_tokens_s": ideal_tokens_s(cfg, n, in_flight),
        "cpu_us": (c1 - c0) / samples * 1e6, "lag_p99_ms": lag.p99(t0, t1) * 1e3, "rss_mib": rss_mib(),
        "sync_ms": statistics.median(sync) * 1e3 if sync else float("nan"),
        "stale": [x / sum(stale) if sum(stale) else 0.0 for x in stale],
        "idle": sum(h["time/wait_rollout"] for h in steady) / sum(h["time/step"] for h in steady),
        "step_s": (t1 - t0) / len(steady), "per_id": per_id,
        "threads": cpu_by_thread(threads[0], threads[-1], samples),
        "workers_us": sum(c - workers[0][p] for p, c in workers[-1].items() if p in workers[0]) / samples * 1e6,
        "busy": (machine[-1][0] - machine[0][0]) / (machine[0][1] * (t1 - t0)),
    }


def reach_times(syncs: list[Any], exports: dict[int, Any], warmup: int) -> list[float]:
    """Seconds from each version's export finishing on the training rank (its worker's end) to the controller
    holding every replica's receipt for it (its ``weight_sync`` span's end), for the versions after `warmup`."""
    out = []
    for s in syncs:
        v = s.args.get("version", 0)
        e = exports.get(v)
        if v > warmup and e is not None:
            done = e.ran[1] if e.ran is not None else e.end
            out.append(s.end - max(done, s.start))
    return out


def set_variant(variant: str) -> Any:
    """Make the controller run as `variant` (module docstring); returns the undo."""
    from asyncrl import _call, _wire
    from asyncrl.pipelines.run import run_journal
    from asyncrl.pipelines.observe import trace
    from asyncrl.pipelines.rollout import stream_rollout as sr
    from asyncrl.pipelines.rollout.admission import Admission

    saved = sr.ROUTE_GROUPS, sr.SHARD_STEP_BATCH, sr.SCORE_IN_GENERATE, trace.Tracer.watch
    kept = _wire.TEXT_TENSORDICTS, Admission._needs, _call.TOP_VALUES, run_journal.FACTS_IN_REPLY
    cut = sr.SPLIT_STEP_PROMPTS, _wire.SMALL_TENSOR_BYTES
    sr.ROUTE_GROUPS = variant != "unrouted"
    sr.SHARD_STEP_BATCH = variant in ("sharded", *CURRENT)
    sr.SCORE_IN_GENERATE = variant in ("before", "columns", "top-values", "after")
    _wire.TEXT_TENSORDICTS = variant in ("columns", "top-values", "after")
    _call.TOP_VALUES = run_journal.FACTS_IN_REPLY = variant in ("top-values", "after")
    if variant != "after":
        sr.SPLIT_STEP_PROMPTS, _wire.SMALL_TENSOR_BYTES = False, 0
    if variant not in ("columns", "top-values", "after"):  # a take as it was: every finished group scanned at every try
        def needs(self: Any) -> dict[int, int]:
            B, k, p = self.groups_per_step, self.max_staleness, self.next_step
            return {u: max(0, self._untrained_upto(u) - max(0, u + k - p) * B) for u in sorted(self._by_v0)}

        Admission._needs = needs  # type: ignore[method-assign]
    if variant not in CURRENT:  # the tracer as it was: every watched call swept every pending one
        def watch(self: Any, future: Any, stage: str, **kw: Any) -> Any:
            self._sweep_at = 0
            return saved[3](self, future, stage, **kw)

        trace.Tracer.watch = watch  # type: ignore[method-assign]

    def undo() -> None:
        sr.ROUTE_GROUPS, sr.SHARD_STEP_BATCH, sr.SCORE_IN_GENERATE, trace.Tracer.watch = saved  # type: ignore[method-assign]
        (_wire.TEXT_TENSORDICTS, Admission._needs,  # type: ignore[method-assign]
         _call.TOP_VALUES, run_journal.FACTS_IN_REPLY) = kept
        sr.SPLIT_STEP_PROMPTS, _wire.SMALL_TENSOR_BYTES = cut

    return undo


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    base = {r["variant"]: r for r in rows if r["n"] == 1}
    for r in rows:
        b = base.get(r["variant"])
        vs = f"{r['samples_s'] / (r['n'] * b['samples_s']):.2f}" if b else "n/a"
        sync = f"{r['sync_ms'] / b['sync_ms']:.2f}x" if b and b["sync_ms"] == b["sync_ms"] else "n/a"
        out.append("| " + " | ".join([
            str(r["n"]), r["variant"], str(r["train_ranks"]), str(r["batch"]), f"{r['samples_s']:.1f}", vs,
            f"{r['tokens_s']:.0f}", f"{r['ideal_tokens_s']:.0f}", f"{r['tokens_s'] / r['ideal_tokens_s']:.2f}",
            f"{r['cpu_us']:.0f}", f"{r['lag_p99_ms']:.1f}", f"{r['rss_mib']:.0f}", f"{r['sync_ms']:.0f}", sync,
            "/".join(f"{100 * x:.0f}" for x in r["stale"]), f"{r['idle']:.2f}", f"{r['step_s']:.2f}",
            f"{r['workers_us']:.0f}", f"{r['busy']:.2f}",
        ]) + " |")
    return "\n".join(out)


def workload(args: argparse.Namespace) -> str:
    from asyncrl.pipelines.twin.profile import TwinConfig, load_profile, tokens_per_id

    p = load_profile(args.profile)
    k = tokens_per_id(p, TwinConfig(profile=args.profile))
    return (
        f"Profile `{args.profile}` ({p.description}); **time scale {args.time_scale:g}** (every simulated cost "
        f"x {args.time_scale:g}: one simulated GPU second lasts {args.time_scale:g} s). Streaming, max_staleness "
        f"{args.staleness}, {args.groups_per_replica} prompt groups of {args.group} per replica per step, one training "
        f"rank per {args.replicas_per_rank} replicas, {args.steps} steps per run (steady state: steps "
        f"{args.warmup + 1}..{args.steps - 1}), up to {args.per_process} simulated replicas per rollout process; each "
        f"response id stands for {k} tokens. samples/s: trained responses per second; tokens/s: simulated tokens "
        "(prompt + response) trained per second; vs N x 1: samples/s over N times the N = 1 run's; ideal tokens/s: "
        "the cost model's, N replicas each decoding as many requests as admission allows ((max_staleness + 1) x "
        "groups per replica x group size) without pause (or the "
        "training ranks' capacity, when lower); ctrl CPU: the controller process's CPU time (all its threads) per "
        "trained sample; loop lag: a 5 ms heartbeat on the controller's loop; RSS: the controller's peak in the run; "
        "weight "
        "sync: from a version's export finishing on the training rank to the controller holding every replica's "
        "receipt (median; each replica pulls the version from the object store and loads it between two decoding "
        "steps); "
        "staleness: the trained response tokens generated 0, 1, 2, .. versions before their step; trainer idle: the "
        "train loop's wait for a batch / step time; workers CPU: the CPU of the run's worker processes (the "
        "simulated replicas and training ranks, with Ray's threads in them) per trained sample; machine busy: the "
        "share of every core busy over the window (the controller, Ray and any other job included).")


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for n in args.replicas:
        for v in [v for v in args.variants if v in CURRENT or n <= args.variants_upto]:
            load = os.getloadavg()[0]
            r = await run_one(args, n, v)
            r["load"] = load
            rows.append(r)
            print(f"N={n} {v}: {r['samples_s']:.1f} samples/s, {r['tokens_s']:.0f} tokens/s (ideal "
                  f"{r['ideal_tokens_s']:.0f}), ctrl {r['cpu_us']:.0f} us/sample, lag p99 {r['lag_p99_ms']:.1f} ms, "
                  f"sync {r['sync_ms']:.0f} ms, idle {r['idle']:.2f}, workers {r['workers_us']:.0f} us/sample, "
                  f"machine busy {r['busy']:.2f}, load {load:.1f}; CPU us/sample by thread: "
                  f"{r['threads']}", flush=True)
    return rows


def fixed_lengths(name: str) -> Path:
    """Profile `name` with every response at its median length (``sigma`` and ``prompt_sigma`` 0), written to a
    temporary file; its description says so."""
    from dataclasses import replace

    from asyncrl.pipelines.twin.profile import dump_profile, load_profile

    prof = load_profile(name)
    fixed = replace(prof, name=f"{prof.name}_fixed_lengths",
                    description=f"{prof.description}; every response {prof.lengths.median:g} tokens (--fixed-lengths)",
                    lengths=replace(prof.lengths, sigma=0.0, prompt_sigma=0.0))
    return dump_profile(fixed, Path(tempfile.mkdtemp(prefix="asyncrl-twin-profile-")) / f"{fixed.name}.yaml")


def add_twin_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The twin runs' options (profile, time scale, steps, workload, layout, overrides), shared with
    ``call_floor.py``."""
    p.add_argument("--profile", default="qwen2_7b_h100_vllm")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the steady state")
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--group", type=int, default=8, help="responses per prompt group")
    p.add_argument("--groups-per-replica", type=int, default=4, help="prompt groups per replica per step")
    p.add_argument("--replicas-per-rank", type=int, default=1, help="rollout replicas per training rank")
    p.add_argument("--per-process", type=int, default=32, help="simulated replicas (and ranks) per process")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override of every twin run (repeatable), e.g. trainer.balance_batch=false")


def run_on_ray(args: argparse.Namespace, amain: Any) -> tuple[list[dict[str, Any]], float]:
    """``amain(args)`` on an embedded Ray sized for the largest run's processes; its rows and the 1-minute load
    average at the start."""
    import asyncrl

    top = max(args.replicas)
    procs = sum(-(-n // args.per_process) for n in (top, max(1, top // args.replicas_per_rank)))
    load0 = os.getloadavg()[0]
    asyncrl.init(num_cpus=procs + 4)
    try:
        return asyncrl.run(amain(args)), load0
    finally:
        asyncrl.shutdown()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="N = 1,2, before and after, 4 short steps: the mechanism only")
    p.add_argument("--replicas", default="1,4,16,64,256",
                   help="comma-separated rollout replica counts; without 1 first, 'vs N x 1' reads n/a")
    p.add_argument("--variants", default="after", help=f"comma-separated, of {','.join(VARIANTS)}")
    add_twin_args(p, steps=6)
    p.add_argument("--variants-upto", type=int, default=64,
                   help="run the variants other than 'two-calls', 'before', 'columns', 'top-values' and 'after' only "
                        "up to this N "
                        "(the unrouted code splits every group across every replica: at 256 a step takes many minutes)")
    p.add_argument("--fixed-lengths", action="store_true",
                   help="every response the profile's median length (no long tail): what the controller, Ray, "
                        "admission and the weight sync do alone, without the workload's stragglers")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.variants, args.steps, args.warmup = "1,2", "before,after", 4, 1
        args.groups_per_replica, args.time_scale = 1, 0.05
    args.replicas = [int(x) for x in args.replicas.split(",")]
    if args.fixed_lengths:
        args.profile = str(fixed_lengths(args.profile))
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or min(args.replicas) < 1 or args.warmup + 2 > args.steps:
        p.error(f"--variants of {VARIANTS}; --replicas of 1 or more; --steps must exceed --warmup + 1")
    rows, load0 = run_on_ray(args, amain)
    write_result(args.out or RESULTS, "\n\n".join([
        "# Cluster twin: the real controller at 1-256 simulated replicas",
        run_header("cluster_twin.py", load_note(load0, os.getloadavg()[0])), workload(args), table(rows),
        "Controller CPU by thread (us per trained sample, the top 4): " + "; ".join(
            f"N={r['n']} {r['variant']}: {r['threads']}" for r in rows) + ".",
        "1-minute load average at each run's start: " + ", ".join(f"N={r['n']} {r['variant']} {r['load']:.1f}"
                                                             for r in rows) + "."]) + "\n")


if __name__ == "__main__":
    main()
