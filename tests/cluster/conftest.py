"""The one-host cluster of this folder's tests (:mod:`tests.cluster.harness`), started once per module."""

from __future__ import annotations

import pytest

from tests.cluster.harness import OneHostCluster


@pytest.fixture(scope="module")
def nodes():
    """A head without CPUs and three 1-CPU nodes: ``roll`` (the rollout pool's), ``t1`` and ``t2``
    (both tagged ``train``: the training pool's)."""
    cluster = OneHostCluster({"roll": 1, "t1": 1, "t2": 1}, tags={"t1": {"train": 1}, "t2": {"train": 1}})
    try:
        yield cluster.start()
    finally:
        cluster.stop()
