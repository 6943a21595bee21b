"""The training-pool side of streaming rollout: one step's batch from its finished prompt groups, and
the step's per-trajectory version metrics (pure functions of TensorDicts; the
:class:`~asyncrl.pipelines.loop.stages.AdvantageWorker` runs them, so no batch bytes reach the controller)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["concat_groups", "select_groups", "version_stats"]


_LEFT_PADDED = ("prompt_ids", "prompt_mask", "input_ids", "attention_mask")


def _left_pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype)
    return torch.cat([pad, t], dim=1)


def select_groups(batches: Sequence[TensorDict], picks: Sequence[tuple[int, int]], group_size: int, *,
                  pad_id: int, uid_base: int, width: int | None = None) -> TensorDict:
    """One batch of the groups `picks` (``(batch number, group number)`` each, in that order) of
    `batches`; prompts are re-padded on the left to a common width (at least `width`), and ``uid`` renumbered
    ``uid_base, uid_base + 1, ...`` per group."""
    rows = [batches[b][g * group_size:(g + 1) * group_size] for b, g in picks]
    prompt_w = max([int(r["prompt_ids"].shape[1]) for r in rows] + [width or 0])
    fixed = []
    for r in rows:
        r = r.clone(recurse=False)
        extra = prompt_w - int(r["prompt_ids"].shape[1])
        if extra:
            for k in _LEFT_PADDED:
                if k in r.keys():
                    t = r.get(k)
                    r[k] = _left_pad(t, t.shape[1] + extra, pad_id if k.endswith("ids") else 0)
        fixed.append(r)
    out = torch.cat(fixed, dim=0) if len(fixed) > 1 else fixed[0]
    n = len(picks)
    out["uid"] = torch.arange(n, dtype=torch.long).repeat_interleave(group_size) + uid_base
    return out


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
    ``d = 0 .. max_staleness``, and up to the oldest token's when one is older: ``trainer.stream.bound=admitted``)."""
    mask = batch["response_mask"].bool()
    first = batch["version"].long()
    stale = (step - first).double()
    out = {"staleness/max": float(stale.max()), "staleness/mean": float(stale.mean())}
    if "token_versions" in batch.keys():
        tv = batch["token_versions"].long()
        low = torch.where(mask, tv, torch.full_like(tv, 1 << 40)).min(1).values
        high = torch.where(mask, tv, torch.full_like(tv, -1)).max(1).values
        out["stream/multi_version_frac"] = float(((high > low) & mask.any(1)).double().mean())
        age = step - tv
        oldest = int(age[mask].max()) if bool(mask.any()) else 0  # past max_staleness only with bound=admitted
        for d in range(max(max_staleness, oldest) + 1):
            out[f"stream/tokens_staleness_{d}"] = float(((age == d) & mask).sum())
    return out
