"""Stage deadlines (pipelines/loop/deadlines.py): the rollout pool's stateless stages carry
``trainer.rollout_timeout_s`` by default (two pools), every stage carries ``stage_timeout_s`` when set,
and the smaller wins. The deadline firing on a hung worker is pinned end to end in
tests/reliability/test_defaults.py and test_faults.py."""

from __future__ import annotations

import pytest

from asyncrl import WorkerGroup
from asyncrl.backends.local import LocalBackend
from asyncrl.pipelines.job.config import ConfigError, TrainerConfig
from asyncrl.pipelines.loop.deadlines import STATELESS_STAGES, Deadlined, stateless_timeout, unwrap, with_deadlines
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.loop.stages import AdvantageWorker, Groups
from asyncrl.roles import PolicyWorker, RewardWorker, RolloutWorker


def _groups() -> Groups:
    def wg(cls: type, name: str) -> WorkerGroup:
        return WorkerGroup(cls, world_size=1, name=name, backend=LocalBackend())  # never started

    return Groups(rollout=wg(RolloutWorker, "rollout"), reward=wg(RewardWorker, "reward"),
                  policy=wg(PolicyWorker, "policy"), advantage=wg(AdvantageWorker, "advantage"))


def _deadline(group: object, method: str) -> float | None:
    """The timeout a call of `group.method` is issued with."""
    return getattr(group, method)._timeout


def test_the_default_puts_600_s_on_generate_and_score_and_nothing_on_the_training_stages():
    t = TrainerConfig()
    assert (t.rollout_timeout_s, t.stage_timeout_s, t.colocated) == (600.0, None, False)
    assert STATELESS_STAGES == {"generate", "generate_episodes", "generate_requests", "compute_reward"}
    g = with_deadlines(_groups(), t)
    assert (_deadline(g.rollout, "generate"), _deadline(g.rollout, "generate_episodes"),
            _deadline(g.rollout, "generate_requests"), _deadline(g.reward, "compute_reward")) == (600.0,) * 4
    # the weight load waits for a training step's export: no fixed default on it
    assert _deadline(g.rollout, "update_weights") is None
    assert g.policy is unwrap(g.policy) and not isinstance(g.advantage, Deadlined)
    assert _deadline(g.policy, "update") is None


def test_stage_timeout_bounds_every_stage_and_the_smaller_deadline_wins_on_the_stateless_ones():
    g = with_deadlines(_groups(), TrainerConfig(stage_timeout_s=30.0))
    assert (_deadline(g.rollout, "generate"), _deadline(g.reward, "compute_reward"),
            _deadline(g.rollout, "update_weights"), _deadline(g.policy, "update"),
            _deadline(g.advantage, "compute_advantages")) == (30.0, 30.0, 30.0, 30.0, 30.0)
    g = with_deadlines(_groups(), TrainerConfig(stage_timeout_s=900.0, rollout_timeout_s=50.0))
    assert (_deadline(g.rollout, "generate"), _deadline(g.rollout, "update_weights"),
            _deadline(g.policy, "update")) == (50.0, 900.0, 900.0)


def test_colocated_or_null_rollout_timeout_puts_no_default_deadline():
    assert stateless_timeout(TrainerConfig(colocated=True)) is None
    assert stateless_timeout(TrainerConfig(rollout_timeout_s=None)) is None
    assert stateless_timeout(TrainerConfig(colocated=True, stage_timeout_s=7.0)) == 7.0
    raw = _groups()
    g = with_deadlines(raw, TrainerConfig(rollout_timeout_s=None))
    assert (g.rollout, g.reward, g.policy) == (raw.rollout, raw.reward, raw.policy)


def test_rewrapping_a_replaced_pool_does_not_stack_deadlines():
    t = TrainerConfig(stage_timeout_s=30.0, rollout_timeout_s=10.0)
    once = with_deadlines(_groups(), t)
    twice = with_deadlines(once, t)  # the supervisor re-wraps the training groups with the new rollout pool
    assert not isinstance(unwrap(twice.rollout), Deadlined) and not isinstance(unwrap(twice.policy), Deadlined)
    assert _deadline(twice.rollout, "generate") == 10.0 and "10 s on generate" in repr(twice.rollout)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf")])
def test_a_bad_rollout_timeout_is_refused_naming_the_key(bad):
    cfg = tiny_test()
    cfg.trainer.rollout_timeout_s = bad
    with pytest.raises(ConfigError, match=r"^trainer\.rollout_timeout_s must be a positive number of seconds or null"):
        cfg.validate()
