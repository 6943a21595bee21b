"""The Ray backend: every worker process is a Ray actor hosting the worker objects.

The only module that imports ray (with :mod:`asyncrl.runtime`, which starts it).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import queue
import threading
import time
from typing import Any, Callable, Sequence

import ray
import structlog
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
    RayError,
    RayTaskError,
    TaskCancelledError,
)
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl._backend import Cancelled, Died, Failed, InputFailed, Slot
from asyncrl._host import ThreadedHost, WorkerHost
from asyncrl._lanes import CallCancelled
from asyncrl.errors import AsyncRLError, PlacementError

_MAX_CONCURRENCY = 100_000  # in-flight calls per async host; ordering is by sequence number, not by slot
THREADED_CALLS = 64
"""Calls a threaded host runs or holds at once (Ray threads of its ``calls`` concurrency
group); more wait in Ray's queue, in submission order."""

_DEATH = (ActorDiedError, ActorUnavailableError, RayActorError, OwnerDiedError, ObjectLostError)

log = structlog.get_logger("asyncrl")


def _input_failed(e: BaseException) -> bool:
    """Whether `e` (a call's outcome) says Ray failed the task before running it because
    a top-level argument could not be read: Ray raises it from
    ``ray._raylet.raise_if_dependency_failed`` (in the task's traceback), and its cause
    is a Ray error (ObjectLostError, RaySystemError for an argument that failed to
    unpickle, a dead producer's ActorDiedError). The host itself only ever fails a call
    with an asyncrl error or a cancellation."""
    if not isinstance(e, RayTaskError):
        return False
    if "raise_if_dependency_failed" in (getattr(e, "traceback_str", "") or ""):
        return True
    cause = getattr(e, "cause", None)
    return isinstance(cause, RayError) and not isinstance(cause, (TaskCancelledError, ActorDiedError,
                                                                     ActorUnavailableError, RayActorError))


def _translate(e: BaseException) -> BaseException:
    """A Ray error as one of the internal outcomes of :mod:`asyncrl._backend` (or the
    asyncrl error a worker raised on purpose)."""
    if isinstance(e, TaskCancelledError):
        return Cancelled(str(e))
    if isinstance(e, RayTaskError):
        cause = getattr(e, "cause", None)
        if _input_failed(e):  # named by the Ray error that made the argument unreadable
            what = cause if cause is not None else e
            return InputFailed(Failed(f"{type(what).__module__}.{type(what).__qualname__}",
                                      str(what).splitlines()[0] if str(what) else "", str(e)))
        if isinstance(cause, AsyncRLError):
            return cause
        if isinstance(cause, (TaskCancelledError, asyncio.CancelledError, CallCancelled)):
            return Cancelled(str(e))
        if isinstance(cause, _DEATH):
            return Died(str(cause).splitlines()[0])
        name = f"{type(cause).__module__}.{type(cause).__qualname__}" if cause is not None else "ray.exceptions.RayTaskError"
        return Failed(name, str(cause) if cause is not None else str(e).splitlines()[0], str(e))
    if isinstance(e, _DEATH):
        return Died(str(e).splitlines()[0])
    if isinstance(e, AsyncRLError):
        return e
    if isinstance(e, CallCancelled):
        return Cancelled(str(e))
    return Failed(f"{type(e).__module__}.{type(e).__qualname__}", str(e), "")


async def await_ray(ref: Any) -> Any:
    """Await an ObjectRef, turning Ray's errors into asyncrl's (used on workers too)."""
    try:
        return await ref
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise _translate(e) from None


_NATIVE_LIMIT = 256  # refs fetched with a direct loop wake-up each at once; past it deliveries are queued
_DELIVER_BATCH = 128  # refs' worth of fetch deliveries handed to the event loop per loop iteration


