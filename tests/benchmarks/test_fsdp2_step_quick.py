"""``benchmarks/fsdp2_step.py --quick`` prints its table: every variant's step split into its parts and its ratio to
ddp (slow: ten gloo processes of the tiny model, one after another, in a process of its own)."""

from __future__ import annotations

import pytest

from .test_benchmarks_quick import run, table_rows


@pytest.mark.slow
def test_fsdp2_step_quick(tmp_path):
    rows = table_rows(run("fsdp2_step.py", tmp_path / "fsdp2_step.md"))
    assert rows[0] == ["variant", "forward s", "backward s", "clip s", "optimizer s", "step s",
                       "vs ddp, median (range)"]
    body = rows[2:]
    assert [r[0] for r in body] == ["ddp", "fsdp2+gloo", "fsdp2", "fsdp2+gloo+keep", "fsdp2+keep"]
    assert body[0][6] == "1.00x (1.00-1.00)"
    for r in body:
        assert all(float(x) >= 0 for x in r[1:6]) and r[6].split()[0].endswith("x")
