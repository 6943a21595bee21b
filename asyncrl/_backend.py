"""What a group needs from a backend, and the one place a backend's outcome becomes a public error.

A backend (Ray actors in :mod:`asyncrl.backends.ray`, in-process objects in
:mod:`asyncrl.backends.local`) reports what happened to a call in four internal
shapes: a value, :class:`Died` (the worker process is gone), :class:`Cancelled` (the
remote work was cancelled), :class:`Failed` (it failed outside the worker method: an
argument or result that could not be unpickled, a serialization error), or an
:class:`~asyncrl.AsyncRLError` raised on purpose on the worker (passed through as it
is). :func:`public_error` turns the internal shapes into the public errors of
:mod:`asyncrl.errors`, naming group, method and rank; nothing else does, so no
internal type and no unnamed error reaches a user.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from asyncrl.errors import (
    AsyncRLError,
    CallCancelledError,
    GroupClosedError,
    RemoteError,
    WorkerDiedError,
)

__all__ = ["Backend", "BackendSpec", "Slot", "Died", "Cancelled", "Failed", "InputFailed", "FetchHandle", "Wedge",
           "public_error"]

Wedge = tuple[int, int, str, float]
"""``(call id, number, description, seconds its method has run)`` of the call wedging a lane:
a host's reply to a deadline's cancel message (wedged-lane of ``docs/protocol.md``)."""


@dataclass(frozen=True)
class Slot:
    """One worker's place: a bundle of a placement group."""

    placement_group: Any
    bundle_index: int
    node_key: Any
    local_rank: int
    num_cpus: float
    num_gpus: float


class Died(Exception):
    """Internal: the worker process running a call is gone."""


class Cancelled(Exception):
    """Internal: a call's remote work was cancelled."""


class Failed(Exception):
    """Internal: a call failed outside the worker method (e.g. a value could not be unpickled)."""

    def __init__(self, exc_type: str, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"{exc_type}: {message}")
        self.exc_type, self.message, self.remote_traceback = exc_type, message, remote_traceback


class InputFailed(Exception):
    """Internal: the backend failed a call before its host ran it, because a top-level
    argument could not be read (lost, never stored because Ray could not serialize it, or
    not unpicklable on the worker); `outcome` is
    what the argument's failure was, in this module's shapes (see asyncrl._deferred)."""

    def __init__(self, outcome: BaseException) -> None:
        super().__init__(str(outcome))
        self.outcome = outcome


def input_error(outcome: BaseException, *, group: str, method: str) -> RemoteError:
    """The producer's side of an :class:`InputFailed`: its result `group.method` could
    not be read by the consumer (named as the producer's error, as a nested input's is)."""
    exc_type, message, tb = _parts(outcome)
    return RemoteError(group, method, None, exc_type,
                       f"its result could not be read by a consumer (lost, not serializable, or not unpicklable "
                       f"there): {message}", tb)


def _parts(outcome: BaseException) -> tuple[str, str, str]:
    if isinstance(outcome, Failed):
        return outcome.exc_type, outcome.message, outcome.remote_traceback
    return f"{type(outcome).__module__}.{type(outcome).__qualname__}", str(outcome), ""


def public_error(
    e: BaseException,
    *,
    group: str,
    method: str,
    rank: int | None,
    closed: bool = False,
    cancelled: Callable[[], BaseException] | None = None,
) -> BaseException:
    """The public error for a backend outcome `e` of `group.method` on `rank`.

    `closed`: the group was closed meanwhile, so a death or cancellation is the close's
    doing (:class:`~asyncrl.GroupClosedError`). `cancelled` builds the error for a
    cancellation the controller asked for (a timeout, say).
    """
    if isinstance(e, AsyncRLError):
        return e
    if isinstance(e, (Died, Cancelled)) and closed:
        return GroupClosedError(
            f"group {group!r} was closed while {group}.{method} was in flight"
            + (f" on rank {rank}" if rank is not None else "")
        )
    if isinstance(e, Died):
        return WorkerDiedError(group, method, rank, str(e))
    if isinstance(e, Cancelled):
        return cancelled() if cancelled is not None else CallCancelledError(f"{group}.{method} was cancelled")
    if isinstance(e, Failed):
        return RemoteError(group, method, rank, e.exc_type, e.message, e.remote_traceback)
    if isinstance(e, InputFailed):  # (a consumer's own future names its producer: asyncrl.future)
        exc_type, message, tb = _parts(e.outcome)
        return RemoteError(group, method, rank, exc_type,
                           f"an argument of the call could not be read on the worker (lost, or not unpicklable there): {message}", tb)
    import traceback

    return RemoteError(group, method, rank, f"{type(e).__module__}.{type(e).__qualname__}", str(e),
                       "".join(traceback.format_exception(e)), cause=e)


