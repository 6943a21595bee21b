"""Shared fixtures: one embedded Ray per test session (starting Ray costs seconds)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The session's Ray advertises a fixed number of logical CPUs whatever the machine has
# (CPUs are scheduling units here: the suite runs on 2 cores as on 64), so no test
# depends on os.cpu_count(). Set ASYNCRL_TEST_NUM_CPUS to run the suite as a bigger
# (or smaller) cluster would, e.g. ASYNCRL_TEST_NUM_CPUS=128.
SESSION_CPUS = int(os.environ.get("ASYNCRL_TEST_NUM_CPUS", "32"))
SESSION_OBJECT_STORE = 2 << 30  # bytes; Ray's default is 30% of the machine's memory


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray: SESSION_CPUS logical CPUs (accounting only) and a 2 GiB
    object store, the same on every machine.

    A Ray that something else started first with another size is replaced, so the
    suite sees the same cluster whatever order its tests run in.
    """
    import ray

    import asyncrl

    if ray.is_initialized() and ray.cluster_resources().get("CPU") != SESSION_CPUS:
        asyncrl.shutdown()
    resources = asyncrl.init(num_cpus=SESSION_CPUS, object_store_memory=SESSION_OBJECT_STORE)
    yield resources
    asyncrl.shutdown()


# ---- two test processes (pytest-xdist: ``-n 2``, the README's test command) ----------------------------------------
#
# The suite is mostly worker-process start-ups (each imports torch: 3.6-4.4 s of CPU) and runs that use one process
# at a time, so one test process leaves a core idle for a fifth of the time on the 2-core machine; two keep both
# busy. Each test process has its own session Ray (``ray_cluster``). Tests go to the processes a scope at a time:
# a test module (its module-scoped fixtures and runs are made once), except these folders, whose session- or
# package-scoped fixtures (the benchmarks' one quick-runs process, tests/cluster's cluster of raylets) must be
# made once, in one process.
WHOLE_FOLDERS = ("tests/benchmarks/", "tests/cluster/")


def xdist_scope(nodeid: str) -> str:
    """The unit of tests one test process runs together: a test's module, or its folder if it is one of
    :data:`WHOLE_FOLDERS`."""
    path = nodeid.split("::", 1)[0]
    return next((folder for folder in WHOLE_FOLDERS if path.startswith(folder)), path)


def pytest_configure(config: pytest.Config) -> None:
    """Refuse what needs every test in one process under ``-n``: tests/reliability's fault table is written from
    the rows its process collected, so each test process would write part of it over the others'."""
    if os.environ.get("ASYNCRL_FAULT_TABLE") and (config.getoption("numprocesses", None)
                                                  or os.environ.get("PYTEST_XDIST_WORKER")):
        raise pytest.UsageError("ASYNCRL_FAULT_TABLE writes the fault table from the rows of one test process: "
                                "run it without -n (or with -n 0)")


@pytest.hookimpl(optionalhook=True)  # (an environment without pytest-xdist, e.g. .venv-vllm, runs without it)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's load-by-scope scheduling with :func:`xdist_scope` as the scope (a class's methods stay with their
    module), handed out in collection order (xdist's default order, by the number of tests, would leave the long
    modules of few tests for the end)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return ModuleScheduling(config, log)
