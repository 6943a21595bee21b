"""Whether a group call is done, without fetching it, and its deadline: :class:`Completion`.

A mixin of the call's state (:class:`asyncrl._call._Call`, which declares the slots):
``GroupFuture.done()``, ``add_done_callback`` and ``done_time`` watch the ranks through the
backend (Ray: a completion callback per rank on Ray's own thread, no polling, nothing
fetched); a call's deadline is checked against that completion (see :mod:`asyncrl._call`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable

from asyncrl.errors import CallTimeoutError

__all__ = ["Completion"]

_BACKGROUND: set[asyncio.Task[Any]] = set()  # deadline checks in flight (a task needs a strong reference)


class Completion:
    """Completion and deadline of a call (the state below is set by the class that mixes
    it in, `_Call`, which also has the rest used here and ``settled()`` / ``fail()``)."""

    __slots__ = ("done_at", "_completed", "_watching", "_done_callbacks", "_loop", "_timer")

    if TYPE_CHECKING:  # the call's slots and methods that the ones below use
        backend: Any
        refs: list[Any]
        method: str
        timeout: float | None
        deadline: float | None
        done_at: float | None
        _completed: bool
        _watching: bool
        _done_callbacks: tuple[asyncio.AbstractEventLoop, list[Callable[[], None]]] | None
        _loop: asyncio.AbstractEventLoop | None
        _timer: asyncio.TimerHandle | None

        @property
        def group(self) -> str: ...

        def settled(self) -> bool: ...

        def fail(self, error: BaseException, *, cancel_remote: bool, deadline: bool = False) -> bool: ...

    def is_done(self) -> bool:
        """Non-blocking: every rank finished, or the controller failed the call. The
        first call starts watching completion in the background (Ray: a completion
        callback per rank on Ray's own thread, no polling)."""
        if self._completed or self.settled():
            return True
        self._watch()
        return self._completed

    def _watch(self) -> None:
        if not self._watching:
            self._watching = True
            self.backend.watch(self.refs, self._mark_completed)

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call `fn()` on the running loop once `is_done()` turns true (see GroupFuture)."""
        loop = asyncio.get_running_loop()
        if self._done_callbacks is None:
            self._done_callbacks = (loop, [])
        self._done_callbacks[1].append(fn)
        if self._completed or self.settled():
            loop.call_soon(self._run_done_callbacks)
            return
        self._watch()
        if self._completed:  # the backend thread finished it between the two checks
            loop.call_soon(self._run_done_callbacks)

    def _run_done_callbacks(self) -> None:  # on the loop only: each callback runs once
        pending, self._done_callbacks = self._done_callbacks, None
        if pending is None:
            return
        loop, callbacks = pending
        for fn in callbacks:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - reported like asyncio's own callbacks
                loop.call_exception_handler({"message": f"done callback of {self.group}.{self.method} "
                                                   "raised", "exception": e})

    def _done_soon(self) -> None:
        """Schedule the done callbacks on the loop, from any thread."""
        pending = self._done_callbacks
        if pending is not None and not pending[0].is_closed():
            pending[0].call_soon_threadsafe(self._run_done_callbacks)

    def _mark_done_at(self) -> None:
        if self.done_at is None:
            self.done_at = time.perf_counter()

    def _mark_completed(self) -> None:  # may run on a backend thread
        self._mark_done_at()  # before `_completed`: whoever sees that also sees the time
        self._completed = True
        if self._done_callbacks is not None:
            self._done_soon()

    def _timeout_error(self, waited: float | None = None) -> CallTimeoutError:
        t = self.timeout if waited is None else waited
        return CallTimeoutError(
            f"{self.group}.{self.method} did not finish within its timeout of {t:g}s; the remote work was "
            "cancelled (a plain def method cannot be interrupted: while it runs, later ordered calls on its "
            "worker fail with LaneWedgedError)"
        )

    # ---- the deadline -----------------------------------------------------------------------

    def _on_deadline(self) -> None:
        self._timer = None
        if self._completed or self.settled():
            return
        task = asyncio.ensure_future(self._check_deadline())
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    async def _check_deadline(self) -> None:
        if not self._completed:
            try:
                done = await self.backend.all_done(self.refs)
            except Exception:  # the backend is gone (Ray shut down): let the fetch report it
                done = True
            if done:
                self._mark_done_at()
                self._completed = True
        if not self._completed:
            self.fail(self._timeout_error(), cancel_remote=True, deadline=True)

    def _arm_deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        """A call issued without a running loop gets its deadline timer on first await."""
        if self.deadline is None or self._timer is not None or self._loop is not None:
            return
        self._loop = loop
        self._timer = loop.call_later(max(0.0, self.deadline - time.monotonic()), self._on_deadline)
