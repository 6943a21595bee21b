"""A streaming run's round log, ``rounds.jsonl``: which requests shared each decoding round of the HF engine
and under which weight version (what :mod:`asyncrl.pipelines.rollout.stream_replay` re-runs). Recorded when
:func:`records_rounds`; written by the run journal after each step."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.pipelines.journaling.journal import JournalError

__all__ = ["ROUNDS", "RoundFile", "read_rounds", "recording_rollout", "records_rounds"]

ROUNDS = "rounds.jsonl"
"""The round log's file name, next to the journal."""


def records_rounds(job: Any) -> bool:
    """Whether a run of `job` (a ``JobConfig``) records its engines' rounds: its rollout mode says
    (``RolloutMode.records_rounds``; streaming on the HF engine)."""
    return job.trainer.mode().records_rounds(job)


def recording_rollout(job: Any) -> Any:
    """The ``RolloutConfig`` the run's rollout workers get: the job's, recording rounds when
    :func:`records_rounds` (the job's own config, and so its fingerprint, is unchanged)."""
    return replace(job.rollout, record_rounds=True) if records_rounds(job) else job.rollout


class RoundFile:
    """Appends a run's ``rounds.jsonl`` (blocking file I/O: small writes, one per step).

    Args:
        path: the file (``<output_dir>/rounds.jsonl``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def start(self, previous: Path | None, start_step: int) -> None:
        """Begin the file: keep the lines of `previous` (this run's, or the resumed run's) for steps before
        `start_step` (a resume or restart rewinds to its checkpoint), drop the rest."""
        kept = [c for c in read_rounds(previous) if int(c["step"]) < start_step] if previous is not None else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(c) + "\n" for c in kept))
        tmp.replace(self.path)

    def append(self, step: int, epoch: int, ranks: list[list[dict[str, Any]]] | None, lost: str | None = None,
               retired: bool = False, notice: int | None = None) -> None:
        """The rounds each rank of rollout pool `epoch` ran since its last line, fetched after step `step` chose
        its groups, or (`retired`) before that pool was closed by a resize (`lost`: why they could not be
        fetched), or (`notice`) the rounds rank `notice` sent with its SIGTERM's preemption notice."""
        rec: dict[str, Any] = {"step": step, "epoch": epoch, "ranks": ranks}
        if retired:
            rec["retired"] = True
        if lost is not None:
            rec["lost"] = lost
        if notice is not None:
            rec["notice"] = notice
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")


def read_rounds(path: Path) -> list[dict[str, Any]]:
    """The lines of a ``rounds.jsonl`` (missing file: none); a torn last line is ignored."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    out = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            int(rec["step"])
        except (ValueError, KeyError, TypeError):
            if n == len(lines) - 1:
                break  # torn by a kill
            raise JournalError(f"{str(path)!r} line {n + 1} is not a round-log record: {line[:80]!r}; restore the "
                               "file the run wrote") from None
        out.append(rec)
    return out
