"""benchmarks/smollm_stream.py's tables from run directories (pure: written metrics.jsonl and bench.json,
no training): accuracy per version, the wall clock of each version, and the per-run line."""

from __future__ import annotations

import json

import pytest
import smollm_stream  # benchmarks/ is on sys.path (tests/benchmarks/conftest.py)

from tests.benchmarks.test_benchmarks_quick import table_rows


def _write_run(path, mode: str, accs: dict[int, float], step_s: float) -> None:
    path.mkdir(parents=True)
    rows = [{"step": s, "reward/mean": 0.1 * s, "staleness/mean": 1.0, "time/step": step_s,
             "time/elapsed": step_s * (s + 1)} for s in range(4)]
    rows += [{"step": v, "kind": "eval", "eval/version": v, "eval/accuracy_flexible": a, "eval/num_prompts": 8}
             for v, a in accs.items()]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "bench.json").write_text(json.dumps({"mode": mode, "seed": 0, "wall_s": 99.0, "load_start": 2.0,
                                                 "load_end": 3.0, "command": f"asyncrl train ({mode})"}))


def test_summary_tables_pin_accuracy_and_wall_clock_per_version(tmp_path):
    _write_run(tmp_path / "stream_s0", "stream", {0: 0.25, 2: 0.5, 4: 0.625}, step_s=10.0)
    _write_run(tmp_path / "batch_s0", "batch", {0: 0.25, 2: 0.375, 4: 0.5, 3: 0.0}, step_s=20.0)
    runs = [smollm_stream.read_run(tmp_path / d) for d in ("stream_s0", "batch_s0")]
    rows = table_rows(smollm_stream.summarize(runs))
    assert rows[0] == ["version", "batch s0", "stream s0", "batch mean", "stream mean"]  # batch first
    assert rows[2:5] == [["0", "0.250", "0.250", "0.250", "0.250"], ["2", "0.375", "0.500", "0.375", "0.500"],
                         ["4", "0.500", "0.625", "0.500", "0.625"]]  # versions both runs evaluated
    assert rows[5] == ["version", "batch s0", "stream s0"]
    assert rows[7:10] == [["0", "0 s: 0.250", "0 s: 0.250"], ["2", "40 s: 0.375", "20 s: 0.500"],
                          ["4", "80 s: 0.500", "40 s: 0.625"]]  # end of step version - 1
    assert rows[10][0] == "run" and rows[12] == ["batch s0", "4", "99", "20", "0.150 / 0.150", "1.00", "2.0 / 3.0"]


def test_unknown_mode_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setattr("sys.argv", ["smollm_stream.py", "--modes", "batch,streaming", "--summarize"])
    with pytest.raises(SystemExit, match=r"unknown mode\(s\) \['streaming'\]; choose from \['batch', 'stream'\]"):
        smollm_stream.main()
