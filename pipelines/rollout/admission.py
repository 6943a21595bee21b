"""Admission control of streaming rollout: which prompt group may start, and which finished groups a
step trains, so that every trajectory's staleness stays within ``trainer.max_staleness`` without
dropping finished work (pure Python, no Ray; the argument is in docs/streaming.md).

Names: ``B`` groups per step, ``k`` = ``max_staleness``, ``p`` the next step to train (the policy
version it trains from), ``v0(g)`` the rollout's weight version when group ``g`` was admitted (its
first token's version is ``>= v0``), ``U_u`` the admitted, not yet trained groups with ``v0 <= u``.

Invariant (between operations)::

    U_u <= max(0, u + k - p + 1) * B        for every version u

* **admit** at version ``v``: only if ``U_v + 1 <= max(0, v + k - p + 1) * B`` (every admitted group has
  ``v0 <= v``, so ``U_u = U_v`` for ``u >= v`` and one check covers all ``u``) and fewer than
  ``max_in_flight`` groups are generating; else the sampler waits for a step (or a finish). So at most
  ``(k + 1) * B`` groups are admitted and untrained at any time (the rollout's version is ``<= p``).
* **take** for step ``p``: the step must leave ``U'_u <= max(0, u + k - p) * B``, i.e. train at least
  ``need_u = max(0, U_u - max(0, u + k - p) * B)`` groups with ``v0 <= u``. Finished groups are
  considered in finish order; one is accepted only if the slots left can still meet every ``need_u``.

Then a group admitted at ``v0`` is trained at a step ``p <= v0 + k`` (the invariant at ``u = p - k - 1``
says no group with ``v0 <= p - k - 1`` is left), so ``staleness = p - v0 <= k``, and every admitted group
is trained exactly once. With ``bound="admitted"`` (AReaL's bound on admission, its ``max_head_offpolicyness``)
admission is the same, but a take needs no ``need_u``: it trains the ``B`` finished groups admitted earliest (finish
order among equals), so a step never waits for one long group, which is trained when it finishes, possibly more
than ``k`` versions after its first token (the per-token correction weights it: docs/correctness.md). With
``drop_stale`` the bound is kept by dropping instead: admission only
respects ``max_in_flight`` (over generating and buffered groups), and a finished group with
``p - v0 > k`` is dropped when a step looks for its groups. With dynamic sampling
(``algorithm.filter_groups``) a finished group whose rewards are all equal may be **rejected**: it
leaves without training (every ``U_u`` only shrinks, so the invariant holds) and is counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.pipelines.configlib import ConfigError

__all__ = ["Admission", "AdmissionStats", "BOUNDS", "check_stream", "groups_in_flight"]

BOUNDS = ("trained", "admitted")
"""``trainer.stream.bound``'s values (:class:`Admission`'s `bound`)."""


def groups_in_flight(job: Any) -> int:
    """``trainer.stream.max_groups_in_flight`` of a :class:`~asyncrl.pipelines.job.config.JobConfig`, resolved."""
    t = job.trainer
    cap = t.stream.max_groups_in_flight
    return cap if cap is not None else (t.max_staleness + 1) * job.prompts_per_step


def check_stream(job: Any) -> None:
    """Raise :class:`ConfigError` for a setting of `job` (a ``JobConfig`` with ``trainer.rollout_mode=stream``)
    that streaming cannot run, before any worker starts (the stream mode's ``check``)."""
    t = job.trainer
    why = "trainer.rollout_mode=stream"
    if t.max_staleness < 1:
        raise ConfigError(f"{why} keeps groups in flight while steps train, so some trajectories are one version "
                          "old: it needs trainer.max_staleness >= 1 (max_staleness=0 is the synchronous loop: use "
                          "rollout_mode=batch)")
    if t.weights_choice() != "latest":
        raise ConfigError(f"{why} loads each exported version as soon as it exists; "
                          f"trainer.rollout_weights={t.rollout_weights!r} pins batch t to version t - max_staleness, "
                          "which streaming has no batches for. Leave trainer.rollout_weights at auto (streaming "
                          "implies latest) or set it to latest")
    B = job.prompts_per_step
    cap = t.stream.max_groups_in_flight
    if cap is not None and cap < B:
        raise ConfigError(f"trainer.stream.max_groups_in_flight={cap} is below one step's {B} prompt groups "
                          f"(trainer.batch_size / algorithm.group_size), so admission control could never fill a "
                          f"step; set it to at least {B}, or null for (max_staleness + 1) * {B}")
    if t.stream.bound == "admitted" and t.stream.drop_stale:
        raise ConfigError("trainer.stream.drop_stale=true keeps the bound on trained groups by dropping the ones past "
                          "it; with trainer.stream.bound=admitted no finished group is past the bound (it is trained "
                          "when it finishes). Set one of them: drop_stale=false, or bound=trained")
    if job.actor.rollout_correction.bypass_mode == "behaviour":
        raise ConfigError(f"{why} with actor.rollout_correction.bypass_mode=behaviour: a streamed step mixes groups "
                          "admitted at different versions, and with partial rollout one trajectory's tokens come from "
                          "several (docs/streaming.md), so the rollout's log-probs are no single policy; the bypass "
                          "would take PPO's ratio and clip against that mixture with no importance weight, where "
                          "streaming's per-token correction divides them into the recomputed pi_old (the proximal "
                          "policy, docs/correctness.md). Use bypass_mode=off (the default), or "
                          "trainer.rollout_mode=batch")
    unsupported = [
            (t.colocated, "trainer.colocated=true (streaming generates while the policy trains: two pools)",
         "set trainer.colocated=false"),
        (t.precompute_log_probs, "trainer.precompute_log_probs=true", "set it to false"),
    ]
    for bad, what, fix in unsupported:
        if bad:
            raise ConfigError(f"{why} does not support {what} yet; {fix}, or use trainer.rollout_mode=batch")


@dataclass
class AdmissionStats:
    """What admission control holds now (observable backpressure)."""

    in_flight: int
    """Admitted groups still generating."""
    buffered: int
    """Finished groups waiting for a step."""
    admitted: int
    """Groups admitted so far."""
    trained: int
    """Groups taken by steps so far."""
    dropped: int
    """Finished groups dropped as too stale (``drop_stale`` only)."""
    peak_in_flight: int
    """Most groups generating at once."""
    rejected: int = 0
    """Finished groups rejected by dynamic sampling (``algorithm.filter_groups``: equal rewards), never trained."""


@dataclass
class _Group:
    v0: int
    finished: bool = False


@dataclass
class Admission:
    """The admission and take rules of the module docstring, for groups numbered by the caller.

    Args:
        groups_per_step: ``B``.
        max_staleness: ``k`` (>= 1).
        max_in_flight: most admitted, unfinished groups (>= ``B``).
        drop_stale: keep the bound by dropping (see :class:`~asyncrl.pipelines.job.config.StreamConfig`).
        next_step: ``p`` at the start (a resumed run's first step).
        bound: ``trained`` (every trained group at most ``k`` versions after its admission) or ``admitted`` (the
            bound on admission only: module docstring).
    """

    groups_per_step: int
    max_staleness: int
    max_in_flight: int
    drop_stale: bool = False
    next_step: int = 0
    bound: str = "trained"
    _groups: dict[int, _Group] = field(default_factory=dict)
    _finished: list[int] = field(default_factory=list)  # finish order
    _admitted: int = 0
    _trained: int = 0
    _dropped: int = 0
    _rejected: int = 0
    _peak: int = 0
    _by_v0: dict[int, int] = field(default_factory=dict)  # untrained groups per admission version
    _finished_by_v0: dict[int, int] = field(default_factory=dict)  # finished, untrained groups per admission version
    dropped_groups: list[int] = field(default_factory=list)
    """Groups dropped since the last successful :meth:`take` (which returns and clears them)."""

    def __post_init__(self) -> None:
        if self.groups_per_step < 1 or self.max_staleness < 1 or self.max_in_flight < self.groups_per_step:
            raise ValueError(f"Admission needs groups_per_step >= 1, max_staleness >= 1 and max_in_flight >= "
                             f"groups_per_step, got {self.groups_per_step}, {self.max_staleness}, {self.max_in_flight}")
        if self.bound not in BOUNDS or (self.bound == "admitted" and self.drop_stale):
            raise ValueError(f"Admission's bound is one of {BOUNDS} (drop_stale only with 'trained'), got "
                             f"{self.bound!r} with drop_stale={self.drop_stale}")

    # ---- queries -------------------------------------------------------------------------------

    def _in_flight(self) -> int:
        return len(self._groups) - len(self._finished)

    def _untrained_upto(self, u: int) -> int:
        # per version, not per group: admission asks this for every group it admits (and at every wake-up
        # of the sampler), with thousands of groups in flight at hundreds of replicas
        return sum(n for v, n in self._by_v0.items() if v <= u)

    def can_admit(self, version: int) -> bool:
        """Whether a group may start now at rollout weight version `version`."""
        if self.drop_stale:
            return len(self._groups) < self.max_in_flight
        if self._in_flight() >= self.max_in_flight:
            return False
        B, k, p = self.groups_per_step, self.max_staleness, self.next_step
        return self._untrained_upto(version) + 1 <= max(0, version + k - p + 1) * B

    def statistics(self) -> AdmissionStats:
        """Counters of groups in flight, buffered, admitted, trained and dropped."""
        return AdmissionStats(self._in_flight(), len(self._finished), self._admitted, self._trained, self._dropped,
                              self._peak, rejected=self._rejected)

    def version_of(self, group: int) -> int:
        """``v0`` of an admitted, untrained group."""
        return self._groups[group].v0

    def pending(self) -> dict[int, int]:
        """``{group: v0}`` of every admitted group not trained yet (finished or not)."""
        return {g: x.v0 for g, x in self._groups.items()}

    # ---- changes -------------------------------------------------------------------------------

    def admit(self, group: int, version: int) -> None:
        """Admit `group` at `version` (call only when :meth:`can_admit` says so)."""
        if group in self._groups:
            raise ValueError(f"group {group} is already admitted")
        if not self.can_admit(version):
            raise RuntimeError(f"admitting group {group} at version {version} would break the staleness bound "
                               f"(next step {self.next_step}); wait until can_admit() holds")
        self._groups[group] = _Group(version)
        self._by_v0[version] = self._by_v0.get(version, 0) + 1
        self._admitted += 1
        self._peak = max(self._peak, self._in_flight())

    def finish(self, group: int) -> None:
        """`group` finished generating (and scoring): it may be taken from now on."""
        g = self._groups[group]
        if g.finished:
            raise ValueError(f"group {group} finished twice")
        g.finished = True
        self._finished.append(group)
        self._finished_by_v0[g.v0] = self._finished_by_v0.get(g.v0, 0) + 1

    def reject(self, group: int) -> None:
        """`group` finished but is not to be trained (dynamic sampling: its rewards are all equal). It leaves
        like a trained group (every ``U_u`` only shrinks, so the invariant holds) and its room may be
        admitted again."""
        if group not in self._groups:
            raise ValueError(f"group {group} is not admitted (or was already taken or rejected)")
        self._discard([group])
        self._rejected += 1

    def take(self) -> tuple[list[int], list[int]] | None:
        """``(groups, dropped)`` for step ``next_step`` when enough groups finished (then the step is
        taken: ``next_step`` advances), else None (wait for more to finish).

        ``groups`` are in finish order; ``dropped`` are the finished groups found past the bound since
        the last take and removed (``drop_stale`` only: they can never be trained; without it nothing
        changes while None is returned)."""
        B, k, p = self.groups_per_step, self.max_staleness, self.next_step
        if self.drop_stale:  # a finished group past the bound now can never be trained: drop it at once
            stale = [g for g in self._finished if p - self._groups[g].v0 > k]
            self._discard(stale)
            self._dropped += len(stale)
            self.dropped_groups += stale
            if len(self._finished) < B:
                return None
            chosen = self._finished[:B]
            self._discard(chosen)
            self._step_done(chosen)
            return chosen, self._drain_dropped()
        if self.bound == "admitted":  # the B finished groups admitted earliest; nobody waits for a long one
            if len(self._finished) < B:
                return None
            done = self._finished
            first = sorted(range(len(done)), key=lambda i: (self._groups[done[i]].v0, i))[:B]
            chosen = [done[i] for i in sorted(first)]  # (in finish order, as every take returns them)
            self._discard(chosen)
            self._step_done(chosen)
            return chosen, []
        need = self._needs()
        if need is None:
            return None
        versions = list(need)
        chosen: list[int] = []
        count = dict.fromkeys(versions, 0)  # chosen groups with v0 <= u
        for g in self._finished:
            w = self._groups[g].v0
            trial = {u: c + (1 if w <= u else 0) for u, c in count.items()}
            left = B - len(chosen) - 1
            if all(need[u] - trial[u] <= left for u in versions):
                chosen.append(g)
                count = trial
                if len(chosen) == B:
                    break
        if len(chosen) < B:
            return None
        self._discard(chosen)
        self._step_done(chosen)
        return chosen, []

    def _needs(self) -> dict[int, int] | None:
        """``need_u`` for every version ``u`` of an untrained group (ascending), or None when the finished groups
        cannot meet them: fewer than ``B``, or fewer than ``need_u`` with ``v0 <= u`` for some ``u`` (then
        :meth:`take`'s scan would find no ``B`` groups either). Counted per version, not per group: a take is tried
        at every finish, and the scan is O(finished groups), thousands at hundreds of replicas."""
        B, k, p = self.groups_per_step, self.max_staleness, self.next_step
        if len(self._finished) < B:
            return None
        need: dict[int, int] = {}
        untrained = finished = 0
        for u in sorted(self._by_v0):
            untrained += self._by_v0[u]
            finished += self._finished_by_v0.get(u, 0)
            need[u] = max(0, untrained - max(0, u + k - p) * B)
            if finished < need[u]:
                return None
        return need

    def _drain_dropped(self) -> list[int]:
        out, self.dropped_groups = self.dropped_groups, []
        return out

    def _discard(self, groups: list[int]) -> None:
        gone = set(groups)
        for g in groups:
            x = self._groups.pop(g)
            _decrement(self._by_v0, x.v0)
            if x.finished:
                _decrement(self._finished_by_v0, x.v0)
        self._finished = [g for g in self._finished if g not in gone]

    def _step_done(self, chosen: list[int]) -> None:
        self._trained += len(chosen)
        self.next_step += 1


def _decrement(counts: dict[int, int], key: int) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