class BackendSpec(Protocol):
    """What a group needs to know of its backend before it starts (a backend, or a
    stand-in that imports one in :meth:`start`, off the event loop)."""

    name: str
    needs_pool: bool

    async def start(self) -> "Backend": ...


class FetchHandle(Protocol):
    """A fetch in progress (:meth:`Backend.fetch`)."""

    outcome: "asyncio.Future[tuple[list[Any], int, float]]"
    """Resolved once, on the loop, with what the fetch delivers (see :meth:`Backend.fetch`)."""

    def cancel(self) -> None:
        """On the loop: no delivery after this (one already posted becomes a no-op)."""


class Backend(Protocol):
    """How a group starts, calls and stops its worker hosts."""

    name: str
    needs_pool: bool
    top_level_inputs: bool
    """Whether :meth:`submit` takes a payload's ``top`` refs as top-level arguments of the
    host's call (see asyncrl._deferred); otherwise every pipelined input stays nested."""
    sends_plain_lists: bool
    """Whether the builder packs a payload's plain arguments as lists (``Payload.sent``,
    from ``Payload.wire``), which :meth:`submit` then sends instead of the payload."""

    async def start(self) -> "Backend":
        """Make the backend usable (Ray: start or connect, off the event loop); returns itself."""

    async def make_hosts(self, group: str, slots: Sequence[Slot], n: int, threaded: bool = False,
                         per_process: int = 1) -> list[Any]:
        """Start one host per rank (Ray: actors created off the event loop); `threaded`:
        hosts without an event loop on the call path (for processes with no concurrent methods);
        `per_process`: ranks per process, each with a host of its own (one process per slot)."""

    async def admin(self, host: Any, method: str, *args: Any) -> Any:
        """Run a host method (set-up, close); errors arrive in the internal shapes."""

    def submit(self, host: Any, msg: Any) -> tuple[Any, Any]:
        """Send one call, an :class:`asyncrl._wire.CallMsg`, to a host (the backend stamps
        ``msg.after``); returns ``(result ref, meta ref or None)``. (Typed ``Any`` here: the
        message's module imports this one.)"""

    def cancel_calls(self, host: Any, entries: list[tuple[int, int | None]], deadline: bool,
                     behind: list[tuple[int, int]] = ...,
                     replied: Callable[[Any, Callable[[list[tuple[int, int]]], None]], None] | None = None) -> None:
        """Send the one cancel message of the sequencing protocol (see ``docs/protocol.md``).
        A deadline's (wedged-lane): `behind`, the calls the host cancels too if one of
        `entries` still runs its plain ``def`` method; ``replied(wedge or None, verdict)``
        on the caller's loop with the host's reply, where ``verdict(entries)`` cancels
        `entries` in a message that every call sent to that host since the deadline's
        cancel runs after (control-before-call)."""

    async def wait(self, ref: Any) -> Any: ...

    def fetch(self, refs: Sequence[Any]) -> "FetchHandle":
        """Fetch every ref and wake the event loop ONCE for all of them: the handle's
        ``outcome`` future resolves on the running loop with ``(outcomes, failed, at)`` when
        the last ref is done (``failed == -1``, ``outcomes`` the values in the order of
        `refs`), or at once when the first one fails (``failed`` its position,
        ``outcomes[failed]`` the backend's raw error: see `translate`; the other refs'
        outcomes are still retrieved, and dropped). `at` is ``time.perf_counter()`` when the
        backend saw it. Never a task per ref; with thousands of fetches outstanding,
        deliveries are spread over loop iterations. Call from the event loop."""
        ...

    def translate(self, e: BaseException) -> BaseException:
        """A raw error of `fetch` as one of this module's outcomes (what `wait` raises)."""
        ...

    def get(self, refs: Sequence[Any], timeout: float | None) -> list[Any] | None:
        """Blocking: the values, or None when `timeout` passed first (the one blocking path)."""

    async def all_done(self, refs: Sequence[Any]) -> bool:
        """Whether every ref has completed (any outcome) without fetching a value or blocking the loop."""

    def watch(self, refs: Sequence[Any], callback: Callable[[], None]) -> None:
        """Call `callback` (from any thread) once every ref has completed; never fetches."""

    def peek(self, refs: Sequence[Any], callback: Callable[[list[Any]], None]) -> None:
        """Call ``callback(values)`` (from any thread, never waking the event loop) once
        every ref has completed: its value, or its error object. For small objects the
        controller holds already (a call's metadata); never blocks."""

    async def kill(self, hosts: Sequence[Any]) -> None: ...

    async def place(self, pool: Any) -> tuple[list[Slot], list[Any]]: ...

    async def remove_placement(self, handles: list[Any]) -> None: ...
