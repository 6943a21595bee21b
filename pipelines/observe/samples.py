"""Sampled trajectories of each training step, written to ``samples.jsonl``.

::

    train batch (advantage worker) ── pick_rows ─► trajectory_rows ─► small dicts (ids, floats)
        ─► controller: SamplesWriter.write (a thread: decode the tokens, append one line each)

The rows are picked and cut on the advantage worker (:meth:`AdvantageWorker.sample_trajectories
<asyncrl.pipelines.loop.stages.AdvantageWorker.sample_trajectories>`), so only a few trajectories cross
to the controller; the tokenizer decodes them there, off the event loop. One line per trajectory::

    {"step", "uid", "index", "row", "prompt", "response", "reward", "version", "staleness",
     "stop_reason", "length", "num_turns", "tool_errors", "episode_reward",
     "tokens": {"id", "text", "mask", "version", "logp_rollout", "logp_old", "advantage"}}

``tokens`` holds the response's tokens column by column (model tokens have ``mask`` 1; an
episode's environment and tool tokens 0). ``version`` is each model token's weight version
(``-1`` off the model tokens); ``logp_rollout`` the behaviour log-prob, ``logp_old`` the log-prob
under the weights the step trained (``old_log_probs``; the rollout's under the bypass), either
``null`` when the batch has none. ``index`` is the row's place in its prompt group (``uid``).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from asyncrl.pipelines.observe.metrics import jsonl_lines, step_of

__all__ = ["SamplesWriter", "pick_rows", "trajectory_rows", "read_samples"]


def pick_rows(uid: Sequence[int] | torch.Tensor, n: int, seed: int) -> list[int]:
    """Rows of `n` trajectories, whole prompt groups first: groups in a random order (`seed`), each
    group's rows together, cut at `n` (a group larger than `n` gives its first `n`)."""
    uids = [int(u) for u in uid]
    groups: dict[int, list[int]] = {}
    for row, u in enumerate(uids):
        groups.setdefault(u, []).append(row)
    order = list(groups)
    random.Random(seed).shuffle(order)
    rows = [row for u in order for row in groups[u]][:n]
    return sorted(rows)


def _floats(t: torch.Tensor) -> list[float | None]:
    return [None if not math.isfinite(x) else round(x, 6) for x in t.double().tolist()]


def trajectory_rows(batch: Any, rows: Sequence[int], policy_version: int) -> list[dict[str, Any]]:
    """The `rows` of a merged training batch (docs/roles_api.md fields) as small dicts of plain
    lists: the prompt's ids without padding, and the response's tokens up to its last real one
    (``attention_mask``: an episode's environment tokens count, padding does not)."""
    keys = set(map(str, batch.keys()))
    P = batch["prompt_ids"].shape[-1] if "prompt_ids" in keys else 0
    R = batch["response_ids"].shape[-1]
    uid = batch["uid"]
    out = []
    for row in rows:
        member = int((uid[:row] == uid[row]).sum())
        prompt = (batch["prompt_ids"][row][batch["prompt_mask"][row].bool()] if "prompt_mask" in keys
                  else batch["prompt_ids"][row] if P else torch.zeros(0, dtype=torch.long))
        # the response's extent: attention (an episode's environment tokens count), else the mask
        att = batch["attention_mask"][row, P:] if "attention_mask" in keys else batch["response_mask"][row]
        length = int(att.nonzero().max()) + 1 if bool(att.any()) else 0
        mask = batch["response_mask"][row, :length].long()
        version = int(batch["version"][row]) if "version" in keys else -1
        if "token_versions" in keys:
            versions = batch["token_versions"][row, :length].long()
        else:
            versions = torch.where(mask.bool(), version, -1)
        rec: dict[str, Any] = {
            "uid": int(uid[row]), "index": member, "row": int(row), "prompt_ids": prompt.tolist(),
            "ids": batch["response_ids"][row, :length].tolist(), "mask": mask.tolist(), "versions": versions.tolist(),
            "logp_rollout": _floats(batch["rollout_log_probs"][row, :length]) if "rollout_log_probs" in keys else None,
            "logp_old": _floats(batch["old_log_probs"][row, :length]) if "old_log_probs" in keys else None,
            "advantage": _floats(batch["advantages"][row, :length]),
            "reward": float(batch["scores"][row]), "version": version,
            "staleness": policy_version - version if version >= 0 else None,
            "length": length,
        }
        if "stop_reason" in keys:
            rec["stop_reason"] = str(batch["stop_reason"][row])
        else:  # a single turn: ended on its own (EOS) before the token limit, or cut there
            rec["stop_reason"] = "max_length" if length >= R else "stop"
        for k in ("num_turns", "tool_errors"):
            rec[k] = int(batch[k][row]) if k in keys else None
        rec["episode_reward"] = _floats(batch["episode_reward"][row:row + 1])[0] if "episode_reward" in keys else None
        out.append(rec)
    return out


class SamplesWriter:
    """Appends each step's sampled trajectories to ``samples.jsonl``, their tokens decoded.

    Args:
        output_dir: the run directory.
        tokenizer: the run's tokenizer (``decode``).
        start_step: on resume, lines of steps at or after it are dropped (the file reads as one run).
    """

    def __init__(self, output_dir: str | Path, tokenizer: Any, *, start_step: int = 0) -> None:
        self.path = Path(output_dir) / "samples.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tok = tokenizer
        if self.path.exists():
            kept = [line for line in jsonl_lines(self.path.read_text(encoding="utf-8")) if step_of(line) < start_step]
            self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        self._f = self.path.open("a", encoding="utf-8")

    def lines(self, step: int, rows: Sequence[dict[str, Any]]) -> list[str]:
        """The JSON lines of `rows` (from :func:`trajectory_rows`) of `step`."""
        dec = self._tok.decode
        out = []
        for r in rows:
            ids = r["ids"]
            line = {
                "step": step, "uid": r["uid"], "index": r["index"], "row": r["row"],
                "prompt": dec(r["prompt_ids"]), "response": dec(ids),
                **{k: r.get(k) for k in ("reward", "version", "staleness", "stop_reason", "length", "num_turns",
                                          "tool_errors", "episode_reward")},
                "tokens": {"id": ids, "text": [dec([i]) for i in ids], "mask": r["mask"], "version": r["versions"],
                           "logp_rollout": r["logp_rollout"], "logp_old": r["logp_old"], "advantage": r["advantage"]},
            }
            out.append(json.dumps(line, ensure_ascii=False))
        return out

    def write(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        """Append `rows` of `step` (blocking: decodes and writes; call it in a thread)."""
        text = "".join(line + "\n" for line in self.lines(step, rows))
        self._f.write(text)
        self._f.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._f.close()


def read_samples(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """The trajectories of a ``samples.jsonl`` and how many lines were skipped (torn by a process killed
    mid-write, or not a trajectory)."""
    rows: list[dict[str, Any]] = []
    bad = 0
    p = Path(path)
    if not p.exists():
        return [], 0
    with p.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict) and isinstance(row.get("tokens"), dict) and "step" in row:
                rows.append(row)
            else:
                bad += 1
    return rows, bad
