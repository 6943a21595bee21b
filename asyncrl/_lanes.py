"""The worker's half of ordered calls: a :class:`Lane` per worker process admits them in number order.

The controller (:class:`asyncrl._call.Sequencer`) numbers the ordered calls of each process; its
host (:mod:`asyncrl._host`) runs them through the lane: :meth:`Lane.arrive`, wait for the
turn, run, :meth:`Lane.leave`. The lane refuses calls cancelled before they arrive, keeps
the outcomes of recent numbers for same-process consumers, and knows whether the call
holding it still runs in its thread (the wedge). :class:`ControlOrder` makes a call wait
for the control messages sent before it. An async host's calls wait on its event loop
(:class:`Lane`, :class:`LoopWaits`); a threaded host's calls wait in Ray's threads
(:class:`ThreadLane`, the same lane under one lock, and :class:`ThreadWaits`).

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
           "CONTROL_WAIT", "ThreadLane", "ThreadCall", "LoopCall", "ThreadWaits"]

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


# ---- the threaded host's lane: each call waits in its own Ray thread -------------------------
# The same states and cases as Lane, under one lock, with the wake-up primitives a waiting
# thread sleeps on (_Wake, ThreadCall, LoopCall) and the pinned thread's jobs (pinned-thread).


class _Wake:
    """A one-shot wake-up for one waiting thread: a lock released once (cheaper than a
    condition: one futex hand-off). ``done``/``set_result`` as an asyncio future's, so the
    lane's bookkeeping treats both kinds of waiter alike; called under the lane's lock."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def done(self) -> bool:
        return self._set

    def set_result(self, _: Any = None) -> bool:
        """Set it and wake the waiter; returns whether this was the first to set it."""
        if self._set:
            return False
        self._set = True
        self._lock.release()
        return True

    def claim(self) -> bool:
        """Mark it set without waking yet (the caller releases after leaving the lane's lock)."""
        if self._set:
            return False
        self._set = True
        return True

    def release(self) -> None:
        self._lock.release()

    def wait(self) -> None:
        self._lock.acquire()


class ThreadCall:
    """The outcome of one plain ``def`` method run in the lane's thread."""

    __slots__ = ("finished", "outcome")

    def __init__(self) -> None:
        self.finished = False
        self.outcome: tuple[bool, Any] = (False, None)

    def done(self) -> bool:
        return self.finished


