"""The worker's half of ordered calls: one :class:`Lane` per worker process.

The controller (:class:`asyncrl._call.Sequencer`) numbers the ordered calls of each process;
its host (:mod:`asyncrl._host`) runs each call through the lane: :meth:`Lane.arrive`, its
turn, run, :meth:`Lane.leave`. Who keeps the order depends on the host: the async host's
calls wait for their number here (:meth:`Lane.turn`: an async Ray actor starts calls in any
order); the threaded host's ordered calls all come through Ray's one-thread group, which
runs them in the order they were sent (one-thread-group-order), so they never wait here.
Either way the lane refuses calls cancelled before they arrive, keeps the outcomes of recent
numbers for same-process consumers, and knows whether a call's plain ``def`` method still
runs (the host's reply to a deadline's cancel: wedged-lane; the wedge itself is the
controller's). :class:`ControlOrder` makes a call wait for the control messages sent before
it.

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

from asyncrl._wire import CallCancelled

if TYPE_CHECKING:
    from asyncrl._backend import Wedge

__all__ = ["Lane", "ControlOrder", "Ticket", "NEVER_RAN", "OrderedThread", "outcome_of", "CONTROL_WAIT", "shallow"]

log = structlog.get_logger("asyncrl")

_REFUSED_MEMORY = 100_000

CONTROL_WAIT = 60.0
"""Seconds a call waits at most for a control message sent before it (control-before-call of
docs/protocol.md); the control thread handles each one in microseconds, so
only a process that is going away reaches it (then the call goes on, with a warning)."""


@dataclass(eq=False)
class Ticket:
    """One arrived call on a host, ordered (`seq` set) or concurrent."""

    call_id: int
    seq: int | None
    group: str
    method: str
    rank: int
    abort: "Callable[[], Any] | None" = None
    """Stops what the call waits for when it is cancelled (the async host: its task; the
    threaded host: its work on the host's event loop); None while it waits for nothing."""
    running_since: float | None = None
    """``time.monotonic()`` when its plain ``def`` method started, while it runs."""
    cancelled: bool = False
    outcome: Any = None
    """What the lane keeps of an ordered call when it leaves (same-process-window): ``(True, result,
    (rows, pad))`` or ``(False, error)``; None: nothing to keep."""

    def describe(self) -> str:
        return f"{self.group}.{self.method} (call {self.call_id}, ordered #{self.seq})"


def outcome_of(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, fn())``, or ``(False, error)`` if it raised."""
    try:
        return True, fn()
    except BaseException as e:  # noqa: BLE001 - handed to the waiting call
        return False, e


NEVER_RAN: tuple[bool, Any] = (False, CallCancelled("cancelled before it ran"))
"""The kept outcome of an ordered call that never ran (same-process-window)."""


def shallow(value: Any) -> Any:
    """A container of its own over `value`'s values, what the lane keeps of a result and
    what each same-process consumer gets: a TensorDict, dict or list is copied one level
    (nested TensorDicts too: their own keys); tensors are shared, and so are text columns
    (tensordict's non-tensor data and stacks): like tensors, inputs are read-only."""
    from tensordict import TensorDictBase

    if isinstance(value, TensorDictBase):
        return _shallow_td(value)
    if type(value) is dict:
        return dict(value)
    if type(value) is list:
        return list(value)
    return value


def _shallow_td(td: Any) -> Any:
    """`shallow` of a TensorDict. ``td.copy()`` (tensordict's one-level clone) also clones every cell of a text
    column, a container per row: 0.86 ms for 32 rows and three text columns against 36 us here, paid by every
    ordered call that returns such a batch (the lane keeps a copy) and by each same-process consumer."""
    from tensordict import TensorDict, TensorDictBase, is_non_tensor

    if type(td) is not TensorDict:  # a lazy stack of rows, a tensorclass: tensordict's own copy
        return td if is_non_tensor(td) else td.copy()
    src = {k: (_shallow_td(v) if isinstance(v, TensorDictBase) else v) for k, v in td.items()}
    names = td.names
    return TensorDict(src, batch_size=td.batch_size, device=td.device,
                      names=None if all(n is None for n in names) else names)


class ControlOrder:
    """The worker half of control-before-call: a call runs only after every control message
    its controller sent (or reserved) to this process before it.

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
    """The ordered calls of one worker process: refusals, turns, kept outcomes.

    Thread-safe (one lock): the threaded host's calls arrive in Ray's threads while its
    cancel messages are handled in another; the async host's all run on its loop.
    `ray_ordered`: Ray itself runs this lane's calls in number order (the threaded host's
    one-thread group: one-thread-group-order), so a number that has not arrived when a later
    one does never will (cancelled before it was sent, or failed by Ray before its host ran
    it), and calls never wait for their turn here.
    """

    def __init__(self, ray_ordered: bool = False) -> None:
        self.ray_ordered = ray_ordered
        self.cancelled: type[BaseException] = CallCancelled if ray_ordered else asyncio.CancelledError
        """What a refused call raises: the threaded host's calls report
        :class:`~asyncrl._wire.CallCancelled`, the async host's are cancelled tasks."""
        self._lock = threading.Lock()
        self._next = 0
        self._released: set[int] = set()  # numbers above _next already released
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._refused: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._live: dict[int, Ticket] = {}  # call id -> arrived, not yet left
        self.keep_results = 0  # set by the host when its workers are built (same-process-window)
        self._kept: dict[int, tuple[int | None, Any]] = {}  # number -> (call id, outcome), within the window
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
        with self._lock:
            got = self._kept.get(seq)
        if got is None or got[0] not in (call_id, None):  # (None: a number that never arrived)
            return None
        return got[1]

    # ---- the protocol -------------------------------------------------------------------

    def arrive(self, call_id: int, seq: int | None, group: str, method: str, rank: int,
               abort: "Callable[[], Any] | None" = None) -> Ticket:
        """Register an arriving call; raises :attr:`cancelled` for one cancelled before it
        arrived (cancelled-before-arrival). `abort`: stops it if it is cancelled later."""
        with self._lock:
            refused = call_id in self._refused
            if refused:
                del self._refused[call_id]
            if refused or (seq is not None and (seq < self._next or seq in self._released)):
                raise self.cancelled(f"call {call_id} was cancelled before it arrived")
            if seq is not None and self.ray_ordered and seq > self._next:
                self._skip_to(seq)
            ticket = Ticket(call_id, seq, group, method, rank, abort=abort)
            self._live[call_id] = ticket
            return ticket

    async def turn(self, ticket: Ticket) -> None:
        """The async host: wait until `ticket` is the next ordered call."""
        seq = ticket.seq
        assert seq is not None
        with self._lock:
            if seq == self._next:
                return
            fut = asyncio.get_running_loop().create_future()
            self._waiters[seq] = fut
        try:
            await fut
        finally:
            with self._lock:
                self._waiters.pop(seq, None)

    async def run_thread(self, ticket: Ticket, run: Callable[[], Any], thread: "OrderedThread") -> Any:
        """The async host: run a plain ``def`` method in its thread. Cancelled, the call
        fails at once on the controller, but here it ends only when the thread returns, so
        it keeps the lane until then (running-thread-keeps-lane) and its result is dropped."""
        fut = thread.run(run)
        with self._lock:
            ticket.running_since = time.monotonic()
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.shield(fut)
                except BaseException:  # noqa: BLE001 - cancelled again, or the method's own error: dropped
                    pass
            raise
        finally:
            with self._lock:
                ticket.running_since = None

    def run_here(self, ticket: Ticket, run: Callable[[], Any]) -> Any:
        """The threaded host: run a plain ``def`` method on this thread (the pinned one).
        Cancelled meanwhile, its result is dropped (running-thread-keeps-lane)."""
        with self._lock:
            if ticket.cancelled:
                raise CallCancelled(f"call {ticket.call_id} was cancelled")
            ticket.running_since = time.monotonic()
        try:
            result = run()
        finally:
            with self._lock:
                ticket.running_since = None
                cancelled = ticket.cancelled
        if cancelled:
            raise CallCancelled(f"call {ticket.call_id} was cancelled while its method ran")
        return result

    def abort_with(self, ticket: Ticket, abort: "Callable[[], Any] | None", coro: Any = None) -> None:
        """From now on `abort` stops what `ticket`'s call waits for (None: it waits for
        nothing). A call cancelled already raises instead (its coroutine `coro` is closed)."""
        with self._lock:
            if abort is not None and ticket.cancelled:
                if coro is not None:
                    coro.close()
                raise CallCancelled(f"call {ticket.call_id} was cancelled")
            ticket.abort = abort

    def leave(self, ticket: Ticket) -> None:
        """The call is over: release its number and keep its outcome."""
        with self._lock:
            self._live.pop(ticket.call_id, None)
            if ticket.seq is None:
                return
            if ticket.outcome is not None:
                self._kept[ticket.seq] = (ticket.call_id, ticket.outcome)
            self._release(ticket.seq)

    def cancel(self, entries: Iterable[tuple[int, int | None]], deadline: bool = False,
               behind: Iterable[tuple[int, int | None]] = ()) -> "Wedge | None":
        """Cancel calls by id (idempotent). A call not arrived yet is refused when it does
        and its number is released now; an arrived one is aborted. With `deadline`: if one
        of them still runs its plain ``def`` method, the lane is wedged: the calls `behind`
        it (the controller's pending calls numbered after it) are cancelled too, here,
        before any of them can start, and the wedge is returned (wedged-lane)."""
        with self._lock:
            wedge = None
            for ticket in self._cancel(entries):
                if deadline and wedge is None and ticket.seq is not None and ticket.running_since is not None:
                    wedge = (ticket.call_id, ticket.seq, ticket.describe(), time.monotonic() - ticket.running_since)
            if wedge is not None:
                self._cancel(behind)
            return wedge

    def cancel_all(self) -> None:
        """Cancel every arrived call (the host is closing)."""
        with self._lock:
            for ticket in list(self._live.values()):
                ticket.cancelled = True
                if ticket.abort is not None:
                    ticket.abort()

    # ---- internals (under the lock) -------------------------------------------------------

    def _cancel(self, entries: Iterable[tuple[int, int | None]]) -> list[Ticket]:
        """Refuse or abort each call; returns the arrived ones."""
        arrived = []
        for call_id, seq in entries:
            ticket = self._live.get(call_id)
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
            if ticket.abort is not None:
                ticket.abort()
            arrived.append(ticket)
        return arrived

    def _skip_to(self, seq: int) -> None:
        """A Ray-ordered lane: the numbers below `seq` that have not arrived never will."""
        if self.keep_results:
            for s in range(max(self._next, seq - self.keep_results), seq):
                if s not in self._released:
                    self._kept[s] = (None, NEVER_RAN)  # its same-process consumers fail as for a cancelled one
        self._released = {s for s in self._released if s > seq}
        self._next = seq

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


# ---- the async host's thread for plain def methods -----------------------------------------


class OrderedThread:
    """The async host's one thread for plain ``def`` methods: a queue and a loop (no executor
    machinery); each outcome is handed back to the event loop."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run `fn` on the thread; the returned future (of the running loop) gets its outcome."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._main, name="asyncrl-ordered_0", daemon=True)
                    self._thread.start()
        self._q.put((fn, functools.partial(_deliver_to_loop, loop, fut)))
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
