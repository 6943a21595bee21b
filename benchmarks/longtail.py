"""Long tail: the rollout schedules on heavy-tailed response lengths, side by side in one run.

The workload (real Ray, real worker groups, the real trainer loops; simulated costs):

* **Rollout**: the real :class:`~asyncrl.roles.generation.rollout.RolloutWorker` on the simulated engine
  (:mod:`asyncrl.roles.engines.sim`): a decoding step costs ``--step-ms`` whatever the number
  of requests in it, up to ``--slots`` (GPU-like: a memory-bound step), and response lengths
  are log-normal (median ``--median``, log-space deviation ``--sigma``, capped at
  ``--max-new-tokens``). A batch's generation therefore lasts as long as its longest row, and
  the engine's slots idle while the tail finishes.
* **Training**: a policy worker that sleeps ``--train-ms`` per step (old log-prob 20 %, update
  60 %, weight export 20 %) and exports a real tiny model's weights; the real advantage worker
  (GRPO); a reward that costs nothing. Two worker processes (rollout pool, training pool),
  reused by every variant.

Variants (the same workers, one after another; ``--variants`` picks them):

* ``sync``: the trainer at ``max_staleness=0`` (the synchronous loop).
* ``batch``: batch overlap, ``rollout_mode=batch`` (at ``max_staleness=1``: one-step overlap).
* ``stream``: ``rollout_mode=stream`` (many prompt groups in flight, admission control).
* ``stream+recompute`` / ``stream+keep``: streaming with partial rollout (a weight update reaches
  generations in flight: re-prefill, or decode on).

Every variant but ``sync`` runs at each ``--staleness`` bound (default 1 and 4): streaming keeps
every trajectory within the bound without dropping it, so at 1 a step must wait for the longest
trajectory admitted one version earlier; a bound of a few steps lets the tail finish while later
steps train.

Ideal step time, per variant, from the rows it trained (g_t = the generation time of step t's
batch alone on an idle engine: its longest row x step cost when the batch fits the slots;
T = the training cost per step; tokens_t = the response tokens of step t):

* sync: mean(g_t) + T  (generation, then training);
* one-step overlap: mean(max(g_t, T))  (each batch's generation hides behind one training step);
* streaming: max(mean(tokens_t) / engine throughput at full occupancy, T)  (throughput = slots /
  step cost: every slot busy all the time).

Figures: ms/step and tokens/s (trained response tokens per second) in steady state (the first
step discarded), efficiency = ideal / measured, the engine's idle fraction (decode slots unused /
available, over the same steady-state window), the peak of trajectories in flight (requests in
the engine, decoding or waiting) and buffered (rows in the rollout->train buffer), the peak RSS of the controller and of
the rollout worker (VmHWM, reset before each variant).

    python benchmarks/longtail.py            # the default workload, ~3 minutes
    python benchmarks/longtail.py --quick    # tiny sizes: the mechanism only (for tests)
    python benchmarks/longtail.py --replicas 1,2,4   # rollout replicas instead (below), ~2 minutes

**Replicas** (``--replicas``): streaming with 1, 2, 4 rollout workers (each its own simulated engine, so each
adds ``slots`` decode slots), the trainer owning its groups; a generation-bound workload (training costs
``--train-ms``, small), tokens/s per replica count and scaling efficiency = tokens/s(n) / (n x tokens/s(1)).
Then one run with ``rollout_workers=1..2`` that calls ``scale_rollout(2)`` after ``--grow-at`` steps: tokens/s of
the steps before, of the step during which the new pool took over, and of the steps after.

Writes ``benchmarks/results/longtail.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from _common import load_note, parse_variants, run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)
import asyncrl  # noqa: E402
from asyncrl import Dispatch, Execute, ResourcePool, Worker, colocate, register  # noqa: E402
from asyncrl.roles.generation.rollout import RolloutWorker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "longtail.md")

VARIANTS = ("sync", "batch", "stream", "stream+recompute", "stream+keep")
TRAIN_SHARE = {"old_log_prob": 0.2, "actor_update": 0.6, "export_weights": 0.2}
COLUMNS = ["variant", "max_staleness", "steps", "ms/step", "ideal ms/step", "eff.", "tokens/s", "vs batch overlap", "engine idle",
           "peak in flight", "peak buffered", "staleness seen", "weight update ms p50/max", "ctrl peak RSS MiB",
           "rollout peak RSS MiB"]


# ---- memory: the peak RSS of a process since the last reset --------------------------------------


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs`` 5); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """This process's peak RSS since the last :func:`reset_peak_rss` (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# ---- the workers -------------------------------------------------------------------------------


