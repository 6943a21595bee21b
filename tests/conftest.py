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
