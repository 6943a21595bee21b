"""Versioned policy -> rollout weight sync from the controller.

The weights never pass through the controller: the policy's ``export_weights``
future goes straight into ``rollout.update_weights``, whose workers fetch the
tensors from the Ray object store.
"""

from __future__ import annotations

from typing import Any

from asyncrl import WorkerGroup

from .errors import WeightSyncError

__all__ = ["sync_weights"]


async def sync_weights(policy: WorkerGroup[Any], rollout: WorkerGroup[Any], *, verify: bool = False) -> int:
    """Push the policy's current weights to every rollout rank; returns the synced version.

    Each rollout rank runs the transaction begin (version check) -> transfer -> commit;
    a version not newer than a rank's raises :class:`~asyncrl.roles.StaleWeightsError`
    (as the cause of the group's ``RemoteError``). With `verify`, the rollout ranks
    check their loaded weights against the policy's checksums and the result is
    re-checked here.
    """
    exported = policy.export_weights()
    expected = await policy.weights_checksum() if verify else None
    results = await rollout.update_weights(exported, expected_checksums=expected)
    versions = {r["version"] for r in results}
    if len(versions) != 1:
        raise WeightSyncError(f"rollout ranks committed different versions: {sorted(versions)}")
    if verify:
        for rank, sums in enumerate(await rollout.weights_checksum()):
            if sums != expected:
                raise WeightSyncError(f"rollout rank {rank} weights differ from the policy's after sync")
    return versions.pop()
