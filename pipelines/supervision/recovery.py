"""Which failures a trainer can recover from, and where they came from.

Two recoveries (``trainer.restart``, docs/reliability.md):

* **Replace** (stateless roles). The rollout pool's workers -- rollout engines and the
  rule-based reward -- hold nothing that is not recomputable: their weights are a published
  policy version, their output a function of (weights, prompts, seed). When one of them
  dies or hangs, the trainer kills that pool's processes, starts new ones *in the same
  placement-group bundles*, loads the weight version the interrupted batch needs and issues
  that batch again with the same prompts and seed. The train loop keeps training on the
  batches already buffered; no checkpoint is restored.
* **Restart** (training roles). A policy, critic, reference or advantage worker holds (or
  shares a process with) optimizer state: every group is closed, new actors are started in
  the same placement groups, the newest checkpoint of the run is restored, and the steps
  after it are recomputed (following the run journal, so they compute what was lost).
"""

from __future__ import annotations

from typing import Any

from asyncrl import CallTimeoutError, GroupBrokenError, RemoteError, UpstreamError, WorkerDiedError

__all__ = ["is_worker_fault", "is_preemption", "fault_origin", "root_cause", "describe", "fault_record"]

_RAY_DEATH = {"ActorDiedError", "ActorUnavailableError", "RayActorError", "OwnerDiedError", "ObjectLostError"}
# What a collective raises in a process whose peer died (its sockets closed): torch's gloo transport
# (`gloo/transport/tcp/pair.cc`, "... by peer"). A training rank on a lost node's peer raises this, sometimes
# before the supervisor hears of the death itself.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer")
_COLLECTIVE_ERRORS = {"RuntimeError", "DistError", "DistBackendError", "DistNetworkError"}  # what torch raises them as


def root_cause(error: BaseException) -> BaseException:
    """The innermost error of an ``UpstreamError`` chain (the producer's own failure)."""
    seen: set[int] = set()
    e = error
    while isinstance(e, UpstreamError) and id(e) not in seen:
        seen.add(id(e))
        e = e.upstream
    return e


def is_worker_fault(error: BaseException, *, timeouts: bool = True) -> bool:
    """True when `error` comes from a worker process that died or hung (so a new process may
    succeed), not from the code it ran: ``WorkerDiedError``, ``GroupBrokenError``, a
    ``CallTimeoutError`` (when `timeouts`), an ``UpstreamError`` whose producer failed so, or a
    worker's error that says a peer process is gone: a ``WeightsLostError`` (the weights it loaded were lost
    with the process that owned or sent them) or a collective's lost connection (a training rank whose peer
    died), or a simulated replica's death (``ReplicaLostError``). A lost node reaches the supervisor as these,
    sometimes before its own death does."""
    e = root_cause(error)
    if isinstance(e, (WorkerDiedError, GroupBrokenError)):
        return True
    if isinstance(e, RemoteError) and (_peer_lost(e) or _replica_lost(e)):
        return True
    if isinstance(e, CallTimeoutError):
        return timeouts
    return any(c.__name__ in _RAY_DEATH for c in type(e).__mro__)  # a worker saw its producer die


def _replica_lost(e: RemoteError) -> bool:
    """Whether a rank's error says the simulated replica it served died (``ReplicaLostError``, the cluster twin's
    chaos): the death of that rank, though its process lives on."""
    return e.exc_type.rpartition(".")[2] == "ReplicaLostError"


def _peer_lost(e: RemoteError) -> bool:
    """Whether a worker's error says another process it depended on is gone (not its own fault)."""
    kind = e.exc_type.rpartition(".")[2]
    return kind == "WeightsLostError" or (kind in _COLLECTIVE_ERRORS and any(p in e.message for p in _PEER_LOST))


def is_preemption(error: BaseException) -> bool:
    """True when `error` says a worker was told to stop (a preemption notice, not a fault): a rollout worker's
    ``PreemptedError``, or a worker process that exited on SIGTERM (Ray's exit detail says so)."""
    e = root_cause(error)
    if isinstance(e, RemoteError) and e.exc_type.rpartition(".")[2] == "PreemptedError":
        return True
    return is_worker_fault(e, timeouts=False) and "receives a SIGTERM" in str(e)


def fault_origin(error: BaseException) -> str | None:
    """The name of the group whose worker failed (``"rollout.rollout"``), when the error says;
    None for errors that do not name a group (a missed deadline, a raw Ray error). A worker that raised
    because a peer process is gone (``WeightsLostError``, a collective's lost connection) did not fail
    itself: the origin is ``"a peer of <its group>"``, so that replacing its group (which would load the
    same lost weights again) is not taken for the cure; the run restarts instead."""
    e = root_cause(error)
    group = getattr(e, "group", None)
    if isinstance(e, RemoteError) and _peer_lost(e):
        return f"a peer of {group}"
    if isinstance(e, (WorkerDiedError, RemoteError)) and isinstance(group, str) and group != "?":
        return group
    if isinstance(e, GroupBrokenError):
        msg = str(e)
        if msg.startswith("group '"):
            return msg.split("'")[1]
    return None


def describe(error: BaseException) -> str:
    """One line for a log or a table: the root cause's type and first line."""
    e = root_cause(error)
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:300]


def fault_record(kind: str, error: BaseException, **fields: Any) -> dict[str, Any]:
    """A ``trainer.restarts`` entry."""
    return {"kind": kind, "error_type": type(error).__name__, "error": (str(error).splitlines() or [""])[0],
            "origin": fault_origin(error), "from_checkpoint": None, "from_step": 0, "time_s": 0.0,
            "interrupted_s": None, **fields}
