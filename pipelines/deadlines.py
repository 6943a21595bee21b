"""Per-call deadlines: every call of a worker group carries ``trainer.stage_timeout_s``.

A stage that misses its deadline fails its future with ``CallTimeoutError``, which the
supervisor (:mod:`asyncrl.pipelines.supervisor`) treats as a worker fault. Precomputed
calls are issued on the undecorated groups (:func:`without_deadlines`): they may wait a
whole step for their turn, and the step's ``advantages`` call, which waits for them,
carries the deadline instead.
"""

from __future__ import annotations

from typing import Any

from asyncrl import GroupMethod
from asyncrl.pipelines.stages import Groups

__all__ = ["Deadlined", "unwrap", "with_deadlines", "without_deadlines"]


class Deadlined:
    """A worker group whose every call carries a deadline (``trainer.stage_timeout_s``)."""

    def __init__(self, group: Any, timeout: float) -> None:
        self._group = group
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._group, name)
        return attr.options(timeout=self._timeout) if isinstance(attr, GroupMethod) else attr

    def __repr__(self) -> str:
        return f"<{self._group!r} with a {self._timeout:g} s deadline per call>"


def unwrap(group: Any) -> Any:
    """`group` without its deadline (itself when it has none)."""
    return group._group if isinstance(group, Deadlined) else group


def without_deadlines(g: Groups) -> Groups:
    """`g` with every group's deadline removed."""
    return Groups(rollout=unwrap(g.rollout), reward=unwrap(g.reward), policy=unwrap(g.policy),
                  advantage=unwrap(g.advantage), reference=unwrap(g.reference), critic=unwrap(g.critic))


def with_deadlines(g: Groups, timeout: float | None) -> Groups:
    """`g` with a `timeout`-second deadline on every call of every group (`g` itself when None)."""
    if timeout is None:
        return g

    def wrap(x: Any) -> Any:
        return Deadlined(x, timeout) if x is not None else None

    return Groups(rollout=wrap(g.rollout), reward=wrap(g.reward), policy=wrap(g.policy),
                  advantage=wrap(g.advantage), reference=wrap(g.reference), critic=wrap(g.critic))
