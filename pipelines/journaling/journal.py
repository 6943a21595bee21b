"""The run journal: what an asynchronous run actually did, enough to do it again exactly.

``<output_dir>/journal.jsonl`` holds one JSON object per line, in the order things happened::

    {"kind": "run", "fingerprint": ..., "config": {...}, "start_step": 0, "next_gen": 0}
    {"kind": "batch", "index": 3, "prompts": [12, 40], "seed": 3, "version": 2, "rows": 8}
    {"kind": "step", "step": 3, "batch": 3, "version": 2}           # step 3 trained on batch 3
    {"kind": "drop", "batch": 5, "version": 1, "at_version": 4}     # too stale: never trained on
    {"kind": "end", "steps": 40, "weights_sha256": "..."}

Streaming rollout (``trainer.rollout_mode=stream``) writes prompt groups instead of batches::

    {"kind": "group", "index": 13, "seed": 13, "version": 2}       # group 13 admitted at version 2
    {"kind": "step", "step": 3, "batch": 3, "version": 2, "groups": [13, 9, 12, 15]}
    {"kind": "group_drop", "index": 7, "version": 0, "at_version": 4}   # trainer.stream.drop_stale
    {"kind": "load", "version": 3}                                  # the rollout starts loading version 3
    {"kind": "resize", "size_before": 2, "size_after": 1, "reason": "scale", "version": 3, "epoch": 1,
     "after_step": 4}                                               # a new rollout pool took over (stream_scale)
    {"kind": "retire", "epoch": 0, "drained": [17, 18], "handed_over": [19],
     "rows": {"19": {"19:0": 3, "19:1": 0}}}                       # pool 0 closed; row 19:0 stopped after 3 tokens

A ``group`` record is written when the group's calls are issued and a ``load`` record when a weight
load is, so their order is the order of those calls on the rollout workers' ordered lane. A ``resize``
record is written as the new pool takes over (it loaded ``version``): the calls after it went to the new
pool, those before it to the old one; ``retire`` names what the old pool finished (``drained``) or handed
over before it was closed, and the decoding step (tokens kept) at which each handed-over row stopped.

A stream run on the HF engine also writes ``"rounds": "rounds.jsonl"`` in its ``run`` record and keeps
its engines' round log (which requests decoded together, under which version, for how many steps) in
that side file next to the journal: too large for one line per event, and only a replay reads it
(:mod:`asyncrl.pipelines.journaling.stream_replay`). It is append-only like the journal and rewinds with it.

A ``batch`` record is written when batch ``index`` is generated and scored: the dataset
indices of its prompts (each repeated ``algorithm.group_size`` times), the sampling seed
of the call, and the weight version every one of its ``rows`` was generated with (the
rollout loop loads weights only between generate calls, so a batch's rows share one
version; each row also carries it in its ``version`` field). ``step`` and ``drop``
records are the consumption order.

In ``rollout_weights: latest`` mode the version a batch gets depends on timing, so two
runs with the same seeds differ. Everything else a step computes is a function of (weights,
batch, seed), so following the journal's versions reproduces the run bit for bit
(:mod:`asyncrl.pipelines.journaling.replay`, ``asyncrl replay RUN``). A resumed or restarted run
rewinds the journal to its checkpoint and follows the versions recorded after it, so the
steps it recomputes are the ones the interrupted run computed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.pipelines.job.configlib import ConfigError

__all__ = ["Journal", "JournalData", "JournalError", "read_journal", "JOURNAL"]

JOURNAL = "journal.jsonl"
"""The journal's file name inside a run directory."""


class JournalError(ConfigError):
    """Raised when a journal is missing, unreadable, or does not match the run replaying it."""


