"""The synchronous baseline: one plain sequential loop over the same stages.

::

    for t in range(steps):
        load_weights(version t - lag)   # weight sync, rollout side
        generate(t + lag) -> score       # rollout pool idle otherwise
        old_log_prob -> ref_log_prob -> values -> advantages -> critic_update -> actor_update
        export_weights                   # version t + 1

With ``lag=0`` this is the classic synchronous RL loop (generate, then train, then
sync); ``lag=k`` is the sequential k-step-off-policy loop: batch t is generated with
weights ``max(0, t - k)``, exactly what the async trainer's ``fixed_lag`` schedule
promises, but with nothing overlapping. No task groups, no buffer: the equivalence
tests compare the async trainer against this loop.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.job.config import JobConfig
from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.datasets.data import PromptLoader
from asyncrl.pipelines.loop.stages import Groups
import asyncrl
from asyncrl.pipelines.datasets.data import make_loader, task_pairs
from asyncrl.pipelines.trainers.trainer import build_groups
from asyncrl.roles.modeling.models import tokenizer_for

__all__ = ["sequential_fit"]


async def sequential_fit(config: JobConfig, groups: Groups, loader: PromptLoader, *, lag: int | None = None,
                         start_version: int = 0) -> list[dict[str, Any]]:
    """Run ``config.trainer.steps`` steps one stage after another; returns per-step metrics
    (the same keys the async trainer reports for reward, staleness and the updates).

    `lag` defaults to ``config.trainer.max_staleness``. `groups` must be started and
    fresh (policy and rollout at version `start_version`).
    """
    k = config.trainer.max_staleness if lag is None else lag
    steps, seed = config.trainer.steps, config.trainer.seed
    algo = to_dict(config.algorithm)
    g = groups
    exports: dict[int, Any] = {}
    rollout_version = version = start_version
    queue: deque[tuple[int, int, Any, Any, float]] = deque()

    async def produce(i: int, v: int) -> None:
        nonlocal rollout_version
        if v > rollout_version:
            await stages.load_weights(g, exports[v])
            rollout_version = v
        gen = stages.generate(g, loader.batch(i), seed=seed * 1_000_003 + i)
        sc = stages.score(g, gen)
        scores = (await sc)["scores"]
        queue.append((i, v, gen, sc, float(scores.float().mean())))

    history: list[dict[str, Any]] = []
    for i in range(min(k, steps)):
        await produce(i, 0)
    for t in range(steps):
        t0 = time.perf_counter()
        if t + k < steps:
            await produce(t + k, max(0, t))
        i, v, gen, sc, reward = queue.popleft()
        assert i == t
        old = stages.old_log_prob(g, gen, bypass=config.actor.rollout_correction.bypass_mode != "off")
        ref = stages.ref_log_prob(g, gen)
        vals = stages.values(g, gen)
        adv = stages.advantages(g, gen, sc, old, ref, vals, algo)
        crit = stages.critic_update(g, adv)
        act = stages.actor_update(g, adv)
        exports[version + 1] = stages.export_weights(g)
        metrics: dict[str, Any] = {}
        if crit is not None:
            metrics.update(stages.mean_metrics(await crit, "critic"))
        metrics.update(stages.mean_metrics(await act, "actor"))
        staleness = version - v
        version += 1
        for old_v in [x for x in exports if x < version - k]:
            del exports[old_v]
        metrics.update({"version": version, "reward/mean": reward, "staleness/mean": float(staleness),
                        "staleness/max": staleness, "batch/version": v, "time/step": time.perf_counter() - t0})
        history.append({"step": t, **metrics})
    return history


async def run_sequential(config: JobConfig, *, lag: int | None = None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Build fresh groups for `config`, run :func:`sequential_fit`, and return
    ``(per-step metrics, policy weight checksums)``; the groups are closed on every path."""
    import asyncio


    resources = await asyncrl.ainit(num_cpus=config.trainer.num_cpus)
    config.validate(cluster_cpus=float(resources.get("CPU", 0.0)))
    groups, parts, pools = build_groups(config)
    try:
        await asyncio.gather(*(p.setup() for p in parts))
        tok = tokenizer_for(config.model)
        loader = make_loader(config.data, tok, task_pairs(config.data, config.trainer.seed),
                             prompts_per_step=config.prompts_per_step, group_size=config.group_size,
                             seed=config.trainer.seed)
        history = await sequential_fit(config, groups, loader, lag=lag)
        return history, await groups.policy.weights_checksum()
    finally:
        for p in parts:
            await p.close()
        for pool in pools:
            await pool.release()