class LoopCall:
    """A coroutine run on a threaded host's event loop for one call; the call's thread
    waits for its outcome. Cancelling it cancels the task; it finishes once the
    coroutine has unwound (or at once, if it had not started)."""

    __slots__ = ("loop", "task", "finished", "outcome", "cancel_requested", "wake", "_settle")

    def __init__(self, loop: asyncio.AbstractEventLoop, settle: Callable[["LoopCall"], None]) -> None:
        self.loop = loop
        self.task: asyncio.Task[Any] | None = None
        self.finished = False
        self.outcome: tuple[bool, Any] = (False, None)
        self.cancel_requested = False
        self.wake = _Wake()
        self._settle = settle

    def start(self, coro: Any) -> None:
        self.loop.call_soon_threadsafe(self._start, coro)

    def cancel(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:  # the loop is closed (the host is closing): nothing runs there any more
            pass

    def _start(self, coro: Any) -> None:
        if self.cancel_requested:
            coro.close()
            self._finish((False, CallCancelled("cancelled before it started")))
            return
        self.task = self.loop.create_task(coro)
        self.task.add_done_callback(self._done)

    def _cancel(self) -> None:  # on the loop, after _start (both go through the loop's FIFO queue)
        self.cancel_requested = True
        if self.task is not None:
            self.task.cancel()

    def _done(self, task: "asyncio.Task[Any]") -> None:
        if task.cancelled():
            self._finish((False, CallCancelled("cancelled")))
        elif task.exception() is not None:
            self._finish((False, task.exception()))
        else:
            self._finish((True, task.result()))

    def _finish(self, outcome: tuple[bool, Any]) -> None:
        self.outcome = outcome
        self._settle(self)


class ThreadLane(Lane):
    """:class:`Lane` for a threaded host: each call waits in its own (Ray) thread.

    The same states and cases as :class:`Lane`; every change happens under one lock.
    A waiting thread sleeps on a one-shot :class:`_Wake` of its own (its turn, its
    method's return, its cancellation, or a job for the pinned thread sets it). A call
    received on the pinned thread runs its plain ``def`` method there, with no hand-off
    (:meth:`run_pinned`); one that waited in another Ray thread hands it to the pinned
    thread as a job and back (:meth:`run_in_thread`, pinned-thread). A cancelled call stops waiting at once
    (cancelled-while-waiting), an ``async def`` method or an argument resolution on the host's loop is
    cancelled and waited for (cancelled-async-method), a plain ``def`` method keeps the lane until its
    thread returns (running-thread-keeps-lane and wedged-lane).
    """

    def __init__(self, pump: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._wakes: dict[int, _Wake] = {}  # call id -> the wake-up its thread sleeps on
        self.pump = pump
        """Submits a call of :meth:`serve_jobs` to the pinned thread (the host's own Ray
        handle, the ``ordered`` concurrency group): how a job finds the thread idle (pinned-thread)."""
        self._jobs: collections.deque[tuple[Callable[[], Any], Callable[[tuple[bool, Any]], None]]] = collections.deque()
        self._server: _Wake | None = None  # the wake-up of the pinned call waiting for its turn: it serves jobs
        self._pumping = False  # a serve_jobs call is on its way to the pinned thread, or running there
        self._unwedge_wakes: list[_Wake] = []
        self.jobs_run = {"waiter": 0, "pump": 0}  # who ran the jobs (for tests and profiles)
        self._fence: Ticket | None = None  # the stuck call of the last wedge, until the controller lifts it
        self._fence_upto: int | None = None  # numbers from here on are the controller's after the wedge

    # ---- the pinned thread (pinned-thread) -------------------------------------------------------

    def submit(self, fn: Callable[[], Any], deliver: Callable[[tuple[bool, Any]], None]) -> None:
        """Run `fn` on the pinned thread, then `deliver((ok, value or error))` there (the
        lane is the `thread` of :meth:`run_in_thread` for calls that waited in the
        ``calls`` group). The pinned call waiting for its turn runs it; when none waits,
        a :meth:`serve_jobs` call submitted to the pinned thread does (pinned-thread)."""
        with self._lock:
            self._jobs.append((fn, deliver))
            server = self._server
            wake = server is not None and server.claim()
            pump = server is None and not self._pumping
            if pump:
                self._pumping = True
        if wake:
            server.release()  # type: ignore[union-attr]
        if pump:
            try:
                assert self.pump is not None, "a ThreadLane that runs jobs needs its pump"
                self.pump()
            except BaseException as e:  # noqa: BLE001 - Ray is shutting down under us: fail the jobs, never strand them
                with self._lock:
                    jobs, self._jobs = list(self._jobs), collections.deque()
                    self._pumping = False
                for _, failed in jobs:
                    failed((False, CallCancelled(f"the host could not reach its pinned thread: {e!r}")))

    def serve_jobs(self) -> None:
        """On the pinned thread: run the waiting jobs until none is left (pinned-thread)."""
        while True:
            with self._lock:
                if not self._jobs:
                    self._pumping = False
                    return
                job = self._jobs.popleft()
                self.jobs_run["pump"] += 1
            _run_job(job)
            job = None  # type: ignore[assignment]  # hold nothing of it while waiting (see OrderedThread)

    def run_pinned(self, ticket: Ticket, run: Callable[[], Any]) -> Any:
        """Run a plain ``def`` method here, on the pinned thread that received the call
        (no hand-off). A deadline's cancel meanwhile wedges the lane until it returns
        (wedged-lane); a cancelled call's result is dropped."""
        call = ThreadCall()
        with self._lock:
            self._thread_starts(ticket, call)
        outcome = outcome_of(run)
        with self._lock:
            call.finished = True
            self._clear_wedge(ticket)
            cancelled = ticket.cancelled
        if cancelled:
            raise CallCancelled(f"call {ticket.call_id} was cancelled while its thread ran")
        return _unwrap(outcome)

    def wait_unwedged(self, call_id: int) -> bool:
        """Block until call `call_id` no longer wedges the lane (its thread returned);
        returns whether it did wedge it when asked (pinned-thread: the controller's signal)."""
        with self._lock:
            stuck = self._wedged_by
            if stuck is None or stuck.call_id != call_id:
                return False
            wake = _Wake()
            self._unwedge_wakes.append(wake)
        wake.wait()
        return True

    def pinned_state(self) -> dict[str, Any]:
        """For tests: whether a pinned call waits for its turn (and so serves jobs), and who ran the jobs so far."""
        with self._lock:
            return {"serving": self._server is not None, "next": self._next, **self.jobs_run}

    def unfence(self, call_id: int, upto: int) -> None:
        """The controller saw call `call_id`'s wedge end and failed every ordered call it
        numbered below `upto` meanwhile: admit numbers from `upto` on (pinned-thread)."""
        with self._lock:
            if self._fence is not None and self._fence.call_id == call_id:
                self._fence_upto = upto

    def _fenced(self, seq: int) -> Ticket | None:
        """The stuck call an ordered call numbered `seq` fails behind: the lane is wedged,
        or was and the controller has not yet said which numbers are its own (pinned-thread)."""
        if self._wedged_by is not None:
            return self._wedged_by
        fence, upto = self._fence, self._fence_upto
        if fence is None:
            return None
        if upto is not None and self._next >= upto:
            self._fence = self._fence_upto = None
            return None
        return fence if upto is None or seq < upto else None

    def _wedge(self, ticket: Ticket) -> None:
        if self._wedged_by is None:
            self._fence, self._fence_upto = ticket, None
        super()._wedge(ticket)

    def _unwedged(self) -> None:  # under the lane's lock
        wakes, self._unwedge_wakes = self._unwedge_wakes, []
        for w in wakes:
            w.set_result(None)

    def arrive(self, call_id: int, seq: int | None, group: str, method: str, rank: int) -> Ticket:
        """Register an arriving call; raises :class:`CallCancelled` for one cancelled before it arrived."""
        with self._lock:
            return self._admit(call_id, seq, group, method, rank, None, CallCancelled)

    def wait_turn(self, ticket: Ticket, serve: bool = False) -> None:
        """Block until `ticket` is the next ordered call; fail fast while the lane is wedged.
        `serve`: this is the pinned thread; run the jobs submitted meanwhile (pinned-thread)."""
        seq = ticket.seq
        assert seq is not None
        while True:
            job = None
            with self._lock:
                if serve and self._jobs:  # first: a job is the lane holder's, which this call waits for
                    job = self._jobs.popleft()
                    self.jobs_run["waiter"] += 1
                else:
                    if ticket.cancelled:
                        raise CallCancelled(f"call {ticket.call_id} was cancelled while waiting for its turn")
                    stuck = self._fenced(seq)
                    if stuck is not None:
                        raise LaneWedgedError(ticket.group, ticket.method, ticket.rank, stuck.describe(),
                                              time.monotonic() - stuck.thread_started)
                    if self._next == seq:
                        return
                    wake = _Wake()
                    self._waiters[seq] = wake  # type: ignore[assignment]  # _release and _wedge set it
                    self._wakes[ticket.call_id] = wake  # _abort sets it
                    if serve:
                        self._server = wake  # submit sets it
            if job is not None:
                _run_job(job)
                continue
            wake.wait()
            with self._lock:
                if self._waiters.get(seq) is wake:
                    del self._waiters[seq]
                self._wakes.pop(ticket.call_id, None)
                if self._server is wake:
                    self._server = None

    def run_in_thread(self, ticket: Ticket, run: Callable[[], Any], thread: Any) -> Any:
        """Run a plain ``def`` method in the lane's thread (`thread.submit(fn, deliver)`).
        Cancelled, the call fails at once but keeps the lane until the thread returns (running-thread-keeps-lane);
        cancelled before the thread took it, the method never starts (the lane is released
        when the thread reaches it)."""
        call = ThreadCall()
        wake = _Wake()
        with self._lock:
            self._thread_starts(ticket, call)
            self._wakes[ticket.call_id] = wake
        def started() -> Any:
            with self._lock:
                cancelled = ticket.cancelled
            if cancelled:  # cancelled while its job waited for the thread: the method never starts
                raise CallCancelled(f"call {ticket.call_id} was cancelled before its method started")
            return run()

        thread.submit(started, lambda outcome: self._thread_returned(ticket, call, outcome, wake))
        wake.wait()
        with self._lock:
            self._wakes.pop(ticket.call_id, None)
            if not call.finished:  # woken by the cancellation
                self._threads[ticket.call_id] = ticket  # _thread_returned releases the lane
                raise CallCancelled(f"call {ticket.call_id} was cancelled while its thread runs")
        return _unwrap(call.outcome)

    def run_on_loop(self, ticket: Ticket, coro: Any, loop: asyncio.AbstractEventLoop) -> Any:
        """Run `coro` on the host's event loop for `ticket`; block until it is over."""
        return self.wait_loop(self.start_on_loop(ticket, coro, loop))

    def start_on_loop(self, ticket: Ticket, coro: Any, loop: asyncio.AbstractEventLoop) -> LoopCall:
        """Start `coro` on the host's loop for `ticket` (cancelled with it); see :meth:`wait_loop`."""
        call = LoopCall(loop, self._loop_settled)
        with self._lock:
            if ticket.cancelled:
                coro.close()
                raise CallCancelled(f"call {ticket.call_id} was cancelled")
            if ticket.loop_calls is None:
                ticket.loop_calls = []
            ticket.loop_calls.append(call)
            call.start(coro)
        return call

    def outcome(self, seq: int, call_id: int) -> Any:
        with self._lock:
            return super().outcome(seq, call_id)

    def wait_loop(self, call: LoopCall) -> Any:
        """Block until `call` is over (a cancelled one unwinds first); its value or error."""
        call.wake.wait()
        return _unwrap(call.outcome)

    def leave(self, ticket: Ticket) -> None:
        with self._lock:
            super().leave(ticket)

    def cancel(self, entries: Iterable[tuple[int, int | None]], deadline: bool) -> "Wedge | None":
        with self._lock:
            return super().cancel(entries, deadline)

    def cancel_all(self) -> None:
        with self._lock:
            super().cancel_all()
            self._unwedged()  # the host is closing: nobody waits for the wedge to end

    # ---- internals (under the lane's lock) ---------------------------------------------------

    @staticmethod
    def _thread_starts(ticket: Ticket, call: ThreadCall) -> None:
        """`ticket`'s plain ``def`` method is about to run (:meth:`run_pinned`,
        :meth:`run_in_thread`); a call cancelled by now never starts it."""
        if ticket.cancelled:
            raise CallCancelled(f"call {ticket.call_id} was cancelled")
        ticket.thread = call
        ticket.thread_started = time.monotonic()

    def _abort(self, ticket: Ticket) -> None:
        for call in ticket.loop_calls or ():
            if not call.finished:
                call.cancel()
        wake = self._wakes.get(ticket.call_id)
        if wake is not None:
            wake.set_result(None)

    def _thread_returned(self, ticket: Ticket, call: ThreadCall, outcome: tuple[bool, Any], wake: _Wake) -> None:
        with self._lock:
            call.outcome = outcome
            call.finished = True
            if ticket.call_id in self._threads:
                self._thread_ended(ticket)
            first = wake.claim()
        if first:  # woken after the lane's lock is free: the waiter does not block on it again
            wake.release()

    def _loop_settled(self, call: LoopCall) -> None:
        with self._lock:
            call.finished = True
            first = call.wake.claim()
        if first:
            call.wake.release()


def _run_job(job: tuple[Callable[[], Any], Callable[[tuple[bool, Any]], None]]) -> None:
    fn, deliver = job
    deliver(outcome_of(fn))


def _unwrap(outcome: tuple[bool, Any]) -> Any:
    ok, value = outcome
    if ok:
        return value
    if isinstance(value, asyncio.CancelledError):
        raise CallCancelled(str(value) or "cancelled") from None
    raise value


class ThreadWaits:
    """The threaded host's way of waiting in the one call template (``asyncrl._host._run_call``):
    each wait blocks the call's Ray thread through this lane (``async def`` only to share
    the template; none of them suspends)."""

    cancelled: type[BaseException] = CallCancelled

    def __init__(self, lane: ThreadLane, loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self._lane = lane
        self._loop = loop  # the host's own event loop, started at its first use

    async def control(self, after: int) -> None:
        self._lane.control.wait(after, CONTROL_WAIT)

    def start(self, ticket: Ticket, coro: Any) -> LoopCall:
        return self._lane.start_on_loop(ticket, coro, self._loop())

    async def turn(self, ticket: Ticket, pinned: bool) -> None:
        self._lane.wait_turn(ticket, serve=pinned)

    async def resolved(self, resolving: LoopCall) -> Any:
        return self._lane.wait_loop(resolving)

    async def run_async(self, ticket: Ticket, coro: Any) -> Any:
        return self._lane.run_on_loop(ticket, coro, self._loop())

    async def run_def(self, ticket: Ticket, run: Callable[[], Any], pinned: bool) -> Any:
        if pinned:
            return self._lane.run_pinned(ticket, run)
        return self._lane.run_in_thread(ticket, run, self._lane)

    @staticmethod
    def stop(resolving: LoopCall) -> None:
        if not resolving.finished:
            resolving.cancel()
