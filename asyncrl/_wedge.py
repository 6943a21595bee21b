"""The controller's side of a wedged pinned lane (case 15 of ``docs/protocol.md``): :class:`WedgeReplies`.

A threaded Ray host runs ordered calls on one pinned thread; a plain ``def`` method whose
deadline passed keeps running there (it cannot be interrupted) and wedges the lane. The
host says so in its reply to the deadline's cancel message; the controller then fails every
ordered call numbered after the stuck one on that lane (``LaneWedgedError``), and once the
host reports the thread returned, tells it which numbers were failed meanwhile
(``unfence``). A mixin of :class:`asyncrl._call.Sequencer`, which remembers the issued
calls and declares the state used here.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    import collections

    from asyncrl._backend import Backend, Wedge

__all__ = ["WedgeReplies"]

log = structlog.get_logger("asyncrl")


class WedgeReplies:
    """The host's reply that a lane is wedged, and the end of the wedge (see the module docstring)."""

    __slots__ = ()

    if TYPE_CHECKING:  # the sequencer's state and methods that the ones below use
        backend: Backend
        hosts: list[Any]
        wedged: dict[int, tuple[int, int, str, float]]
        _issued: list[collections.deque[tuple[int, Any]]]
        _next: list[int]
        _lock: threading.Lock

        def _fail_wedged(self, call: Any, rank: int) -> None: ...

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
            if s > seq and call is not None and not call.settled() and not call._completed:
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
