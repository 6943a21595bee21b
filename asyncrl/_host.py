"""The worker side of a group: one host per worker process.

A host constructs the worker objects of one process (several, for colocated
groups), resolves pipelined arguments, and runs calls. Ordered calls are admitted by
the process's :class:`~asyncrl._lanes.Lane` in the order the controller numbered
them, whatever order they arrive in (an async Ray actor does not keep submission
order); concurrent calls run as soon as they arrive. A call's arguments travel as one
:class:`~asyncrl._wire.Payload`, so a worker that cannot unpickle them still runs the host method,
which reports the failure and releases the call's number.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import functools
import os
import pickle
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine

from asyncrl import batch as B
from asyncrl._deferred import (has_deferred, has_local, input_pad, resolve_on_worker, shallow, take_local_inputs,
                               take_top_inputs)
from asyncrl._lanes import NEVER_RAN, Lane, LoopWaits, OrderedThread, ThreadLane, ThreadWaits, Ticket
from asyncrl._wire import CallMsg, Payload, arrived
from asyncrl.errors import RemoteError
from asyncrl.register import registered_methods
from asyncrl.worker import WorkerContext, _CONTEXT


@dataclass
class RoleSpec:
    """How to build one worker object in a host."""

    role: str
    group: str
    cls: type
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    context: WorkerContext = field(default_factory=WorkerContext)
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # pragma: no cover - ray missing or not in a ray process
        pass
    return "127.0.0.1"


def _picklable(exc: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return None


class _HostBase:
    """What both host kinds share: the worker objects, their specs, set-up and the
    per-call checks. No ``async def`` here: Ray makes an actor async when its class has one."""

    _wait: Callable[[Any], Awaitable[Any]]  # how the host awaits a pipelined input's ref

    def __init__(self, lane: Lane, local: bool) -> None:
        self._local = local
        self._lane = lane
        self._workers: dict[str, Any] = {}
        self._specs: dict[str, RoleSpec] = {}
        self._methods: dict[str, dict[str, Any]] = {}

    def node_info(self) -> dict[str, Any]:
        """Address and a free port of this process's node (rank 0 serves as MASTER_ADDR)."""
        return {"ip": node_ip(), "port": free_port(), "pid": os.getpid()}

    def _prepare(self, spec: RoleSpec) -> Callable[[], Any]:
        """Set the process up for `spec`; returns the constructor to run on the thread of its plain ``def`` methods."""
        if not self._local:  # in-process workers share the controller's environment
            from asyncrl.runtime import quiet_tensor_warnings

            quiet_tensor_warnings()
            os.environ.update(spec.env)
            self._set_threads(spec.context)
        return functools.partial(contextvars.copy_context().run, _construct, spec)

    def _constructed(self, spec: RoleSpec, outcome: tuple[bool, Any], out: dict[str, dict[str, Any]]) -> None:
        ok, worker = outcome
        if not ok:
            e = worker
            raise RemoteError(
                spec.group, f"{spec.cls.__name__}.__init__", spec.context.rank,
                f"{type(e).__module__}.{type(e).__qualname__}", str(e),
                "".join(traceback.format_exception(e)), cause=_picklable(e),
            ) from None
        self._workers[spec.role] = worker
        self._specs[spec.role] = spec
        self._methods[spec.role] = registered_methods(spec.cls)
        out[spec.role] = dict(worker._asyncrl_meshes)

    def _started(self) -> None:
        if not self._local:  # (in-process workers: the controller's group set-up does it)
            gc.freeze()  # see asyncrl.host_set: start-up objects out of the collector's full passes

    @staticmethod
    def _set_threads(ctx: WorkerContext) -> None:
        n = max(1, int(ctx.num_cpus))
        os.environ.setdefault("OMP_NUM_THREADS", str(n))
        try:
            import torch

            torch.set_num_threads(n)
        except Exception:  # pragma: no cover
            pass

    def cancel_calls(self, entries: list[tuple[int, int | None]], deadline: bool = False, note: int = 0) -> Any:
        """The worker end of the one cancel path (see docs/protocol.md); after a
        deadline's cancel, the call wedging the lane, if any (pinned-thread). `note`: this
        control message's number (control-before-call; 0: unnumbered)."""
        try:
            return self._lane.cancel(entries, deadline)
        finally:
            self._lane.control.done(note)

    def control_state(self) -> dict[str, int]:
        """For tests: the control messages handled (every one numbered up to ``seen``) and
        the calls waiting for one now (control-before-call of docs/protocol.md)."""
        return {"seen": self._lane.control.seen, "waiting": self._lane.control.waiting}

    def _identity(self, role: str) -> tuple[str, int]:
        """``(group, rank)`` a call to `role` is reported under (an unknown role: itself, -1)."""
        spec = self._specs.get(role)
        return (spec.group, spec.context.rank) if spec is not None else (role, -1)

    def _lookup(self, role: str, method: str, payload: "Payload") -> tuple[RoleSpec, Any]:
        """The call's role and method spec; raises the call's error for an unknown method
        or arguments the worker could not unpickle."""
        spec = self._specs.get(role)
        mspec = self._methods[role].get(method) if spec is not None else None
        if spec is None or mspec is None:
            group, rank = self._identity(role)
            raise RemoteError(group, method, rank, "asyncrl.errors.RegistrationError",
                              f"{role}.{method} is not a registered method of this worker", "")
        if payload.error is not None:
            raise RemoteError(spec.group, method, spec.context.rank, *payload.error)
        return spec, mspec

    @staticmethod
    def _method_error(spec: RoleSpec, method: str, e: Exception) -> RemoteError:
        return RemoteError(spec.group, method, spec.context.rank, f"{type(e).__module__}.{type(e).__qualname__}",
                           str(e), "".join(traceback.format_exception(e)), cause=_picklable(e))

    def _finish(self, spec: RoleSpec, msg: CallMsg, args: Any, kwargs: Any, result: Any, pad: int,
                ticket: Ticket, data_parallel: bool, times: tuple[float, float, float]) -> Any:
        """The call's return: the result, and with `want_meta` its metadata ``(rows,
        trailing padding rows, arrived, started, ended)``: rows and padding of a
        data-parallel result (``(None, 0)`` for another mode, timed by the group's
        ``time_calls``), then `times`, the host's ``time.time()`` when the call arrived,
        when the method started (its turn and inputs there) and when it returned."""
        keep = msg.keep
        if not msg.want_meta:
            return result if keep else None
        meta = (*(self._meta(spec, msg.method, args, kwargs, result, pad) if data_parallel else (None, 0)), *times)
        if ticket.outcome is not None:  # kept for same-process consumers (same-process-window of docs/protocol.md)
            # The container as it is now, as Ray serializes it now: a worker that returns a
            # container it keeps (a buffer it refills) and changes its keys in a later call
            # does not change what this call's consumers read.
            ticket.outcome = (True, shallow(result), meta)
        return (result if keep else None), meta

    def _keeps(self, ticket: Ticket, want_meta: bool, keep: bool) -> None:
        """Mark an ordered call whose outcome its lane keeps for same-process consumers:
        a data-parallel call whose result is kept (what a :class:`LocalShard` can name).
        Until it returns, its outcome is a failure that never ran."""
        if want_meta and keep and ticket.seq is not None and self._lane.keep_results:
            ticket.outcome = NEVER_RAN

    @staticmethod
    def _failed(ticket: Ticket, e: BaseException) -> None:
        if ticket.outcome is not None:
            ticket.outcome = (False, e)

    @staticmethod
    def _meta(spec: RoleSpec, method: str, args: Any, kwargs: Any, result: Any, pad: int) -> tuple[int, int]:
        rows = B.result_len(result)
        if rows is None:
            raise RemoteError(spec.group, method, spec.context.rank, "asyncrl.errors.DispatchError",
                              f"a DP_COMPUTE method must return a batch (TensorDict, tensor or list), "
                              f"got {type(result).__name__}; use DP_COMPUTE_METRIC for per-rank values", "")
        if pad == 0:
            return rows, 0
        in_rows = next((B.batch_len(a) for a in [*args, *kwargs.values()] if B.is_batch(a)), None)
        if not in_rows or (rows * pad) % in_rows:
            raise RemoteError(spec.group, method, spec.context.rank, "asyncrl.errors.DispatchError",
                              f"returned {rows} rows for {in_rows} input rows of which {pad} are padding; "
                              "a padded DP_COMPUTE method must return a whole multiple of its input rows", "")
        return rows, rows * pad // in_rows

    def _close_workers(self) -> None:
        self._lane.cancel_all()
        for w in self._workers.values():
            try:
                w.on_close()
            except Exception:  # closing must not fail the group's close
                traceback.print_exc()

    def ping(self) -> int:
        return os.getpid()


