"""The controller's half of ordered calls: numbering, submission and cancellation (:class:`Sequencer`).

Ray's async actors do not keep submission order, so the controller numbers the ordered
calls of each worker process (a *lane*) and the process runs them by number (the worker
half: :mod:`asyncrl._lanes`, :mod:`asyncrl._thread_lane`). The invariant: **every number
taken is released exactly once on the worker**, whatever fails, so the next number's call
always gets its turn. Cancellation has one path, :meth:`Sequencer.cancel` → the host's
``cancel_calls`` → :meth:`~asyncrl._lanes.Lane.cancel`; cancelling twice is harmless.

The 16 failure cases of this protocol, each with the test that pins it, are in
``docs/protocol.md``; the code cites them as "case N".
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable

import structlog

from asyncrl.errors import LaneWedgedError

if TYPE_CHECKING:
    from asyncrl._backend import Backend, Wedge

__all__ = ["Sequencer", "Entry", "new_call_id"]

log = structlog.get_logger("asyncrl")

Entry = tuple[int, int, "int | None"]
"""``(rank, call id, number or None)`` of one submitted per-rank call."""

_call_ids = itertools.count()
_ISSUED_SWEEP = 1024  # remembered ordered calls per lane before the first sweep (case 15)


class Sequencer:
    """Numbers the ordered calls of each worker process and submits every call.

    One per set of worker processes (a group, or colocated groups sharing processes):
    all ordered calls to one process share one numbering, whatever role they call.
    """

    __slots__ = ("backend", "hosts", "keep_results", "_next", "_lock", "pinned", "wedged", "_issued", "_sweep_at")

    def __init__(self, backend: "Backend", hosts: list[Any], world_size: int, keep_results: int = 0) -> None:
        self.backend = backend
        self.hosts = hosts  # filled in by the owner as the processes start
        self.keep_results = keep_results
        """How many of its latest ordered numbers each lane keeps the outcome of (case 14)."""
        self._next = [0] * world_size  # each lane's next number; only under the lock
        self._lock = threading.Lock()  # number order = submission order per host, from any thread (case 12)
        self.pinned = False
        """The hosts run ordered calls on a pinned thread (threaded Ray hosts): a wedge is
        also the controller's to act on (case 15). Set by the owner when the hosts start."""
        self.wedged: dict[int, tuple[int, int, str, float]] = {}
        """Lane -> ``(call id, number, description, monotonic start)`` of the call wedging it, as its host reported."""
        self._issued: list[collections.deque[tuple[int, Any]]] = [collections.deque() for _ in range(world_size)]
        self._sweep_at = [_ISSUED_SWEEP] * world_size

    def submit(self, role: str, method: str, ordered: bool, want_meta: bool, ranks: Iterable[int],
               build: Callable[[int, int | None], tuple[Any, int | None, bool]]) -> tuple[list[Any], list[Any], tuple[Entry, ...]]:
        """Submit one call per rank of `ranks`; ``build(rank, number)`` makes its
        ``(payload, input padding, keep result)`` knowing the number the call will have
        (None for a concurrent call): same-process inputs depend on it (case 14). Returns
        ``(result refs, meta refs, entries)``. On any failure (building a rank's
        arguments included: no number is taken then) nothing stays half-issued: the calls
        already submitted and the number taken for the failing one are cancelled, then
        the error is raised."""
        backend, hosts, numbers = self.backend, self.hosts, self._next
        refs: list[Any] = []
        metas: list[Any] = []
        entries: list[Entry] = []
        try:
            with self._lock:
                for rank in ranks:
                    payload, pad, keep = build(rank, numbers[rank] if ordered else None)
                    call_id = next(_call_ids)
                    seq = None
                    if ordered:
                        seq = numbers[rank]
                        numbers[rank] = seq + 1
                    entries.append((rank, call_id, seq))
                    ref, meta = backend.submit(hosts[rank], role, method, seq, call_id, payload, pad, want_meta, keep)
                    refs.append(ref)
                    metas.append(meta)
        except BaseException:
            self.cancel(entries, deadline=False)
            raise
        return refs, metas, tuple(entries)  # a tuple of ints: the collector stops tracking it

    def cancel(self, entries: Iterable[Entry], *, deadline: bool) -> None:
        """The one cancel path: one message per worker process. `deadline`: the calls'
        deadline passed (a call still running in its thread wedges its lane)."""
        by_rank: dict[int, list[tuple[int, int | None]]] = {}
        for rank, call_id, seq in entries:
            by_rank.setdefault(rank, []).append((call_id, seq))
        for rank, items in by_rank.items():
            try:
                if deadline and self.pinned:
                    self.backend.cancel_calls(self.hosts[rank], items, deadline,  # type: ignore[call-arg]
                                              wedged=functools.partial(self._wedged_reply, rank))
                else:
                    self.backend.cancel_calls(self.hosts[rank], items, deadline)
            except Exception as e:  # the process is gone (its lane with it) or Ray is shutting down
                log.warning("cancel.unsent", rank=rank, calls=len(items), error=repr(e))

    # ---- the wedge of a pinned lane (case 15), on the controller's loop --------------------------

    def issued(self, call: Any) -> None:
        """A call was submitted (`call`: its ``_Call``). On pinned hosts, remember its ordered
        numbers (a wedge fails the ones still queued) and fail it at once if a lane it
        needs is wedged."""
        if not self.pinned:
            return
        ref = weakref.ref(call)
        wedged = None
        for rank, _, seq in call.entries:
            if seq is None:
                continue
            q = self._issued[rank]
            q.append((seq, ref))
            if len(q) >= self._sweep_at[rank]:
                self._sweep(rank)
            if self.wedged and wedged is None and rank in self.wedged:
                wedged = rank
        if wedged is not None:
            self._fail_wedged(call, wedged)

    def _sweep(self, rank: int) -> None:
        """Forget the calls that are over (amortized: the bound doubles with what stays)."""
        q = self._issued[rank]
        self._issued[rank] = collections.deque(e for e in q if _pending(e[1]()))
        self._sweep_at[rank] = max(_ISSUED_SWEEP, 2 * len(self._issued[rank]))

    def _wedged_reply(self, rank: int, wedge: "Wedge") -> None:
        """A host said its lane is wedged (its reply to a deadline's cancel): fail every
        ordered call numbered after the stuck one there, until it reports the wedge over."""
        call_id, seq, _, running = wedge
        now = self.wedged.get(rank)
        if now is not None and now[0] == call_id:
            return
        self.wedged[rank] = (call_id, seq, wedge[2], time.monotonic() - running)
        try:
            self.backend.watch_unwedged(self.hosts[rank], call_id,  # type: ignore[attr-defined]
                                        functools.partial(self._unwedged, rank, call_id))
        except Exception as e:  # Ray is shutting down: the lane goes with it
            log.warning("wedge.unwatched", rank=rank, error=repr(e))
        for s, ref in list(self._issued[rank]):
            call = ref()
            if s > seq and _pending(call):
                self._fail_wedged(call, rank)

    def _unwedged(self, rank: int, call_id: int) -> None:
        now = self.wedged.get(rank)
        if now is None or now[0] != call_id:
            return
        with self._lock:  # every number below `upto` was failed here while the lane was wedged
            del self.wedged[rank]
            upto = self._next[rank]
        try:
            self.backend.unfence(self.hosts[rank], call_id, upto)  # type: ignore[attr-defined]
        except Exception as e:  # the process is gone (its lane with it) or Ray is shutting down
            log.warning("unfence.unsent", rank=rank, error=repr(e))

    def _fail_wedged(self, call: Any, rank: int) -> None:
        _, _, stuck, since = self.wedged[rank]
        call.fail(LaneWedgedError(call.group, call.method, rank, stuck, time.monotonic() - since), cancel_remote=True)


def _pending(call: Any) -> bool:
    return call is not None and not call.settled() and not call._completed


def new_call_id() -> int:
    """A fresh call id (unique in this controller process)."""
    return next(_call_ids)
