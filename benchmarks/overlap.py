"""Overlap: the async trainer vs the synchronous loop, measured against the ideal.

Two workloads, one run, on real Ray with real worker groups and the real loops of
``asyncrl.pipelines`` (the trainer's ``_rollout_loop``/``_train_loop`` and the
synchronous baseline ``sequential_fit``):

1. **Simulated PPO workers.** Every stage of a PPO step is one group call on a worker
   that sleeps a set cost (``async def`` + ``asyncio.sleep`` on the rollout side, ``def``
   + ``time.sleep`` on the ordered thread of the training side), on two worker
   processes: rollout pool (``generate``, ``score``) and training pool
   (``old_log_prob``, ``values``, ``advantages``, ``critic_update``, ``actor_update``,
   ``export_weights`` = the weight sync). Training + sync costs ``--train-ms`` (200 ms)
   per step, rollout ``ratio x`` that. For each cost ratio (0.25, 0.5, 1, 2, 4) the
   synchronous loop runs once and the async trainer at ``max_staleness`` 0, 1, 2.
   Ideal step time: the sum of the stage costs for the synchronous loop (and for the
   trainer at ``max_staleness=0``, which is the synchronous schedule);
   ``max(rollout, training + sync)`` for the trainer at ``max_staleness >= 1``.
2. **The real tiny-model GRPO and PPO** (the ``asyncrl train`` presets ``grpo_toy`` and
   ``ppo_toy``, rollout and training on separate worker processes) on CPU: the trainer at
   ``max_staleness=0`` (synchronous) vs ``max_staleness=1`` (async), same steps, same seeds.

Step times are steady state: the first step is discarded as warm-up. The controller's
own work per step is the CPU time of the controller's thread (``time.thread_time``
around the loop; the asyncio event loop runs there) and of the whole controller
process (``time.process_time``: also Ray's driver threads that submit calls and
receive results).

    python benchmarks/overlap.py           # full: ~5 minutes on 2 cores
    python benchmarks/overlap.py --quick   # tiny costs and step counts, GRPO only: for tests
    python benchmarks/overlap.py --profile trainer --steps 30   # cProfile of the controller thread

Writes ``benchmarks/results/overlap.md`` and ``overlap.png`` (``--out``/``--png``).
"""

from __future__ import annotations

import argparse
import asyncio
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

from _common import run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)
import asyncrl  # noqa: E402
from asyncrl import Dispatch, Execute, ResourcePool, Worker, colocate, register  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "overlap.md")
PLOT = os.path.join(HERE, "results", "overlap.png")

RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0)
STALENESS = (0, 1, 2)
# Shares of the training-pool cost (training + sync) per stage, and of the rollout cost.
TRAIN_SHARE = {"old_log_prob": 0.15, "values": 0.10, "advantages": 0.05, "critic_update": 0.20,
               "actor_update": 0.30, "export_weights": 0.20}
ROLLOUT_SHARE = {"generate": 0.9, "score": 0.1}
R = 4  # response tokens of a simulated batch

COLUMNS = ["cost ratio", "max_staleness", "sync ms/step", "sync ideal", "sync eff.", "async ms/step",
           "async ideal", "async eff.", "speedup", "ideal speedup", "ctrl thread ms/step",
           "ctrl process ms/step"]
REAL_COLUMNS = ["workload", "mode", "steps", "loop s", "ms/step", "rollout ms", "train+sync ms", "ideal ms/step",
                "eff.", "speedup", "reward first 5", "reward last 10", "s to reward ≥ 0.5",
                "ctrl thread ms/step", "ctrl process ms/step"]


# ---- simulated workers ---------------------------------------------------------------------------


class _Marks:
    """Each stage's (name, start, end) on the worker's monotonic clock (one tuple per stage:
    microseconds against stages of milliseconds), to see where a step's time goes."""

    costs: dict[str, float]
    marks: list[tuple[str, float, float]]

    def _sleep(self, stage: str) -> None:
        t0 = time.monotonic()
        time.sleep(self.costs.get(stage, 0.0))
        self.marks.append((stage, t0, time.monotonic()))


class _AsyncMarks(_Marks):
    """`_Marks` with an asyncio sleep (kept apart: one `async def` makes a Ray actor an async
    actor, and the plain training actor must stay a sync one, which runs calls in order)."""

    async def _asleep(self, stage: str, cost: str | None = None) -> None:
        t0 = time.monotonic()
        await asyncio.sleep(self.costs.get(cost or stage, 0.0))
        self.marks.append((stage, t0, time.monotonic()))


class _Sim(_AsyncMarks, Worker):
    """A stage that costs `costs[name]` seconds."""

    def __init__(self) -> None:
        self.costs: dict[str, float] = {}
        self.marks: list[tuple[str, float, float]] = []
        self.version = 0

    @register(Dispatch.ONE_TO_ALL)
    def configure(self, costs: dict[str, float]) -> int:
        """Set the stage costs (seconds), start again at version 0, forget the marks."""
        self.costs, self.version, self.marks = dict(costs), 0, []
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def timeline(self) -> list[tuple[str, float, float]]:
        """The stages run since `configure`: (name, start, end), monotonic seconds."""
        return list(self.marks)


class SimRollout(_Sim):
    @register(Dispatch.DP_COMPUTE)
    async def generate(self, batch: Any, seed: int | None = None) -> TensorDict:
        await self._asleep("generate")
        out = batch.clone(recurse=False)
        n = batch.batch_size[0]
        out.set("response_ids", torch.ones(n, R, dtype=torch.long))
        out.set("response_mask", torch.ones(n, R, dtype=torch.long))
        out.set("version", torch.full((n,), self.version, dtype=torch.long))
        return out

    @register(Dispatch.ONE_TO_ALL)
    async def update_weights(self, weights: Any, version: int | None = None) -> dict[str, int]:
        if isinstance(weights, list):
            weights = weights[0]
        v, _ = weights
        assert v > self.version, f"stale weight update {v} <= {self.version}"
        await self._asleep("update_weights", "load_weights")
        self.version = v
        return {"version": v}


class SimReward(_Sim):
    @register(Dispatch.DP_COMPUTE)
    async def compute_reward(self, batch: Any) -> TensorDict:
        await self._asleep("score")
        n = batch.batch_size[0]
        return TensorDict({"scores": batch["version"].float() / 100.0}, batch_size=[n])


class SimPolicy(_Sim):
    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Any) -> TensorDict:
        self._sleep("old_log_prob")
        n = batch.batch_size[0]
        return TensorDict({"old_log_probs": torch.zeros(n, R), "entropy": torch.zeros(n, R)}, batch_size=[n])

    @register(Dispatch.DP_COMPUTE_METRIC)
    def update(self, batch: Any) -> dict[str, float]:
        self._sleep("actor_update")
        self.version += 1
        return {"pg_loss": 0.0, "version": float(self.version)}

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def export_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        self._sleep("export_weights")
        return self.version, {}


