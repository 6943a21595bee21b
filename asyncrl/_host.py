"""The worker side of a group: one host per worker process.

A host constructs the worker objects of one process (several, for colocated groups),
takes a call's pipelined inputs, and runs calls through the process's
:class:`~asyncrl._lanes.Lane`. Two kinds, one lane:

* :class:`ThreadedHost` (a sync Ray actor; processes with no concurrent method): every
  ordered call comes through Ray's one-thread group, in the order the controller sent it
  (one-thread-group-order), and its call is a plain function on that thread: unpack, check
  refusals, take its inputs (waiting for unfinished ones right there), run.
* :class:`WorkerHost` (an async Ray actor, and the local backend's host): calls start in
  any order, so an ordered call waits for its number in the lane; plain ``def`` methods run
  in one thread of the host's own.

A call's arguments travel as one :class:`~asyncrl._wire.Payload`, so a worker that cannot
unpickle them still runs the host method, which reports the failure and releases the
call's number.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import os
import pickle
import threading
import time
import traceback
from typing import Any, Awaitable, Callable

from asyncrl import batch as B
from asyncrl._deferred import input_pad, resolve_on_worker, take_local_inputs, take_top_inputs
from asyncrl._lanes import CONTROL_WAIT, NEVER_RAN, Lane, OrderedThread, Ticket, shallow
from asyncrl._wire import CallCancelled, CallMsg, Payload, arrived, as_columns, has_deferred, has_local
from asyncrl.errors import RemoteError
from asyncrl.register import registered_methods
from asyncrl.worker import RoleSpec, Worker, WorkerContext, _CONTEXT
from asyncrl.runtime import free_port, quiet_tensor_warnings


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
        if isinstance(worker, Worker):
            worker._asyncrl_colocated = self._workers  # (shared: each sees the roles built after it too)
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

    def cancel_calls(self, entries: list[tuple[int, int | None]], deadline: bool = False,
                     behind: list[tuple[int, int | None]] = (), note: int = 0) -> Any:  # type: ignore[assignment]
        """The worker end of the one cancel path (see docs/protocol.md). After a deadline's
        cancel: the wedge, if one of the calls still runs its plain ``def`` method (then the
        calls `behind` it are cancelled too), else None (wedged-lane). `note`: this control
        message's number (control-before-call; 0: unnumbered)."""
        try:
            return self._lane.cancel(entries, deadline, behind)
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

    def _arrived(self, msg: CallMsg, top: tuple[Any, ...]) -> tuple[RoleSpec, Any, Any, Any, int | None]:
        """The call's role and method spec, and its arguments as they arrived with its
        top-level inputs in place (and the padding those report)."""
        payload = arrived(msg.payload)
        spec, mspec = self._lookup(msg.role, msg.method, payload)
        if not top:
            return spec, mspec, payload.args, payload.kwargs, None
        return spec, mspec, *take_top_inputs(spec, msg.method, payload.args, payload.kwargs, top)

    def _at_turn(self, spec: RoleSpec, msg: CallMsg, ticket: Ticket, args: Any, kwargs: Any,
                 top_pad: int | None, pipe_pad: int | None) -> tuple[Any, Any, int]:
        """At the call's turn: its same-process inputs in place (the producers ran before
        it), and its input padding."""
        local_pad = None
        if has_local(args, kwargs):
            args, kwargs, local_pad = take_local_inputs(self._lane, spec, msg.method, ticket, args, kwargs)
        if msg.in_pad is not None:
            return args, kwargs, msg.in_pad
        if top_pad is None and pipe_pad is None and local_pad is None:
            return args, kwargs, 0
        return args, kwargs, input_pad(spec, msg.method, top_pad, pipe_pad, local_pad)

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
        when the method started (its turn and inputs there) and when it returned; then, for a
        data-parallel method registered with ``summary`` fields, those fields of the result."""
        keep = msg.keep
        out = (result if self._local else as_columns(result)) if keep else None  # (Ray pickles it: as its columns)
        if not msg.want_meta:
            return out
        meta = (*(self._meta(spec, msg.method, args, kwargs, result, pad) if data_parallel else (None, 0)), *times)
        fields = self._methods[spec.role][msg.method].summary
        if fields and data_parallel:  # the result's small fields ride in the reply (GroupFuture.summary)
            meta = (*meta, _summary(result, fields))
        if ticket.outcome is not None:  # kept for same-process consumers (same-process-window of docs/protocol.md)
            # The container as it is now, as Ray serializes it now: a worker that returns a
            # container it keeps (a buffer it refills) and changes its keys in a later call
            # does not change what this call's consumers read.
            ticket.outcome = (True, shallow(result), meta)
        return out, meta

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
    Ray backend's host for processes with concurrent methods), and the local backend's
    host. Calls start in any order; an ordered one waits for its number in the lane, and
    its plain ``def`` method runs in the host's one thread (:class:`~asyncrl._lanes.OrderedThread`)."""

    def __init__(self, wait: Callable[[Any], Awaitable[Any]] | None = None, local: bool = False) -> None:
        super().__init__(Lane(), local)
        self._wait = wait or _await_plain
        self._thread = OrderedThread()  # runs the constructors and every plain def method

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

    async def call(self, msg: "CallMsg | list[Any]", *top: Any) -> Any:
        """Run one call (the Ray backend sends the list :meth:`CallMsg.wire` packed, then the
        call's top-level inputs, resolved by Ray): wait for the control messages sent before
        it (control-before-call), arrive in the lane, start fetching its pipelined inputs, wait for
        its turn, take its same-process inputs, run the method, report."""
        arrived_at = time.time()  # the worker's times travel in the call's metadata (want_meta)
        if type(msg) is not CallMsg:
            msg = CallMsg.from_wire(msg)  # type: ignore[arg-type]
        lane = self._lane
        if msg.after > lane.control.seen:  # a control message sent before this call is not handled yet
            await lane.control.wait_async(msg.after, CONTROL_WAIT)
        group, rank = self._identity(msg.role)
        ticket = lane.arrive(msg.call_id, msg.seq, group, msg.method, rank, asyncio.current_task().cancel)  # type: ignore[union-attr]
        self._keeps(ticket, msg.want_meta, msg.keep)
        resolving: asyncio.Future[Any] | None = None
        try:
            spec, mspec, args, kwargs, top_pad = self._arrived(msg, top)
            if has_deferred(args, kwargs):  # pipelined inputs: fetch them while waiting our turn
                resolving = asyncio.ensure_future(resolve_on_worker(spec, msg.method, args, kwargs, self._wait))
            if msg.seq is not None:
                await lane.turn(ticket)
            pipe_pad = None
            if resolving is not None:
                args, kwargs, pipe_pad = await resolving
            args, kwargs, pad = self._at_turn(spec, msg, ticket, args, kwargs, top_pad, pipe_pad)
            fn = getattr(self._workers[msg.role], msg.method)
            started_at = time.time()
            try:
                if mspec.is_async:
                    result = await fn(*args, **kwargs)
                else:
                    run = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
                    result = await lane.run_thread(ticket, run, self._thread)
            except Exception as e:
                raise self._method_error(spec, msg.method, e) from None
            return self._finish(spec, msg, args, kwargs, result, pad, ticket, mspec.dispatch_mode.data_parallel,
                                (arrived_at, started_at, time.time()))
        except BaseException as e:
            self._failed(ticket, e)
            raise
        finally:
            if resolving is not None and not resolving.done():
                resolving.cancel()
            lane.leave(ticket)

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

    A sync Ray actor with three concurrency groups (the backend names the group of each
    call): ``ordered``, ONE thread (the *pinned* thread), which builds the workers and
    runs every ordered call, in the order the controller sent them (Ray keeps it:
    one-thread-group-order); ``calls`` (the backend's ``THREADED_CALLS`` threads) for
    concurrent calls; ``control`` for cancel messages and close. A call is a plain function
    on the thread that received it: its plain ``def`` method runs right there (no thread
    hand-off, what a plain sync Ray actor costs); an ``async def`` method, and the fetch of
    pipelined inputs that were still being produced when the call was sent, run on an event
    loop of the host's own (a thread started at the first use) while the call's thread
    waits for them, and the calls behind it wait in Ray's queue as behind any running call
    (pinned-thread of docs/protocol.md).
    """

    def __init__(self, wait: Callable[[Any], Awaitable[Any]] | None = None) -> None:
        super().__init__(Lane(ray_ordered=True), local=False)
        self._wait = wait or _await_plain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def host_kind(self) -> str:
        return "threaded"

    def init_workers(self, specs: list[RoleSpec], keep_results: int = 0) -> dict[str, dict[str, Any]]:
        """Construct the workers here, on the pinned thread (every ordered call runs on it);
        returns each role's registered meshes. `keep_results`: as :meth:`WorkerHost.init_workers`'s."""
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

    def call(self, msg: "CallMsg | list[Any]", *top: Any) -> Any:
        """Run one call on this thread (as :meth:`WorkerHost.call` takes it): wait for the
        control messages sent before it (control-before-call), arrive in the lane (refused if
        cancelled before it arrived), take its inputs (waiting here for pipelined ones still
        being produced), run the method, report."""
        arrived_at = time.time()
        if type(msg) is not CallMsg:
            msg = CallMsg.from_wire(msg)  # type: ignore[arg-type]
        lane = self._lane
        if msg.after > lane.control.seen:
            lane.control.wait(msg.after, CONTROL_WAIT)
        group, rank = self._identity(msg.role)
        ticket = lane.arrive(msg.call_id, msg.seq, group, msg.method, rank)
        self._keeps(ticket, msg.want_meta, msg.keep)
        try:
            spec, mspec, args, kwargs, top_pad = self._arrived(msg, top)
            pipe_pad = None
            if has_deferred(args, kwargs):
                args, kwargs, pipe_pad = self._on_loop(ticket, resolve_on_worker(spec, msg.method, args, kwargs,
                                                                                 self._wait))
            args, kwargs, pad = self._at_turn(spec, msg, ticket, args, kwargs, top_pad, pipe_pad)
            fn = getattr(self._workers[msg.role], msg.method)
            started_at = time.time()
            try:
                if mspec.is_async:
                    result = self._on_loop(ticket, fn(*args, **kwargs))
                else:
                    result = lane.run_here(ticket, functools.partial(contextvars.copy_context().run, fn, *args,
                                                                     **kwargs))
            except CallCancelled:
                raise
            except Exception as e:
                raise self._method_error(spec, msg.method, e) from None
            return self._finish(spec, msg, args, kwargs, result, pad, ticket, mspec.dispatch_mode.data_parallel,
                                (arrived_at, started_at, time.time()))
        except BaseException as e:
            self._failed(ticket, e)
            raise
        finally:
            lane.leave(ticket)

    def _on_loop(self, ticket: Ticket, coro: Any) -> Any:
        """Run `coro` on the host's event loop while this thread waits for it; cancelling the
        call cancels it, and the wait ends once it has unwound (cancelled-while-waiting,
        cancelled-async-method)."""
        work = _LoopWork(self._event_loop())
        self._lane.abort_with(ticket, work.cancel, coro)
        try:
            work.start(coro)
            return work.result()
        finally:
            self._lane.abort_with(ticket, None)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="asyncrl-host-loop", daemon=True).start()
                self._loop = loop
            return self._loop

    def close(self) -> None:
        """Cancel the calls in flight, call each worker's `on_close`, then stop the loop."""
        self._close_workers()
        with self._loop_lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)


