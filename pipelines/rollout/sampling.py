"""Dynamic sampling (DAPO's ``filter_groups``, as verl names it): drop GRPO groups whose rewards are all
equal -- their advantages are all zero, so they carry no signal -- and keep sampling until the batch
holds ``prompts_per_step`` groups that do, at most ``algorithm.filter_groups.max_num_gen_batches``
generate calls per step.

Generate call 0 of step ``t`` is the step's own prompt batch (``PromptLoader.batch(t)``); call
``k >= 1`` draws ``prompts_per_step`` other prompts with a generator seeded by ``(seed, t, k)`` and
samples with its own seed, so a step's batch stays a pure function of ``(seed, t)`` (resume and replay
regenerate it). The kept groups are taken in call order; when the calls run out first, the rest of the
batch is filled with the first groups that were dropped (``sampling/padded_groups`` counts them).

The selected rows are fetched to the controller, concatenated (prompts re-padded on the left to a
common width) and handed to the training pool as one batch. Metrics per step: ``sampling/gen_batches``,
``sampling/filtered_groups`` (groups dropped for equal rewards), ``sampling/padded_groups`` and
``sampling/min_group_std`` (the smallest reward std of a trained group).
"""

from __future__ import annotations

import random
from typing import Any, Callable

import anyio.to_thread
import torch
from tensordict import TensorDict

from asyncrl.pipelines.loop.stream_batch import select_groups

__all__ = ["group_stds", "informative_groups", "extra_indices", "fill_batch"]


def group_stds(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Population std of the rewards of each group of `group_size` consecutive rows."""
    return scores.float().reshape(-1, group_size).std(dim=1, unbiased=False)


def informative_groups(scores: torch.Tensor, group_size: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal."""
    g = scores.float().reshape(-1, group_size)
    return [k for k in range(g.shape[0]) if bool((g[k] != g[k, 0]).any())]


def extra_indices(num_rows: int, prompts: int, *, seed: int, step: int, call: int) -> list[int]:
    """Dataset indices of generate call `call` (>= 1) of step `step`: `prompts` distinct rows (with
    repeats only when the dataset is smaller), from a generator seeded by ``(seed, step, call)``."""
    rng = random.Random(f"filter_groups:{seed}:{step}:{call}")
    if prompts <= num_rows:
        return rng.sample(range(num_rows), prompts)
    return [rng.randrange(num_rows) for _ in range(prompts)]


async def fill_batch(*, step: int, first: tuple[Any, Any, torch.Tensor], loader: Any, group_size: int,
                     max_calls: int, seed: int, generate: Callable[[TensorDict, int], tuple[Any, Any]],
                     echo: Callable[[TensorDict], Any]
                     ) -> tuple[Any, Any, torch.Tensor, dict[str, float], list[tuple[int, int]] | None]:
    """Step `step`'s batch of informative groups.

    Args:
        first: ``(generate future, score future, scores)`` of the step's own prompt batch.
        loader: the run's :class:`~asyncrl.pipelines.datasets.data.PromptLoader`.
        group_size: rows per group.
        max_calls: most generate calls, the first included.
        seed: the run's seed (``trainer.seed``).
        generate: ``generate(prompt batch, call) -> (generate future, score future)`` of call `call`.
        echo: puts a concrete batch on the training pool and returns its future.

    Returns ``(batch future, scores future, scores, metrics, picks)``, `picks` the ``(call, group)`` of each
    group of the batch, in order (the run journal's ``filter`` record); when the first call's groups are all
    informative the first call's futures are returned as they are (nothing is fetched) and `picks` is None."""
    pps = loader.prompts_per_step
    gen, sc, scores = first
    keep = informative_groups(scores, group_size)
    calls, dropped_total = 1, pps - len(keep)
    if len(keep) == pps:
        return gen, sc, scores, _metrics(calls, dropped_total, 0, group_stds(scores, group_size)), None
    results = [(gen, sc, scores, keep)]
    have = len(keep)
    while have < pps and calls < max_calls:
        idx = extra_indices(len(loader.pairs), pps, seed=seed, step=step, call=calls)
        prompts = await anyio.to_thread.run_sync(loader.batch_of, idx, step)  # off the loop: a step's rows
        g2, s2 = generate(prompts, calls)
        sc2 = (await s2)["scores"]
        k2 = informative_groups(sc2, group_size)
        results.append((g2, s2, sc2, k2))
        calls += 1
        have += len(k2)
        dropped_total += pps - len(k2)
    picks = [(b, k) for b, r in enumerate(results) for k in r[3]][:pps]
    padded = 0
    if len(picks) < pps:  # out of calls: fill with dropped groups, in order
        rest = [(b, k) for b, r in enumerate(results) for k in range(pps) if k not in r[3]]
        padded = pps - len(picks)
        picks += rest[:padded]
    needed = sorted({b for b, _ in picks})
    fetched: dict[int, TensorDict] = {}
    for b in needed:
        td = await results[b][0]
        td.update(await results[b][1])
        fetched[b] = td
    order = {b: n for n, b in enumerate(needed)}
    combined = await anyio.to_thread.run_sync(lambda: select_groups(
        [fetched[b] for b in needed], [(order[b], k) for b, k in picks], group_size, pad_id=loader.pad_id,
        uid_base=step * pps))
    out_scores = combined["scores"].clone()
    fut = echo(combined)
    return fut, fut.select("scores"), out_scores, _metrics(calls, dropped_total, padded,
                                                           group_stds(out_scores, group_size)), picks


def _metrics(calls: int, dropped: int, padded: int, stds: torch.Tensor) -> dict[str, float]:
    return {"sampling/gen_batches": float(calls), "sampling/filtered_groups": float(dropped),
            "sampling/padded_groups": float(padded), "sampling/min_group_std": float(stds.min())}