class _Fetch:
    """One fetch: a set of ObjectRefs whose outcomes reach the event loop together, in
    ONE loop wake-up — when the last ref is done, or at once on the first error.

    If the getter thread is idle it takes the fetch and waits for it in ``ray.get`` (see
    :class:`_Getter`); it hands a fetch not done in time, or that failed, to the callbacks.
    With the callbacks, each ref gets Ray's ``_on_completed`` callback (the value, or
    Ray's error object, on Ray's own thread: every outcome is retrieved, so Ray never
    reports an unhandled error, even for ranks that fail after the first error was delivered). The callbacks
    count down under a lock; the one that completes the set, or brings its first error,
    posts the delivery (:meth:`_Resolver.post`): one ``call_soon_threadsafe`` per fetch
    instead of one per ref. On the loop, `deliver(outcomes, failed, at)` runs once:
    `failed` is -1 and `outcomes` the values in the order of the refs, or the position of
    the first error and ``outcomes[failed]`` Ray's raw error (see :func:`_translate`);
    `at` is ``time.perf_counter()`` when Ray's thread (or the getter's) saw it.
    :meth:`cancel` (on the loop) makes a later delivery a no-op.
    """

    __slots__ = ("_loop", "_deliver", "_refs", "_outcomes", "_left", "_failed", "_sent", "_live", "_queued", "at")

    _LOCK = threading.Lock()  # the count-down, across Ray's callback threads

    def __init__(self, loop: asyncio.AbstractEventLoop, refs: Sequence[Any],
                 deliver: Callable[[list[Any], int, float], None], queued: bool) -> None:
        self._loop = loop
        self._deliver = deliver
        self._refs: list[Any] | None = list(refs)  # held until every callback ran (as _Watch)
        n = len(self._refs)
        self._outcomes: list[Any] = [None] * n
        self._left = n
        self._failed = -1
        self._sent = False  # the delivery was posted (Ray's side, under the lock)
        self._live = True  # not delivered, not cancelled (the loop's side)
        self._queued = queued  # delivered through the resolver's batched queue
        self.at = 0.0
        if not _GETTER.take(self):
            try:
                self._register()
            except BaseException:  # Ray shut down under us: the caller sees the error, nothing is delivered
                self._live = False
                raise

    def _register(self) -> None:
        """Hand every ref to Ray's ``_on_completed`` callbacks (raises if Ray shut down)."""
        refs = self._refs
        assert refs is not None
        for i, ref in enumerate(refs):
            ref._on_completed(functools.partial(self._one, i))

    def _got(self, values: list[Any]) -> None:
        """On the getter's thread, which alone holds this fetch (no callback registered)."""
        self._outcomes, self._left, self._refs, self._sent = list(values), 0, None, True
        self.at = time.perf_counter()
        _RESOLVER.post(self)

    def _one(self, i: int, outcome: Any) -> None:  # on Ray's thread
        with self._LOCK:
            self._outcomes[i] = outcome
            self._left -= 1
            if not self._left:
                self._refs = None
            if self._sent:
                return  # settled by an earlier error: this outcome is retrieved, and dropped
            if isinstance(outcome, RayError):
                self._failed = i
            elif self._left:
                return
            self._sent = True
        self.at = time.perf_counter()
        _RESOLVER.post(self)

    def _fire(self) -> None:  # on the loop, once
        if not self._live:
            return  # cancelled meanwhile
        self._live = False
        if not self._queued:
            _RESOLVER.native -= len(self._outcomes)
        self._deliver(self._outcomes, self._failed, self.at)

    def cancel(self) -> None:
        """On the loop: no delivery after this (a posted one becomes a no-op)."""
        if self._live:
            self._live = False
            if not self._queued:
                _RESOLVER.native -= len(self._outcomes)


_GET_WINDOW = 0.02
"""Seconds the getter thread waits in Ray's blocking get for one fetch before it hands the
fetch to Ray's completion callbacks (see :class:`_Getter`)."""


def _getter_allowed() -> bool:
    """Whether this process may wait in ``ray.get`` on a thread of its own: not inside an
    async Ray actor, where Ray warns about any blocking get (a controller run there keeps
    the callbacks only)."""
    core = getattr(ray._private.worker.global_worker, "core_worker", None)
    return core is None or not core.current_actor_is_asyncio()


