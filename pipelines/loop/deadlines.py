"""Per-call deadlines: the rollout pool's stages always carry one; every stage when ``trainer.stage_timeout_s`` is set.

* ``trainer.stage_timeout_s`` (default None): a deadline on every call of every group.
* ``trainer.rollout_timeout_s`` (default 600 s): a deadline on the stateless stages -- the rollout's
  ``generate``/``generate_episodes`` and the reward's ``compute_reward`` -- with two pools, so that a
  hung rollout or reward worker is replaced (``trainer.restart``) instead of hanging a default run.
  When both are set these stages take the smaller. A colocated layout shares the rollout's process
  with the policy (its calls may wait behind a training step), so there only ``stage_timeout_s`` applies.

A stage that misses its deadline fails its future with ``CallTimeoutError``, which the
supervisor (:mod:`asyncrl.pipelines.supervision.supervisor`) treats as a worker fault. Precomputed
calls are issued on the undecorated groups (:func:`without_deadlines`): they may wait a
whole step for their turn, and the step's ``advantages`` call, which waits for them,
carries the deadline instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from asyncrl import GroupMethod
from asyncrl.pipelines.loop.stages import Groups

if TYPE_CHECKING:
    from asyncrl.pipelines.job.config import TrainerConfig

__all__ = ["STATELESS_STAGES", "Deadlined", "stateless_timeout", "unwrap", "with_deadlines", "without_deadlines"]

STATELESS_STAGES = frozenset({"generate", "generate_episodes", "generate_requests", "compute_reward"})
"""The rollout pool's methods that ``trainer.rollout_timeout_s`` bounds: they compute (generate, score) and
wait for nothing but their own inputs, unlike the weight loads, which wait for a training step's export."""


class Deadlined:
    """A worker group whose calls carry a deadline: `timeout` (None: none), or `per_method[name]`."""

    def __init__(self, group: Any, timeout: float | None, per_method: Mapping[str, float] | None = None) -> None:
        self._group = group
        self._timeout = timeout
        self._per_method = dict(per_method or {})

    def timeout_of(self, name: str) -> float | None:
        """The deadline (seconds) calls of method `name` carry, or None."""
        return self._per_method.get(name, self._timeout)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._group, name)
        if not isinstance(attr, GroupMethod):
            return attr
        timeout = self.timeout_of(name)
        return attr.options(timeout=timeout) if timeout is not None else attr

    def __repr__(self) -> str:
        every = f"a {self._timeout:g} s deadline per call" if self._timeout is not None else "no deadline"
        extra = "".join(f", {t:g} s on {m}" for m, t in sorted(self._per_method.items()))
        return f"<{self._group!r} with {every}{extra}>"


def unwrap(group: Any) -> Any:
    """`group` without its deadline (itself when it has none)."""
    return group._group if isinstance(group, Deadlined) else group


def without_deadlines(g: Groups) -> Groups:
    """`g` with every group's deadline removed."""
    return Groups(rollout=unwrap(g.rollout), reward=unwrap(g.reward), policy=unwrap(g.policy),
                  advantage=unwrap(g.advantage), reference=unwrap(g.reference), critic=unwrap(g.critic))


def stateless_timeout(t: "TrainerConfig") -> float | None:
    """The deadline of the rollout pool's stateless stages (:data:`STATELESS_STAGES`): the smaller of
    ``rollout_timeout_s`` (two pools only) and ``stage_timeout_s``, or None when neither applies."""
    set_ = [x for x in (None if t.colocated else t.rollout_timeout_s, t.stage_timeout_s) if x is not None]
    return min(set_) if set_ else None


def with_deadlines(g: Groups, t: "TrainerConfig") -> Groups:
    """`g` with the deadlines `t` asks for: ``stage_timeout_s`` on every call, :func:`stateless_timeout`
    on the rollout's and the reward's stateless stages (`g` itself when there is none)."""
    stateless = stateless_timeout(t)
    if t.stage_timeout_s is None and stateless is None:
        return g
    pool = {m: stateless for m in STATELESS_STAGES} if stateless is not None else {}

    def wrap(x: Any, per_method: Mapping[str, float] | None = None) -> Any:
        if x is None or (t.stage_timeout_s is None and not per_method):
            return unwrap(x)
        return Deadlined(unwrap(x), t.stage_timeout_s, per_method)

    return Groups(rollout=wrap(g.rollout, pool), reward=wrap(g.reward, pool), policy=wrap(g.policy),
                  advantage=wrap(g.advantage), reference=wrap(g.reference), critic=wrap(g.critic))
