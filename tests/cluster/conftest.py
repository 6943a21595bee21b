"""The one-host cluster of this folder's tests (:mod:`tests.cluster.harness`), started once for the whole folder
(a start costs 10-20 s on the 2-core machine; each module's cases leave it whole again)."""

from __future__ import annotations

import pytest

from tests.cluster.harness import OneHostCluster


@pytest.fixture(scope="package")
def cluster():
    """A head without CPUs and four 1-CPU nodes: ``roll_a`` and ``roll_b`` (both tagged ``rollout``: a rollout pool
    lands on either) and ``t1`` and ``t2`` (both tagged ``train``: a training pool of two spans both)."""
    cluster = OneHostCluster({"roll_a": 1, "roll_b": 1, "t1": 1, "t2": 1},
                             tags={"roll_a": {"rollout": 1}, "roll_b": {"rollout": 1},
                                   "t1": {"train": 1}, "t2": {"train": 1}})
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def nodes(cluster):
    """The folder's cluster, whole again: each case starts with every node, whatever the case before it did."""
    return cluster.restore()