class _Getter:
    """One thread that waits for a fetch the way a blocking caller does: ``ray.get``.

    Ray's blocking get returns to the waiting thread as soon as the objects are there,
    while its completion callbacks first run on Ray's own thread, one per ref, each
    taking the GIL: measured on the tiny 4-rank call, a wait in ``ray.get`` on this thread
    plus one loop wake-up takes 0.85-0.92x the callbacks' time with asyncio's loop and
    0.87-0.99x with uvloop's (round 8 of issue 14, docs/benchmarks_core.md). So while the
    thread is idle a new fetch is handed to it instead of the callbacks; it waits at most `_GET_WINDOW` and posts the delivery. A
    fetch not done by then (a long call), or whose get raised (a failed rank: Ray's get
    stops at the first error; the callbacks then retrieve every outcome and report the
    first error, as always), is handed to the callbacks and the thread is free again.
    While it is busy, fetches take the callbacks at once: a long call never delays
    another one's delivery by more than it would without the thread. The event loop only
    hands the fetch over; it never waits.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = False
        self._queue: queue.SimpleQueue[_Fetch] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._allowed: bool | None = None
        self.enabled = True  # False: every fetch takes the callbacks (benchmarks/fetch_wakeups.py compares)
        self.served = 0  # fetches delivered from the thread's get (for tests)
        self.handed = 0  # fetches the thread handed to the callbacks

    def take(self, f: "_Fetch") -> bool:
        """On the loop: hand `f` to the thread if it is idle (start it the first time)."""
        if f._queued or not self.enabled:
            return False  # (thousands in flight: the resolver's batched queue, as before)
        with self._lock:
            if self._thread is None:
                if self._allowed is None:
                    self._allowed = _getter_allowed()
                if not self._allowed:
                    return False
                self._thread = threading.Thread(target=self._run, name="asyncrl-getter", daemon=True)
                self._thread.start()
            elif not self._idle:
                return False
            self._idle = False
        self._queue.put(f)
        return True

    def _run(self) -> None:
        while True:
            f = self._queue.get()
            try:
                values = ray.get(f._refs, timeout=_GET_WINDOW)
            except BaseException:  # not done in time, an error, or Ray shutting down: the callbacks take over
                served = False
                try:
                    f._register()
                except BaseException:  # Ray shut down under us: nothing is delivered (as with the callbacks);
                    pass  # the fetch stays live, so the call's cancel or its group's close still settles it
            else:
                served = True
                f._got(values)
            del f  # (the refs: not held while idle)
            with self._lock:
                if served:
                    self.served += 1
                else:
                    self.handed += 1
                self._idle = True

    def _after_fork(self) -> None:
        """In a forked child: the thread did not come along; start afresh."""
        self.__init__()  # type: ignore[misc]


_GETTER = _Getter()
os.register_at_fork(after_in_child=_GETTER._after_fork)


class _Resolver:
    """Hands fetches' outcomes to the event loop without stalling it when thousands of
    calls are in flight.

    While at most `_NATIVE_LIMIT` refs are being fetched, a fetch's delivery is one
    ``call_soon_threadsafe`` of its own. Past it, a delivery only appends to a queue on
    Ray's thread and the loop drains the queue `_DELIVER_BATCH` refs' worth per
    iteration, so 10,000 completions never land on the loop in one iteration. No
    polling, no thread of ours, no task per ref.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[asyncio.AbstractEventLoop, collections.deque[_Fetch]] = {}
        self._draining: set[asyncio.AbstractEventLoop] = set()
        self.native = 0  # refs being fetched with a direct wake-up (the loop's side only)

    def fetch(self, refs: Sequence[Any], deliver: Callable[[list[Any], int, float], None]) -> _Fetch:
        """Fetch `refs` with one loop wake-up (see :class:`_Fetch`); returns its handle."""
        loop = asyncio.get_running_loop()
        queued = self.native + len(refs) > _NATIVE_LIMIT
        if not queued:
            self.native += len(refs)
        try:
            return _Fetch(loop, refs, deliver, queued)
        except BaseException:
            if not queued:
                self.native -= len(refs)
            raise

    async def wait(self, ref: Any) -> Any:
        """One ref's value; Ray's error as :func:`_translate` makes it."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def got(outcomes: list[Any], failed: int, _at: float) -> None:
            if fut.done():
                return
            if failed < 0:
                fut.set_result(outcomes[0])
            else:
                fut.set_exception(_translate(outcomes[0]))

        handle = self.fetch([ref], got)
        try:
            return await fut
        finally:
            handle.cancel()  # (a no-op once delivered)

    def post(self, f: _Fetch) -> None:
        """On Ray's thread: hand a finished fetch to its loop."""
        loop = f._loop
        if not f._queued:
            try:
                loop.call_soon_threadsafe(f._fire)
            except RuntimeError:  # that loop is closed
                pass
            return
        with self._lock:
            self._ready.setdefault(loop, collections.deque()).append(f)
            if loop in self._draining:
                return
            self._draining.add(loop)
        try:
            loop.call_soon_threadsafe(self._drain, loop)
        except RuntimeError:  # that loop is closed
            with self._lock:
                self._draining.discard(loop)
                self._ready.pop(loop, None)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        batch: list[_Fetch] = []
        with self._lock:
            q = self._ready.get(loop)
            weight = 0
            while q and weight < _DELIVER_BATCH:
                f = q.popleft()
                batch.append(f)
                weight += len(f._outcomes)
            more = bool(q)
            if not more:
                self._draining.discard(loop)
                self._ready.pop(loop, None)
        for f in batch:
            try:
                f._fire()
            except Exception as e:  # noqa: BLE001 - reported as asyncio reports a callback's error
                loop.call_exception_handler({"message": "asyncrl: a fetch's delivery raised", "exception": e})
        if more:
            loop.call_soon(self._drain, loop)


