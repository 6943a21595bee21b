"""benchmarks/ledger_cost.py --quick drives the real run journal (group, step and ledger records, the measurement
task and its thread) and checks the ledger it wrote; it prints its table. No timing asserts (the benchmark measures
speed, the test its mechanism)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ledger_cost_quick(tmp_path):
    out = tmp_path / "ledger_cost.md"
    done = subprocess.run([sys.executable, "benchmarks/ledger_cost.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 256")]
    assert len(rows) == 1
    loop, proc, naive = (float(x) for x in rows[0][1:4])
    assert loop > 0 and proc >= loop and naive > 0
    assert float(rows[0][5]) > 0  # bytes per sample of journal.jsonl + ledger.jsonl
    assert "1-minute load average" in out.read_text()