class RanksHost:
    """The hosts of several ranks in one process (an async Ray actor): one :class:`WorkerHost` per rank, each with
    its own worker objects, ordered lane and thread; every method names its rank's host (``index``, the rank's
    place in this process). What a group of ``ranks_per_process > 1`` runs on (the Ray backend's ``make_hosts``)."""

    def __init__(self, wait: Callable[[Any], Any], ranks: int) -> None:
        self._hosts = [WorkerHost(wait=wait) for _ in range(ranks)]
        self._constructing: asyncio.Lock | None = None

    def node_info(self, index: int) -> dict[str, Any]:
        return self._hosts[index].node_info()

    def host_kind(self, index: int) -> str:
        return self._hosts[index].host_kind()

    def ping(self, index: int) -> int:
        return self._hosts[index].ping()

    async def init_workers(self, index: int, specs: list[Any], keep_results: int = 0) -> dict[str, dict[str, Any]]:
        # One rank's constructors at a time: each rank's run on its own thread, and two threads importing a
        # lazily-loaded library (transformers) at once can see it half-initialised.
        if self._constructing is None:
            self._constructing = asyncio.Lock()
        async with self._constructing:
            return await self._hosts[index].init_workers(specs, keep_results)

    async def call(self, index: int, msg: "CallMsg | list[Any]", *top: Any) -> Any:
        return await self._hosts[index].call(msg, *top)

    def cancel_calls(self, index: int, entries: list[tuple[int, int | None]], deadline: bool = False,
                     behind: list[tuple[int, int | None]] = (), note: int = 0) -> Any:  # type: ignore[assignment]
        return self._hosts[index].cancel_calls(entries, deadline, behind, note)

    def control_state(self, index: int) -> dict[str, int]:
        return self._hosts[index].control_state()

    async def close(self, index: int) -> None:
        await self._hosts[index].close()