class SimCritic(_Sim):
    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Any) -> TensorDict:
        self._sleep("values")
        n = batch.batch_size[0]
        return TensorDict({"values": torch.zeros(n, R)}, batch_size=[n])

    @register(Dispatch.DP_COMPUTE_METRIC)
    def update(self, batch: Any) -> dict[str, float]:
        self._sleep("critic_update")
        return {"vf_loss": 0.0}


class SimAdvantage(_Sim):
    @register(Dispatch.DP_COMPUTE)
    def compute_advantages(self, batch: Any, scores: Any, log_probs: Any, ref: Any = None, values: Any = None, *,
                           algo: Any) -> TensorDict:
        self._sleep("advantages")
        out = batch.clone(recurse=False)
        for part in (scores, log_probs, ref, values):
            if part is not None:
                out.update(part)
        out.set("advantages", torch.zeros(batch.batch_size[0], R))
        out.set("returns", torch.zeros(batch.batch_size[0], R))
        return out


def stage_costs(ratio: float, train_s: float) -> dict[str, float]:
    """Seconds per stage: training + sync = `train_s`, rollout = `ratio` x that."""
    costs = {k: v * train_s for k, v in TRAIN_SHARE.items()}
    costs.update({k: v * ratio * train_s for k, v in ROLLOUT_SHARE.items()})
    costs["load_weights"] = 0.0  # the sync's cost sits on the policy side (export), (the ideal overlap)
    return costs


def ideals(costs: dict[str, float], k: int) -> tuple[float, float]:
    """(synchronous ideal, async ideal) seconds per step for these stage costs."""
    rollout = costs["generate"] + costs["score"] + costs["load_weights"]
    train = sum(costs[s] for s in TRAIN_SHARE)
    return rollout + train, (rollout + train if k == 0 else max(rollout, train))


