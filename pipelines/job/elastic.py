"""Elastic rollout: the range a rollout pool may be resized within, and the error of a size outside it.

``trainer.rollout_workers`` is a count (the pool keeps that size) or a range ``min..max`` (a string in
YAML and on the command line, a :class:`WorkerRange` in Python): the run starts at ``min`` and
``await trainer.scale_rollout(n)`` (or the autoscaler, ``trainer.rollout_autoscale``) resizes the pool
within it. How a resize runs is the rollout's business: between two batches in batch mode
(:meth:`~asyncrl.pipelines.supervision.supervisor.Supervisor.apply_scale`), beside the groups in flight in streaming
mode (:mod:`asyncrl.pipelines.rollout.stream_scale`). docs/nodes.md, "Elastic rollout".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from asyncrl.roles.fields import MAX_WORKERS

__all__ = ["WorkerRange", "RolloutRangeError", "parse_workers"]

_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


@dataclass(frozen=True)
class WorkerRange:
    """The sizes a rollout pool may take: ``min`` to ``max`` workers, both included (``"1..3"``)."""

    min: int
    """The smallest size (the run starts at it)."""
    max: int
    """The largest size."""

    def __str__(self) -> str:
        return f"{self.min}..{self.max}"

    def __contains__(self, n: object) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and self.min <= n <= self.max

    @property
    def elastic(self) -> bool:
        """True when the pool may change size (``min < max``)."""
        return self.min < self.max

    def sizes(self) -> range:
        """Every size of the range, smallest first."""
        return range(self.min, self.max + 1)


class RolloutRangeError(ValueError):
    """Raised when ``scale_rollout`` asks for a rollout pool size outside ``trainer.rollout_workers``'s range."""


def parse_workers(value: Any, key: str = "trainer.rollout_workers") -> WorkerRange:
    """The :class:`WorkerRange` of a ``rollout_workers`` value: an int ``n`` (``n..n``), a ``WorkerRange``,
    a ``"min..max"`` string or a ``{min, max}`` mapping. ``ValueError`` (one line naming `key` and the
    fix) for anything else, a minimum below 1, a maximum below the minimum or above ``MAX_WORKERS``."""
    if isinstance(value, WorkerRange):
        r = value
    elif isinstance(value, int) and not isinstance(value, bool):
        r = WorkerRange(value, value)
    elif isinstance(value, str) and (m := _RANGE.match(value)):
        r = WorkerRange(int(m.group(1)), int(m.group(2)))
    elif isinstance(value, dict) and set(value) == {"min", "max"} and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        r = WorkerRange(value["min"], value["max"])
    else:
        raise ValueError(f"{key} must be a number of workers or a range min..max (e.g. 1..3), got {value!r}")
    if r.min < 1 or r.max < r.min:
        raise ValueError(f"{key}={r} needs 1 <= min <= max (e.g. 1..3), got min={r.min}, max={r.max}")
    if r.max > MAX_WORKERS:
        raise ValueError(f"{key}={r}: a pool has at most {MAX_WORKERS} workers, got max={r.max}")
    return r
