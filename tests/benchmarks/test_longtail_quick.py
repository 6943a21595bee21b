"""benchmarks/longtail.py --quick runs every variant this checkout supports end to end (the real
rollout worker on the simulated engine, the real trainer loops) and writes its table. Mechanism
only: no timing asserts (speed is what the benchmark measures, not what tests check)."""

from __future__ import annotations

import re

import pytest

from .test_overlap_quick import tables

VARIANTS = ["sync", "batch", "stream", "stream+recompute", "stream+keep"]

COLUMNS = ["variant", "max_staleness", "steps", "ms/step", "ideal ms/step", "eff.", "tokens/s", "vs batch overlap",
           "engine idle", "peak in flight", "peak buffered", "staleness seen", "weight update ms p50/max",
           "ctrl peak RSS MiB", "rollout peak RSS MiB"]


@pytest.mark.slow  # the quick run starts Ray and two worker processes: 25-120 s on the shared 2-core machine
def test_longtail_quick(quick_runs):
    text = quick_runs.text("longtail")
    (rows,) = tables(text)
    assert rows[0] == COLUMNS
    variants = [r[0] for r in rows[1:]]
    m = re.search(r"Not run: (.*) \(this trainer does not support them yet\)", text)
    skipped = m.group(1).split(", ") if m else []
    assert variants + skipped == VARIANTS  # every variant is run, or said not to be, in this order
    assert [r[1] for r in rows[1:]] == ["0"] + ["1"] * (len(variants) - 1)  # --quick: sync, then the rest at k=1
    for r in rows[1:]:
        assert r[2] == "3"  # steps
        assert all(float(c.rstrip("x")) > 0 for c in (r[3], r[4], r[5], r[6], r[7], r[13], r[14]))
        assert 0.0 <= float(r[8]) <= 1.0  # engine idle: a share of the decode slots
        assert int(r[11]) <= int(r[1])  # the staleness bound holds
        if not r[0].startswith("stream"):
            assert r[11] == r[1]  # fixed_lag: every batch after the first k is exactly k versions old
        assert len(r[12].split("/")) == 2  # p50/max of the weight updates
    batch = rows[2]
    assert batch[7] == "1.00x"  # its own baseline
    assert batch[9] == "8" and batch[10] == "8"  # one batch of 8 rows in flight, one buffered at most
    for r in rows[3:]:  # streaming: admission control bounds the rows generating or buffered by (k + 1) steps
        assert int(r[9]) <= 16 and int(r[10]) <= 16
    m = re.search(r"Response lengths trained \(all variants, (\d+) rows\): p50 (\d+), .*p99/p50 = ([\d.]+)", text)
    assert m is not None and int(m.group(1)) == 8 * 3 * len(variants)