@dataclass
class JournalData:
    """The parsed records of a journal (the last segment wins for a repeated batch or step)."""

    header: dict[str, Any] | None = None
    """The first ``run`` record (the config and fingerprint of the run)."""
    runs: list[dict[str, Any]] = field(default_factory=list)
    """Every ``run`` record: one per segment (a resume or a restart starts another)."""
    batches: dict[int, dict[str, Any]] = field(default_factory=dict)
    """``batch`` records by batch index."""
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    """``step`` records by step."""
    drops: list[dict[str, Any]] = field(default_factory=list)
    """``drop`` records, in order."""
    groups: dict[int, dict[str, Any]] = field(default_factory=dict)
    """``group`` records (streaming rollout's admissions) by group index."""
    group_drops: list[dict[str, Any]] = field(default_factory=list)
    """``group_drop`` records, in order."""
    stream_order: list[dict[str, Any]] = field(default_factory=list)
    """Streaming: the ``group`` and ``load`` records, in the order they were written."""
    resizes: list[dict[str, Any]] = field(default_factory=list)
    """Streaming: ``resize`` records (a new rollout pool took over: ``scale_rollout``, a preemption, the
    autoscaler), in order (also in :attr:`stream_order`)."""
    retires: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Streaming: ``retire`` records (a resized-away pool closed) by pool epoch."""
    end: dict[str, Any] | None = None
    """The last ``end`` record, when the run finished (or stopped cleanly)."""

    def schedule(self, from_index: int = 0) -> dict[int, int]:
        """``{batch index: version}`` of the batches from `from_index` on."""
        return {i: int(b["version"]) for i, b in self.batches.items() if i >= from_index}


def read_journal(path: str | Path) -> JournalData:
    """Parse a journal file (or the journal of a run directory). A torn last line (a process
    killed mid-write) is ignored; any other unreadable line is a :class:`JournalError`."""
    p = Path(path)
    if p.is_dir():
        p = p / JOURNAL
    if not p.is_file():
        raise JournalError(f"no run journal at {str(p)!r}; runs write one as {JOURNAL} in their output directory")
    lines = p.read_text().splitlines()
    data = JournalData()
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            kind = rec["kind"]
        except (ValueError, KeyError, TypeError):
            if n == len(lines) - 1:
                break  # torn by a kill
            raise JournalError(f"{str(p)!r} line {n + 1} is not a journal record: {line[:80]!r}") from None
        _apply(data, rec, kind)
    return data


def _apply(data: JournalData, rec: dict[str, Any], kind: str) -> None:
    if kind == "run":
        data.runs.append(rec)
        if data.header is None:
            data.header = rec
    elif kind == "batch":
        data.batches[int(rec["index"])] = rec
    elif kind == "step":
        data.steps[int(rec["step"])] = rec
    elif kind == "drop":
        data.drops.append(rec)
    elif kind == "end":
        data.end = rec
    elif kind == "group":
        data.groups[int(rec["index"])] = rec
        data.stream_order.append(rec)
    elif kind == "load":
        data.stream_order.append(rec)
    elif kind == "group_drop":
        data.group_drops.append(rec)
    elif kind == "resize":
        data.resizes.append(rec)
        data.stream_order.append(rec)
    elif kind == "retire":
        data.retires[int(rec["epoch"])] = rec


class Journal:
    """Writes a run's journal (append-only; one small line per event, flushed, not fsynced).

    Args:
        path: the journal file (``<output_dir>/journal.jsonl``).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._f: Any = None
        self._records: list[dict[str, Any]] = []

    def start(self, header: dict[str, Any], *, previous: JournalData | None = None, next_gen: int = 0,
              start_step: int = 0) -> dict[int, int]:
        """Begin a segment (blocking file I/O: call it in a thread). With `previous` (the journal of
        the run being resumed), keep its records before the restore point -- batches before
        `next_gen`, steps before `start_step` -- and return the versions of the batches it
        recorded after that point (to follow them again); otherwise start a new file."""
        kept: list[dict[str, Any]] = []
        schedule: dict[int, int] = {}
        if previous is not None:
            if previous.header is not None:
                kept.append(previous.header)
            kept += [b for i, b in sorted(previous.batches.items()) if i < next_gen]
            steps = [s for i, s in sorted(previous.steps.items()) if i < start_step]
            trained = {g for s in steps for g in s.get("groups", ())}
            kept += [r for i, r in sorted(previous.groups.items()) if i in trained]
            kept += steps
            kept += [d for d in previous.drops if int(d["at_version"]) < start_step]
            kept += [d for d in previous.group_drops if int(d["at_version"]) < start_step]
            kept += [r for r in previous.resizes if int(r["after_step"]) < start_step]
            epochs = {int(r["epoch"]) - 1 for r in previous.resizes if int(r["after_step"]) < start_step}
            kept += [r for e, r in sorted(previous.retires.items()) if e in epochs]
            schedule = previous.schedule(next_gen)
        self._rewrite(kept + [{"kind": "run", **header, "start_step": start_step, "next_gen": next_gen}])
        return schedule

    def rewind(self, *, next_gen: int, start_step: int) -> dict[int, int]:
        """Back to a restore point within this run (a restart from a checkpoint): drop what was
        recorded after it and return the versions of the batches recorded after `next_gen`."""
        data = JournalData()
        for rec in self._records:
            _apply(data, rec, rec["kind"])
        runs = [r for r in self._records if r["kind"] == "run"]
        header = {k: v for k, v in (runs[-1] if runs else {}).items() if k not in ("kind", "start_step", "next_gen")}
        self.close()
        return self.start(header, previous=data, next_gen=next_gen, start_step=start_step)

    def _rewrite(self, records: list[dict[str, Any]]) -> None:
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.replace(self.path)
        self._records = list(records)
        self._f = self.path.open("a")

    def _write(self, rec: dict[str, Any]) -> None:
        self._records.append(rec)
        if self._f is not None:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()

    def batch(self, index: int, *, prompts: list[int], seed: int, version: int, rows: int) -> None:
        """Batch `index` was generated and scored with weights `version`."""
        self._write({"kind": "batch", "index": index, "prompts": prompts, "seed": seed, "version": version,
                     "rows": rows})

    def step(self, step: int, *, batch: int, version: int, groups: list[int] | None = None) -> None:
        """Step `step` trained on batch `batch` (generated with `version`; streaming: the prompt `groups`
        it took, `version` their oldest admission version)."""
        rec: dict[str, Any] = {"kind": "step", "step": step, "batch": batch, "version": version}
        if groups is not None:
            rec["groups"] = list(groups)
        self._write(rec)

    def group(self, index: int, *, seed: int, version: int) -> None:
        """Streaming: prompt group `index` was admitted at weight version `version` and samples with `seed`."""
        self._write({"kind": "group", "index": index, "seed": seed, "version": version})

    def load(self, version: int) -> None:
        """Streaming: the rollout starts loading weights `version` (the update call is issued now)."""
        self._write({"kind": "load", "version": version})

    def resize(self, *, size_before: int, size_after: int, reason: str, version: int, epoch: int,
               after_step: int) -> None:
        """Streaming: a new rollout pool of `size_after` workers (it loaded `version`) took over from one of
        `size_before` for `reason` (``scale``, ``preempt``, ``autoscale``), as pool `epoch`, after step
        `after_step` was taken."""
        self._write({"kind": "resize", "size_before": size_before, "size_after": size_after, "reason": reason,
                     "version": version, "epoch": epoch, "after_step": after_step})

    def retire(self, *, epoch: int, drained: list[int], handed_over: list[int],
               rows: dict[int, dict[str, int]] | None = None) -> None:
        """Streaming: rollout pool `epoch`, replaced by a resize, is closed after its groups in flight finished
        there (`drained`) or were handed over to the new pool (`handed_over`; `rows`: the tokens each of their
        rows had decoded when it stopped, by group and request key)."""
        self._write({"kind": "retire", "epoch": epoch, "drained": list(drained), "handed_over": list(handed_over),
                     "rows": {str(g): dict(r) for g, r in sorted((rows or {}).items())}})

    def group_drop(self, index: int, *, version: int, at_version: int) -> None:
        """Streaming with ``drop_stale``: group `index` (admitted at `version`) was dropped at `at_version`."""
        self._write({"kind": "group_drop", "index": index, "version": version, "at_version": at_version})

    def group_filter(self, index: int, *, version: int) -> None:
        """Streaming with ``algorithm.filter_groups``: group `index` (admitted at `version`) finished with
        equal rewards and was rejected (never trained)."""
        self._write({"kind": "group_filter", "index": index, "version": version})

    def drop(self, batch: int, *, version: int, at_version: int) -> None:
        """Batch `batch` (of `version`) was dropped as too stale when the policy was at `at_version`."""
        self._write({"kind": "drop", "batch": batch, "version": version, "at_version": at_version})

    def end(self, steps: int, weights_sha256: str | None) -> None:
        """The run finished (or stopped cleanly) after `steps` steps with these weights."""
        self._write({"kind": "end", "steps": steps, "weights_sha256": weights_sha256})

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._f is not None:
            self._f.close()
            self._f = None
