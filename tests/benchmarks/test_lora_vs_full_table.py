"""benchmarks/lora_vs_full.py's table from run directories (pure: written metrics.jsonl, no training): per variant
and version, the mean held-out accuracy over the seeds, each seed's, and the median seconds since the start."""

from __future__ import annotations

import json

import lora_vs_full  # benchmarks/ is on sys.path (tests/benchmarks/conftest.py)

from tests.benchmarks.test_benchmarks_quick import table_rows


def _write_run(path, accs: dict[int, float], step_s: float, wall_s: float) -> None:
    path.mkdir(parents=True)
    rows = [{"step": s, "time/elapsed": step_s * (s + 1)} for s in range(4)]
    rows += [{"step": v, "kind": "eval", "eval/version": v, "eval/accuracy_flexible": a} for v, a in accs.items()]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "wall_s.txt").write_text(f"{wall_s}\n")


def test_the_table_gives_accuracy_per_version_over_seeds_and_the_seconds_it_took(tmp_path):
    _write_run(tmp_path / "full0", {0: 0.25, 2: 0.5, 4: 0.75}, step_s=10.0, wall_s=100.0)
    _write_run(tmp_path / "full1", {0: 0.25, 2: 0.25, 4: 0.5}, step_s=30.0, wall_s=300.0)
    _write_run(tmp_path / "lora0", {0: 0.25, 2: 0.375, 4: 0.625, 3: 1.0}, step_s=5.0, wall_s=50.0)
    rows = table_rows("\n".join(lora_vs_full.table({"full": {0: tmp_path / "full0", 1: tmp_path / "full1"},
                                                     "lora": {0: tmp_path / "lora0"}})))
    assert rows[2:] == [
        ["full", "0", "0.250", "0.250 / 0.250", "0", ""],
        ["full", "2", "0.375", "0.500 / 0.250", "40", ""],  # version 2 was trained after steps 0-1: median(20, 60)
        ["full", "4", "0.625", "0.750 / 0.500", "80", "200"],
        ["lora", "0", "0.250", "0.250", "0", ""],
        ["lora", "2", "0.375", "0.375", "10", ""],
        ["lora", "3", "1.000", "1.000", "15", ""],
        ["lora", "4", "0.625", "0.625", "20", "50"],
    ]
