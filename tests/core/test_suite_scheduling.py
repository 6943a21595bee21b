"""How the suite splits across two test processes (``pytest -n 2``, tests/conftest.py): a module's tests stay
together (its module-scoped fixtures and runs are made once), and so do the folders whose session- or
package-scoped fixtures must be made once (the benchmarks' quick runs, tests/cluster's raylets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import xdist_scope

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nodeid, scope", [
    ("tests/core/test_protocol.py::test_close[ray-threaded]", "tests/core/test_protocol.py"),
    ("tests/core/test_protocol.py::test_order", "tests/core/test_protocol.py"),
    ("tests/pipelines/test_x.py::TestA::test_b[1]", "tests/pipelines/test_x.py"),  # a class stays with its module
    ("tests/benchmarks/test_benchmarks_quick.py::test_pipelining_quick", "tests/benchmarks/"),
    ("tests/benchmarks/test_call_floor.py::test_table", "tests/benchmarks/"),
    ("tests/cluster/test_nodes.py::test_a_pool", "tests/cluster/"),
    ("tests/cluster/test_lost_nodes.py::test_lost[a::b]", "tests/cluster/"),
])
def test_a_module_is_one_scope_and_the_shared_fixture_folders_are_one_each(nodeid, scope):
    assert xdist_scope(nodeid) == scope


RECORD = """
import json, os, pytest

@pytest.fixture(scope="module")
def made(request):
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps(["module", request.module.__name__, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")

@pytest.mark.parametrize("i", range(3))
def test_one(made, i, request):
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps(["test", request.node.nodeid, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def test_two_test_processes_run_each_module_and_each_whole_folder_in_one_process(tmp_path):
    pytest.importorskip("xdist")  # (in the test extras; .venv-vllm has none)
    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "conftest.py").write_text("from suite_conftest import pytest_xdist_make_scheduler  # noqa\n")
    folders = ("benchmarks", "cluster", "core", "roles")
    modules = [f"tests/{folder}/test_{folder}_{i}.py" for folder in folders for i in range(3)]
    for m in modules:
        (tree / m).parent.mkdir(exist_ok=True)
        (tree / m).write_text(RECORD)
    (tree / "suite_conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "RECORD": str(record), "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-o", "addopts=",
                           "tests"], cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    tests = [(nodeid, worker) for kind, nodeid, worker in rows if kind == "test"]
    assert len(tests) == 3 * len(modules)
    workers_of = defaultdict(set)
    for nodeid, worker in tests:
        workers_of[xdist_scope(nodeid)].add(worker)
    assert all(len(w) == 1 for w in workers_of.values()), dict(workers_of)  # each scope in one process
    assert {xdist_scope(n) for n, _ in tests} == {"tests/benchmarks/", "tests/cluster/",
                                                  *(m for m in modules if "/core/" in m or "/roles/" in m)}
    assert len({w for _, w in tests}) == 2  # and both processes ran tests
    made = [r for r in rows if r[0] == "module"]
    assert len(made) == len(modules)  # each module's fixture made once


def test_the_fault_table_refuses_two_test_processes_with_what_to_run_instead(tmp_path):
    pytest.importorskip("xdist")
    env = {**os.environ, "ASYNCRL_FAULT_TABLE": str(tmp_path / "table.md")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "--co", "-q",
                           "tests/reliability/test_security.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]  # pytest's usage error
    assert "ASYNCRL_FAULT_TABLE writes the fault table from the rows of one test process: run it without -n " \
           "(or with -n 0)" in proc.stderr
    assert not (tmp_path / "table.md").exists()