_RESOLVER = _Resolver()


class _Watch:
    """Reports when every ObjectRef of one call exists, without fetching any of them.

    Each ref gets Ray's ``_on_ready`` callback (``CoreWorker::WaitAsync``: no fetch, no
    deserialization, no polling): it runs on Ray's thread when the task that makes the
    object has finished, successfully or not (a failed task's ref holds its error), or
    with an error when the wait itself ends (the owner or Ray gone): either way nothing
    more will come, so the ref counts as done. The last one calls `callback` (on Ray's
    thread). A ref that cannot be watched (Ray shut down) counts as done at once.
    """

    __slots__ = ("_left", "_callback", "_refs")

    _LOCK = threading.Lock()  # the count-down, across Ray's callback threads and the registering one

    def __init__(self, refs: Sequence[Any], callback: Callable[[], None]) -> None:
        self._refs = list(refs)  # "dropping the ObjectRef does not run the callback": keep them until done
        self._left = len(self._refs) + 1  # +1: registration itself, so no callback finishes it half-registered
        self._callback = callback
        for ref in self._refs:
            try:
                ref._on_ready(self._one)  # (Ray >= 2.60, as _on_completed above)
            except Exception:  # Ray shut down under us (its worker has no core worker any more):
                if not hasattr(ref, "_on_ready"):  # nothing will complete any more
                    raise  # (Ray < 2.60: not a shutdown)
                self._one(None)
        self._one(None)

    def _one(self, _exc: BaseException | None) -> None:
        with self._LOCK:
            self._left -= 1
            if self._left:
                return
        self._refs = []
        self._callback()


def _host_methods(host: Any) -> tuple[Any, Any, Any, Any]:
    """A host's call methods: ``calls`` group, the same with 2 returns, and (a threaded
    host) its pinned thread's, with 2 returns; None for an async host."""
    calls = host.call_packed
    try:
        pinned = host.call_pinned
    except AttributeError:  # an async host
        return calls, calls.options(num_returns=2), None, None
    return calls, calls.options(num_returns=2), pinned, pinned.options(num_returns=2)


