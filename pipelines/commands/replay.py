"""Replay a run from its journal: the same batches, generated with the same weight versions.

An asynchronous run with ``rollout_weights: latest`` generates each batch with whatever
policy version is newest at that moment, so two runs with the same seeds differ. Its
journal (:mod:`asyncrl.pipelines.journaling.journal`) records the version of every batch; a replay
builds the run's config from the journal, generates batch i with exactly version v_i
(waiting for it to be published), trains in the recorded consumption order, and compares
the result with the original run: the final weights' digest (the journal's ``end``
record) and every per-step metric of ``metrics.jsonl`` except timings and buffer
occupancy. On CPU the replay is bit-identical::

    asyncrl replay runs/grpo_toy                  # writes runs/grpo_toy/replay/, exit 0 when identical

A streaming run (``trainer.rollout_mode=stream``, HF engine) replays too: its journal also records each
group's admission, each step's groups and the engines' decoding rounds, which the replay follows
(:mod:`asyncrl.pipelines.rollout.stream_replay`, which also lists the stream runs it refuses); it is compared
the same way, plus the groups of every step.

What it cannot replay: a run whose workers draw randomness outside (weights, batch, seed)
(custom workers), or nondeterministic kernels (some GPU kernels; see docs/reliability.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from asyncrl.pipelines.job.config import JobConfig, config_fingerprint
from asyncrl.pipelines.configlib import from_dict
from asyncrl.pipelines.datasets.datafiles import check_code_digests
from asyncrl.pipelines.journaling.journal import JOURNAL, JournalError, read_journal
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.trainers.trainer import make_trainer, weights_digest

__all__ = ["ReplayResult", "replay", "replay_config", "compare_metrics"]

_VOLATILE = ("time/", "buffer/", "stream/in_flight", "stream/buffered", "stream/peak_in_flight",
             "stream/admission_wait")
"""Metric prefixes that depend on timing, not on what was computed (streaming: the groups generating or
waiting when a step took its own, and the sampler's waits)."""


@dataclass
class ReplayResult:
    """What a replay computed, compared with the original run."""

    steps: int
    """Steps replayed."""
    history: list[dict[str, Any]]
    """The replay's per-step metrics."""
    weights_sha256: str | None
    """Digest of the replay's final policy weights."""
    original_weights_sha256: str | None
    """Digest recorded by the original run (None when it did not finish or stop cleanly)."""
    versions: dict[int, int]
    """Batch index -> weight version, as the replay generated them."""
    original_versions: dict[int, int]
    """Batch index -> weight version, as the original run generated them."""
    groups: dict[int, list[int]] = field(default_factory=dict)
    """Streaming: step -> the prompt groups it trained, as the replay trained them."""
    original_groups: dict[int, list[int]] = field(default_factory=dict)
    """Streaming: step -> the prompt groups it trained, as the original run trained them."""
    metric_differences: list[tuple[int, str, Any, Any]] = field(default_factory=list)
    """``(step, key, original, replayed)`` for every per-step metric that differs."""
    output_dir: Path | None = None
    """Where the replay wrote its own outputs."""

    @property
    def identical(self) -> bool:
        """Same versions (streaming: same groups per step), same per-step metrics and (when recorded) the
        same final weights."""
        weights_ok = self.original_weights_sha256 is None or self.weights_sha256 == self.original_weights_sha256
        return (weights_ok and not self.metric_differences and self.versions == self.original_versions
                and self.groups == self.original_groups)


def replay_config(run_dir: str | Path, *, output_dir: str | Path | None = None,
                  overrides: Mapping[str, Any] | None = None) -> tuple[JobConfig, int]:
    """The config a replay of `run_dir` runs (the journal's, with ``trainer.steps`` set to the
    steps the journal recorded, outputs under `output_dir` (default ``RUN/replay``), no
    checkpoints) and that step count."""
    run = Path(run_dir)
    data = read_journal(run)
    if data.header is None or "config" not in data.header:
        raise JournalError(f"{str(run / JOURNAL)!r} has no run header; it cannot be replayed")
    check_code_digests(data.header.get("code_digests"), data.header["config"], f"the journal of {str(run)!r}")
    cfg = from_dict(JobConfig, data.header["config"])
    if data.header.get("fingerprint") != config_fingerprint(cfg):
        raise JournalError(f"the journal of {str(run)!r} was edited: its config does not hash to the fingerprint it "
                           "records, so it is refused")
    steps = data.end["steps"] if data.end is not None else len(data.steps)
    if steps < 1:
        raise JournalError(f"{str(run / JOURNAL)!r} records no finished step; nothing to replay")
    t = cfg.trainer
    t.steps = int(steps)
    t.output_dir = str(output_dir if output_dir is not None else run / "replay")
    t.checkpoint_every, t.checkpoint_at_end, t.checkpoint_every_s = 0, False, None
    t.restart.max_restarts = 0
    for key, value in (overrides or {}).items():  # reporting only: trace, plot, progress, tensorboard
        setattr(t, key, value)
    return cfg.validate(), int(steps)


def compare_metrics(original: list[dict[str, Any]], replayed: list[dict[str, Any]]
                    ) -> list[tuple[int, str, Any, Any]]:
    """Per-step metrics that differ (timings and buffer occupancy excluded); values compare as
    they read back from JSON, so a float equals its ``metrics.jsonl`` text exactly."""
    by_step = {int(r["step"]): r for r in original}
    out: list[tuple[int, str, Any, Any]] = []
    for row in replayed:
        step = int(row["step"])
        want = by_step.get(step)
        if want is None:
            out.append((step, "<row>", None, "present"))
            continue
        got = json.loads(json.dumps(row))
        for k in sorted(set(want) | set(got)):
            if k.startswith(_VOLATILE):
                continue
            a, b = want.get(k), got.get(k)
            same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
            if not same:
                out.append((step, k, a, b))
    return out


async def replay(run_dir: str | Path, *, output_dir: str | Path | None = None,
                 worker_overrides: Mapping[str, Any] | None = None,
                 reporting: Mapping[str, Any] | None = None) -> ReplayResult:
    """Replay `run_dir` from its journal in this process (Ray is started if needed) and compare.

    `worker_overrides` replaces worker classes as in :class:`~asyncrl.pipelines.trainers.trainer.Trainer`
    (e.g. to replay under different stage delays); `reporting` sets trainer reporting keys
    (``trace``, ``plot``, ``progress``, ``tensorboard``)."""
    run = Path(run_dir)
    cfg, steps = replay_config(run, output_dir=output_dir, overrides=reporting)
    original = read_journal(run)
    trainer = make_trainer(cfg, replay=run, worker_overrides=worker_overrides)
    async with trainer:
        history = await trainer.fit()
        sums = await trainer.groups.policy.weights_checksum()  # type: ignore[union-attr]
    mine = read_journal(trainer.output_dir)
    metrics_path = run / "metrics.jsonl"
    # the training rows: an evaluation row ({"kind": "eval", "step": version}) shares its step number
    original_rows = ([r for r in read_jsonl(metrics_path) if r["step"] < steps and r.get("kind") != "eval"]
                     if metrics_path.is_file() else [])
    return ReplayResult(
        steps=steps, history=history, weights_sha256=weights_digest(sums),
        original_weights_sha256=original.end.get("weights_sha256") if original.end else None,
        versions={i: int(b["version"]) for i, b in mine.batches.items()},
        original_versions={i: int(b["version"]) for i, b in original.batches.items() if i < len(mine.batches)},
        groups={t: list(r["groups"]) for t, r in mine.steps.items() if "groups" in r},
        original_groups={t: list(r["groups"]) for t, r in original.steps.items() if "groups" in r and t < steps},
        metric_differences=compare_metrics(original_rows, history), output_dir=trainer.output_dir,
    )