class WorkerHost(_HostBase):
    """Runs the worker objects of one process on an event loop: an async Ray actor (the
    Ray backend's host for processes with concurrent methods), and the local backend's host."""

    def __init__(self, wait: Callable[[Any], Awaitable[Any]] | None = None, local: bool = False) -> None:
        super().__init__(Lane(), local)
        self._wait = wait or _await_plain
        self._thread = OrderedThread()  # runs the constructors and every plain def method
        self._waits = LoopWaits(self._lane, self._thread)

    def host_kind(self) -> str:
        return "async"

    async def init_workers(self, specs: list[RoleSpec], keep_results: int = 0) -> dict[str, dict[str, Any]]:
        """Construct the workers; returns each role's registered meshes. `keep_results`:
        how many of its latest ordered numbers the lane keeps outcomes of (same-process-window of
        docs/protocol.md)."""
        self._lane.keep_results = keep_results
        out: dict[str, dict[str, Any]] = {}
        for spec in specs:
            construct = self._prepare(spec)
            try:
                outcome: tuple[bool, Any] = (True, await self._thread.run(construct))
            except Exception as e:
                outcome = (False, e)
            self._constructed(spec, outcome, out)
        self._started()
        return out

    async def call(self, msg: CallMsg, *top: Any) -> Any:
        """Run the call `msg`; `top`: its top-level inputs. The steps are
        :func:`_run_call`'s; they wait on this process's event loop."""
        return await _run_call(self, self._waits, msg, top, False)

    async def call_packed(self, packed: list[Any], *top: Any) -> Any:
        """:meth:`call` of the message :meth:`CallMsg.wire` packed: the Ray backend's entry point
        (one argument for Ray to serialize and deserialize per call), then the call's
        top-level inputs, resolved by Ray."""
        return await _run_call(self, self._waits, packed, top, False)

    async def close(self) -> None:
        """Cancel the calls in flight, call each worker's `on_close`, then stop the thread."""
        self._close_workers()
        self._thread.stop()

    def abort(self) -> None:
        """Cancel every call in flight at once (the local backend's stand-in for killing the process)."""
        self._lane.cancel_all()


