"""Admission control of streaming rollout (pipelines/rollout/admission.py, pure Python): pinned selections for
fixed sequences, and over random interleavings the staleness bound holds for every trained group,
nothing is dropped, and a step never waits when the groups it needs have finished."""

from __future__ import annotations

import pytest
from asyncrl.pipelines.rollout.admission import Admission
from hypothesis import given, settings
from hypothesis import strategies as st


def test_admission_pauses_at_the_bound_and_resumes_after_a_step():
    a = Admission(groups_per_step=2, max_staleness=1, max_in_flight=8)
    for g in range(4):  # U_0 + 1 <= (0 + 1 - 0 + 1) * 2 = 4
        assert a.can_admit(0)
        a.admit(g, 0)
    assert not a.can_admit(0)
    with pytest.raises(RuntimeError, match="would break the staleness bound"):
        a.admit(4, 0)
    a.finish(0)
    a.finish(1)
    assert a.take() == ([0, 1], [])
    assert not a.can_admit(0)  # at version 0 a group would be trained at step 1 or 2: step 2 is too late
    assert a.can_admit(1)


def test_a_step_skips_fresh_groups_until_the_old_ones_it_must_train_finish():
    a = Admission(groups_per_step=2, max_staleness=1, max_in_flight=8)
    for g in range(4):
        a.admit(g, 0)
    a.finish(0)
    a.finish(1)
    assert a.take() == ([0, 1], [])
    a.admit(4, 1)
    a.admit(5, 1)
    assert not a.can_admit(1)  # U_1 = 4 = (1 + 1 - 1 + 1) * 2
    a.finish(4)
    a.finish(5)
    assert a.take() is None  # groups 2 and 3 (v0=0) must be trained at step 1; 4 and 5 can wait
    a.finish(3)
    assert a.take() is None
    a.finish(2)
    assert a.take() == ([3, 2], [])
    assert a.take() == ([4, 5], [])
    assert a.statistics().trained == 6 and a.statistics().dropped == 0


def test_finish_order_decides_when_the_bound_allows_it():
    a = Admission(groups_per_step=2, max_staleness=2, max_in_flight=8)
    for g in range(6):  # (0 + 2 - 0 + 1) * 2 = 6
        a.admit(g, 0)
    for g in (5, 3, 0, 4):
        a.finish(g)
    assert a.take() == ([5, 3], [])  # no group has to be trained yet: first finished first
    assert a.take() == ([0, 4], [])


def test_the_in_flight_cap_bounds_generating_groups():
    a = Admission(groups_per_step=2, max_staleness=3, max_in_flight=3)
    for g in range(3):
        a.admit(g, 0)
    assert not a.can_admit(0)  # the bound allows 8, the cap 3
    a.finish(0)
    assert a.can_admit(0)
    assert a.statistics().peak_in_flight == 3


def test_drop_stale_drops_finished_groups_past_the_bound_and_counts_them():
    a = Admission(groups_per_step=1, max_staleness=1, max_in_flight=4, drop_stale=True)
    a.admit(0, 0)
    a.admit(1, 0)
    a.finish(1)
    assert a.take() == ([1], [])
    a.admit(2, 1)
    a.finish(2)
    assert a.take() == ([2], [])
    a.finish(0)  # v0=0 at step 2: staleness 2 > 1
    assert a.take() is None
    a.admit(3, 2)
    a.finish(3)
    assert a.take() == ([3], [0])
    assert a.statistics().dropped == 1


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="max_in_flight >= groups_per_step"):
        Admission(groups_per_step=4, max_staleness=1, max_in_flight=3)
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        Admission(groups_per_step=4, max_staleness=0, max_in_flight=8)