def _all_ready(refs: list[Any]) -> bool:
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    return len(ready) == len(refs)


class _ThreadedWorkerHost(ThreadedHost):
    """The threaded host as a sync Ray actor (``max_concurrency=1``, so Ray keeps the
    submission order when it dispatches each group's calls: case 12 of
    docs/protocol.md): set-up and the ordered calls that can run at once in
    ``ordered``, a group of ONE thread (the pinned thread); ordered calls with nested
    pipelined inputs (and concurrent calls) in ``calls`` (:data:`THREADED_CALLS` threads);
    cancel messages and close in ``control`` (never queued behind calls or constructors)."""

    @ray.method(concurrency_group="ordered")
    def init_workers(self, specs: list[Any], keep_results: int = 0) -> dict[str, dict[str, Any]]:
        # A job that finds the pinned thread idle gets it by a call of our own into its group.
        self._lane.pump = ray.get_runtime_context().current_actor.serve_jobs.remote  # type: ignore[attr-defined]
        return super().init_workers(specs, keep_results)

    @ray.method(concurrency_group="ordered")
    def call_pinned(self, packed: list[Any], *top: Any) -> Any:
        return self.call(*packed, top=top, pinned=True)

    @ray.method(concurrency_group="ordered")
    def serve_jobs(self) -> None:
        super().serve_jobs()

    @ray.method(concurrency_group="calls")
    def call_packed(self, packed: list[Any], *top: Any) -> Any:
        return self.call(*packed, top=top)

    @ray.method(concurrency_group="calls")
    def wait_unwedged(self, call_id: int) -> bool:
        return super().wait_unwedged(call_id)

    @ray.method(concurrency_group="control")
    def cancel_calls(self, entries: list[tuple[int, int | None]], deadline: bool = False, note: int = 0) -> Any:
        return super().cancel_calls(entries, deadline, note)

    @ray.method(concurrency_group="control")
    def unfence(self, call_id: int, upto: int, note: int = 0) -> None:
        super().unfence(call_id, upto, note)

    @ray.method(concurrency_group="control")
    def pinned_state(self) -> dict[str, Any]:
        return super().pinned_state()

    @ray.method(concurrency_group="control")
    def control_state(self) -> dict[str, int]:
        return super().control_state()

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        # Beside the calls and the constructors (ordered group), as on the async host: a
        # close during set-up need not wait for the constructors.
        super().close()