class SimBench:
    """One pair of simulated pools (rollout, training), reused by every configuration."""

    def __init__(self) -> None:
        from asyncrl.pipelines.loop.stages import Groups

        pool = ResourcePool([2], cpus_per_bundle=1.0, name="overlap-sim")
        self.pool = pool
        rpool, tpool = pool.split([1, 1])
        self.rcol = colocate({"rollout": SimRollout, "reward": SimReward}, rpool, name="rollout")
        self.tcol = colocate({"policy": SimPolicy, "critic": SimCritic, "advantage": SimAdvantage}, tpool,
                             name="train")
        self.groups = Groups(rollout=self.rcol["rollout"], reward=self.rcol["reward"], policy=self.tcol["policy"],
                             advantage=self.tcol["advantage"], critic=self.tcol["critic"])
        self.tmp = tempfile.mkdtemp(prefix="asyncrl-overlap-")

    async def setup(self) -> None:
        await asyncio.gather(self.rcol.setup(), self.tcol.setup())
        g = self.groups
        pids = await asyncio.gather(g.rollout.configure({}), g.policy.configure({}))
        assert pids[0] != pids[1], "rollout and training must be separate processes"

    async def close(self) -> None:
        await self.rcol.close()
        await self.tcol.close()
        await self.pool.release()

    def config(self, steps: int, k: int, name: str, trace: bool = True, precompute: bool = False) -> Any:
        from asyncrl.pipelines.job.presets import tiny_test

        cfg = tiny_test("ppo")
        t = cfg.trainer
        t.steps, t.max_staleness, t.checkpoint_at_end, t.trace = steps, k, False, trace
        if hasattr(t, "precompute_log_probs"):  # (absent in code before it: A/B runs against an older main)
            t.precompute_log_probs = precompute
        t.output_dir = os.path.join(self.tmp, name)
        return cfg.validate()

    async def configure(self, costs: dict[str, float]) -> None:
        g = self.groups
        await asyncio.gather(*(grp.configure(costs) for grp in (g.rollout, g.reward, g.policy, g.critic,
                                                                   g.advantage)))

    async def run_sync(self, costs: dict[str, float], steps: int) -> dict[str, Any]:
        from asyncrl.pipelines.datasets.data import PromptLoader, get_task
        from asyncrl.pipelines.trainers.sync import sequential_fit
        from asyncrl.roles import load_tokenizer

        cfg = self.config(steps, 0, "sync")
        await self.configure(costs)
        tok = load_tokenizer("tiny")
        loader = PromptLoader(tok, get_task(cfg.data.task).make(cfg.data.num_prompts, cfg.trainer.seed),
                              prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size,
                              seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
        c0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        hist = await sequential_fit(cfg, self.groups, loader, lag=0)
        c1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
        steady = [h["time/step"] for h in hist[1:]]
        return {"step_s": sum(steady) / len(steady), "thread_s": (c1 - c0) / steps, "proc_s": (p1 - p0) / steps,
                "wall_s": w1 - w0, "history": hist}

    async def run_async(self, costs: dict[str, float], steps: int, k: int, trace: bool = True,
                        precompute: bool = False) -> dict[str, Any]:
        from asyncrl.pipelines.trainers.trainer import PPOTrainer

        cfg = self.config(steps, k, f"async-k{k}", trace, precompute)
        await self.configure(costs)
        trainer = PPOTrainer(cfg, groups=self.groups)
        async with trainer:
            c0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
            hist = await trainer.fit()
            c1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
        el = [h["time/elapsed"] for h in hist]
        return {"step_s": (el[-1] - el[0]) / (len(el) - 1), "thread_s": (c1 - c0) / steps,
                "proc_s": (p1 - p0) / steps, "wall_s": w1 - w0, "history": hist, "spans": list(trainer.tracer.spans),
                "hops": await self.hops(costs, trainer.tracer if trace else None)}

    async def hops(self, costs: dict[str, float], tracer: Any = None) -> dict[str, dict[str, float]]:
        """Where each worker process's time went in the last run (see :func:`hop_breakdown`); with
        the run's tracer, the cross-process hops are split at the moment the controller issued the
        waiting stage (its span's start)."""
        g = self.groups
        parts = await asyncio.gather(g.rollout.timeline(), g.reward.timeline(), g.policy.timeline(),
                                     g.critic.timeline(), g.advantage.timeline())
        issued = None
        if tracer is not None:
            issued = {}
            for sp in tracer.spans:
                issued.setdefault(sp.name, []).append(sp.start + tracer.origin)
        return hop_breakdown({"rollout": parts[0] + parts[1], "train": parts[2] + parts[3] + parts[4]}, costs,
                             issued=issued)


async def simulated(ratios: tuple[float, ...], train_s: float, steps: int) -> tuple[list[dict[str, Any]], dict]:
    bench = SimBench()
    rows: list[dict[str, Any]] = []
    timelines: dict[str, Any] = {}
    await bench.setup()
    try:
        await bench.run_sync(stage_costs(1.0, train_s), 2)  # warm-up: imports and first calls on the workers
        await bench.run_async(stage_costs(1.0, train_s), 2, 1)
        for ratio in ratios:
            costs = stage_costs(ratio, train_s)
            sync = await bench.run_sync(costs, steps)
            print(f"ratio {ratio:g}: sync {sync['step_s'] * 1e3:.1f} ms/step", flush=True)
            for k in STALENESS:
                res = await bench.run_async(costs, steps, k)
                ideal_sync, ideal_async = ideals(costs, k)
                rows.append({"ratio": ratio, "k": k, "sync": sync, "async": res, "ideal_sync": ideal_sync,
                             "ideal_async": ideal_async})
                print(f"  k={k}: async {res['step_s'] * 1e3:.1f} ms/step (ideal {ideal_async * 1e3:.0f}), "
                      f"speedup {sync['step_s'] / res['step_s']:.2f}x", flush=True)
                if ratio == 1.0 and k in (0, 1):
                    timelines[f"k{k}"] = res["spans"]
    finally:
        await bench.close()
    return rows, timelines


def sim_table(rows: list[dict[str, Any]]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    for r in rows:
        s, a = r["sync"]["step_s"], r["async"]["step_s"]
        cells = [f"{r['ratio']:g}", str(r["k"]), f"{s * 1e3:.1f}", f"{r['ideal_sync'] * 1e3:.0f}",
                 f"{r['ideal_sync'] / s:.3f}", f"{a * 1e3:.1f}", f"{r['ideal_async'] * 1e3:.0f}",
                 f"{r['ideal_async'] / a:.3f}", f"{s / a:.2f}x", f"{r['ideal_sync'] / r['ideal_async']:.2f}x",
                 f"{r['async']['thread_s'] * 1e3:.2f}", f"{r['async']['proc_s'] * 1e3:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


# ---- the same step on plain Ray actors (the floor) --------------------------------------------------


def _sim_generate(costs: dict[str, float], version: int, batch: TensorDict) -> TensorDict:
    out = batch.clone(recurse=False)
    n = batch.batch_size[0]
    out.set("response_ids", torch.ones(n, R, dtype=torch.long))
    out.set("response_mask", torch.ones(n, R, dtype=torch.long))
    out.set("version", torch.full((n,), version, dtype=torch.long))
    return out


class PlainRollout(_AsyncMarks):
    """The rollout pool's process as an ordinary async Ray actor: generate, score, load weights."""

    def __init__(self) -> None:
        from asyncrl.runtime import quiet_tensor_warnings

        quiet_tensor_warnings()
        self.costs: dict[str, float] = {}
        self.marks: list[tuple[str, float, float]] = []
        self.version = 0

    async def configure(self, costs: dict[str, float]) -> int:
        self.costs, self.version, self.marks = dict(costs), 0, []
        return os.getpid()

    async def timeline(self) -> list[tuple[str, float, float]]:
        return list(self.marks)

    async def generate(self, batch: TensorDict, seed: int) -> TensorDict:
        await self._asleep("generate")
        return _sim_generate(self.costs, self.version, batch)

    async def compute_reward(self, batch: TensorDict) -> TensorDict:
        await self._asleep("score")
        return TensorDict({"scores": batch["version"].float() / 100.0}, batch_size=batch.batch_size)

    async def update_weights(self, weights: tuple[int, dict[str, torch.Tensor]]) -> dict[str, int]:
        v, _ = weights
        assert v > self.version, f"stale weight update {v} <= {self.version}"
        await self._asleep("update_weights", "load_weights")
        self.version = v
        return {"version": v}


class PlainTrain(_Marks):
    """The training pool's process as an ordinary sync Ray actor (runs calls in submission order)."""

    def __init__(self) -> None:
        from asyncrl.runtime import quiet_tensor_warnings

        quiet_tensor_warnings()
        self.costs: dict[str, float] = {}
        self.marks: list[tuple[str, float, float]] = []
        self.version = 0

    def configure(self, costs: dict[str, float]) -> int:
        self.costs, self.version, self.marks = dict(costs), 0, []
        return os.getpid()

    def timeline(self) -> list[tuple[str, float, float]]:
        return list(self.marks)

    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        self._sleep("old_log_prob")
        n = batch.batch_size[0]
        return TensorDict({"old_log_probs": torch.zeros(n, R), "entropy": torch.zeros(n, R)}, batch_size=[n])

    def compute_values(self, batch: TensorDict) -> TensorDict:
        self._sleep("values")
        return TensorDict({"values": torch.zeros(batch.batch_size[0], R)}, batch_size=batch.batch_size)

    def compute_advantages(self, batch: TensorDict, scores: TensorDict, log_probs: TensorDict,
                           values: TensorDict) -> TensorDict:
        self._sleep("advantages")
        out = batch.clone(recurse=False)
        for part in (scores, log_probs, values):
            out.update(part)
        out.set("advantages", torch.zeros(batch.batch_size[0], R))
        out.set("returns", torch.zeros(batch.batch_size[0], R))
        return out

    def critic_update(self, batch: TensorDict) -> dict[str, float]:
        self._sleep("critic_update")
        return {"vf_loss": 0.0}

    def actor_update(self, batch: TensorDict) -> dict[str, float]:
        self._sleep("actor_update")
        self.version += 1
        return {"pg_loss": 0.0, "version": float(self.version)}

    def export_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        self._sleep("export_weights")
        return self.version, {}


async def plain_fit(roll: Any, train: Any, loader: Any, steps: int, k: int, precompute: bool = False,
                    score_behind: bool = False) -> list[float]:
    """The trainer's schedule written with plain Ray actors and ObjectRefs: a rollout loop
    (batch i with weights version max(0, i - k), scores awaited) and a train loop (the six
    training stages, each ObjectRef passed straight into the next call; the export is
    published to the rollout loop, then the updates' metrics are awaited). Returns the
    wall time at the end of every step.

    With `precompute` (and k >= 1), the trainer's ``trainer.precompute_log_probs=true`` schedule as a
    Ray user would write it: batch i's ``compute_log_prob`` and ``compute_values`` get batch i's
    generate ObjectRef as soon as both that generate is issued and step i - 1's export is (the
    training actor runs its calls in submission order, so they run right after that export, with
    step i's weights); step i then passes those refs into its advantages.

    With `score_behind` (an experiment, ``--score-behind``: not what the trainer does) the rollout
    loop waits for batch i's generate, not its score, before loading the next weights and
    generating batch i + 1; the scores are awaited off the loop (the train loop passes the score
    ref into advantages anyway), so the score leaves the rollout loop's own cycle too."""
    cond = asyncio.Condition()
    queue: asyncio.Queue[tuple[Any, Any]] = asyncio.Queue()
    exports: dict[int, Any] = {}
    exported = 0
    ends: list[float] = []
    gens: dict[int, Any] = {}  # batch index -> its generate ref, once issued (batch i is step i's)
    early: dict[int, tuple[Any, Any]] = {}  # step -> (old, values) refs issued ahead
    taken = -1  # the last step whose batch the train loop took
    behind: list[Any] = []  # scores awaited off the rollout loop (score_behind)

    def issue_early(i: int) -> None:
        if precompute and k >= 1 and i < steps and i in gens and exported >= i and taken < i and i not in early:
            early[i] = (train.compute_log_prob.remote(gens[i]), train.compute_values.remote(gens[i]))

    async def rollout_loop() -> None:
        rollout_version = 0
        for i in range(steps):
            need = max(0, i - k)
            async with cond:
                await cond.wait_for(lambda: exported >= need)
            if need > rollout_version:
                await roll.update_weights.remote(exports.pop(need))
                rollout_version = need
            gen = roll.generate.remote(loader.batch(i), seed=i)
            gens[i] = gen
            issue_early(i)
            sc = roll.compute_reward.remote(gen)
            if score_behind:
                await gen  # generated: the engine is free for the next weights (the score runs meanwhile)
                behind.append(asyncio.ensure_future(sc))
            else:
                float((await sc)["scores"].float().mean())
            await queue.put((gen, sc))

    async def train_loop() -> None:
        nonlocal exported, taken
        for step in range(steps):
            gen, sc = await queue.get()
            taken = step
            gens.pop(step, None)
            if step in early:
                old, vals = early.pop(step)
            else:
                old = train.compute_log_prob.remote(gen)
                vals = train.compute_values.remote(gen)
            adv = train.compute_advantages.remote(gen, sc, old, vals)
            crit = train.critic_update.remote(adv)
            act = train.actor_update.remote(adv)
            exp = train.export_weights.remote()
            async with cond:
                exports[step + 1] = exp
                exported = step + 1
                cond.notify_all()
            issue_early(step + 1)
            await crit
            await act
            ends.append(time.perf_counter())

    await asyncio.gather(rollout_loop(), train_loop())
    for f in behind:
        float((await f)["scores"].float().mean())
    return ends


class PlainBench:
    """The two plain Ray actors (rollout, training) of the floor, reused by every run."""

    def __init__(self) -> None:
        import ray

        opts = {"num_cpus": 1, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
        self.roll = ray.remote(PlainRollout).options(max_concurrency=1000, **opts).remote()
        self.train = ray.remote(PlainTrain).options(**opts).remote()

    async def setup(self) -> None:
        pids = await asyncio.gather(self.roll.configure.remote({}), self.train.configure.remote({}))
        assert pids[0] != pids[1]

    def close(self) -> None:
        import ray

        ray.kill(self.roll)
        ray.kill(self.train)

    async def run(self, costs: dict[str, float], steps: int, k: int, loader: Any,
                  precompute: bool = False, score_behind: bool = False) -> dict[str, Any]:
        await asyncio.gather(self.roll.configure.remote(costs), self.train.configure.remote(costs))
        c0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        ends = await plain_fit(self.roll, self.train, loader, steps, k, precompute, score_behind)
        c1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
        marks = await asyncio.gather(self.roll.timeline.remote(), self.train.timeline.remote())
        return {"step_s": (ends[-1] - ends[0]) / (len(ends) - 1), "thread_s": (c1 - c0) / steps,
                "proc_s": (p1 - p0) / steps, "wall_s": w1 - w0,
                "hops": hop_breakdown({"rollout": marks[0], "train": marks[1]}, costs)}


PROCESS_STAGES = {"rollout": ("update_weights", "generate", "score"),
                  "train": tuple(TRAIN_SHARE)}
CROSS_HOPS = (("train", "export_weights", "rollout", "update_weights"), ("rollout", "score", "train", "old_log_prob"),
              ("rollout", "generate", "train", "old_log_prob"), ("rollout", "score", "train", "advantages"))
HOP_KEYS = (["period", "over"] + [f"{p}:{st}" for p, sts in PROCESS_STAGES.items() for st in sts]
            + [f"{a}->{b}{x}" for _, a, _, b in CROSS_HOPS for x in ("", ":issued")])


def hop_breakdown(marks: dict[str, list[tuple[str, float, float]]], costs: dict[str, float],
                  skip: int = 1, issued: dict[str, list[float]] | None = None) -> dict[str, dict[str, float]]:
    """Per worker process, seconds per step in steady state: ``period`` (from one step's first
    stage to the next), ``over`` (stages running longer than their cost: the sleeps' own
    overshoot) and, per stage, the idle time of the process just before that stage started
    (waiting for its call or its arguments to arrive: the hops between stages). The first
    `skip` + 1 steps are left out. Per step: period = costs + over + idle (up to the window's ends)."""
    out: dict[str, dict[str, float]] = {}
    for proc, recs in marks.items():
        recs = sorted(recs, key=lambda r: r[1])
        first = PROCESS_STAGES[proc][1 if proc == "rollout" else 0]  # generate / old_log_prob
        starts = [r[1] for r in recs if r[0] == first]
        if len(starts) < 3:
            continue
        skip = max(0, min(skip, len(starts) - 3))  # short runs (--quick) keep at least one step
        t_from, t_to = starts[skip + 1], starts[-1]
        n = len(starts) - skip - 2
        row = {"period": (t_to - t_from) / n, "over": 0.0}
        prev_end = None
        for stage, start, end in recs:
            if t_from <= start < t_to:
                cost = costs.get("load_weights" if stage == "update_weights" else stage, 0.0)
                row["over"] += (end - start - cost) / n
                if prev_end is not None:
                    key = f"{proc}:{stage}"
                    row[key] = row.get(key, 0.0) + max(0.0, start - prev_end) / n
            if start < t_to:
                prev_end = end if prev_end is None else max(prev_end, end)
        out[proc] = row
    # Across the two processes (one monotonic clock on one machine): from the end of the stage
    # a stage waits for to its start. At max_staleness=0 each is a pure hop; at >= 1 it also
    # holds the time the consumer's process was still busy with the previous step.
    for p_from, s_from, p_to, s_to in CROSS_HOPS:
        ends = sorted(e for st, _, e in marks.get(p_from, []) if st == s_from)
        starts = sorted(b for st, b, _ in marks.get(p_to, []) if st == s_to)[skip + 1:]
        gaps = [b - max(e for e in ends if e <= b) for b in starts if ends and ends[0] <= b]
        if gaps and p_to in out:
            out[p_to][f"{s_from}->{s_to}"] = statistics.mean(gaps)
        # the part from the controller's issue of the waiting stage to its start on the worker
        # (only where the issue came after the awaited stage ended: the controller's hop)
        sent = sorted((issued or {}).get(s_to, []))
        split = [b - max(i for i in sent if i <= b) for b in starts
                 if ends and ends[0] <= b and sent and sent[0] <= b
                 and max(i for i in sent if i <= b) >= max(e for e in ends if e <= b)]
        if split and p_to in out:
            out[p_to][f"{s_from}->{s_to}:issued"] = statistics.mean(split)
    return out


def make_loader() -> Any:
    from asyncrl.pipelines.datasets.data import PromptLoader, get_task
    from asyncrl.pipelines.job.presets import tiny_test
    from asyncrl.roles import load_tokenizer

    cfg = tiny_test("ppo")
    tok = load_tokenizer("tiny")
    return PromptLoader(tok, get_task(cfg.data.task).make(cfg.data.num_prompts, cfg.trainer.seed),
                        prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size,
                        seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)


FLOOR_VARIANTS = ("asyncrl trainer", "asyncrl trainer, trace off", "plain Ray")
PRECOMPUTED = ", precomputed"
"""In the variants run with ``trainer.precompute_log_probs=true`` (``--precompute``): the next batch's
old_log_prob and values issued on its generate right after the current step's export, not after its
scores (the plain-Ray step written the same way)."""
SCORE_BEHIND = ", score behind"
"""Suffix of the plain-Ray variant that also takes the score off the rollout loop (``--score-behind``)."""


def floor_of(variant: str) -> str:
    """The plain-Ray variant a variant is compared with: the same schedule."""
    return "plain Ray" + (PRECOMPUTED if PRECOMPUTED in variant else "")


async def vs_plain(configs: list[tuple[float, int]], train_s: float, steps: int,
                   rounds: int, variants: tuple[str, ...] = FLOOR_VARIANTS) -> list[dict[str, Any]]:
    """The trainer (trace on, its default; and off) and the plain-Ray loop on the same
    simulated step, interleaved: each round runs every variant once, order rotating."""
    bench, plain = SimBench(), PlainBench()
    loader = make_loader()
    rows = []
    await asyncio.gather(bench.setup(), plain.setup())
    try:
        await bench.run_async(stage_costs(1.0, train_s), 2, 1)  # warm-up
        await plain.run(stage_costs(1.0, train_s), 2, 1, loader)
        for ratio, k in configs:
            costs = stage_costs(ratio, train_s)
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
            order = list(variants)
            for r in range(rounds):
                for v in order[r % len(order):] + order[:r % len(order)]:
                    precompute = PRECOMPUTED in v
                    if v.startswith("plain Ray"):
                        res = await plain.run(costs, steps, k, loader, precompute, v.endswith(SCORE_BEHIND))
                    else:
                        trace = not v.startswith("asyncrl trainer, trace off")
                        res = await bench.run_async(costs, steps, k, trace=trace, precompute=precompute)
                    runs[v].append(res)
                    print(f"  ratio {ratio:g} k={k} round {r} {v:28s} {res['step_s'] * 1e3:7.1f} ms/step  "
                          f"ctrl thread {res['thread_s'] * 1e3:5.1f} ms/step", flush=True)
            med = {v: {key: statistics.median(x[key] for x in rs) for key in ("step_s", "thread_s", "proc_s")}
                   for v, rs in runs.items()}
            for v, rs in runs.items():
                med[v]["hops"] = {proc: {key: statistics.median(x["hops"].get(proc, {}).get(key, 0.0) for x in rs)
                                         for key in HOP_KEYS if key in ("period", "over") or key.startswith(proc)
                                         or any(key.startswith(f"{a}->{b}") and pt == proc
                                                for _, a, pt, b in CROSS_HOPS)}
                                  for proc in PROCESS_STAGES}
            rows.append({"ratio": ratio, "k": k, "ideal": ideals(costs, k)[1], "med": med, "variants": variants})
    finally:
        await bench.close()
        plain.close()
    return rows


def floor_table(rows: list[dict[str, Any]]) -> str:
    head = ["cost ratio", "max_staleness", "ideal ms/step", "variant", "ms/step", "eff. vs ideal", "vs plain Ray",
            "ctrl thread ms/step", "ctrl process ms/step"]
    out = ["| " + " | ".join(head) + " |", "|---:|---:|---:|---|" + "---:|" * (len(head) - 4)]
    for r in rows:
        for v in r["variants"]:
            m = r["med"][v]
            floor = r["med"][floor_of(v)]["step_s"]
            out.append(f"| {r['ratio']:g} | {r['k']} | {r['ideal'] * 1e3:.0f} | {v} | {m['step_s'] * 1e3:.1f} | "
                       f"{r['ideal'] / m['step_s']:.3f} | {m['step_s'] / floor:.3f}x | {m['thread_s'] * 1e3:.2f} | "
                       f"{m['proc_s'] * 1e3:.2f} |")
    return "\n".join(out)


def hop_table(rows: list[dict[str, Any]]) -> str:
    """Per variant and worker process: ms per step of period, sleep overshoot, and idle time
    before each stage (the hops), medians over the rounds."""
    head = ["cost ratio", "max_staleness", "variant", "process", "period ms", "stage overshoot ms", "idle ms",
            "idle before each stage, ms per step", "from the other process, ms"]
    out = ["| " + " | ".join(head) + " |", "|---:|---:|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        for v in r["variants"]:
            for proc, stages_ in PROCESS_STAGES.items():
                h = r["med"][v]["hops"][proc]
                idle = {st: h.get(f"{proc}:{st}", 0.0) for st in stages_}
                detail = ", ".join(f"{st} {x * 1e3:.1f}" for st, x in idle.items())
                cross = ", ".join(f"{a} end → {b} start {h.get(f'{a}->{b}', 0.0) * 1e3:.1f}"
                                  + (f" (of which issue → start {h[f'{a}->{b}:issued'] * 1e3:.1f})"
                                     if h.get(f"{a}->{b}:issued") else "")
                                  for _, a, pt, b in CROSS_HOPS if pt == proc)
                out.append(f"| {r['ratio']:g} | {r['k']} | {v} | {proc} | {h['period'] * 1e3:.1f} | "
                           f"{h['over'] * 1e3:.1f} | {sum(idle.values()) * 1e3:.1f} | {detail} | {cross} |")
    return "\n".join(out)


# ---- the real tiny-model runs --------------------------------------------------------------------


def real_config(preset: str, k: int, steps: int | None, quick: bool, tmp: str) -> Any:
    from asyncrl.pipelines.job.presets import PRESETS, tiny_test

    cfg = tiny_test("ppo" if preset.startswith("ppo") else "grpo") if quick else PRESETS[preset]()
    t = cfg.trainer
    if steps is not None:
        t.steps = steps
    t.max_staleness, t.rollout_weights, t.buffer_capacity = k, "fixed_lag", None
    t.colocated, t.rollout_workers, t.train_workers, t.cpus_per_worker = False, 1, 1, 1.0
    t.progress = t.plot = t.tensorboard = t.checkpoint_at_end = False
    t.trace = True
    t.output_dir = os.path.join(tmp, f"{preset}-k{k}")
    return cfg.validate()


async def real_run(preset: str, k: int, steps: int | None, quick: bool, tmp: str) -> dict[str, Any]:
    from asyncrl.pipelines.trainers.trainer import make_trainer

    cfg = real_config(preset, k, steps, quick, tmp)
    trainer = make_trainer(cfg)
    async with trainer:  # starts the two worker processes (not timed)
        c0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        hist = await trainer.fit()
        c1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
    n = len(hist)
    el = [h["time/elapsed"] for h in hist]
    steady = hist[1:]
    gen = statistics.mean(h["time/generate"] for h in steady)
    step = (el[-1] - el[0]) / (n - 1)
    return {"preset": preset, "k": k, "steps": n, "loop_s": w1 - w0, "step_s": step, "gen_s": gen,
            "train_s": statistics.mean(h["time/train"] for h in steady),
            "step_minus_gen_s": statistics.mean(h["time/step"] for h in steady) - gen if k == 0 else None,
            "thread_s": (c1 - c0) / n, "proc_s": (p1 - p0) / n, "history": hist}


async def real(presets: list[str], steps: int | None, quick: bool) -> list[dict[str, Any]]:
    tmp = tempfile.mkdtemp(prefix="asyncrl-overlap-real-")
    out = []
    for preset in presets:
        for k in (0, 1):
            r = await real_run(preset, k, steps, quick, tmp)
            print(f"{preset} max_staleness={k}: {r['step_s'] * 1e3:.0f} ms/step, loop {r['loop_s']:.1f} s, "
                  f"reward last {statistics.mean(h['reward/mean'] for h in r['history'][-10:]):.3f}", flush=True)
            out.append(r)
    return out


def time_to(hist: list[dict[str, Any]], level: float, window: int = 5) -> float | None:
    rew = [h["reward/mean"] for h in hist]
    for i in range(window - 1, len(rew)):
        if statistics.mean(rew[i - window + 1:i + 1]) >= level:
            return float(hist[i]["time/elapsed"])
    return None


def real_table(runs: list[dict[str, Any]]) -> str:
    out = ["| " + " | ".join(REAL_COLUMNS) + " |", "|---|---|" + "---:|" * (len(REAL_COLUMNS) - 2)]
    by = {(r["preset"], r["k"]): r for r in runs}
    for r in runs:
        sync = by[(r["preset"], 0)]
        rollout, train = sync["gen_s"], sync["step_minus_gen_s"]  # stage times measured in the synchronous run
        ideal = rollout + train if r["k"] == 0 else max(rollout, train)
        t = time_to(r["history"], 0.5)
        hist = r["history"]
        cells = [r["preset"], "sync (max_staleness=0)" if r["k"] == 0 else f"async (max_staleness={r['k']})",
                 str(r["steps"]), f"{r['loop_s']:.1f}", f"{r['step_s'] * 1e3:.0f}",
                 f"{r['gen_s'] * 1e3:.0f}", f"{(r['step_minus_gen_s'] or r['train_s']) * 1e3:.0f}",
                 f"{ideal * 1e3:.0f}", f"{ideal / r['step_s']:.2f}", f"{sync['step_s'] / r['step_s']:.2f}x",
                 f"{statistics.mean(h['reward/mean'] for h in hist[:5]):.3f}",
                 f"{statistics.mean(h['reward/mean'] for h in hist[-10:]):.3f}",
                 "—" if t is None else f"{t:.1f}", f"{r['thread_s'] * 1e3:.1f}", f"{r['proc_s'] * 1e3:.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


# ---- the plot ------------------------------------------------------------------------------------

STAGE_COLORS = {"generate": "#4c72b0", "score": "#8172b2", "weight_sync": "#937860", "old_log_prob": "#dd8452",
                "values": "#da8bc3", "advantages": "#8c8c8c", "critic_update": "#ccb974",
                "actor_update": "#c44e52", "export_weights": "#55a868"}


def executed(spans: list[Any]) -> list[tuple[str, str, float, float]]:
    """(pool, stage, start, end) per group span. A span starts when its call was issued;
    calls on one worker process run one at a time in issue order, so a queued call is
    drawn from when the previous call of its pool ended, and a weight sync from when the
    export it loads had finished (before that it only waits)."""
    out = []
    exports = sorted(s.end for s in spans if s.name == "export_weights")
    for pool in ("rollout", "train"):
        free = 0.0
        mine = sorted((s for s in spans if s.track.startswith(pool + ".") or (pool == "rollout"
                       and s.name == "weight_sync")), key=lambda s: (s.start, s.end))
        for s in mine:
            start = max(s.start, free)
            if s.name == "weight_sync":
                start = max([start] + [e for e in exports if e <= s.end])
            out.append((pool, s.name, start, s.end))
            free = max(free, s.end)
    return out


def plot(rows: list[dict[str, Any]], timelines: dict[str, Any], runs: list[dict[str, Any]], path: str,
         window: float) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig = plt.figure(figsize=(14, 9))
    gs = fig.add_gridspec(2, 2, height_ratios=[1, 1.2])
    for col, (key, title) in enumerate([("k0", "synchronous schedule (trainer, max_staleness=0)"),
                                        ("k1", "async (trainer, max_staleness=1)")]):
        ax = fig.add_subplot(gs[0, col])
        spans = executed(timelines.get(key, []))
        train_starts = sorted(s for p, n, s, _ in spans if n == "old_log_prob")
        t0 = train_starts[2] if len(train_starts) > 2 else 0.0  # past the warm-up steps
        seen = set()
        for pool, name, s, e in spans:
            if e < t0 or s > t0 + window:
                continue
            y = 1 if pool == "rollout" else 0
            lab = name if name not in seen else None
            seen.add(name)
            ax.barh(y, e - s, left=s - t0, height=0.6, color=STAGE_COLORS.get(name, "#333333"), label=lab,
                    edgecolor="white", linewidth=0.5)
        ax.set_xlim(0, window)
        ax.set_yticks([0, 1], ["training pool", "rollout pool"])
        ax.set_xlabel("seconds (simulated PPO, cost ratio 1)")
        ax.set_title(title, fontsize=10)
        if col == 1:
            ax.legend(fontsize=7, loc="upper right", ncol=3)
    ax = fig.add_subplot(gs[1, 0])
    ratios = sorted({r["ratio"] for r in rows})
    ideal = [(1 + x) / max(1.0, x) for x in ratios]
    ax.plot(ratios, ideal, "k--", label="ideal (max_staleness ≥ 1)")
    ax.plot(ratios, [1.0] * len(ratios), "k:", label="ideal (max_staleness = 0)")
    for k, m in zip(STALENESS, "os^"):
        pts = [(r["ratio"], r["sync"]["step_s"] / r["async"]["step_s"]) for r in rows if r["k"] == k]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=m, label=f"measured, max_staleness={k}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ratios, [f"{x:g}" for x in ratios])
    ax.set_xlabel("rollout / (training + sync) cost")
    ax.set_ylabel("speedup (sync step time / async step time)")
    ax.set_title("simulated PPO: speedup vs cost ratio", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(gs[1, 1])
    for r in runs:
        h = r["history"]
        ax.plot([x["time/elapsed"] for x in h], [x["reward/mean"] for x in h],
                ls="-" if r["k"] else "--", label=f"{r['preset']} max_staleness={r['k']}")
    ax.set_xlabel("wall seconds of the training loop")
    ax.set_ylabel("mean reward")
    ax.set_title("real tiny-model runs on CPU: reward vs wall clock", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---- main ----------------------------------------------------------------------------------------


def header(argv: list[str], load: tuple[float, float]) -> str:
    return run_header("overlap.py", machine_note=f"shared with other jobs: 1-minute load average {load[0]:.1f} "
                      f"at the start, {load[1]:.1f} at the end")


async def profile_variant(variant: str, train_s: float, steps: int, k: int, top: int) -> None:
    """cProfile of the controller's event-loop thread (the thread cProfile sees) over one run
    of `variant` on the simulated step at cost ratio 1, after a warm-up run; prints the top
    functions by own time and by cumulative time, and the thread CPU per step unprofiled."""
    import cProfile
    import pstats

    costs = stage_costs(1.0, train_s)
    if variant == "plain":
        plain, loader = PlainBench(), make_loader()
        await plain.setup()
        try:
            await plain.run(costs, 2, k, loader)
            res = await plain.run(costs, steps, k, loader)
            prof = cProfile.Profile()
            prof.enable()
            await plain.run(costs, steps, k, loader)
            prof.disable()
        finally:
            plain.close()
    else:
        trace = variant == "trainer"
        bench = SimBench()
        await bench.setup()
        try:
            await bench.run_async(costs, 2, k, trace=trace)
            res = await bench.run_async(costs, steps, k, trace=trace)
            prof = cProfile.Profile()
            prof.enable()
            await bench.run_async(costs, steps, k, trace=trace)
            prof.disable()
        finally:
            await bench.close()
    print(f"{variant}, max_staleness={k}, {steps} steps: unprofiled {res['step_s'] * 1e3:.1f} ms/step, "
          f"ctrl thread {res['thread_s'] * 1e3:.2f} ms/step, process {res['proc_s'] * 1e3:.2f} ms/step")
    for key in ("tottime", "cumulative"):
        print(f"\n---- by {key} (whole profiled run of {steps} steps; divide by {steps} for per step) ----")
        pstats.Stats(prof).sort_stats(key).print_stats(top)


async def amain(args: argparse.Namespace) -> tuple[list, dict, list, list]:
    if args.profile:
        await profile_variant(args.profile, args.train_ms / 1e3, args.steps, args.profile_staleness, args.profile_top)
        return [], {}, [], []
    ratios = tuple(float(x) for x in args.ratios.split(",")) if args.ratios else RATIOS
    floor = []
    if args.floor_rounds:
        configs = [(float(c.split(":")[0]), int(c.split(":")[1])) for c in args.floor_configs.split(",")]
        variants = FLOOR_VARIANTS + ((f"asyncrl trainer{PRECOMPUTED}", f"plain Ray{PRECOMPUTED}")
                                     if args.precompute or args.score_behind else ())
        variants += (f"plain Ray{PRECOMPUTED}{SCORE_BEHIND}",) if args.score_behind else ()
        floor = await vs_plain(configs, args.train_ms / 1e3, args.steps, args.floor_rounds, variants)
    rows, timelines = ([], {}) if args.no_sweep else await simulated(ratios, args.train_ms / 1e3, args.steps)
    runs = [] if args.no_real else await real(args.presets.split(","), args.real_steps, args.quick)
    return rows, timelines, runs, floor


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="10 ms training cost, 3 steps per simulated run, 3-step tiny GRPO only")
    p.add_argument("--train-ms", type=float, default=None, help="training + sync cost per step (default 200)")
    p.add_argument("--steps", type=int, default=None, help="steps per simulated run (default 12)")
    p.add_argument("--real-steps", type=int, default=None, help="steps per real run (default: the preset's)")
    p.add_argument("--ratios", default=None, help="comma-separated cost ratios (default 0.25,0.5,1,2,4)")
    p.add_argument("--presets", default=None,
                   help="real runs: comma-separated presets (default grpo_toy,ppo_toy; --quick: grpo_toy)")
    p.add_argument("--no-real", action="store_true", help="skip the real tiny-model runs")
    p.add_argument("--no-sweep", action="store_true", help="skip the ratio x max_staleness sweep")
    p.add_argument("--floor-configs", default="1:1,1:0",
                   help="ratio:max_staleness pairs compared with the plain-Ray floor (default 1:1,1:0)")
    p.add_argument("--floor-rounds", type=int, default=None,
                   help="interleaved rounds of the plain-Ray comparison (default 3, --quick 1; 0 skips it)")
    p.add_argument("--precompute", action="store_true",
                   help="also run the trainer with trainer.precompute_log_probs=true and the plain-Ray step written "
                        "the same way (the next batch's old_log_prob and values issued on its generate right after "
                        "the current step's export), to show what that schedule gains")
    p.add_argument("--score-behind", action="store_true",
                   help="also run the plain-Ray step, precomputed, with the score off the rollout loop's cycle (an "
                        "experiment: the next weights and generate once the current generate finished, the score "
                        "awaited later); implies --precompute")
    p.add_argument("--profile", choices=["trainer", "trainer-notrace", "plain"], default=None,
                   help="only profile the controller thread (cProfile) over one run of this variant of the "
                        "simulated step at cost ratio 1, print the top functions, write nothing")
    p.add_argument("--profile-staleness", type=int, default=1, help="max_staleness of the --profile run (default 1)")
    p.add_argument("--profile-top", type=int, default=45, help="functions printed per --profile table")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="the controller's event loop, for every variant alike (asyncrl.run; `asyncrl train` uses "
                        "uvloop by default, trainer.event_loop)")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--png", default=None, help="the plot (default: next to --out, overlap.png)")
    args = p.parse_args(argv)
    args.train_ms = args.train_ms or (10.0 if args.quick else 200.0)
    args.steps = args.steps or (3 if args.quick else 12)
    args.presets = args.presets or ("grpo_toy" if args.quick else "grpo_toy,ppo_toy")
    if args.floor_rounds is None:
        args.floor_rounds = 1 if args.quick else 3
    png = args.png or os.path.join(os.path.dirname(os.path.abspath(args.out)), "overlap.png")
    load0 = os.getloadavg()[0]
    asyncrl.init(num_cpus=16)
    try:
        rows, timelines, runs, floor = asyncrl.run(amain(args), loop=args.loop)
    finally:
        asyncrl.shutdown()
    if args.profile:
        return
    worst = max((r["ideal_sync"] for r in rows), default=0.0)
    if rows:
        plot(rows, timelines, runs, png, window=8 * args.train_ms / 1e3)  # 4 synchronous steps at ratio 1
    r1 = next((r for r in rows if r["ratio"] == 1.0 and r["k"] == 1), None)
    verdict = ""
    if r1 is not None:
        eff = r1["ideal_async"] / r1["async"]["step_s"]
        sp = r1["sync"]["step_s"] / r1["async"]["step_s"]
        verdict = (f"At cost ratio 1, max_staleness=1: efficiency {eff:.3f} (target ≥ 0.95), "
                   f"speedup {sp:.2f}x (target ≥ 1.9x, ideal 2.00x).")
    sections = [
        "# Overlap: async trainer vs synchronous loop",
        header(argv, (load0, os.getloadavg()[0])),
    ]
    if floor:
        f1 = next((r for r in floor if r["ratio"] == 1.0 and r["k"] == 1), None)
        fverdict = ""
        if f1 is not None:
            m = f1["med"]
            fverdict = (f"At cost ratio 1, max_staleness=1: the trainer's efficiency {f1['ideal'] / m['asyncrl trainer']['step_s']:.3f} "
                        f"(trace off {f1['ideal'] / m['asyncrl trainer, trace off']['step_s']:.3f}; target ≥ 0.97), "
                        f"{m['asyncrl trainer']['step_s'] / m['plain Ray']['step_s']:.3f}x the plain-Ray step "
                        f"(trace off {m['asyncrl trainer, trace off']['step_s'] / m['plain Ray']['step_s']:.3f}x; "
                        f"target ≤ 1.05x), controller thread CPU {m['asyncrl trainer']['thread_s'] * 1e3:.1f} ms/step "
                        f"(trace off {m['asyncrl trainer, trace off']['thread_s'] * 1e3:.1f}; plain Ray "
                        f"{m['plain Ray']['thread_s'] * 1e3:.1f}; target ≤ 5 ms).")
            if f"plain Ray{PRECOMPUTED}" in m:
                fverdict += (f" With trainer.precompute_log_probs (`--precompute`): the trainer "
                             f"{f1['ideal'] / m[f'asyncrl trainer{PRECOMPUTED}']['step_s']:.3f}, plain Ray written the "
                             f"same way {f1['ideal'] / m[f'plain Ray{PRECOMPUTED}']['step_s']:.3f}.")
        sections += [
            "## The simulated step: asyncrl trainer vs the same step on plain Ray",
            f"The simulated PPO step of the sweep below (training + sync = {args.train_ms:g} ms), run by the "
            "asyncrl trainer (trace on, its default; and trace off) and by the same schedule written with plain Ray "
            "actors and ObjectRefs (`plain_fit`: an async rollout actor, a sync training actor, each stage's "
            "ObjectRef passed straight into the next call, the same staleness gate). The plain-Ray row is the floor: "
            "what Ray itself costs per step. `precomputed` rows (`--precompute`): the trainer with "
            "`trainer.precompute_log_probs=true` and plain Ray written the same way (at max_staleness ≥ 1 the next "
            "batch's old_log_prob and values get its generate ref right after the current step's export), each "
            "compared with the plain-Ray row of its own schedule. Medians over "
            f"{args.floor_rounds} interleaved round(s) (variant order rotating), {args.steps} steps per run, the "
            "first discarded. ctrl thread / process = controller CPU per step (event-loop thread / whole process).",
            floor_table(floor),
            fverdict,
            "### Where a step's time goes, per worker process",
            "Each simulated stage records its start and end on its worker (monotonic clock). Per step in "
            "steady state: `period` = from one step's first stage (generate / old_log_prob) to the next; "
            "`stage overshoot` = the stages' run time beyond their cost (the sleeps' own lateness); `idle` = the "
            "process waiting between its stages, split by the stage it was waiting to start (for its call or its "
            "pipelined arguments to arrive: each is one or more hops through Ray and the controller). "
            "period = stage costs + overshoot + idle. The last column: from the end of the other process's stage "
            "to the start of the one that waits for it (one clock: same machine) and, with the trainer's trace, "
            "the part from the controller issuing the waiting stage to its start on the worker (the rest is "
            "the controller's hop); at max_staleness=0, where "
            "every stage is on the critical path, each idle number and each of these is one hop, and "
            "period − 400 ms − overshoot is the sum of the step's hops.",
            hop_table(floor),
        ]
    if rows:
        sections += [
            "## Simulated PPO workers (real Ray, real worker groups, real trainer loops)",
            f"Training + sync = {args.train_ms:g} ms per step (old_log_prob 15 %, values 10 %, advantages 5 %, "
            "critic_update 20 %, actor_update 30 %, export_weights = weight sync 20 %), rollout = cost ratio x that "
            f"(generate 90 %, score 10 %); two worker processes (rollout pool, training pool). {args.steps} steps "
            "per run, the first discarded. `sync` = `sequential_fit(lag=0)` (the synchronous baseline loop, one "
            "run per cost ratio, shown on each row); `async` = the trainer at that `max_staleness` "
            "(`fixed_lag`). Ideal: sum of the stage costs for sync and for max_staleness=0; "
            "max(rollout, training + sync) for max_staleness ≥ 1. eff. = ideal / measured. "
            "ctrl thread / process = CPU time of the controller's event-loop thread / whole process per step "
            f"(async runs; the slowest step here is {worst * 1e3:.0f} ms).",
            sim_table(rows),
            verdict,
    ]
    if runs:
        sections += [
            "## Real tiny-model GRPO and PPO on CPU",
            "The `asyncrl train` presets (tiny Qwen2 from a config, `char_class` task"
            + (", shrunk to `tiny_test` sizes by --quick" if args.quick else "")
            + "), rollout and training on two worker processes (1 CPU each in Ray; 1 torch thread each), "
            "same steps and seeds; the trainer at max_staleness=0 (synchronous) and 1 (async, `fixed_lag`). "
            "ms/step is steady state (first step discarded). `rollout ms` = generate + score per step and "
            "`train+sync ms` = the rest of a step, both measured in that run (for the async run: its "
            "generate time and its train time, contention included); the ideal of both rows uses the "
            "synchronous run's stage times. `s to reward ≥ 0.5` = wall seconds of the loop until the "
            "5-step mean reward first reaches 0.5.",
            real_table(runs),
        ]
    text = "\n\n".join(s for s in sections if s) + "\n"
    write_result(args.out, text)


if __name__ == "__main__":
    main()