class ThreadedHost(_HostBase):
    """Runs the worker objects of one process without an event loop on the call path:
    the Ray backend's host for processes with no concurrent methods.

    A sync Ray actor with three concurrency groups: ``ordered``, ONE thread (the
    *pinned* thread), which builds the workers and receives every ordered call the
    controller can run at once (no pipelined input to fetch first); ``calls``
    (:data:`THREADED_CALLS` threads) for concurrent calls and ordered calls with nested
    pipelined inputs, which fetch them while their predecessors run; ``control`` for
    cancel messages and close. A pinned call waits for its turn and runs its plain
    ``def`` method right there, on the thread that received it and built the worker:
    no thread hand-off. A ``calls``-group call hands its ``def`` method to the pinned
    thread as a job (the pinned call waiting for its turn runs it, or a call the host
    submits to itself does: pinned-thread of docs/protocol.md). ``async def``
    methods and the resolution of pipelined arguments run on an event loop of the
    host's own (a thread started at the first use). Ordering, cancellation and the
    wedged lane are :class:`~asyncrl._lanes.ThreadLane`'s; a wedge that pinned calls
    queued in Ray cannot see is the controller's to act on (pinned-thread).
    """

    def __init__(self, wait: Callable[[Any], Awaitable[Any]] | None = None) -> None:
        super().__init__(ThreadLane(), local=False)
        self._wait = wait or _await_plain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self._waits = ThreadWaits(self._lane, self._event_loop)  # type: ignore[arg-type]

    def host_kind(self) -> str:
        return "threaded"

    def init_workers(self, specs: list[RoleSpec], keep_results: int = 0) -> dict[str, dict[str, Any]]:
        """Construct the workers here, on the pinned thread (every plain ``def`` call runs
        on it); returns each role's registered meshes. `keep_results`: as
        :meth:`WorkerHost.init_workers`'s."""
        threading.current_thread().name = "asyncrl-ordered_0"
        self._lane.keep_results = keep_results
        out: dict[str, dict[str, Any]] = {}
        for spec in specs:
            construct = self._prepare(spec)
            try:
                outcome: tuple[bool, Any] = (True, construct())
            except Exception as e:
                outcome = (False, e)
            self._constructed(spec, outcome, out)
        self._started()
        return out

    def serve_jobs(self) -> None:
        """On the pinned thread: run the ``def`` methods of ``calls``-group calls waiting for it (pinned-thread)."""
        self._lane.serve_jobs()  # type: ignore[attr-defined]

    def wait_unwedged(self, call_id: int) -> bool:
        """Return once call `call_id` no longer wedges this process's lane (pinned-thread)."""
        return self._lane.wait_unwedged(call_id)  # type: ignore[attr-defined]

    def pinned_state(self) -> dict[str, Any]:
        """For tests: the pinned thread's state (:meth:`~asyncrl._lanes.ThreadLane.pinned_state`)."""
        return self._lane.pinned_state()  # type: ignore[attr-defined]

    def unfence(self, call_id: int, upto: int, note: int = 0) -> None:
        """The controller saw call `call_id`'s wedge end: admit ordered numbers from `upto`
        on (pinned-thread). `note`: this control message's number (control-before-call)."""
        try:
            self._lane.unfence(call_id, upto)  # type: ignore[attr-defined]
        finally:
            self._lane.control.done(note)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="asyncrl-host-loop", daemon=True).start()
                self._loop = loop
            return self._loop

    def call(self, msg: "CallMsg | list[Any]", top: tuple[Any, ...] = (), pinned: bool = False) -> Any:
        """Run the call `msg` (or the list :meth:`CallMsg.wire` packed; in Ray's thread, blocking). `top`: its top-level inputs
        (resolved by Ray: no hand-off to the host's loop for them). `pinned`: this is the
        pinned thread (pinned-thread). The steps are :func:`_run_call`'s; every wait blocks this thread."""
        return _blocking(_run_call(self, self._waits, msg, top, pinned))

    def call_packed(self, packed: list[Any], *top: Any) -> Any:
        """:meth:`call` of the message :meth:`CallMsg.wire` packed, then its top-level
        inputs: the Ray backend's entry point (``calls`` group)."""
        return self.call(packed, top)

    def close(self) -> None:
        """Cancel the calls in flight, call each worker's `on_close`, then stop the threads."""
        self._close_workers()
        with self._loop_lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)


