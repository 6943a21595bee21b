"""The core benchmarks run end to end with --quick (tiny sizes) and print the expected
table. No timing asserts: speed is measured by the benchmarks, not by tests. The quick runs
happen in one process for the session (`quick_runs`, tests/benchmarks/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, out: Path, *extra: str) -> str:
    """A benchmark's --quick run in a process of its own (for those benchmarks/quick.py does not run)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)  # its own embedded Ray, never the test session's
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "Command: `python benchmarks/" in text and "ray 2." in text and "torch " in text
    return text


def table_rows(text: str) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def tables(text: str) -> list[list[list[str]]]:
    """Each markdown table of `text`, as table_rows makes it."""
    return [table_rows(block) for block in text.split("\n\n") if block.startswith("|")]


def test_dispatch_overhead_quick(quick_runs):
    text = quick_runs.text("dispatch_overhead")
    rows, cpu = tables(text)
    assert cpu[0] == ["workers", "call", "asyncrl CPU µs", "plain Ray CPU µs", "asyncrl / plain Ray",
                      "host path / plain Ray", "async host / plain Ray"]
    assert [(r[0], r[1]) for r in cpu[2:]] == [("1", "tiny ONE_TO_ALL"), ("1", "1 MiB DP_COMPUTE")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and all(c.endswith("x") for c in r[4:]) for r in cpu[2:])
    assert rows[0][:9] == ["workers", "call", "asyncrl µs", "plain Ray µs", "asyncrl / plain Ray", "host path µs",
                           "host path / plain Ray", "async host µs", "async host / plain Ray"]
    assert rows[0][9:] in ([], ["verl µs", "asyncrl / verl"])  # verl's columns only where verl is installed
    body = rows[2:]
    assert [(r[0], r[1]) for r in body] == [("1", "tiny ONE_TO_ALL"), ("1", "1 MiB DP_COMPUTE")]
    for r in body:
        assert float(r[2]) > 0 and float(r[3]) > 0 and float(r[5]) > 0 and r[4].endswith("x") and r[6].endswith("x")
        assert float(r[7]) > 0 and r[8].endswith("x")
    assert "1-minute load average" in text
    checks = [ln for ln in text.splitlines() if ln.startswith("- ") and "workers," in ln]
    assert len(checks) == 1 and all("every shard is a view of the input" in c for c in checks)


def test_pipelining_quick(quick_runs):
    rows = table_rows(quick_runs.text("pipelining"))
    assert rows[0] == ["variant", "median ms/chain", "min–max ms", "vs raw Ray floor", "pipelined speed-up",
                       "controller payload bytes/chain"]
    body = {r[0]: r for r in rows[2:]}
    assert set(body) == {"pipelined", "collect + redispatch", "raw Ray"}
    assert body["pipelined"][5] == "0" and body["raw Ray"][5] == "0"  # a contract, not a timing
    assert int(body["collect + redispatch"][5].replace(",", "")) > 0
    assert body["raw Ray"][3] == "1.00x"


@pytest.mark.slow  # default suite: dispatch_overhead, pipelining and overlap quick runs (README, Tests)
def test_inflight_quick(quick_runs):
    rows = table_rows(quick_runs.text("inflight"))
    assert rows[0] == ["variant", "worst lag, submitting (ms)", "worst lag, awaiting (ms)",
                       "worst lag, all rounds (ms)", "longest GC pause, awaiting (ms)", "wall s", "calls/s"]
    assert [r[0] for r in rows[2:]] == ["idle (heartbeat alone)", "asyncrl, asyncrl.gather", "asyncrl, asyncio.gather",
                                        "asyncrl, ordered", "plain Ray, asyncio.gather", "plain Ray, chunked"]
    assert rows[2][1] == "—" and float(rows[2][2]) >= 0
    for r in rows[3:]:
        assert all(float(c.replace(",", "")) >= 0 for c in r[1:]) and float(r[5]) > 0


@pytest.mark.slow  # default suite: dispatch_overhead, pipelining and overlap quick runs (README, Tests)
def test_fetch_wakeups_quick(quick_runs):
    rows = table_rows(quick_runs.text("fetch_wakeups"))
    assert rows[0] == ["variant", "µs per call", "/ a wake-up per rank", "controller thread CPU µs per call"]
    assert [r[0] for r in rows[2:]] == ["asyncrl", "asyncrl, callbacks only", "asyncrl, a wake-up per rank",
                                        "plain Ray, asyncio.gather", "plain Ray, blocking ray.get"]
    assert rows[4][2] == "1.00x" and all(float(r[1]) > 0 and float(r[3]) >= 0 for r in rows[2:])


@pytest.mark.slow  # default suite: dispatch_overhead, pipelining and overlap quick runs (README, Tests)
def test_loop_lag_quick(quick_runs):
    rows = table_rows(quick_runs.text("loop_lag"))
    assert rows[0][:4] == ["phase", "variant", "worst lag ms", "p99 lag ms"]
    phases = [(r[0], r[1]) for r in rows[2:]]
    assert phases[:2] == [("idle", "-"), ("Ray start", "asyncrl")]
    assert ("setup, 2 workers", "asyncrl") in phases and ("setup, 2 workers", "plain Ray") in phases
    assert [p for p, _ in phases[-5:-2]] == ["trainer set-up", "trainer fit (3 steps)", "trainer close"]
    assert phases[-2:] == [("agents worker set-up", "1 rollout"), ("64 episodes in flight", "1 rollout")]
    assert rows[0][4:8] == ["wake-ups > 20 ms", "held: loop thread on the CPU (worst ms)",
                            "starved: waiting for a core (worst ms)",
                            "blocked: asleep past its timer, on the GIL or a lock (worst ms)"]


@pytest.mark.slow  # default suite: dispatch_overhead, pipelining and overlap quick runs (README, Tests)
def test_pipelined_hop_quick(quick_runs):
    rows = table_rows(quick_runs.text("pipelined_hop"))
    assert rows[0] == ["variant", "issue -> start ms", "min–max ms", "vs plain Ray"]
    body = {r[0]: r for r in rows[2:]}
    base = ["asyncrl, pipelined", "asyncrl, pipelined nested", "asyncrl, value", "plain Ray"]
    assert list(body) == base + [f"{v}, then 1 ms {k}" for k in ("busy", "asleep", "nogil") for v in base]
    assert body["plain Ray"][3] == "1.00x"
    for r in body.values():
        assert float(r[1]) > 0 and r[3].endswith("x")


@pytest.mark.slow  # default suite: dispatch_overhead, pipelining and overlap quick runs (README, Tests)
def test_local_chain_quick(quick_runs):
    """The script itself asserts that every same-process call took the local hand-off and
    none of the controller-path ones did."""
    rows = table_rows(quick_runs.text("local_chain"))
    assert rows[0] == ["payload", "variant", "chain ms", "min–max ms", "chain vs plain Ray", "hop ms",
                       "hop vs plain Ray"]
    body = rows[2:]
    assert sorted((r[0], r[1]) for r in body) == sorted(
        (p, v) for p in ("small", "1 MiB")
        for v in ("asyncrl, same process", "asyncrl, through the controller", "plain Ray"))
    for r in body:
        assert float(r[2]) > 0 and r[4].endswith("x") and r[6].endswith("x")
        if r[1] == "plain Ray":
            assert r[4] == r[6] == "1.00x"