class RayBackend:
    """Worker hosts as Ray actors; every blocking Ray call runs off the event loop."""

    name = "ray"
    needs_pool = True
    top_level_inputs = True
    pins_ordered_calls = True
    """A threaded host runs ordered calls on its pinned thread (case 15 of docs/protocol.md)."""

    def __init__(self) -> None:
        # Local wrappers: need no running Ray.
        self._actor_cls = ray.remote(WorkerHost)
        self._threaded_cls = ray.remote(concurrency_groups={"calls": THREADED_CALLS, "control": 1, "ordered": 1})(_ThreadedWorkerHost)
        self._methods: dict[int, tuple[Any, Any, Any, Any]] = {}  # id(host) -> _host_methods(host)
        # id(host) -> control messages (cancel, unfence) sent to it: each is numbered and
        # every call carries the count, so it runs only after them (case 16 of docs/protocol.md).
        self._notes: dict[int, int] = {}
        self._notes_lock = threading.Lock()  # (a release can be sent from Ray's thread)

    async def start(self) -> "RayBackend":
        if not ray.is_initialized():
            from asyncrl.runtime import ainit

            await ainit()
        return self

    async def make_hosts(self, group: str, slots: Sequence[Any], n: int, threaded: bool = False) -> list[Any]:
        # Creating an actor is a GCS round trip (and, the first time, Ray imports what it
        # needs to export the class): in a thread, like every blocking Ray call.
        return await asyncio.get_running_loop().run_in_executor(None, self._make_hosts, list(slots), n, threaded)

    def _make_hosts(self, slots: list[Any], n: int, threaded: bool) -> list[Any]:
        hosts = []
        cls, kind = (self._threaded_cls, {}) if threaded else (self._actor_cls, {"max_concurrency": _MAX_CONCURRENCY})
        for rank in range(n):
            slot = slots[rank]
            hosts.append(cls.options(
                name=None,
                num_cpus=slot.num_cpus,
                num_gpus=slot.num_gpus,
                max_restarts=0,
                **kind,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=slot.placement_group,
                    placement_group_bundle_index=slot.bundle_index,
                ),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(max(1, int(slot.num_cpus)))}},
            ).remote(wait=await_ray))
        return hosts

    async def admin(self, host: Any, method: str, *args: Any) -> Any:
        return await await_ray(getattr(host, method).remote(*args))

    def submit(self, host: Any, role: str, method: str, seq: int | None, call_id: int, payload: Any,
               in_pad: int | None, want_meta: bool, keep: bool) -> tuple[Any, Any]:
        # One Ray argument, not eight: Ray serializes each argument on its own (~10 µs each).
        # A list, not a tuple: Ray encodes lists, strings and numbers with msgpack and
        # pickles anything else (a tuple too), so a call whose arguments are plain scalars
        # (Payload.wire) crosses without pickling on either side.
        packed = [role, method, seq, call_id, payload.wire(), in_pad, want_meta, keep, self._notes.get(id(host), 0)]
        methods = self._methods.get(id(host))
        if methods is None:  # .options() builds a new method object: once per host, not per call
            methods = self._methods[id(host)] = _host_methods(host)
        # An ordered call to a threaded host goes to its pinned thread unless it has nested
        # pipelined inputs to fetch while its predecessors run (case 15 of docs/protocol.md).
        pinned = seq is not None and methods[2] is not None and not payload.nested
        if want_meta:
            call2 = methods[3] if pinned else methods[1]
            top = payload.top  # (only data-parallel calls, which return their meta, take top-level inputs)
            if top:
                ref, meta = call2.remote(packed, *top)
                self._observe(meta, host, call_id, seq)
            else:
                ref, meta = call2.remote(packed)
            return ref, meta
        return (methods[2] if pinned else methods[0]).remote(packed), None

    def _observe(self, ref: Any, host: Any, call_id: int, seq: int | None) -> None:
        """Watch a call sent with top-level inputs: if Ray fails it before its host runs
        it (an input lost, or not unpicklable there: see asyncrl._deferred), the host
        never saw its number, so release it with the one cancel message (case 4 of
        docs/protocol.md; idempotent). `ref` is the call's metadata ref (a few bytes);
        Ray calls back on its own thread; nothing runs on the loop unless it failed so."""
        if seq is None:
            return  # a concurrent call holds no number
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # issued from a thread without a loop
            loop = None
        # The callback holds `ref`: a future dropped by its caller is still observed.
        ref._on_completed(functools.partial(self._observed, loop, host, call_id, seq, ref))

    def _observed(self, loop: asyncio.AbstractEventLoop | None, host: Any, call_id: int, seq: int,
                  ref: Any, result: Any) -> None:  # on Ray's thread
        if not _input_failed(result):
            return
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._release, host, call_id, seq)
                return
            except RuntimeError:  # that loop is closed
                pass
        threading.Thread(target=self._release, args=(host, call_id, seq), daemon=True).start()

    def _release(self, host: Any, call_id: int, seq: int) -> None:
        try:
            self.cancel_calls(host, [(call_id, seq)], False)
        except Exception as e:  # the process is gone (its lane with it) or Ray is shutting down
            log.warning("release.unsent", call_id=call_id, error=repr(e))

    def cancel_calls(self, host: Any, entries: list[tuple[int, int | None]], deadline: bool,
                     wedged: Callable[[Any], None] | None = None) -> None:
        """Send the cancel message. `wedged`: called on the caller's loop with the host's
        reply to a deadline's cancel when it says the lane is wedged (case 15)."""
        ref = self._control(host, host.cancel_calls, entries, deadline)
        if deadline and wedged is not None:
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            ref._on_completed(functools.partial(_cancel_replied, loop, wedged))

    def unfence(self, host: Any, call_id: int, upto: int) -> None:
        """Tell `host` which ordered numbers are past call `call_id`'s wedge (case 15)."""
        self._control(host, host.unfence, call_id, upto)

    def _control(self, host: Any, method: Any, *args: Any) -> Any:
        """Send a control message to `host`, numbered in the order sent (case 16 of
        docs/protocol.md); the count moves on only once Ray took the message."""
        with self._notes_lock:
            note = self._notes.get(id(host), 0) + 1
            ref = method.remote(*args, note)
            self._notes[id(host)] = note
        return ref

    def watch_unwedged(self, host: Any, call_id: int, callback: Callable[[], None]) -> None:
        """Call `callback` (on the caller's loop) once call `call_id` no longer wedges
        `host`'s lane, or the host is gone (case 15)."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        ref = host.wait_unwedged.remote(call_id)
        _Watch([ref], functools.partial(_on_loop, loop, callback))

    async def wait(self, ref: Any) -> Any:
        return await _RESOLVER.wait(ref)

    def fetch(self, refs: Sequence[Any], deliver: Callable[[list[Any], int, float], None]) -> _Fetch:
        return _RESOLVER.fetch(refs, deliver)

    def translate(self, e: BaseException) -> BaseException:
        return _translate(e)

    def get(self, refs: Sequence[Any], timeout: float | None) -> list[tuple[bool, Any]] | None:
        refs = list(refs)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=True)
        if len(ready) < len(refs):
            return None
        out: list[tuple[bool, Any]] = []
        for r in refs:
            try:
                out.append((True, ray.get(r)))
            except Exception as e:
                out.append((False, _translate(e)))
        return out

    async def all_done(self, refs: Sequence[Any]) -> bool:
        return await asyncio.get_running_loop().run_in_executor(None, _all_ready, list(refs))

    def watch(self, refs: Sequence[Any], callback: Callable[[], None]) -> None:
        _Watch(refs, callback)

    async def kill(self, hosts: Sequence[Any]) -> None:
        for h in hosts:
            self._methods.pop(id(h), None)
        await asyncio.get_running_loop().run_in_executor(None, _kill_all, list(hosts))

    async def place(self, pool: Any) -> tuple[list[Any], list[Any]]:
        """Create the pool's placement groups in a thread (every call there blocks on
        the GCS); a cancelled wait stops the thread, which removes what it created."""
        stop = threading.Event()
        fut = asyncio.get_running_loop().run_in_executor(None, _place, pool, stop)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            stop.set()
            while not fut.done():  # wait for its clean-up, even if cancelled again meanwhile
                try:
                    await asyncio.shield(fut)
                except BaseException:  # noqa: BLE001 - its error is moot: we were cancelled
                    pass
            raise

    async def remove_placement(self, handles: list[Any]) -> None:
        await asyncio.get_running_loop().run_in_executor(None, _remove_all, list(handles))


def _on_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., None], *args: Any) -> None:
    """Run `fn(*args)` on `loop` (from Ray's thread); with no loop (or a closed one), here."""
    if loop is not None:
        try:
            loop.call_soon_threadsafe(fn, *args)
            return
        except RuntimeError:  # that loop is closed
            pass
    fn(*args)


def _cancel_replied(loop: asyncio.AbstractEventLoop | None, wedged: Callable[[Any], None], reply: Any) -> None:
    if isinstance(reply, (list, tuple)) and len(reply) == 4:  # (a Ray error or None: nothing to report)
        _on_loop(loop, wedged, tuple(reply))


def _kill_all(hosts: list[Any]) -> None:
    for h in hosts:
        try:
            ray.kill(h, no_restart=True)
        except Exception:
            pass


def _remove_all(handles: list[Any]) -> None:
    for pg in handles:
        try:
            remove_placement_group(pg)
        except Exception:
            pass


def _place(pool: Any, stop: threading.Event) -> tuple[list[Any], list[Any]]:
    try:
        return _place_groups(pool, stop)
    except (PlacementError, _Stopped):
        raise
    except Exception as e:  # the GCS unreachable, a malformed request: still a placement failure, named
        raise PlacementError(f"{pool!r} could not be placed: {type(e).__name__}: {e}") from e


def _place_groups(pool: Any, stop: threading.Event) -> tuple[list[Any], list[Any]]:
    _check_capacity(pool)
    nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: (not n.get("IsHeadNode", False), n["NodeID"]))
    pin = len(pool.bundles_per_node) > 1 and len(nodes) >= len(pool.bundles_per_node)
    bundle: dict[str, float] = {}
    if pool.cpus_per_bundle:
        bundle["CPU"] = pool.cpus_per_bundle
    if pool.gpus_per_bundle:
        bundle["GPU"] = pool.gpus_per_bundle
    pgs = []
    try:
        for i, count in enumerate(pool.bundles_per_node):
            kw: dict[str, Any] = {}
            if pin:  # one placement group per node, on distinct nodes
                kw["bundle_label_selector"] = [{"ray.io/node-id": nodes[i]["NodeID"]}] * count
            pgs.append(placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_PACK",
                                       name=f"{pool.name}-{id(pool):x}-{i}", **kw))
        _wait_ready(pgs, pool, stop)
    except BaseException:
        _remove_all(pgs)
        raise
    slots = []
    for node, (pg, count) in enumerate(zip(pgs, pool.bundles_per_node)):
        for b in range(count):
            slots.append(Slot(pg, b, node, b, pool.cpus_per_actor, pool.gpus_per_actor))
    return slots, pgs


