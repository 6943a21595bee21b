"""``benchmarks/stream_learning.py --late-share``: late prompt groups, and what each bound trains of them.

A late group holds a step under the trained bound (every trained token at most ``max_staleness`` versions old)
and is trained older than that under ``trainer.stream.bound=admitted``: the runs of the benchmark's learning table
on tokens older than k. Real trainer, real Ray, the tiny model."""

from __future__ import annotations

import argparse

import pytest
from ray import cloudpickle

import stream_learning as sl  # benchmarks/ is on sys.path (tests/benchmarks/conftest.py)


@pytest.fixture
def late_by_value():
    """``LateRollout`` goes to the worker processes by value: they cannot import ``benchmarks/`` (the script's
    own directory when the benchmark runs, where it is ``__main__`` and goes by value anyway)."""
    cloudpickle.register_pickle_by_value(sl)
    yield
    cloudpickle.unregister_pickle_by_value(sl)


def test_the_same_groups_are_late_in_every_run():
    # group g's sampling seed at trainer.seed 0 is g (loop_state.batch_seed): these are the late ones
    assert [g for g in range(16) if sl.is_late(g, 0.135)] == [1, 14]
    assert [g for g in range(16) if sl.is_late(g, 0.13)] == [14]
    assert not any(sl.is_late(g, 0.0) for g in range(16))
    assert all(sl.is_late(g, 1.0) for g in range(16))


def test_old_tokens_is_the_share_of_trained_tokens_older_than_k():
    rows = [{"stream/tokens_staleness_0": 10.0, "stream/tokens_staleness_1": 20.0, "reward/mean": 0.5},
            {"stream/tokens_staleness_0": 5.0, "stream/tokens_staleness_1": 5.0, "stream/tokens_staleness_2": 6.0,
             "stream/tokens_staleness_3": 4.0}]
    assert sl.old_tokens(rows, k=1) == "20.0 %"  # 10 of 50 tokens are 2 or 3 versions old
    assert sl.old_tokens(rows, k=2) == "8.0 %"
    assert sl.old_tokens([{"reward/mean": 0.5}]) == "n/a"  # batch mode records no token ages


@pytest.mark.parametrize("argv, says", [
    (["--late-share", "0.1", "--variants", "batch,stream"], "which ['batch'] do not make"),
    (["--late-share", "0.1"], "which ['batch'] do not make"),  # the default variants include batch
    (["--late-share", "1.5", "--variants", "stream"], "--late-share must be in [0, 1]"),
    (["--late-share", "0.1", "--late-versions", "-1", "--variants", "stream"], "got 0.1, 1.0 and -1"),
])
def test_late_flags_the_run_cannot_honour_are_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        sl.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


async def test_a_late_group_holds_a_step_under_the_trained_bound_and_is_trained_older_than_k_under_admitted(
        ray_cluster, late_by_value, tmp_path):
    # tiny_test: 2 groups of 4 per step; group 1 (admitted at version 0) is late: it answers once its replica
    # loaded version 0 + 2, or after 2 s. Under the trained bound step 1 must train it (admitted one version
    # back), so it waits the 2 s; under admitted the other groups train versions 1 and 2 meanwhile.
    args = argparse.Namespace(quick=True, steps=6, lr=1e-2, late_share=0.135, late_s=2.0, late_versions=2)
    trained = await sl.run("stream", 0, args, str(tmp_path))
    admitted = await sl.run("stream+admitted", 0, args, str(tmp_path))
    for run in (trained, admitted):
        assert len(run["history"]) == 6
    assert max(h["staleness/max"] for h in trained["history"]) <= sl.K
    assert sl.old_tokens(trained["history"]) == "0.0 %"
    assert max(h["staleness/max"] for h in admitted["history"]) >= sl.K + 1  # group 1: 2 or more versions old
    assert sl.old_tokens(admitted["history"]) != "0.0 %"