class LongtailRollout(RolloutWorker):
    """The real rollout worker (on the simulated engine), restartable between variants."""

    @register(Dispatch.ONE_TO_ALL)
    def configure(self, partial: str | None = None) -> int:
        """Start a variant: weights version 0, the engine's counters and the peak RSS reset, partial
        rollout `partial` (None: off)."""
        self.weights.version = 0
        if hasattr(self.config, "partial_rollout"):
            self.config.partial_rollout = partial or "off"
            self.weights.updates = []
        elif partial is not None:
            raise RuntimeError("this RolloutWorker has no partial rollout (RolloutConfig.partial_rollout)")
        self._update_s: list[float] = []
        self.engine.reset_statistics()
        reset_peak_rss()
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    async def update_weights(self, weights: Any, version: int | None = None, *,
                             expected_checksums: dict[str, str] | None = None) -> dict[str, Any]:
        """:meth:`RolloutWorker.update_weights`, timed (from the call's start on this worker to its end)."""
        t0 = time.perf_counter()
        out = await super().update_weights(weights, version, expected_checksums=expected_checksums)
        self._update_s.append(time.perf_counter() - t0)
        return out

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def sim_statistics(self, start: float, end: float) -> dict[str, float]:
        """The engine's counters since :meth:`configure` (its idle fraction between the monotonic times
        `start` and `end`) and this process's peak RSS (MiB)."""
        st = self.engine.statistics()
        return {"idle": self.engine.idle_between(start, end), "peak_in_flight": st.peak_in_flight, "tokens": st.tokens,
                "steps": st.steps, "loads": st.loads, "prefills": st.prefills, "rss_mib": peak_rss_mib(),
                "update_s": list(self._update_s)}


class SimReward(Worker):
    """A reward that costs nothing: 1 for a response shorter than 16 tokens, else 0."""

    @register(Dispatch.DP_COMPUTE)
    def compute_reward(self, batch: Any) -> TensorDict:
        return TensorDict({"scores": (batch["response_mask"].sum(-1) < 16).float()}, batch_size=batch.batch_size)