class _LoopWork:
    """A coroutine run on the threaded host's event loop for a call whose thread waits for
    it (:meth:`result`). Started and cancelled through the loop's queue, so a cancel always
    finds it started; it is over once the coroutine has unwound."""

    __slots__ = ("_loop", "_task", "_cancelled", "_done", "_outcome")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task: asyncio.Task[Any] | None = None
        self._cancelled = False
        self._done = threading.Event()
        self._outcome: tuple[bool, Any] = (False, None)

    def start(self, coro: Any) -> None:
        self._loop.call_soon_threadsafe(self._start, coro)

    def cancel(self) -> None:
        """From any thread."""
        try:
            self._loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:  # the loop is closed (the host is closing): nothing runs there any more
            pass

    def result(self) -> Any:
        self._done.wait()
        ok, value = self._outcome
        if ok:
            return value
        raise value

    def _start(self, coro: Any) -> None:
        if self._cancelled:
            coro.close()
            self._finish((False, CallCancelled("cancelled before it started")))
            return
        self._task = self._loop.create_task(coro)
        self._task.add_done_callback(self._ended)

    def _cancel(self) -> None:
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()

    def _ended(self, task: "asyncio.Task[Any]") -> None:
        if task.cancelled():
            self._finish((False, CallCancelled("cancelled")))
        elif task.exception() is not None:
            self._finish((False, task.exception()))
        else:
            self._finish((True, task.result()))

    def _finish(self, outcome: tuple[bool, Any]) -> None:
        self._outcome = outcome
        self._done.set()


def _summary(result: Any, fields: Any) -> dict[str, Any]:
    """The `fields` of a data-parallel `result` that it has (copies: a view would carry its whole storage), or
    what the method's summary function (`fields` callable) gives of it."""
    if callable(fields):
        return {str(k): v for k, v in fields(result).items()}
    keys = result.keys() if hasattr(result, "keys") else ()
    return {f: result[f].clone() for f in fields if f in keys}


def _construct(spec: RoleSpec) -> Any:
    token = _CONTEXT.set(spec.context)
    try:
        return spec.cls(*spec.args, **spec.kwargs)
    finally:
        _CONTEXT.reset(token)


async def _await_plain(x: Any) -> Any:
    return await x