def test_the_admitted_bound_trains_what_finished_and_a_long_group_when_it_finishes():
    """``bound="admitted"`` (AReaL's): the same admissions as the trained bound, but the step the trained bound
    holds for group 0 (admitted at version 0, max_staleness 1) trains the groups that finished; group 0 is trained
    when it finishes, 2 versions after its admission, before a later group that finished first."""
    runs = {b: Admission(groups_per_step=2, max_staleness=1, max_in_flight=8, bound=b) for b in ("trained", "admitted")}
    for a in runs.values():
        for g in range(4):
            a.admit(g, 0)
        assert not a.can_admit(0)
        a.finish(1)
        a.finish(2)
        assert a.take() == ([1, 2], [])
        a.admit(4, 1)
        a.admit(5, 1)
        assert not a.can_admit(1)  # U_1 = 4: admission is bounded alike
        a.finish(3)
        a.finish(4)
    assert runs["trained"].take() is None  # group 0 (v0 = 0) must be trained at step 1: the step waits for it
    a = runs["admitted"]
    assert a.take() == ([3, 4], [])  # step 1: what finished; group 0 still generating
    assert not a.can_admit(1)  # U_1 = 2 (groups 0, 5) = (1 + 1 - 2 + 1) * 2: group 0 holds a place
    assert a.can_admit(2)
    a.admit(6, 2)
    a.admit(7, 2)
    assert not a.can_admit(2)  # U_2 = 4 = (2 + 1 - 2 + 1) * 2
    a.finish(6)
    a.finish(5)
    a.finish(0)
    assert a.take() == ([5, 0], [])  # step 2: the earliest admitted (0 at v0 0, 5 at 1; not 6 at 2), finish order
    assert a.take() is None and a.pending() == {6: 2, 7: 2}
    st_ = a.statistics()
    assert (st_.trained, st_.admitted, st_.dropped) == (6, 8, 0)


def test_a_bound_that_does_not_exist_or_drops_under_the_admitted_bound_is_refused():
    with pytest.raises(ValueError, match=r"bound is one of \('trained', 'admitted'\).*got 'tokens'"):
        Admission(groups_per_step=2, max_staleness=1, max_in_flight=8, bound="tokens")
    with pytest.raises(ValueError, match="drop_stale only with 'trained'"):
        Admission(groups_per_step=2, max_staleness=1, max_in_flight=8, drop_stale=True, bound="admitted")


def _invariant_holds(a: Admission) -> bool:
    B, k, p = a.groups_per_step, a.max_staleness, a.next_step
    pending = a.pending()
    return all(sum(1 for v in pending.values() if v <= u) <= max(0, u + k - p + 1) * B
               for u in set(pending.values()))


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 4), k=st.integers(1, 3), extra=st.integers(0, 4), steps=st.integers(1, 8),
       ops=st.lists(st.integers(0, 99), min_size=300, max_size=300))
def test_every_trained_group_is_within_the_bound_and_nothing_is_lost(B, k, extra, steps, ops):
    """Random interleavings of admissions (at the newest version the policy has), weight loads,
    finishes (any order) and takes: staleness p - v0 in [0, k] for every trained group, the invariant
    after every operation, each group trained exactly once, and every step completes."""
    a = Admission(groups_per_step=B, max_staleness=k, max_in_flight=B + extra)
    version, nxt, trained = 0, 0, []
    running: list[int] = []
    v0: dict[int, int] = {}
    it = iter(ops)
    budget = len(ops) + 4 * steps * B + 4 * steps  # the drawn operations, then at most ~4 per group and step
    for _ in range(budget):
        if a.next_step >= steps:
            break
        op = next(it, None)
        if op is not None:
            choice = op % 4
        else:  # the drawn operations ran out: make progress (admit, finish, load the newest weights, take)
            choice = (0 if nxt < steps * B and a.can_admit(version) else 2 if running
                      else 1 if version < a.next_step else 3)
        if choice == 0 and nxt < steps * B and a.can_admit(version):
            a.admit(nxt, version)
            v0[nxt] = version
            running.append(nxt)
            nxt += 1
        elif choice == 1 and version < a.next_step:
            version += 1  # the rollout loads a newer export (never newer than the policy)
        elif choice == 2 and running:
            a.finish(running.pop((op or 0) % len(running)))
        else:
            got = a.take()
            if got is None:
                # waiting is only right when a needed group is unfinished or too few were admitted
                if not running and nxt < steps * B:
                    if a.can_admit(version):
                        continue
                    version = a.next_step  # the sampler waits for the newest weights
                    continue
                assert running or nxt < steps * B or len(a.pending()) < B
                if running:
                    a.finish(running.pop(0))
                continue
            chosen, dropped = got
            assert dropped == []
            p = a.next_step - 1
            assert len(chosen) == B
            assert all(0 <= p - v0[g] <= k for g in chosen), (p, [(g, v0[g]) for g in chosen])
            trained += chosen
        assert _invariant_holds(a)
    else:
        pytest.fail(f"{budget} operations trained only {a.next_step} of {steps} steps: admission stalled "
                    f"(admitted {nxt}, generating {running}, version {version}, pending {a.pending()})")
    assert len(trained) == len(set(trained)) == steps * B
    assert a.statistics().dropped == 0