class ReplicaReward(SimReward):
    """:class:`SimReward` under the trainer's constructor arguments (the reward config)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class SimPolicy(Worker):
    """A policy whose stages sleep their cost; it exports a real tiny model's weights (what the rollout
    worker checks and loads) and records the response lengths of every batch it trained."""

    def __init__(self, model: Any) -> None:
        from asyncrl.roles.modeling.models import load_model

        built, _ = load_model(model)
        self.weights = {k: v.detach().clone() for k, v in built.state_dict().items()}
        self.costs: dict[str, float] = {}
        self.version = 0
        self.trained: list[list[int]] = []

    @register(Dispatch.ONE_TO_ALL)
    def configure(self, costs: dict[str, float]) -> int:
        """Set the stage costs (seconds), start again at version 0, forget the trained batches."""
        self.costs, self.version, self.trained = dict(costs), 0, []
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def trained_lengths(self) -> list[list[int]]:
        """The response lengths of each trained batch, in step order."""
        return self.trained

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Any) -> TensorDict:
        time.sleep(self.costs.get("old_log_prob", 0.0))
        shape = batch["response_mask"].shape
        return TensorDict({"old_log_probs": torch.zeros(shape), "entropy": torch.zeros(shape)},
                          batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def update(self, batch: Any) -> dict[str, float]:
        time.sleep(self.costs.get("actor_update", 0.0))
        lengths = batch["response_mask"].sum(-1).tolist()
        self.trained.append([int(n) for n in lengths])
        self.version += 1
        return {"pg_loss": 0.0, "tokens": float(sum(lengths))}

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def export_weights(self, dtype: str | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        time.sleep(self.costs.get("export_weights", 0.0))
        return self.version, self.weights


class ReplicaPolicy(SimPolicy):
    """:class:`SimPolicy` under the trainer's constructor arguments (model, actor config, max_staleness); its
    costs come from the ``ASYNCRL_LONGTAIL_TRAIN_S`` environment variable (set before Ray starts)."""

    def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(model)
        train_s = float(os.environ.get("ASYNCRL_LONGTAIL_TRAIN_S", "0.02"))
        self.costs = {k: v * train_s for k, v in TRAIN_SHARE.items()}

    @register(Dispatch.ONE_TO_ALL)
    def compute_ref_log_prob(self, batch: Any) -> TensorDict:  # never called: no KL term
        raise RuntimeError("no reference")


# ---- ideals ------------------------------------------------------------------------------------


def batch_makespan(lengths: list[int], slots: int) -> int:
    """Decoding steps to finish `lengths` on `slots` slots (first come, first served; one token per
    request per step): the longest row when they all fit."""
    if len(lengths) <= slots:
        return max(lengths, default=0)
    import heapq

    free = [0] * slots  # the step at which each slot frees up
    for n in lengths:
        heapq.heappush(free, heapq.heappop(free) + n)
    return max(free)


def ideal_step_s(variant: str, trained: list[list[int]], step_s: float, slots: int, train_s: float) -> float:
    """The variant's ideal seconds per step for the batches it trained (see the module docstring)."""
    gen = [batch_makespan(b, slots) * step_s for b in trained]
    if variant == "sync":
        return statistics.fmean(gen) + train_s
    if variant == "batch":
        return statistics.fmean(max(g, train_s) for g in gen)
    tokens = statistics.fmean(sum(b) for b in trained)
    return max(tokens * step_s / slots, train_s)


# ---- the bench ---------------------------------------------------------------------------------


