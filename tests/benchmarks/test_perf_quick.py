"""The weight-sync and engine-throughput benchmarks run end to end with --quick (tiny model, one
repetition) and print their tables. No timing asserts: the tables' numbers are measurements."""

from __future__ import annotations

import pytest

from .test_benchmarks_quick import table_rows


@pytest.mark.slow  # 2-4 min here (six worker processes); default tests of its mechanisms: tests/roles/
def test_weight_sync_quick(quick_runs):  # test_bucketed_snapshot.py, test_weight_transports.py (bit-identical)
    rows = table_rows(quick_runs.text("weight_sync"))
    assert rows[0] == ["model", "rollout dtype", "MB", "what", "median s", "min–max s", "GB/s", "floor",
                       "of floor's GB/s"]
    body = rows[2:]
    assert [(r[0], r[1], r[3]) for r in body] == [("tiny", "float32", w) for w in (
        "memcpy", "gloo broadcast", "ray.put + ray.get", "object_store", "collective", "local")]
    assert len({r[2] for r in body}) == 1 and float(body[0][2]) > 0  # every row moved the same bytes
    assert [r[7] for r in body] == ["(floor)"] * 3 + ["ray.put + ray.get", "gloo broadcast", "memcpy"]
    assert all(float(r[4]) > 0 for r in body) and all(r[8].endswith("%") for r in body[3:])


def test_engine_throughput_quick(quick_runs):
    rows = table_rows(quick_runs.text("engine_throughput"))
    assert rows[0] == ["batch", "variant", "tokens", "median s", "min–max s", "tokens/s", "speed vs generate"]
    body = rows[2:]
    variants = ["HF engine", "HF engine, before the fix", "transformers generate"]
    assert [(r[0], r[1], r[2]) for r in body] == [(b, v, n) for b, n in (("1", "8"), ("4", "32")) for v in variants]
    assert body[2][6] == body[5][6] == "1.00x" and all(float(r[5]) > 0 for r in body)
