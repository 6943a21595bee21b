"""benchmarks/token_budget.py --quick updates a real PolicyWorker under each variant and writes its
table. Mechanism only: no timing asserts (speed is what the benchmark measures, not what tests check)."""

from __future__ import annotations

from .test_benchmarks_quick import table_rows


def test_token_budget_quick(quick_runs):
    text = quick_runs.text("token_budget")
    rows = table_rows(text)
    assert rows[0] == ["variant", "micro-batching", "update s (median)", "vs fixed", "padded tokens/update",
                       "vs fixed tokens", "micro-batches/update", "max weight diff vs fixed"]
    body = {r[0]: r for r in rows[2:]}
    assert list(body) == ["fixed", "budget", "budget+ckpt"]
    assert body["fixed"][3] == "1.00x" and body["fixed"][5] == "1.00x"
    for r in body.values():
        assert float(r[2]) > 0 and float(r[6]) >= 1
        assert float(r[7]) < 1e-5  # the same weights: the budget changes how, not what, it computes
    tokens = {v: float(r[4].replace(",", "")) for v, r in body.items()}
    assert tokens["budget"] < tokens["fixed"]  # padding cut (a count, not a timing)
    assert "1-minute load average" in text
