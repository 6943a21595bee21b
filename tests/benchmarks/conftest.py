"""The benchmarks' quick runs, all in one process (``benchmarks/quick.py``), once per session.

Each test ``test_<name>_quick`` checks benchmark ``<name>``'s table; the session runs the
quick runs of exactly the selected tests' benchmarks, one after another in one fresh Python
process (the process start and imports are paid once, not once per benchmark) on one embedded
Ray (``--one-ray``: Ray's start and stop are paid once too; loop_lag and weight_sync still get
their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from quick import QUICK  # noqa: E402  (benchmarks/quick.py)


PER_BENCHMARK_S = 240
"""The longest a benchmark's quick run may take here (the slowest, overlap, takes ~50 s on the 2-core machine)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The first test to ask for `quick_runs` waits for all of them: its time limit covers them all."""
    n = sum("quick_runs" in getattr(item, "fixturenames", ()) for item in items)
    for item in items:
        if "quick_runs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(PER_BENCHMARK_S * max(1, n) + 60))


class QuickRuns:
    """The outputs of one ``benchmarks/quick.py`` run."""

    def __init__(self, out_dir: Path, names: list[str], proc: subprocess.CompletedProcess[str]) -> None:
        self.out_dir, self.names, self.proc = out_dir, names, proc
        path = out_dir / "status.json"
        self.status: dict[str, dict] = json.loads(path.read_text()) if path.is_file() else {}

    def text(self, name: str) -> str:
        """Benchmark `name`'s table (failing the test with its log if it did not run to the end)."""
        assert name in self.names, f"{name} was not selected for the quick runs"
        s = self.status.get(name)
        log = self.out_dir / f"{name}.log"
        tail = log.read_text()[-3000:] if log.is_file() else self.proc.stdout[-2000:] + self.proc.stderr[-2000:]
        assert s is not None and s["ok"], f"{name} --quick failed: {s and s['error']}\n{tail}"
        text = (self.out_dir / f"{name}.md").read_text()
        assert f"Command: `python benchmarks/{name}.py --quick" in text and "ray 2." in text and "torch " in text
        return text

    def path(self, name: str) -> Path:
        return self.out_dir / name


@pytest.fixture(scope="session")
def quick_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> QuickRuns:
    wanted = {item.name.removeprefix("test_").removesuffix("_quick") for item in request.session.items}
    names = [n for n in QUICK if n in wanted]
    out_dir = tmp_path_factory.mktemp("quick")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)  # their own embedded Ray, never the test session's
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quick.py"), "--one-ray", "--out-dir", str(out_dir), *names],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=PER_BENCHMARK_S * max(1, len(names)))
    return QuickRuns(out_dir, names, proc)
