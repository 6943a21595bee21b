"""Every public exception of asyncrl, one line each on when it is raised."""

from __future__ import annotations

__all__ = [
    "AsyncRLError",
    "DispatchError",
    "RegistrationError",
    "RemoteError",
    "UpstreamError",
    "WorkerDiedError",
    "GroupClosedError",
    "GroupBrokenError",
    "CallTimeoutError",
    "CallCancelledError",
    "LaneWedgedError",
    "PlacementError",
]


class AsyncRLError(Exception):
    """Base class of every error asyncrl raises on purpose."""


class DispatchError(AsyncRLError, ValueError):
    """Raised when a call's arguments cannot be split or merged as its dispatch mode says."""


class RegistrationError(AsyncRLError, TypeError):
    """Raised when a worker method or dispatch mode is registered wrongly, or an unregistered one is called."""


class RemoteError(AsyncRLError):
    """Raised when a worker method raised; names group, method and rank and keeps the remote traceback."""

    def __init__(
        self,
        group: str,
        method: str,
        rank: int | None,
        exc_type: str,
        message: str,
        remote_traceback: str,
        cause: BaseException | None = None,
    ) -> None:
        self.group = group
        self.method = method
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.cause = cause
        where = f"{group}.{method}" + (f" on rank {rank}" if rank is not None else "")
        super().__init__(
            f"{where} raised {exc_type}: {message}\n--- remote traceback ---\n{remote_traceback}"
        )

    def __reduce__(self):  # keep the story when the error itself is pickled
        return (
            type(self),
            (self.group, self.method, self.rank, self.exc_type, self.message, self.remote_traceback, self.cause),
        )


class UpstreamError(RemoteError):
    """Raised when a call's argument was a future whose producer failed; `upstream` is the producer's error."""

    def __init__(self, group: str, method: str, rank: int | None, upstream: BaseException) -> None:
        self.upstream = upstream
        AsyncRLError.__init__(
            self,
            f"{group}.{method}" + (f" on rank {rank}" if rank is not None else "")
            + f" could not run: an input future failed: {upstream}",
        )
        self.group, self.method, self.rank = group, method, rank
        self.exc_type = type(upstream).__name__
        self.message = str(upstream)
        self.remote_traceback = getattr(upstream, "remote_traceback", "")
        self.cause = upstream

    def __reduce__(self):
        return (type(self), (self.group, self.method, self.rank, self.upstream))


class WorkerDiedError(AsyncRLError, RuntimeError):
    """Raised when the worker process running a call died (killed, crashed, out of memory)."""

    def __init__(self, group: str, method: str, rank: int | None, detail: str = "") -> None:
        self.group, self.method, self.rank, self.detail = group, method, rank, detail
        super().__init__(
            f"worker rank {rank} of group {group!r} died while running {method!r}"
            + (f": {detail}" if detail else "")
            + "; the group is now broken. Close it and create a new one (or give it restart='process' and "
            "replace the lost process: `await wg.replace_process(rank)`)."
        )

    def __reduce__(self):  # pickled inside an UpstreamError from a worker: rebuild it from its parts
        return (type(self), (self.group, self.method, self.rank, self.detail))


class GroupClosedError(AsyncRLError, RuntimeError):
    """Raised when a closed group (or a future from one) is used."""


class GroupBrokenError(AsyncRLError, RuntimeError):
    """Raised when a call is made on a group one of whose workers has died (with ``restart='process'``: a call
    that reaches a rank of a lost process); `ranks` names the dead ranks when known."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class CallTimeoutError(AsyncRLError, TimeoutError):
    """Raised when a call's deadline passed before its result arrived; the remote work is cancelled."""


class CallCancelledError(AsyncRLError):
    """Raised when a call was cancelled (`GroupFuture.cancel()`, or every task awaiting it was cancelled)."""


class LaneWedgedError(AsyncRLError, RuntimeError):
    """Raised when an ordered call cannot run because an earlier ordered call on its worker outlived its
    deadline and is still running in its thread."""

    def __init__(self, group: str, method: str, rank: int | None, stuck: str, running_s: float) -> None:
        self.group, self.method, self.rank, self.stuck, self.running_s = group, method, rank, stuck, running_s
        super().__init__(
            f"{group}.{method} cannot run on rank {rank}: the earlier ordered call {stuck} outlived its deadline "
            f"and has been running in its thread for {running_s:.1f}s (a plain def method cannot be interrupted). "
            "Ordered calls on this worker fail until it returns; make the method return (e.g. check a stop "
            "flag), or close the group and create a new one"
        )

    def __reduce__(self):
        return (type(self), (self.group, self.method, self.rank, self.stuck, self.running_s))


class PlacementError(AsyncRLError, RuntimeError):
    """Raised when a resource pool cannot be placed on the cluster (infeasible, or not ready in time)."""
