"""benchmarks/cluster_twin.py --quick runs the real trainer against 1 and 2 simulated replicas, before and after
the twin's fixes, and writes its table with every column (no timing asserts: speed is what it measures)."""

from __future__ import annotations

import pytest

from .test_overlap_quick import tables

COLUMNS = ["N", "variant", "train ranks", "samples/step", "samples/s", "vs N x 1", "tokens/s", "ideal tokens/s",
           "vs ideal", "ctrl CPU us/sample", "loop lag p99 ms", "ctrl RSS MiB", "weight sync ms", "sync vs N=1",
           "staleness 0/1/2/.. (tokens %)", "trainer idle", "s/step", "workers CPU us/sample", "machine busy"]


@pytest.mark.slow  # two twin runs per variant on real Ray: a minute or two on the shared 2-core machine
def test_cluster_twin_quick(quick_runs):
    text = quick_runs.text("cluster_twin")
    assert "time scale 0.05" in text
    (rows,) = tables(text)
    assert rows[0] == COLUMNS
    assert [(r[0], r[1]) for r in rows[1:]] == [("1", "before"), ("1", "after"), ("2", "before"), ("2", "after")]
    for r in rows[1:]:
        assert r[2] == r[0] and r[3] == str(8 * int(r[0]))  # a training rank per replica; one group of 8 each
        assert float(r[4]) > 0 and float(r[9]) > 0
        assert 97 <= sum(int(x) for x in r[14].split("/")) <= 103  # the staleness histogram, in percent (rounded)
        assert 0.0 <= float(r[15]) <= 1.0
        assert float(r[17]) > 0 and 0.0 < float(r[18]) <= 1.05  # the worker processes' CPU; the cores' busy share
