"""benchmarks/offpolicy.py --quick trains the synchronous loop and the async trainer with and
without off-policy correction end to end and writes its table and plot. No learning or timing
asserts: learning is measured by the benchmark, not by tests; what is pinned is what the runs
report about staleness and importance weights, which the schedule fixes."""

from __future__ import annotations

import pytest

from .test_benchmarks_quick import table_rows

COLUMNS = ["variant", "max_staleness", "correction", "seeds", "reward first 5", "reward last 10",
           "steps to 0.5", "steps to 0.9", "s to 0.5", "s to 0.9", "loop s", "ms/step", "row staleness",
           "IS weight mean", "IS weight max", "over cap"]


@pytest.mark.slow  # default suite: dispatch_overhead, pipelining and overlap quick runs (README, Tests)
def test_offpolicy_quick(quick_runs):
    text = quick_runs.text("offpolicy")
    rows = table_rows(text)
    assert rows[0] == COLUMNS
    body = rows[2:]
    assert [r[:4] for r in body] == [["sync", "0", "none", "1"], ["k=1 tis", "1", "tis", "1"]]
    # 4 steps with fixed_lag: the synchronous rows are never stale; at k=1 the last 3 of 4 batches are
    assert body[0][12] == "0.00" and body[0][13] == "1.0000"
    assert body[1][12] == "0.75"
    png = quick_runs.path("offpolicy.png")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