def _scan_take(a: Admission) -> list[int] | None:
    """The groups a take chooses by the full scan alone (the module docstring's rule, with no early answer), without
    changing `a`."""
    B, k, p = a.groups_per_step, a.max_staleness, a.next_step
    pending = a.pending()
    versions = sorted(set(pending.values()))
    need = {u: max(0, sum(1 for v in pending.values() if v <= u) - max(0, u + k - p) * B) for u in versions}
    chosen: list[int] = []
    count = dict.fromkeys(versions, 0)
    for g in a._finished:
        trial = {u: c + (pending[g] <= u) for u, c in count.items()}
        if all(need[u] - trial[u] <= B - len(chosen) - 1 for u in versions):
            chosen.append(g)
            count = trial
            if len(chosen) == B:
                return chosen
    return None


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 5), k=st.integers(1, 3), steps=st.integers(1, 6),
       ops=st.lists(st.integers(0, 99), min_size=200, max_size=200))
def test_a_take_answers_as_the_full_scan_of_finished_groups_does(B, k, steps, ops):
    """A take that answers None from its per-version counts (too few finished groups of an old version) answers what
    the scan of every finished group answers, at every point of random interleavings."""
    a = Admission(groups_per_step=B, max_staleness=k, max_in_flight=(k + 1) * B)
    version, nxt = 0, 0
    running: list[int] = []
    for op in ops:
        if a.next_step >= steps:
            break
        choice = op % 4
        if choice == 0 and nxt < steps * B and a.can_admit(version):
            a.admit(nxt, version)
            running.append(nxt)
            nxt += 1
        elif choice == 1 and version < a.next_step:
            version += 1
        elif choice == 2 and running:
            a.finish(running.pop(op % len(running)))
        else:
            expected = _scan_take(a)
            got = a.take()
            assert (got[0] if got is not None else None) == expected


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 4), k=st.integers(1, 3), steps=st.integers(1, 8),
       ops=st.lists(st.integers(0, 99), min_size=300, max_size=300))
def test_under_the_admitted_bound_every_group_is_trained_once_and_no_step_waits_for_one(B, k, steps, ops):
    """Random interleavings under ``bound="admitted"``: at most ``(k + 1) * B`` groups admitted and untrained, a take
    answers as soon as ``B`` groups finished (the ``B`` admitted earliest), each group trained exactly once."""
    a = Admission(groups_per_step=B, max_staleness=k, max_in_flight=(k + 1) * B, bound="admitted")
    version, nxt, trained, running = 0, 0, [], []
    v0: dict[int, int] = {}
    it = iter(ops)
    for _ in range(len(ops) + 8 * steps * B + 8 * steps):
        if a.next_step >= steps:
            break
        op = next(it, None)
        choice = op % 4 if op is not None else (0 if nxt < steps * B and a.can_admit(version) else 2 if running
                                                else 1 if version < a.next_step else 3)
        if choice == 0 and nxt < steps * B and a.can_admit(version):
            a.admit(nxt, version)
            v0[nxt], nxt = version, nxt + 1
            running.append(nxt - 1)
        elif choice == 1 and version < a.next_step:
            version += 1
        elif choice == 2 and running:
            a.finish(running.pop((op or 0) % len(running)))
        else:
            finished = [g for g in a.pending() if g not in running]
            got = a.take()
            assert (got is None) == (len(finished) < B)
            if got is not None:
                chosen = got[0]
                left = [g for g in finished if g not in chosen]
                assert max((v0[g] for g in chosen), default=0) <= min((v0[g] for g in left), default=1 << 30)
                trained += chosen
            elif not running and nxt < steps * B and not a.can_admit(version):
                version = a.next_step  # the sampler waits for the newest weights
        assert len(a.pending()) <= (k + 1) * B
    else:
        pytest.fail(f"trained only {a.next_step} of {steps} steps (admitted {nxt}, generating {running})")
    assert len(trained) == len(set(trained)) == steps * B
