"""A Ray cluster of real raylets on this machine (``ray.cluster_utils.Cluster``), for tests of runs
across nodes: a head without CPUs for the controller, and worker nodes each named by a custom
resource of its own (``{"n_roll": 1}``), so that a test steers pools with ``resources_per_bundle`` /
``trainer.*_resources`` and removes, adds or asks about a node by name.

Ray allows one connection per process, so :meth:`OneHostCluster.start` shuts the session's embedded
Ray down and :meth:`OneHostCluster.stop` starts it again (with the sizes of ``tests/conftest.py``) when
one was running. Node CPUs stay small: the machine has 2 cores.
"""

from __future__ import annotations

import time
from typing import Any

import ray

import asyncrl

__all__ = ["OneHostCluster", "FAST_HEALTH_CHECKS"]

FAST_HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_timeout_ms": 1000,
                      "health_check_failure_threshold": 3}
"""The head's GCS declares a raylet dead after about 1.5 s of failed health checks (Ray's default: 15 s)."""

_STORE = 80 * 1024 * 1024  # bytes of object store per node: every size explicit


class OneHostCluster:
    """A head (no CPUs; the controller connects to it) and named worker nodes.

    Args:
        nodes: name -> CPUs of each worker node started with the cluster; node `name` advertises the
            custom resource ``name`` (1 per CPU), which is how pools are steered onto it.
        tags: name -> further custom resources of that node (``{"train": 1}`` on two nodes steers a
            training pool to either).
    """

    def __init__(self, nodes: dict[str, int], tags: dict[str, dict[str, float]] | None = None) -> None:
        self.spec = dict(nodes)
        self.tags = dict(tags or {})
        self.cluster: Any = None
        self.nodes: dict[str, Any] = {}
        self._session: dict[str, float] | None = None

    def start(self) -> "OneHostCluster":
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            self._session = dict(ray.cluster_resources())
            asyncrl.shutdown()
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": _STORE, "include_dashboard": False,
            "_system_config": FAST_HEALTH_CHECKS})
        for name, cpus in self.spec.items():
            self.add(name, cpus, wait=False)
        self.cluster.wait_for_nodes()
        asyncrl.init(address=self.cluster.address)
        return self

    def add(self, name: str, cpus: int, *, wait: bool = True) -> Any:
        """Start worker node `name` with `cpus` CPUs, the custom resource ``name`` and its tags."""
        node = self.cluster.add_node(num_cpus=cpus, resources={name: float(cpus), **self.tags.get(name, {})},
                                     object_store_memory=_STORE)
        self.nodes[name] = node
        if wait:
            self.cluster.wait_for_nodes()
        return node

    def restore(self) -> "OneHostCluster":
        """Start again every node of the cluster's spec that a case removed and did not add back, so that each
        case starts on the whole cluster whatever the one before it did (or failed to do)."""
        missing = [name for name in self.spec if name not in self.nodes]
        for name in missing:
            self.add(name, self.spec[name], wait=False)
        if missing:
            self.cluster.wait_for_nodes()
        return self

    def remove(self, name: str) -> None:
        """Kill node `name`'s raylet and every process on it (as a lost machine)."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def node_id(self, name: str) -> str:
        """The Ray node id of node `name`."""
        for n in ray.nodes():
            if n.get("Alive") and name in n.get("Resources", {}):
                return str(n["NodeID"])
        raise KeyError(f"no alive node {name!r}")

    def names(self) -> dict[str, str]:
        """Node id -> name, for the alive named nodes."""
        return {str(n["NodeID"]): k for n in ray.nodes() if n.get("Alive")
                for k in n.get("Resources", {}) if k in self.nodes}

    def wait_dead(self, name_id: str, timeout: float = 30.0) -> None:
        """Until the GCS reports node id `name_id` dead."""
        deadline = time.monotonic() + timeout
        while any(n["NodeID"] == name_id and n.get("Alive") for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {name_id[:8]} still alive after {timeout}s")
            time.sleep(0.1)

    def stop(self) -> None:
        """Disconnect, stop every raylet, and restart the session's Ray if one was running."""
        asyncrl.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
        if self._session is not None:
            from tests.conftest import SESSION_CPUS, SESSION_OBJECT_STORE

            asyncrl.init(num_cpus=SESSION_CPUS, object_store_memory=SESSION_OBJECT_STORE)