# ---- the call: one template, two ways of waiting --------------------------------------------


async def _run_call(host: _HostBase, waits: "LoopWaits | ThreadWaits", msg: "CallMsg | list[Any]",
                    top: tuple[Any, ...], pinned: bool) -> Any:
    """The steps of one call on a host, for both host kinds: wait for the control messages
    sent before it (control-before-call), arrive in the lane, start fetching its pipelined inputs, wait
    for its turn (ordered calls), take its same-process inputs, run the method, report.
    Every wait is `waits`'s: :class:`LoopWaits` awaits on the async host's event loop;
    :class:`ThreadWaits` blocks the threaded host's Ray thread (never suspends, so
    :func:`_blocking` runs the coroutine to its end in one step)."""
    arrived_at = time.time()  # the worker's times travel in the call's metadata (want_meta)
    if type(msg) is list:  # as the Ray backend sent it
        msg = CallMsg.from_wire(msg)
    assert isinstance(msg, CallMsg)
    role, method, seq = msg.role, msg.method, msg.seq
    group, rank = host._identity(role)
    lane = host._lane
    after = msg.after
    if after > lane.control.seen:  # a control message sent before this call is not handled yet
        await waits.control(after)
    ticket = lane.arrive(msg.call_id, seq, group, method, rank)  # from here on, leave() releases the number
    resolving: Any = None
    host._keeps(ticket, msg.want_meta, msg.keep)
    try:
        payload = arrived(msg.payload)
        spec, mspec = host._lookup(role, method, payload)
        args1, kwargs1, top_pad = take_top_inputs(spec, method, payload.args, payload.kwargs, top)
        if has_deferred(args1, kwargs1):  # pipelined inputs: fetch them while waiting our turn
            resolving = waits.start(ticket, resolve_on_worker(spec, method, args1, kwargs1, host._wait))
        if seq is not None:
            await waits.turn(ticket, pinned)
        if resolving is None:
            args2, kwargs2, pipe_pad = args1, kwargs1, None
        else:
            args2, kwargs2, pipe_pad = await waits.resolved(resolving)
        local_pad = None
        if has_local(args2, kwargs2):  # same-process inputs: the producers ran before our turn
            args2, kwargs2, local_pad = take_local_inputs(host._lane, spec, method, ticket, args2, kwargs2)
        pad = msg.in_pad if msg.in_pad is not None else input_pad(spec, method, top_pad, pipe_pad, local_pad)
        fn = getattr(host._workers[role], method)
        started_at = time.time()
        try:
            if mspec.is_async:
                result = await waits.run_async(ticket, fn(*args2, **kwargs2))
            else:
                run = functools.partial(contextvars.copy_context().run, fn, *args2, **kwargs2)
                result = await waits.run_def(ticket, run, pinned)
        except waits.cancelled:
            raise
        except Exception as e:
            raise host._method_error(spec, method, e) from None
        return host._finish(spec, msg, args2, kwargs2, result, pad, ticket, mspec.dispatch_mode.data_parallel,
                            (arrived_at, started_at, time.time()))
    except BaseException as e:
        host._failed(ticket, e)
        raise
    finally:
        if resolving is not None:
            waits.stop(resolving)
        lane.leave(ticket)


def _blocking(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (a threaded host's :func:`_run_call`) to its end, here."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a threaded host's call suspended: its waits must block, never await")


def _construct(spec: RoleSpec) -> Any:
    token = _CONTEXT.set(spec.context)
    try:
        return spec.cls(*spec.args, **spec.kwargs)
    finally:
        _CONTEXT.reset(token)


async def _await_plain(x: Any) -> Any:
    return await x
