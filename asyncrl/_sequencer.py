"""Ordered calls: numbering, submit-or-release, cancellation and lane health, in one place.

Ray's async actors do not keep submission order, so the controller numbers the ordered
calls of each worker process (a *lane*) and the process runs them by number. Two halves
share this protocol:

* :class:`Sequencer` (controller, one per set of worker processes) takes a number per
  ordered call and submits every call (ordered or concurrent) to its host.
* :class:`Lane` (worker host, one per process) admits ordered calls one at a time in
  number order, refuses calls cancelled before they arrive, and knows whether the call
  holding it is still running in its thread. An async host's calls wait on its event
  loop; :class:`ThreadLane` is the same lane for a threaded host, whose calls wait in
  Ray's threads (same states, same cases; only the waiting differs).

The invariant: **every number taken is released exactly once on the worker**, whatever
fails, so the next number's call always gets its turn. A number is released when its
call leaves the lane (returned, raised, cancelled), or, for a call that never ran
(cancelled, refused, never delivered), by the one cancel message. Cancellation has one
path, :meth:`Sequencer.cancel` → the host's ``cancel_calls`` → :meth:`Lane.cancel`;
cancelling twice is harmless.

Failure cases, and what happens:

1. *Building a rank's arguments raises* (a custom dispatch's short padding list, a
   closed producer): no number was taken for that rank; the ranks already submitted are
   cancelled (case 4) and the error is raised at the call site.
2. *Submission raises after the number was taken* (an argument that cannot be pickled,
   Ray shut down): the number is released by a cancel message for that call id (it may
   or may not have left, so the worker refuses it if it ever arrives), the ranks already
   submitted are cancelled, and the error is raised at the call site.
3. *The worker cannot unpickle the arguments* (a class not importable there): the
   arguments travel as one :class:`~asyncrl._host.Payload` whose unpickling never
   raises, so the host method still runs, reports a ``RemoteError`` naming the failure,
   and releases the number. (The price: the arguments are pickled as a nested stream,
   about 8 µs per rank on the controller; tensors still go out of band, without copies.)
4. *Cancelled before the call arrives*: the host remembers the call id, releases its
   number at once, and refuses the call when it arrives (also by number, if the id was
   forgotten: a number below the lane's next one never runs).
5. *Cancelled while waiting for its turn or resolving its arguments*: the waiting task is
   cancelled; leaving the lane releases the number.
6. *Cancelled while running an ``async def`` method*: the coroutine sees
   ``CancelledError``; leaving the lane releases the number.
7. *Cancelled while running a plain ``def`` method in its thread*: a thread cannot be
   interrupted. The call fails at once (its result will be dropped) but keeps the lane
   until the thread returns, so the next ordered call never overlaps it; later calls
   wait for the thread (the lane is *draining*).
8. *Its deadline passed while its thread runs*: as 7, and the lane is *wedged*: every
   ordered call waiting behind it, and every later one, fails at once with
   :class:`~asyncrl.LaneWedgedError` naming the stuck call (their numbers are released),
   until the thread returns — the worker's proof that the thread ended — after which
   the lane runs normally again.
9. *The cancel message arrives twice, or after the call finished*: a no-op (a finished
   call's number is already released; a refused id is forgotten after 100,000 entries,
   and the number check of case 4 covers it).
10. *The worker process dies*: its lane dies with it; the calls on it fail with
    ``WorkerDiedError`` on the controller and the group is broken.
11. *The cancel message cannot be sent* (the worker is gone or Ray is shutting down):
    logged; the lane is gone with its process (case 10).
12. *A threaded host* (:class:`ThreadLane`) holds one of Ray's threads per call that
    waits for its turn in its ``calls`` group (case 15: most ordered calls wait on the
    pinned thread instead). Ray dispatches its calls in submission order (a sync actor
    with concurrency groups keeps it), and the controller submits the calls of one
    host in number order (:meth:`Sequencer.submit` takes the number and submits under
    one lock), so the threads always hold the lowest outstanding numbers: the call
    whose turn it is never waits for a thread behind calls that wait for it.
13. *Ray fails the call before the host runs it* because a top-level argument cannot
    be read (Ray backend: a pipelined input passed top-level, see
    :mod:`asyncrl._deferred`; only inputs known to have finished successfully go so,
    so this is an object lost after it was read, one Ray could not serialize (read
    before only by a consumer in the producer's own process, case 14), or one that
    cannot be unpickled on that worker): the host never sees the number. The backend observes every call sent
    with top-level inputs (a completion callback on its metadata ref, on Ray's thread;
    awaited or not) and releases the number with the cancel message, as in case 4
    (idempotent: case 9); the call's future fails with an ``UpstreamError`` naming the
    producer. If the controller process itself dies, so do the lanes' owner and calls.
14. *A same-process input* (:class:`~asyncrl._deferred.LocalShard`: the consumer's input
    is the result of an earlier ordered call on the same lane). The lane keeps the
    outcome of every number it released (a value, an error, a cancellation, or "never
    ran" for a number released by a cancel message) while it is within
    ``keep_results`` of the lane's next number; the controller sends the marker only
    when ``consumer number - producer number <= keep_results`` (it numbers the calls
    itself, :meth:`Sequencer.submit`), so at the consumer's turn — every lower number
    released, the lane's next number the consumer's — the producer's outcome is
    retained, whatever ran, failed or was cancelled in between. Nothing is released by
    message and nothing outlives the window. An outcome that is not there (a controller
    bug, a host that was replaced) fails the consumer with a clear error, never a wait.
15. *The pinned thread of a threaded host* (Ray backend). The host's Ray actor has a
    concurrency group ``ordered`` of ONE thread, the *pinned thread*, which ran the
    constructors; an ordered call without nested pipelined inputs is sent there
    (``call_pinned``) and runs its plain ``def`` method on the thread that received it
    (:meth:`ThreadLane.run_pinned`: no hand-off). An ordered call with nested inputs goes
    to the ``calls`` group (case 12) so that it fetches them while its predecessors run;
    at its turn its method becomes a *job* for the pinned thread
    (:meth:`ThreadLane.submit`): the pinned call waiting for its turn runs it (it waits
    with ``serve=True`` and runs jobs before anything else), or, when none waits, a call
    of :meth:`ThreadLane.serve_jobs` the host submits to itself into ``ordered`` does.
    Ray facts this rests on (Ray 2.60, measured, ``docs/benchmarks_core.md`` round 7): a
    one-thread group is one OS thread for the actor's life; a sync actor with
    ``max_concurrency=1`` dispatches each group's calls in submission order (calls with
    1 MiB arguments included); a ``control`` call runs while ``ordered`` is held.

    *No deadlock.* A job exists only while its call holds the lane (it is the next number,
    every lower one released), so no other ordered method runs meanwhile and the pinned
    thread is, in finite time, one of: idle; in a pinned call waiting for its turn (a
    higher number: it runs the job); in a ``serve_jobs`` call (it runs the job); or
    finishing a call that already left the lane, refused one, or the constructors (set-up
    ends before any call is issued). Which of the first two serves is decided under the
    lane's lock: :meth:`ThreadLane.submit` wakes the registered waiter, or, when none is
    registered and no ``serve_jobs`` call is pending, submits one; a waiter leaves
    ``wait_turn`` only under that lock with no job queued (the jobs go first), and
    ``serve_jobs`` clears its pending flag under it only with no job queued, so a job is
    never left with nobody to run it. A pending ``serve_jobs`` call waits in Ray's queue
    only behind pinned calls, each of which waits for its turn (serving jobs) or runs in
    finite time. A pinned call never waits for a Ray thread (its group's one thread is
    its own), and ``calls``-group calls keep case 12. If the self-submission fails (Ray
    shutting down), the queued jobs fail with :class:`CallCancelled` instead of waiting.
    A call cancelled while its job waits for the pinned thread fails at once (case 5); when
    the thread reaches the job it does not start the method, and the lane is released then.

    *The wedge* (case 8) with pinned calls: the stuck method runs on the pinned thread
    (a pinned call's own, or a job), so every pinned call behind it waits inside Ray,
    invisible to the host; the controller acts. The host's reply to a deadline's cancel
    message is the lane's wedge (``(call id, number, description, seconds)``, or None);
    on it the controller (:meth:`Sequencer._wedged_reply`, on its loop) fails at once,
    with ``LaneWedgedError`` naming the stuck call, every call it issued on that lane
    with a higher number that is still pending, and every ordered call issued to that
    lane later (:meth:`Sequencer.issued`); failing a call sends its cancel message, so
    each number is released once, by the host (not arrived: case 4; arrived: on leaving).
    The host holds a *fence* from the wedge on: an ordered call arriving while it is up
    fails with the same ``LaneWedgedError`` (so a call the controller has failed never
    runs, even if it reaches the host after the thread returned). The controller watches
    ``wait_unwedged`` (a ``calls``-group call that returns when the stuck thread returned,
    or fails when the process dies); then it stops failing new calls and sends
    ``unfence(upto)`` with its next number on that lane: every number below it was failed
    by the controller, numbers from it on run normally (a call sent after that message
    waits until the host has handled it: case 16). Calls that can see
    the wedge on the host (waiting in ``calls``) fail there as in case 8; failing them on
    both sides is harmless (first outcome wins, case 9).
16. *A call overtakes a control message sent before it* (Ray backend). Ray runs a
    host's control messages (cancel messages, ``unfence``) in their own place (the
    threaded host's ``control`` thread; an async host's tasks, which Ray may start out of
    order), so a call submitted after a cancel message could run first: seen in CI, a
    concurrent ``unblock()`` sent after ``cancel()`` of a queued pinned call released
    the pinned thread, which then ran the cancelled call before the cancel message was
    handled. So the controller numbers its control messages to each process (1, 2, ...,
    under a lock, in the order sent) and stamps every call with how many it had sent;
    the host starts a call only once it has handled every message up to that count
    (:class:`ControlOrder`; a count check per call, a wait only when behind). Every
    effect of a call sent after a cancel (or an unfence) follows that message, so a
    cancelled queued call never runs because of a later call, and a call sent after an
    unfence is not refused as wedged. The control thread never waits for a call, so
    the wait ends in finite time; a message never handled (its process gone) ends it
    after ``CONTROL_WAIT`` with a warning.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import structlog

from asyncrl.errors import LaneWedgedError

if TYPE_CHECKING:
    from asyncrl._backend import Backend

__all__ = ["Sequencer", "Lane", "ThreadLane", "ControlOrder", "Ticket", "Entry"]

log = structlog.get_logger("asyncrl")

Entry = tuple[int, int, "int | None"]
"""``(rank, call id, number or None)`` of one submitted per-rank call."""

Wedge = tuple[int, int, str, float]
"""``(call id, number, description, seconds its thread has run)`` of the call wedging a lane."""

_call_ids = itertools.count()
_REFUSED_MEMORY = 100_000
_ISSUED_SWEEP = 1024  # remembered ordered calls per lane before the first sweep (case 15)


# ---- controller half -------------------------------------------------------------------


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


# ---- worker half -----------------------------------------------------------------------


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
    loop_calls: "list[LoopCall] | None" = None
    """A threaded host's work on its event loop for this call (argument resolution, an
    ``async def`` method): cancelled with the call."""
    outcome: Any = None
    """What the lane keeps of an ordered call when it leaves (case 14): ``(True, result,
    (rows, pad))`` or ``(False, error)``; None: nothing to keep."""

    def describe(self) -> str:
        return f"{self.group}.{self.method} (call {self.call_id}, ordered #{self.seq})"


class ControlOrder:
    """The worker half of case 16: a call runs only after every control message (a
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
        self.keep_results = 0  # set by the host when its workers are built (case 14)
        self._kept: dict[int, tuple[int, Any]] = {}  # number -> (call id, outcome), within the window
        self.control = ControlOrder()
        """The control messages handled so far; a call waits for those sent before it (case 16)."""

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
        lane does not hold it. Read by the call whose turn it is (case 14)."""
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
        lane until the thread returns (case 7)."""
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
        `deadline`, one still running in its thread wedges the lane (case 8). Returns the
        lane's wedge after a deadline's cancel (case 15: the controller's half), else None."""
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
            oldest = self._next - self.keep_results  # the window of case 14
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
"""The kept outcome of an ordered call that never ran (case 14)."""


# ---- the worker half on a threaded host -------------------------------------------------


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
    thread as a job and back (:meth:`run_in_thread`, case 15). A cancelled call stops waiting at once
    (case 5), an ``async def`` method or an argument resolution on the host's loop is
    cancelled and waited for (case 6), a plain ``def`` method keeps the lane until its
    thread returns (cases 7 and 8).
    """

    def __init__(self, pump: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._wakes: dict[int, _Wake] = {}  # call id -> the wake-up its thread sleeps on
        self.pump = pump
        """Submits a call of :meth:`serve_jobs` to the pinned thread (the host's own Ray
        handle, the ``ordered`` concurrency group): how a job finds the thread idle (case 15)."""
        self._jobs: collections.deque[tuple[Callable[[], Any], Callable[[tuple[bool, Any]], None]]] = collections.deque()
        self._server: _Wake | None = None  # the wake-up of the pinned call waiting for its turn: it serves jobs
        self._pumping = False  # a serve_jobs call is on its way to the pinned thread, or running there
        self._unwedge_wakes: list[_Wake] = []
        self.jobs_run = {"waiter": 0, "pump": 0}  # who ran the jobs (for tests and profiles)
        self._fence: Ticket | None = None  # the stuck call of the last wedge, until the controller lifts it
        self._fence_upto: int | None = None  # numbers from here on are the controller's after the wedge

    # ---- the pinned thread (case 15) -------------------------------------------------------

    def submit(self, fn: Callable[[], Any], deliver: Callable[[tuple[bool, Any]], None]) -> None:
        """Run `fn` on the pinned thread, then `deliver((ok, value or error))` there (the
        lane is the `thread` of :meth:`run_in_thread` for calls that waited in the
        ``calls`` group). The pinned call waiting for its turn runs it; when none waits,
        a :meth:`serve_jobs` call submitted to the pinned thread does (case 15)."""
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
        """On the pinned thread: run the waiting jobs until none is left (case 15)."""
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
        (case 8); a cancelled call's result is dropped."""
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
        returns whether it did wedge it when asked (case 15: the controller's signal)."""
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
        numbered below `upto` meanwhile: admit numbers from `upto` on (case 15)."""
        with self._lock:
            if self._fence is not None and self._fence.call_id == call_id:
                self._fence_upto = upto

    def _fenced(self, seq: int) -> Ticket | None:
        """The stuck call an ordered call numbered `seq` fails behind: the lane is wedged,
        or was and the controller has not yet said which numbers are its own (case 15)."""
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
        `serve`: this is the pinned thread; run the jobs submitted meanwhile (case 15)."""
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
        Cancelled, the call fails at once but keeps the lane until the thread returns (case 7);
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


def outcome_of(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, fn())``, or ``(False, error)`` if it raised: a thread's outcome, handed to the call that waits for it."""
    try:
        return True, fn()
    except BaseException as e:  # noqa: BLE001 - handed to the waiting call
        return False, e


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
