"""The Ray backend's fetch machinery: how the outcomes of ObjectRefs reach the controller's event loop.

:class:`_Resolver` (one per process) hands each fetch (:class:`_Fetch`) to the getter
thread (:class:`_Getter`, a ``ray.get`` of its own) or to Ray's completion callbacks, and
delivers it to the loop in one wake-up; :class:`_Watch` runs a callback once a set of refs
is done. Nothing here blocks the event loop.
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
from ray.exceptions import RayError

from asyncrl.backends._ray_errors import _translate

__all__: list[str] = []  # the Ray backend's internals

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
    instead of one per ref. On the loop, the delivery resolves :attr:`outcome` once with
    ``(outcomes, failed, at)``: `failed` is -1 and `outcomes` the values in the order of the
    refs, or the position of the first error and ``outcomes[failed]`` Ray's raw error (see
    :func:`_translate`); `at` is ``time.perf_counter()`` when Ray's thread (or the getter's)
    saw it. :meth:`cancel` (on the loop) makes a later delivery a no-op.
    """

    __slots__ = ("_loop", "outcome", "_refs", "_outcomes", "_left", "_failed", "_sent", "_live", "_queued", "at")

    _LOCK = threading.Lock()  # the count-down, across Ray's callback threads

    def __init__(self, loop: asyncio.AbstractEventLoop, refs: Sequence[Any], queued: bool) -> None:
        self._loop = loop
        self.outcome: asyncio.Future[tuple[list[Any], int, float]] = loop.create_future()
        """What the fetch delivers, on the loop, in one wake-up (see the class docstring)."""
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
        if not self.outcome.done():  # (an awaiter that was cancelled cancels it)
            self.outcome.set_result((self._outcomes, self._failed, self.at))

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
    0.87-0.99x with uvloop's. So while the
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

    def fetch(self, refs: Sequence[Any]) -> _Fetch:
        """Fetch `refs` with one loop wake-up (see :class:`_Fetch`); returns its handle,
        whose :attr:`_Fetch.outcome` the caller awaits."""
        loop = asyncio.get_running_loop()
        queued = self.native + len(refs) > _NATIVE_LIMIT
        if not queued:
            self.native += len(refs)
        try:
            return _Fetch(loop, refs, queued)
        except BaseException:
            if not queued:
                self.native -= len(refs)
            raise

    async def wait(self, ref: Any) -> Any:
        """One ref's value; Ray's error as :func:`_translate` makes it."""
        handle = self.fetch([ref])
        try:
            outcomes, failed, _ = await handle.outcome
        finally:
            handle.cancel()  # (a no-op once delivered)
        if failed < 0:
            return outcomes[0]
        raise _translate(outcomes[0])

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


class _Peek:
    """Hands the values of a set of small ObjectRefs to `callback` (on Ray's thread) once
    every one completed: Ray's ``_on_completed`` per ref (the value, or Ray's error
    object), no fetch thread, no event-loop wake-up. Used for calls' metadata (the
    worker's times), which the task's reply carries to the controller."""

    __slots__ = ("_left", "_values", "_callback", "_refs")

    _LOCK = threading.Lock()

    def __init__(self, refs: Sequence[Any], callback: Callable[[list[Any]], None]) -> None:
        self._refs = list(refs)
        self._values: list[Any] = [None] * len(self._refs)
        self._left = len(self._refs) + 1  # +1: registration itself (as _Watch)
        self._callback = callback
        for i, ref in enumerate(self._refs):
            try:
                ref._on_completed(functools.partial(self._one, i))
            except Exception as e:  # Ray shut down under us: that value never comes
                self._one(i, e)
        self._one(-1, None)

    def _one(self, i: int, value: Any) -> None:
        if i >= 0:
            self._values[i] = value
        with self._LOCK:
            self._left -= 1
            if self._left:
                return
        self._refs = []
        self._callback(self._values)

