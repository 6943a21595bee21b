"""The worker's half of ordered calls: a :class:`Lane` per worker process admits them in number order.

The controller (:class:`asyncrl._call.Sequencer`) numbers the ordered calls of each process; its
host (:mod:`asyncrl._host`) runs them through the lane: :meth:`Lane.arrive`, wait for the
turn, run, :meth:`Lane.leave`. The lane refuses calls cancelled before they arrive, keeps
the outcomes of recent numbers for same-process consumers, and knows whether the call
holding it still runs in its thread (the wedge). :class:`ControlOrder` makes a call wait
for the control messages sent before it. An async host waits on its event loop (this
module); a threaded host's calls wait in Ray's threads (:mod:`asyncrl._thread_lane`).

The failure cases are named invariants in ``docs/protocol.md`` (``wedged-lane``,
``same-process-window``, ...), each with the test that pins it; the code cites them by name.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import structlog

from asyncrl.errors import LaneWedgedError

if TYPE_CHECKING:
    from asyncrl._backend import Wedge

__all__ = ["Lane", "ControlOrder", "Ticket", "CallCancelled", "NEVER_RAN", "OrderedThread", "outcome_of", "LoopWaits",
           "CONTROL_WAIT"]

log = structlog.get_logger("asyncrl")

_REFUSED_MEMORY = 100_000


@dataclass(eq=False)
class Ticket:
    """One arrived call on a host, ordered (`seq` set) or concurrent."""

    call_id: int
    seq: int | None
    group: str
    method: str
    rank: int
    task: "asyncio.Task[Any] | None" = None
    thread: Any = None
    """The outcome of a plain ``def`` method while it runs in the lane's thread (an
    asyncio future, or a :class:`ThreadCall`): ``done()`` tells whether it returned."""
    thread_started: float = 0.0
    cancelled: bool = False
    loop_calls: "list[Any] | None" = None
    """A threaded host's work on its event loop for this call (argument resolution, an
    ``async def`` method): cancelled with the call."""
    outcome: Any = None
    """What the lane keeps of an ordered call when it leaves (same-process-window): ``(True, result,
    (rows, pad))`` or ``(False, error)``; None: nothing to keep."""

    def describe(self) -> str:
        return f"{self.group}.{self.method} (call {self.call_id}, ordered #{self.seq})"


class ControlOrder:
    """The worker half of control-before-call: a call runs only after every control message (a
    cancel message, an ``unfence``) its controller sent to this process before it.

    The controller numbers its control messages to each process 1, 2, 3, ... and stamps
    every call with how many it had sent (`after`). Ray runs the two kinds in different
    places (a threaded host's ``control`` thread and its call threads; an async host's
    tasks), so without this a call submitted after a cancel message could run before it
    and make the cancelled call run (seen: ``unblock()`` sent after ``cancel()`` released
    the thread that then ran the cancelled call). Thread-safe; :meth:`wait` for a thread,
    :meth:`wait_async` on an event loop. A message never seen (its process gone, which
    ends the calls too) stops the wait after `timeout` with a warning, never a hang.
    """

    __slots__ = ("_cond", "seen", "_early", "_waiters", "waiting")

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.seen = 0
        """Every control message numbered up to here has been handled."""
        self._early: set[int] = set()  # handled above `seen` (out of order)
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.waiting = 0
        """How many calls wait for a message now (for tests)."""

    def done(self, n: int) -> None:
        """Control message `n` was handled (0: an unnumbered one, nothing to do)."""
        if n <= 0:
            return
        with self._cond:
            if n <= self.seen:
                return
            self._early.add(n)
            while self.seen + 1 in self._early:
                self._early.discard(self.seen + 1)
                self.seen += 1
            self._cond.notify_all()
            ready = [w for w in self._waiters if w[0] <= self.seen]
            if ready:
                self._waiters = [w for w in self._waiters if w[0] > self.seen]
        for _, loop, fut in ready:
            try:
                loop.call_soon_threadsafe(_resolve_waiter, fut)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass

    def wait(self, after: int, timeout: float) -> None:
        """In a thread: return once every message up to `after` was handled."""
        if after <= self.seen:
            return
        with self._cond:
            self.waiting += 1
            try:
                ok = self._cond.wait_for(lambda: self.seen >= after, timeout)
            finally:
                self.waiting -= 1
        if not ok:
            log.warning("control.unseen", after=after, seen=self.seen, waited_s=timeout)

    async def wait_async(self, after: int, timeout: float) -> None:
        """On an event loop: as :meth:`wait`."""
        if after <= self.seen:
            return
        fut = asyncio.get_running_loop().create_future()
        with self._cond:
            if self.seen >= after:
                return
            self._waiters.append((after, asyncio.get_running_loop(), fut))
            self.waiting += 1
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            log.warning("control.unseen", after=after, seen=self.seen, waited_s=timeout)
        finally:
            with self._cond:
                self.waiting -= 1
                self._waiters = [w for w in self._waiters if w[2] is not fut]


def _resolve_waiter(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


class Lane:
    """The worker half: admits ordered calls one at a time, in number order.

    Used by :class:`~asyncrl._host.WorkerHost` on the worker's event loop thread.
    """

    def __init__(self) -> None:
        self._next = 0
        self._released: set[int] = set()  # numbers above _next already released
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._refused: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._live: dict[int, Ticket] = {}  # call id -> arrived, not yet left
        self._threads: dict[int, Ticket] = {}  # call id -> left, but its thread still runs
        self._wedged_by: Ticket | None = None
        self.keep_results = 0  # set by the host when its workers are built (same-process-window)
        self._kept: dict[int, tuple[int, Any]] = {}  # number -> (call id, outcome), within the window
        self.control = ControlOrder()
        """The control messages handled so far; a call waits for those sent before it (control-before-call)."""

    # ---- state, for tests and error messages --------------------------------------------

    @property
    def next_number(self) -> int:
        """The number whose turn it is."""
        return self._next

    @property
    def wedged_by(self) -> Ticket | None:
        """The call whose thread outlived its deadline and still holds the lane, if any."""
        return self._wedged_by

    def outcome(self, seq: int, call_id: int) -> Any:
        """The kept outcome of ordered call `call_id` (number `seq`), or None when this
        lane does not hold it. Read by the call whose turn it is (same-process-window)."""
        got = self._kept.get(seq)
        if got is None or got[0] != call_id:
            return None
        return got[1]

    # ---- the protocol -------------------------------------------------------------------

    def arrive(self, call_id: int, seq: int | None, group: str, method: str, rank: int) -> Ticket:
        """Register an arriving call; raises ``CancelledError`` for one cancelled before it arrived."""
        return self._admit(call_id, seq, group, method, rank, asyncio.current_task(), asyncio.CancelledError)

    def _admit(self, call_id: int, seq: int | None, group: str, method: str, rank: int,
               task: "asyncio.Task[Any] | None", cancelled: type[BaseException]) -> Ticket:
        refused = call_id in self._refused
        if refused:
            del self._refused[call_id]
        if refused or (seq is not None and (seq < self._next or seq in self._released)):
            raise cancelled(f"call {call_id} was cancelled before it arrived")
        ticket = Ticket(call_id, seq, group, method, rank, task=task)
        self._live[call_id] = ticket
        return ticket

    async def turn(self, ticket: Ticket) -> None:
        """Wait until `ticket` is the next ordered call; fail fast while the lane is wedged."""
        seq = ticket.seq
        assert seq is not None
        if self._wedged_by is None and seq == self._next:
            return
        if self._wedged_by is None:
            fut = asyncio.get_running_loop().create_future()
            self._waiters[seq] = fut
            try:
                await fut
            finally:
                self._waiters.pop(seq, None)
        if self._wedged_by is not None:
            stuck = self._wedged_by
            raise LaneWedgedError(ticket.group, ticket.method, ticket.rank, stuck.describe(),
                                  time.monotonic() - stuck.thread_started)

    async def run_thread(self, ticket: Ticket, run: Callable[[], Any], thread: Any) -> Any:
        """Run a plain ``def`` method in the lane's thread (`thread.run(fn)` returns an
        asyncio future of its outcome). Cancelled, the call fails at once but keeps the
        lane until the thread returns (running-thread-keeps-lane)."""
        fut = thread.run(run)
        ticket.thread = fut
        ticket.thread_started = time.monotonic()
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                self._threads[ticket.call_id] = ticket
                fut.add_done_callback(lambda _: self._thread_ended(ticket))
            raise

    def leave(self, ticket: Ticket) -> None:
        """The call is over on the event loop; release its number unless its thread still runs."""
        self._live.pop(ticket.call_id, None)
        if ticket.seq is None:
            return
        if ticket.outcome is not None:
            self._kept[ticket.seq] = (ticket.call_id, ticket.outcome)
        if ticket.thread is not None and not ticket.thread.done():
            return  # _thread_ended releases it
        self._release(ticket.seq)

    def cancel(self, entries: Iterable[tuple[int, int | None]], deadline: bool) -> "Wedge | None":
        """Cancel calls by id (idempotent). A call not arrived yet is refused when it
        does and its number is released now; a running one is cancelled; with
        `deadline`, one still running in its thread wedges the lane (wedged-lane). Returns the
        lane's wedge after a deadline's cancel (pinned-thread: the controller's half), else None."""
        self._cancel(entries, deadline)
        return self.wedge() if deadline else None

    def wedge(self) -> "Wedge | None":
        """``(call id, number, description, seconds running)`` of the call wedging the lane, or None."""
        stuck = self._wedged_by
        if stuck is None or stuck.seq is None:  # (only an ordered call wedges a lane)
            return None
        return (stuck.call_id, stuck.seq, stuck.describe(), time.monotonic() - stuck.thread_started)

    def _cancel(self, entries: Iterable[tuple[int, int | None]], deadline: bool) -> None:
        for call_id, seq in entries:
            ticket = self._live.get(call_id) or self._threads.get(call_id)
            if ticket is None:
                self._refused[call_id] = None
                while len(self._refused) > _REFUSED_MEMORY:
                    self._refused.popitem(last=False)
                if seq is not None:
                    if self.keep_results and seq >= self._next and seq not in self._released:
                        self._kept[seq] = (call_id, NEVER_RAN)  # its consumers fail as the nested path's do
                    self._release(seq)
                continue
            ticket.cancelled = True
            self._abort(ticket)
            if deadline and ticket.seq is not None and ticket.thread is not None and not ticket.thread.done():
                self._wedge(ticket)

    def cancel_all(self) -> None:
        """Cancel every arrived call (the host is closing)."""
        for ticket in list(self._live.values()):
            ticket.cancelled = True
            self._abort(ticket)

    # ---- internals ------------------------------------------------------------------------

    def _abort(self, ticket: Ticket) -> None:
        """Stop a cancelled call's waiting (an async host: cancel its task)."""
        if ticket.task is not None and not ticket.task.done():
            ticket.task.cancel()

    def _release(self, seq: int) -> None:
        if seq < self._next:
            return
        self._released.add(seq)
        while self._next in self._released:
            self._released.remove(self._next)
            self._next += 1
        if self._kept:
            oldest = self._next - self.keep_results  # the window of same-process-window
            for s in [s for s in self._kept if s < oldest]:
                del self._kept[s]
        waiter = self._waiters.get(self._next)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _clear_wedge(self, ticket: Ticket) -> None:
        if self._wedged_by is ticket:
            self._wedged_by = None
            self._unwedged()

    def _unwedged(self) -> None:
        """The wedge is over (a threaded host wakes its :meth:`ThreadLane.wait_unwedged` callers)."""

    def _wedge(self, ticket: Ticket) -> None:
        if self._wedged_by is not None:
            return
        self._wedged_by = ticket
        for fut in list(self._waiters.values()):  # every ordered call waiting behind it fails now
            if not fut.done():
                fut.set_result(None)

    def _thread_ended(self, ticket: Ticket) -> None:
        self._threads.pop(ticket.call_id, None)
        self._clear_wedge(ticket)
        if ticket.seq is not None and ticket.call_id not in self._live:
            self._release(ticket.seq)


class CallCancelled(Exception):
    """Internal: a threaded host's call was cancelled (an ``Exception``, not asyncio's
    ``CancelledError``, so that Ray reports it as the call's error; the controller
    reads it as a cancellation)."""


NEVER_RAN: tuple[bool, Any] = (False, CallCancelled("cancelled before it ran"))
"""The kept outcome of an ordered call that never ran (same-process-window)."""


def outcome_of(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, fn())``, or ``(False, error)`` if it raised: a thread's outcome, handed to the call that waits for it."""
    try:
        return True, fn()
    except BaseException as e:  # noqa: BLE001 - handed to the waiting call
        return False, e


# ---- the async host's thread for plain def methods -----------------------------------------


class OrderedThread:
    """The async host's one thread for plain ``def`` methods: a queue and a loop (no executor
    machinery); each outcome is handed back by a `deliver` callback run on the thread."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any], deliver: Callable[[tuple[bool, Any]], None]) -> None:
        """Run `fn` on the thread, then `deliver((True, value))` or `deliver((False, error))` there."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._main, name="asyncrl-ordered_0", daemon=True)
                    self._thread.start()
        self._q.put((fn, deliver))

    def run(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run `fn` on the thread; the returned future (of the running loop) gets its outcome."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self.submit(fn, functools.partial(_deliver_to_loop, loop, fut))
        return fut

    def _main(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, deliver = item
            item = None
            outcome = outcome_of(fn)
            fn = None
            deliver(outcome)
            # Hold nothing of this call while waiting for the next one: its arguments
            # (a shard that aliases the object store, with zero-copy tensors) and its
            # result would otherwise stay alive until another call reaches this thread.
            deliver = outcome = None  # type: ignore[assignment]

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(None)


def _deliver_to_loop(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    try:
        loop.call_soon_threadsafe(_settle, fut, outcome)
    except RuntimeError:  # that loop is closed
        pass


def _settle(fut: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if fut.done():
        return
    ok, value = outcome
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


CONTROL_WAIT = 60.0
"""Seconds a call waits at most for a control message sent before it (control-before-call of
docs/protocol.md); the control thread handles each one in microseconds, so
only a process that is going away reaches it (then the call goes on, with a warning)."""


class LoopWaits:
    """The async host's way of waiting in the one call template (``asyncrl._host._run_call``):
    each wait awaits on the process's event loop, through this lane."""

    cancelled: type[BaseException] = asyncio.CancelledError

    def __init__(self, lane: Lane, thread: "OrderedThread") -> None:
        self._lane = lane
        self._thread = thread

    async def control(self, after: int) -> None:
        await self._lane.control.wait_async(after, CONTROL_WAIT)

    def start(self, ticket: Ticket, coro: Any) -> "asyncio.Future[Any]":
        return asyncio.ensure_future(coro)

    async def turn(self, ticket: Ticket, pinned: bool) -> None:
        await self._lane.turn(ticket)

    async def resolved(self, resolving: "asyncio.Future[Any]") -> Any:
        return await resolving

    async def run_async(self, ticket: Ticket, coro: Any) -> Any:
        return await coro

    async def run_def(self, ticket: Ticket, run: Callable[[], Any], pinned: bool) -> Any:
        return await self._lane.run_thread(ticket, run, self._thread)

    @staticmethod
    def stop(resolving: "asyncio.Future[Any]") -> None:
        if not resolving.done():
            resolving.cancel()