class Bench:
    """One rollout process and one training process, reused by every variant."""

    def __init__(self, args: argparse.Namespace) -> None:
        from asyncrl.pipelines.job.presets import tiny_test
        from asyncrl.pipelines.loop.stages import AdvantageWorker, Groups
        from asyncrl.roles import RolloutConfig

        self.args = args
        base = tiny_test("grpo")
        self.model = base.model
        self.rollout_cfg = RolloutConfig(
            engine="sim", max_new_tokens=args.max_new_tokens,
            engine_kwargs={"step_ms": args.step_ms, "max_batch_size": args.slots, "median_tokens": args.median,
                           "sigma": args.sigma, "prefill_ms": args.prefill_ms, "round_steps": args.round_steps})
        self.pool = ResourcePool([2], cpus_per_bundle=1.0, name="longtail")
        rpool, tpool = self.pool.split([1, 1])
        self.rcol = colocate({"rollout": (LongtailRollout, (self.model, self.rollout_cfg), {}), "reward": SimReward},
                             rpool, name="rollout")
        self.tcol = colocate({"policy": (SimPolicy, (self.model,), {}), "advantage": AdvantageWorker}, tpool,
                             name="train")
        self.groups = Groups(rollout=self.rcol["rollout"], reward=self.rcol["reward"], policy=self.tcol["policy"],
                             advantage=self.tcol["advantage"])
        self.tmp = tempfile.mkdtemp(prefix="asyncrl-longtail-")

    async def setup(self) -> None:
        await asyncio.gather(self.rcol.setup(), self.tcol.setup())

    async def close(self) -> None:
        await self.rcol.close()
        await self.tcol.close()
        await self.pool.release()

    def config(self, variant: str, k: int) -> Any:
        """The trainer's config of `variant` (the same data, batch and costs for all)."""
        from asyncrl.pipelines.job.presets import tiny_test

        a = self.args
        cfg = tiny_test("grpo")
        cfg.rollout = dataclasses.replace(self.rollout_cfg)
        cfg.data.num_prompts = max(64, 4 * a.batch // a.group)
        cfg.algorithm.group_size = a.group
        t = cfg.trainer
        t.steps, t.batch_size, t.trace = a.steps, a.batch, False
        t.checkpoint_at_end, t.checkpoint_every_s = False, None
        t.max_staleness = k
        if variant.startswith("stream"):
            if not hasattr(t, "rollout_mode"):
                raise RuntimeError("this trainer has no trainer.rollout_mode; the stream variants need it")
            t.rollout_mode, t.rollout_weights = "stream", "latest"
        mode = variant.partition("+")[2] or None
        if mode is not None:
            cfg.rollout.partial_rollout = mode
        t.output_dir = os.path.join(self.tmp, f"{variant.replace('+', '-')}-k{k}")
        return cfg.validate(simulated_policy=True)  # SimPolicy: the groups' policy is simulated too

    async def run(self, variant: str, k: int) -> dict[str, Any]:
        from asyncrl.pipelines.trainers.trainer import make_trainer

        a = self.args
        cfg = self.config(variant, k)
        g = self.groups
        train_s = a.train_ms / 1e3
        await asyncio.gather(g.rollout.configure(variant.partition("+")[2] or None),
                             g.policy.configure({k: v * train_s for k, v in TRAIN_SHARE.items()}))
        reset_peak_rss()
        marks: list[float] = []  # monotonic time at the end of each step (the clock is system-wide)
        trainer = make_trainer(cfg, groups=g, on_step=lambda tr, step, m: marks.append(time.monotonic()))
        async with trainer:
            w0 = time.perf_counter()
            hist = await trainer.fit()
            wall = time.perf_counter() - w0
        sim, trained = await asyncio.gather(g.rollout.sim_statistics(marks[0], marks[-1]), g.policy.trained_lengths())
        el = [h["time/elapsed"] for h in hist]
        steady = hist[1:]
        span = el[-1] - el[0]
        tokens = sum(h["actor/tokens"] for h in steady)
        if variant.startswith("stream"):  # finished groups waiting for a step, seen at each step's take
            buffered = max(h["stream/buffered"] for h in hist) * a.group
        else:  # batches in the rollout->train buffer
            buffered = max(h["buffer/peak"] for h in hist) * a.batch
        return {
            "variant": variant, "k": k, "steps": len(hist), "step_s": span / len(steady), "wall_s": wall,
            "tokens_s": tokens / span, "ideal_s": ideal_step_s(variant, trained[1:], a.step_ms / 1e3, a.slots, train_s),
            "idle": sim["idle"], "peak_in_flight": sim["peak_in_flight"], "peak_buffered": buffered,
            "ctrl_rss": peak_rss_mib(), "rollout_rss": sim["rss_mib"], "lengths": [n for b in trained for n in b],
            "update_s": sim["update_s"], "prefills": sim["prefills"],
            "staleness_max": int(max(h["staleness/max"] for h in hist)),
            "stream": {k: max(h.get(k, 0.0) for h in hist) for k in hist[-1] if k.startswith("stream/")},
        }


# ---- replicas ----------------------------------------------------------------------------------


def replica_config(args: argparse.Namespace, workers: str | int, out: str) -> Any:
    """A streaming run whose trainer owns its groups: `workers` rollout workers (a count or ``"1..2"``), each
    on its own simulated engine, a training pool of one."""
    from asyncrl.pipelines.job.presets import tiny_test
    from asyncrl.roles import RolloutConfig

    cfg = tiny_test("grpo")
    cfg.rollout = RolloutConfig(
        engine="sim", max_new_tokens=args.max_new_tokens,
        engine_kwargs={"step_ms": args.step_ms, "max_batch_size": args.slots, "median_tokens": args.median,
                       "sigma": args.sigma, "prefill_ms": args.prefill_ms, "round_steps": args.round_steps})
    cfg.data.num_prompts = max(64, 4 * args.batch // args.group)
    cfg.algorithm.group_size = args.group
    t = cfg.trainer
    t.steps, t.batch_size = args.steps, args.batch
    t.trace, t.plot, t.progress, t.tensorboard = False, False, False, False
    t.checkpoint_at_end, t.checkpoint_every_s, t.samples_per_step = False, None, 0
    t.max_staleness, t.rollout_mode = 2, "stream"
    t.rollout_workers, t.rollout_placement = workers, [int(str(workers).partition("..")[0])]
    t.output_dir = out
    return cfg.validate(simulated_policy=True)  # ReplicaPolicy (replica_run's worker_overrides) is simulated too


async def replica_run(args: argparse.Namespace, workers: str | int, out: str, grow_at: int | None = None
                      ) -> dict[str, Any]:
    """One streaming run (see :func:`replica_config`): per-step tokens and end times; with `grow_at`, a
    ``scale_rollout(2)`` once that many steps are done, and the step at which the new pool took over."""
    from asyncrl.pipelines.trainers.trainer import make_trainer

    cfg = replica_config(args, workers, out)
    marks: list[float] = []
    overrides = {"policy": ReplicaPolicy, "reward": ReplicaReward}
    tr = make_trainer(cfg, worker_overrides=overrides, on_step=lambda t, step, m: marks.append(time.monotonic()))
    took_over: list[float] = []
    async with tr:
        async def grow() -> None:
            while len(marks) < (grow_at or 0):
                await asyncio.sleep(0.01)
            await tr.scale_rollout(2)
            took_over.append(time.monotonic())

        task = asyncio.create_task(grow()) if grow_at is not None else None
        hist = await tr.fit()
        if task is not None:
            await task
    tokens = [h["actor/tokens"] for h in hist]
    return {"tokens": tokens, "marks": marks, "took_over": took_over[0] if took_over else None}


def rate(tokens: list[float], marks: list[float], lo: int, hi: int) -> float:
    """Trained tokens per second of steps ``lo+1 .. hi`` (step i ends at ``marks[i]``)."""
    return sum(tokens[lo + 1:hi + 1]) / (marks[hi] - marks[lo])


async def replicas_main(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = []
    for n in args.replicas:
        r = await replica_run(args, n, os.path.join(tempfile.mkdtemp(prefix="asyncrl-replicas-"), f"n{n}"))
        rows.append({"n": n, "tokens_s": rate(r["tokens"], r["marks"], 0, len(r["marks"]) - 1)})
        print(f"{n} replicas: {rows[-1]['tokens_s']:.0f} tokens/s", flush=True)
    g = await replica_run(args, "1..2", tempfile.mkdtemp(prefix="asyncrl-grow-"), grow_at=args.grow_at)
    marks, over = g["marks"], g["took_over"]
    swap = next(i for i, m in enumerate(marks) if m >= over)  # the first step that ended after the swap
    last = len(marks) - 1
    grow = {"before": rate(g["tokens"], marks, 0, args.grow_at - 1), "swap_step": swap,
            "during": rate(g["tokens"], marks, swap - 1, swap), "after": rate(g["tokens"], marks, swap, last),
            "steps_after": last - swap}
    print(f"grow 1 -> 2: {grow['before']:.0f} tokens/s before, {grow['after']:.0f} after", flush=True)
    return rows, grow


def replica_table(rows: list[dict[str, Any]], grow: dict[str, Any], args: argparse.Namespace) -> str:
    one = rows[0]["tokens_s"] / rows[0]["n"]
    out = ["| rollout replicas | tokens/s | vs 1 replica | scaling efficiency (vs linear) |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['n']} | {r['tokens_s']:.0f} | {r['tokens_s'] / rows[0]['tokens_s']:.2f}x | "
                   f"{r['tokens_s'] / (r['n'] * one):.2f} |")
    out += ["", "| grow 1 -> 2 mid-run (`scale_rollout(2)` after step " + str(args.grow_at - 1) + ") | tokens/s |",
            "|---|---|",
            f"| steps before the call (1 replica) | {grow['before']:.0f} |",
            f"| the step the new pool took over in (step {grow['swap_step']}) | {grow['during']:.0f} |",
            f"| the {grow['steps_after']} steps after it (2 replicas) | {grow['after']:.0f} |"]
    return "\n".join(out)


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        base = next((b for b in rows if b["variant"] == "batch" and b["k"] == max(1, r["k"])), None)
        vs = f"{r['tokens_s'] / base['tokens_s']:.2f}x" if base is not None else "n/a"
        out.append("| " + " | ".join([
            r["variant"], str(r["k"]), str(r["steps"]), f"{r['step_s'] * 1e3:.0f}", f"{r['ideal_s'] * 1e3:.0f}",
            f"{r['ideal_s'] / r['step_s']:.2f}", f"{r['tokens_s']:.0f}", vs, f"{r['idle']:.2f}",
            str(r["peak_in_flight"]), f"{r['peak_buffered']:.0f}", str(r["staleness_max"]), update_ms(r["update_s"]),
            f"{r['ctrl_rss']:.0f}", f"{r['rollout_rss']:.0f}",
        ]) + " |")
    return "\n".join(out)


def update_ms(seconds: list[float]) -> str:
    """``p50/max`` of the rollout worker's weight updates, ms."""
    if not seconds:
        return "none"
    return f"{statistics.median(seconds) * 1e3:.1f}/{max(seconds) * 1e3:.1f}"


def length_note(rows: list[dict[str, Any]]) -> str:
    lengths = [n for r in rows for n in r["lengths"]]
    q = statistics.quantiles(lengths, n=100)
    return (f"Response lengths trained (all variants, {len(lengths)} rows): p50 {q[49]:.0f}, p90 {q[89]:.0f}, "
            f"p99 {q[98]:.0f} tokens, max {max(lengths)}, mean {statistics.fmean(lengths):.1f}; "
            f"p99/p50 = {q[98] / q[49]:.1f}.")


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    bench = Bench(args)
    await bench.setup()
    rows = []
    try:
        for v, k in runs(args):
            rows.append(await bench.run(v, k))
            r = rows[-1]
            print(f"{v} k={k}: {r['step_s'] * 1e3:.0f} ms/step (ideal {r['ideal_s'] * 1e3:.0f}), "
                  f"{r['tokens_s']:.0f} tokens/s, engine idle {r['idle']:.2f}", flush=True)
    finally:
        await bench.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and costs, 3 steps: the mechanism only")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, in run order (default: those this trainer supports of {','.join(VARIANTS)})")
    p.add_argument("--steps", type=int, default=None, help="steps per variant (default 16; --quick 3)")
    p.add_argument("--batch", type=int, default=None, help="responses per step (default 32; --quick 8)")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (GRPO group)")
    p.add_argument("--slots", type=int, default=None, help="the engine's decode slots (default: --batch)")
    p.add_argument("--step-ms", type=float, default=None, help="cost of one decoding step (default 5; --quick 1)")
    p.add_argument("--median", type=float, default=None, help="median response length (default 16; --quick 4)")
    p.add_argument("--sigma", type=float, default=1.2, help="log-space deviation of the lengths (p99/p50 = "
                                                           "exp(2.326 sigma))")
    p.add_argument("--max-new-tokens", type=int, default=None, help="length cap (default 256; --quick 32)")
    p.add_argument("--train-ms", type=float, default=None, help="training + sync cost per step (default 250; "
                                                                "--quick 20)")
    p.add_argument("--prefill-ms", type=float, default=None,
                   help="cost of re-prefilling the requests in flight after a weight update (partial recompute; "
                        "default: 2 decoding steps)")
    p.add_argument("--staleness", default=None,
                   help="comma-separated max_staleness bounds; every variant but sync runs at each (default 1,4; "
                        "--quick 1)")
    p.add_argument("--round-steps", type=int, default=32,
                   help="decoding steps per engine round: a load that arrives with requests in flight and no "
                        "pause waits for the running round to end (default 32, the HF engine's chunk_tokens)")
    p.add_argument("--replicas", default=None,
                   help="comma-separated rollout replica counts (e.g. 1,2,4): run the replica section instead of the "
                        "variants (tokens/s, scaling efficiency, and a run that grows 1 -> 2 mid-run)")
    p.add_argument("--grow-at", type=int, default=6,
                   help="--replicas: steps done before the grow run's scale_rollout(2)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    q = args.quick
    train_given, slots_given, step_given = args.train_ms, args.slots, args.step_ms
    args.steps = args.steps or (3 if q else 16)
    args.batch = args.batch or (8 if q else 32)
    args.slots = args.slots or args.batch
    args.step_ms = args.step_ms or (1.0 if q else 5.0)
    args.median = args.median or (4.0 if q else 16.0)
    args.max_new_tokens = args.max_new_tokens or (32 if q else 256)
    args.train_ms = args.train_ms or (20.0 if q else 250.0)
    args.staleness = [int(k) for k in (args.staleness or ("1" if q else "1,4")).split(",")]
    if args.replicas:
        # generation-bound (what more replicas can speed up): cheap training, a small, slow engine per replica
        args.train_ms, args.slots, args.step_ms = train_given or 20.0, slots_given or 8, step_given or 10.0
        replicas_section(p, args)
        return
    if min(args.staleness) < 1:
        p.error("--staleness: every bound must be >= 1 (sync is the max_staleness=0 variant)")
    args.prefill_ms = args.prefill_ms if args.prefill_ms is not None else 2 * args.step_ms
    if args.variants:
        args.variants = parse_variants(p, args.variants, VARIANTS)
    else:
        args.variants = supported_variants()
    load0 = os.getloadavg()[0]
    asyncrl.init(num_cpus=4)
    try:
        rows = asyncrl.run(amain(args))
    finally:
        asyncrl.shutdown()
    missing = [v for v in VARIANTS if v not in args.variants]
    sections = [
        "# Long tail: sync, batch overlap, streaming, streaming + partial rollout",
        run_header("longtail.py", load_note(load0, os.getloadavg()[0])),
        workload(args),
        length_note(rows),
        table(rows),
        verdict(rows),
        (f"Not run: {', '.join(missing)} (this trainer does not support them yet)." if missing else ""),
    ]
    write_result(args.out or RESULTS, "\n\n".join(s for s in sections if s) + "\n")


def replicas_section(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--replicas``: streaming on 1, 2, 4 rollout replicas and a run that grows 1 -> 2 (the module docstring)."""
    args.replicas = [int(n) for n in args.replicas.split(",")]
    if args.replicas[0] != 1 or any(n < 1 for n in args.replicas):
        p.error("--replicas must start at 1 (the baseline of the scaling efficiency), e.g. 1,2,4")
    if args.batch // args.group % max(args.replicas):
        p.error(f"--replicas: {max(args.replicas)} must divide the {args.batch // args.group} prompts per step")
    args.prefill_ms = args.prefill_ms if args.prefill_ms is not None else 2 * args.step_ms
    args.steps = max(args.steps, args.grow_at + 10)
    os.environ["ASYNCRL_LONGTAIL_TRAIN_S"] = str(args.train_ms / 1e3)  # the policy workers read it
    load0 = os.getloadavg()[0]
    asyncrl.init(num_cpus=2 + max(args.replicas) + 2)  # logical CPUs: pools of their own, a grow beside the old pool
    try:
        rows, grow = asyncrl.run(replicas_main(args))
    finally:
        asyncrl.shutdown()
    write_result(args.out or os.path.join(HERE, "results", "longtail_replicas.md"), "\n\n".join([
        "# Long tail: rollout replicas", run_header("longtail.py", load_note(load0, os.getloadavg()[0])),
        replica_workload(args), replica_table(rows, grow, args)]) + "\n")


def replica_workload(args: argparse.Namespace) -> str:
    return (
        f"Workload: streaming at max_staleness 2, {args.batch} responses per step "
        f"({args.batch // args.group} prompts x {args.group}), {args.steps} steps per run (tokens/s over steps 1..{args.steps - 1}). Each rollout replica is "
        f"a worker process with its own simulated engine: {args.slots} decode slots, {args.step_ms:g} ms per decoding "
        f"step, log-normal response lengths (median {args.median:g}, sigma {args.sigma:g}, cap "
        f"{args.max_new_tokens}). Training + sync {args.train_ms:g} ms per step (slept): generation-bound. Scaling "
        "efficiency = tokens/s(n) / (n x tokens/s(1)). The grow run starts at 1 replica (rollout_workers=1..2) and "
        f"calls scale_rollout(2) after {args.grow_at} steps; the new pool starts beside the old one, loads the newest "
        "weights, then takes new groups while the old one drains.")


def supported_variants() -> tuple[str, ...]:
    """The variants this checkout's trainer and rollout worker can run."""
    from asyncrl.pipelines.job.config import TrainerConfig
    from asyncrl.roles import RolloutConfig

    out = ["sync", "batch"]
    if "rollout_mode" in TrainerConfig.__dataclass_fields__:
        out.append("stream")
        if "partial_rollout" in RolloutConfig.__dataclass_fields__:
            out += ["stream+recompute", "stream+keep"]
    return tuple(out)


def workload(args: argparse.Namespace) -> str:
    p99 = args.median * math.exp(2.326 * args.sigma)
    return (
        f"Workload: {args.batch} responses per step ({args.batch // args.group} prompts x {args.group}), "
        f"{args.steps} steps per variant (the first discarded), every variant but sync at max_staleness "
        f"{', '.join(map(str, args.staleness))}. Simulated engine: {args.slots} decode slots, {args.step_ms:g} ms per decoding step whatever "
        f"the batch size, log-normal response lengths (median {args.median:g}, sigma {args.sigma:g}: p99 ≈ "
        f"{p99:.0f} in theory; cap {args.max_new_tokens}), re-prefill after a weight update (recompute) "
        f"{args.prefill_ms:g} ms. Training + sync {args.train_ms:g} ms per step (slept). "
        "Two worker processes (rollout, training) for every variant. Ideal ms/step: sync = mean(g_t) + T; "
        "batch overlap = mean(max(g_t, T)); streaming = max(mean tokens per step / (slots / step cost), T), "
        "with g_t = the longest row of step t's batch x step cost and T the training cost. eff. = ideal / "
        "measured. engine idle = decode slots unused / available, in the same window as ms/step. peak in flight = "
        "most requests in the engine at once (decoding or waiting for a slot); peak buffered = most rows in "
        "the rollout->train buffer. RSS: peak resident memory (VmHWM, reset before each variant)."
    )


def runs(args: argparse.Namespace) -> list[tuple[str, int]]:
    """``(variant, max_staleness)`` in run order: sync once, the others at each bound."""
    out = [("sync", 0)] if "sync" in args.variants else []
    return out + [(v, k) for k in args.staleness for v in args.variants if v != "sync"]


def verdict(rows: list[dict[str, Any]]) -> str:
    lines = []
    for k in sorted({r["k"] for r in rows if r["k"] > 0}):
        by = {r["variant"]: r for r in rows if r["k"] == k}
        base = by.get("batch")
        best = next((by[v] for v in ("stream+recompute", "stream+keep", "stream") if v in by), None)
        if base is None or best is None:
            continue
        lines.append(f"max_staleness={k}: {best['variant']} {best['tokens_s'] / base['tokens_s']:.2f}x the tokens/s of "
                     "batch overlap (target ≥ 1.5x for streaming + partial rollout).")
    return " ".join(lines)


if __name__ == "__main__":
    main()
