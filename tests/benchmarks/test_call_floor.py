"""``benchmarks/call_floor.py``: a plain Ray driver makes the calls the twin's controller made, no more, no fewer."""

from __future__ import annotations

import collections
from typing import Any

import pytest

import call_floor as cf  # benchmarks/ is on sys.path (tests/benchmarks/conftest.py)


def test_the_plan_is_the_twins_calls_per_step_by_kind():
    counts = collections.Counter({
        "rollout.generate_requests": 32, "rollout.update_weights": 8, "advantage.concat_shard": 8,
        "policy.compute_log_prob": 8, "policy.update": 8, "advantage.version_stats": 2, "policy.export_weights": 2,
        "policy.weights_checksum": 1,  # half a call per step: rounds to none
    })
    assert cf.call_plan(counts, steps=2) == {
        "generate": 16, "weights": 4,
        "rank": {"advantage.concat_shard": 4, "policy.compute_log_prob": 4, "policy.update": 4,
                 "advantage.version_stats": 1, "policy.export_weights": 1},
    }


@pytest.fixture
def remote_calls(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Every Ray actor call made in the test, by method name."""
    import ray.actor

    counts: collections.Counter[str] = collections.Counter()
    remote = ray.actor.ActorMethod._remote

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts[self._method_name] += 1
        return remote(self, *args, **kwargs)

    monkeypatch.setattr(ray.actor.ActorMethod, "_remote", counted)
    return counts


async def test_the_plain_driver_makes_exactly_the_planned_calls(ray_cluster, remote_calls):
    plan = {"generate": 16, "weights": 4,
            "rank": {"advantage.concat_shard": 4, "policy.update": 4, "advantage.version_stats": 1}}
    out = await cf.plain_run(4, 4, plan, steps=3, warmup=0, pace=0.0, group=8, per_process=2)
    # per step: a generate per group, each rank's chain (one call per rank-wide method, the one-rank method on rank
    # 0), a weight load per replica; and one call per process to start (2 rollout, 2 training processes)
    assert dict(remote_calls) == {"generate": 3 * 16, "rank_call": 3 * (4 + 4 + 1) + 4, "update_weights": 3 * 4}
    assert out["cpu_us"] > 0 and out["step_s"] > 0


async def test_several_groups_per_call_stream_back_one_reply_per_group(ray_cluster, remote_calls):
    rows = await cf.per_group(8, groups=256, per_call=4, rounds=1)
    assert [r["mode"] for r in rows] == ["one call per group", "4 groups per call, streamed"]
    assert dict(remote_calls) == {"rank_call": 2, "generate_one": 256, "generate_many": 64}
