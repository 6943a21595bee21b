"""``benchmarks/fsdp2_step.py --quick`` prints its table: each fsdp2 variant's step split into its parts, the step of
the ddp that ran beside it and its ratio to it (slow: three pairs of variants, four gloo processes of the tiny model
each, one pair after another, in a process of its own)."""

from __future__ import annotations

import pytest

from .test_benchmarks_quick import run, table_rows


@pytest.mark.slow
def test_fsdp2_step_quick(tmp_path):
    rows = table_rows(run("fsdp2_step.py", tmp_path / "fsdp2_step.md"))
    assert rows[0] == ["variant", "forward s", "backward s", "clip s", "optimizer s", "step s", "ddp beside it: step s",
                       "vs ddp, median (range)"]
    body = rows[2:]
    assert [r[0] for r in body] == ["fsdp2:before", "fsdp2", "fsdp2+keep"]
    for r in body:
        assert all(float(x) > 0 for x in (r[1], r[2], r[5], r[6])) and r[7].split()[0].endswith("x")
