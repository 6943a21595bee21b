"""The training-pool side of streaming rollout: one step's batch from its finished prompt groups, and
the step's per-trajectory version metrics (pure functions of TensorDicts; the
:class:`~asyncrl.pipelines.loop.stages.AdvantageWorker` runs them, so no batch bytes reach the controller)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from asyncrl.pipelines.rollout.sampling import select_groups
from tensordict import TensorDict, TensorDictBase

__all__ = ["concat_groups", "version_stats"]


def concat_groups(parts: Sequence[TensorDictBase], scores: Sequence[TensorDictBase | None], *, pad_id: int,
                  uid_base: int, width: int | None = None) -> TensorDict:
    """The groups' generate results (`parts`, one prompt group each, in order) with their ``scores``
    merged in, as one batch: prompts re-padded on the left to a common width (at least `width`: the shards of
    one step's batch share it), ``uid`` renumbered ``uid_base, uid_base + 1, ...`` per group. A None score is a
    group scored where it was generated (``generate_requests(compute_reward=True)``): its part holds them."""
    if not parts or len(parts) != len(scores):
        raise ValueError(f"concat_groups needs one scores TensorDict (or None) per group, got {len(parts)} groups "
                         f"and {len(scores)} scores")
    merged = []
    for i, (p, s) in enumerate(zip(parts, scores)):
        td = p.clone(recurse=False)
        if s is not None:
            td.update(s)
        elif "scores" not in td.keys():
            raise ValueError(f"group {i} has no scores: pass its score call's result, or generate it with "
                             "compute_reward=True")
        merged.append(td)
    size = int(merged[0].batch_size[0])
    if any(int(m.batch_size[0]) != size for m in merged):
        raise ValueError(f"groups of unequal size: {[int(m.batch_size[0]) for m in merged]}")
    return select_groups(merged, [(i, 0) for i in range(len(merged))], size, pad_id=pad_id, uid_base=uid_base,
                         width=width)


def version_stats(batch: TensorDictBase, step: int, max_staleness: int) -> dict[str, float]:
    """Per-trajectory version metrics of a step's batch trained at policy version `step`:
    ``staleness/max`` and ``staleness/mean`` (``step`` minus the version of each row's first token),
    ``stream/multi_version_frac`` (rows whose tokens come from more than one version) and
    ``stream/tokens_staleness_{d}`` (response tokens generated ``d`` versions before the step,
    ``d = 0 .. max_staleness``)."""
    mask = batch["response_mask"].bool()
    first = batch["version"].long()
    stale = (step - first).double()
    out = {"staleness/max": float(stale.max()), "staleness/mean": float(stale.mean())}
    if "token_versions" in batch.keys():
        tv = batch["token_versions"].long()
        low = torch.where(mask, tv, torch.full_like(tv, 1 << 40)).min(1).values
        high = torch.where(mask, tv, torch.full_like(tv, -1)).max(1).values
        out["stream/multi_version_frac"] = float(((high > low) & mask.any(1)).double().mean())
        for d in range(max_staleness + 1):
            out[f"stream/tokens_staleness_{d}"] = float(((step - tv == d) & mask).sum())
    return out