class _Stopped(Exception):
    """The placement's waiter was cancelled."""


def _check_capacity(pool: Any) -> None:
    total = ray.cluster_resources()
    need_cpu = pool.cpus_per_bundle * pool.world_size
    need_gpu = pool.gpus_per_bundle * pool.world_size
    have_cpu, have_gpu = total.get("CPU", 0.0), total.get("GPU", 0.0)
    if need_cpu > have_cpu or need_gpu > have_gpu:
        raise PlacementError(
            f"{pool!r} needs {need_cpu:g} CPUs and {need_gpu:g} GPUs but the Ray cluster has {have_cpu:g} CPUs "
            f"and {have_gpu:g} GPUs in all; make the pool smaller, or give Ray more logical CPUs "
            "(asyncrl.init(num_cpus=...)) or more nodes"
        )


def _wait_ready(pgs: list[Any], pool: Any, stop: threading.Event) -> None:
    deadline = time.monotonic() + pool.placement_timeout
    while True:
        if all(_state(pg) == "CREATED" for pg in pgs):
            return
        for pg in pgs:
            table = placement_group_table(pg)
            if _state(pg, table) == "INFEASIBLE":
                raise PlacementError(
                    f"{pool!r} cannot be placed: a placement group of {len(table.get('bundles', {}))} bundles "
                    f"{table.get('bundles')} fits on no node of the cluster (scheduling state INFEASIBLE); "
                    "use fewer bundles per node or smaller bundles"
                )
        if time.monotonic() > deadline:
            raise PlacementError(
                f"{pool!r} was not placed within {pool.placement_timeout:g}s (the cluster's free resources are "
                f"{ray.available_resources()}); free resources or raise placement_timeout"
            )
        if stop.wait(0.05):
            raise _Stopped()


def _state(pg: Any, table: dict[str, Any] | None = None) -> str:
    table = table if table is not None else placement_group_table(pg)
    if table.get("state") == "CREATED":
        return "CREATED"
    return str(table.get("stats", {}).get("scheduling_state") or table.get("state"))
