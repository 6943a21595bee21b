"""The worker side of a group: one host per worker process.

A host constructs the worker objects of one process (several, for colocated
groups), resolves pipelined arguments, and runs calls. Ordered calls are admitted by
the process's :class:`~asyncrl._sequencer.Lane` in the order the controller numbered
them, whatever order they arrive in (an async Ray actor does not keep submission
order); concurrent calls run as soon as they arrive. A call's arguments travel as one
:class:`Payload`, so a worker that cannot unpickle them still runs the host method,
which reports the failure and releases the call's number.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import functools
import io
import os
import pickle
import queue
import socket
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from asyncrl import batch as B
from asyncrl._deferred import DeferredShard, DeferredValue, resolve_args
from asyncrl._sequencer import Lane
from asyncrl.errors import AsyncRLError, DispatchError, RemoteError, UpstreamError
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


class Payload:
    """A call's arguments on their way to a worker.

    Pickled as a nested pickle stream (with Ray's reducers and out-of-band buffers, so
    tensors still cross without copies) whose unpickling on the worker never raises: a
    failure (a class that is not importable there, a ``__setstate__`` that raises)
    arrives as `error` and the host reports it as the call's ``RemoteError``, releasing
    the call's number (case 3 of :mod:`asyncrl._sequencer`).
    """

    __slots__ = ("args", "kwargs", "error")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 error: tuple[str, str, str] | None = None) -> None:
        self.args = args
        self.kwargs = kwargs
        self.error = error

    def __reduce__(self) -> tuple[Any, ...]:
        data, buffers = _inner_pickler().dumps((self.args, self.kwargs))
        return (_UNPACK, (data, *buffers))

    def local_copy(self) -> "Payload":
        """What a worker process would receive, made in this process (the local backend):
        pickled and unpickled, deferred values passed through as they are."""
        from ray import cloudpickle

        kept: list[Any] = []

        class _Pickler(cloudpickle.CloudPickler):
            def persistent_id(self, obj: Any) -> Any:
                if isinstance(obj, (DeferredShard, DeferredValue)):
                    kept.append(obj)
                    return len(kept) - 1
                return None

        class _Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                return kept[pid]

        buf = io.BytesIO()
        _Pickler(buf, protocol=5).dump((self.args, self.kwargs))  # raises at submission, as Ray's would
        try:
            args, kwargs = _Unpickler(io.BytesIO(buf.getvalue())).load()
        except Exception as e:
            return Payload((), {}, _unpickling_error(e))
        return Payload(args, kwargs)


class _InnerPickler:
    """One cloudpickle pickler per thread, reused for every Payload (building a pickler
    costs several times more than pickling a few small arguments). It is Ray's
    cloudpickle, so Ray's reducers apply (zero-copy tensors, ObjectRef accounting)."""

    def __init__(self) -> None:
        from ray import cloudpickle

        self._file = io.BytesIO()
        self._buffers: list[pickle.PickleBuffer] = []
        self._pickler = cloudpickle.CloudPickler(self._file, protocol=5, buffer_callback=self._buffer)
        self._busy = False

    def _buffer(self, b: pickle.PickleBuffer) -> None:
        self._buffers.append(b)

    def dumps(self, obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
        if self._busy:  # a Payload inside a Payload's arguments: a one-off pickler
            from ray import cloudpickle

            buffers: list[pickle.PickleBuffer] = []
            return cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append), buffers
        self._busy = True
        f, self._buffers = self._file, []
        try:
            f.seek(0)
            f.truncate()
            self._pickler.clear_memo()
            self._pickler.globals_ref = {}  # cloudpickle's per-dump state: never shared between calls
            self._pickler.dump(obj)
            return f.getvalue(), self._buffers
        finally:
            self._busy = False


_INNER = threading.local()


def _inner_pickler() -> _InnerPickler:
    p = getattr(_INNER, "pickler", None)
    if p is None:
        p = _INNER.pickler = _InnerPickler()
    return p


class _Unpacker:
    """Rebuilds a Payload on the worker; unpickling failures become its `error`.

    An object, not a function: pickled as a plain global name (``__reduce__`` returns
    one), so Ray's cloudpickle does not inspect it on every call as it does functions.
    """

    def __call__(self, data: bytes, *buffers: Any) -> Payload:
        try:
            args, kwargs = pickle.loads(data, buffers=buffers)
        except Exception as e:
            return Payload((), {}, _unpickling_error(e))
        return Payload(args, kwargs)

    def __reduce__(self) -> str:
        return "_UNPACK"


_UNPACK = _Unpacker()


def _unpickling_error(e: BaseException) -> tuple[str, str, str]:
    return (f"{type(e).__module__}.{type(e).__qualname__}",
            f"the worker could not unpickle the call's arguments ({e}); an argument's class must be importable "
            "on the workers (put its module on their PYTHONPATH, or in runtime_env py_modules/working_dir)",
            traceback.format_exc())


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


class WorkerHost:
    """Runs the worker objects of one process. Wrapped as a Ray actor by the Ray backend
    and used directly by the local backend."""

    def __init__(self, wait: Callable[[Any], Awaitable[Any]] | None = None, local: bool = False) -> None:
        self._local = local
        self._lane = Lane()
        self._workers: dict[str, Any] = {}
        self._specs: dict[str, RoleSpec] = {}
        self._methods: dict[str, dict[str, Any]] = {}
        self._thread = OrderedThread()
        self._wait = wait or _await_plain

    # ---- set-up -------------------------------------------------------------------------

    def node_info(self) -> dict[str, Any]:
        """Address and a free port of this process's node (rank 0 serves as MASTER_ADDR)."""
        return {"ip": node_ip(), "port": free_port(), "pid": os.getpid()}

    async def init_workers(self, specs: list[RoleSpec]) -> dict[str, dict[str, Any]]:
        """Construct the workers; returns each role's registered meshes."""
        out = {}
        for spec in specs:
            if not self._local:  # in-process workers share the controller's environment
                from asyncrl.runtime import quiet_tensor_warnings

                quiet_tensor_warnings()
                os.environ.update(spec.env)
                self._set_threads(spec.context)
            try:
                worker = await self._thread.run(functools.partial(contextvars.copy_context().run, _construct, spec))
            except Exception as e:
                raise RemoteError(
                    spec.group, f"{spec.cls.__name__}.__init__", spec.context.rank,
                    f"{type(e).__module__}.{type(e).__qualname__}", str(e), traceback.format_exc(),
                    cause=_picklable(e),
                ) from None
            self._workers[spec.role] = worker
            self._specs[spec.role] = spec
            self._methods[spec.role] = registered_methods(spec.cls)
            out[spec.role] = dict(worker._asyncrl_meshes)
        if not self._local:  # (in-process workers: the controller's group set-up does it)
            gc.freeze()  # see asyncrl.hosts: start-up objects out of the collector's full passes
        return out

    @staticmethod
    def _set_threads(ctx: WorkerContext) -> None:
        n = max(1, int(ctx.num_cpus))
        os.environ.setdefault("OMP_NUM_THREADS", str(n))
        try:
            import torch

            torch.set_num_threads(n)
        except Exception:  # pragma: no cover
            pass

    # ---- calls --------------------------------------------------------------------------

    def cancel_calls(self, entries: list[tuple[int, int | None]], deadline: bool = False) -> None:
        """The worker end of the one cancel path (see :mod:`asyncrl._sequencer`)."""
        self._lane.cancel(entries, deadline)

    async def call(
        self,
        role: str,
        method: str,
        seq: int | None,
        call_id: int,
        payload: Payload,
        in_pad: int | None,
        want_meta: bool,
        keep: bool = True,
    ) -> Any:
        """Run `role.method`; ordered when `seq` is given. With `want_meta` returns
        ``(result, (rows, trailing padding rows))``."""
        spec = self._specs.get(role)
        rank = spec.context.rank if spec is not None else -1
        group = spec.group if spec is not None else role
        lane = self._lane
        ticket = lane.arrive(call_id, seq, group, method, rank)  # from here on, leave() releases the number
        resolving: asyncio.Future[Any] | None = None
        try:
            mspec = self._methods[role].get(method) if spec is not None else None
            if spec is None or mspec is None:
                raise RemoteError(group, method, rank, "asyncrl.errors.RegistrationError",
                                  f"{role}.{method} is not a registered method of this worker", "")
            if payload.error is not None:
                raise RemoteError(group, method, rank, *payload.error)
            if has_deferred(payload.args, payload.kwargs):  # pipelined inputs: fetch them while waiting our turn
                resolving = asyncio.ensure_future(self._resolve(spec, method, payload.args, payload.kwargs))
            if seq is not None:
                await lane.turn(ticket)
            if resolving is None:
                args2, kwargs2, pipe_pad = payload.args, payload.kwargs, None
            else:
                args2, kwargs2, pipe_pad = await resolving
            pad = in_pad if in_pad is not None else (pipe_pad or 0)
            fn = getattr(self._workers[role], method)
            try:
                if mspec.is_async:
                    result = await fn(*args2, **kwargs2)
                else:
                    run = functools.partial(contextvars.copy_context().run, fn, *args2, **kwargs2)
                    result = await lane.run_thread(ticket, run, self._thread)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                raise RemoteError(
                    group, method, rank, f"{type(e).__module__}.{type(e).__qualname__}", str(e),
                    traceback.format_exc(), cause=_picklable(e),
                ) from None
            if not want_meta:
                return result if keep else None
            meta = self._meta(spec, method, args2, kwargs2, result, pad)
            return (result if keep else None), meta
        finally:
            if resolving is not None and not resolving.done():
                resolving.cancel()
            lane.leave(ticket)

    async def call_packed(self, packed: tuple[Any, ...]) -> Any:
        """:meth:`call` with its arguments in one tuple: the Ray backend's entry point
        (one argument for Ray to serialize and deserialize per call, not eight)."""
        return await self.call(*packed)

    async def _resolve(self, spec: RoleSpec, method: str, args: Any, kwargs: Any) -> Any:
        try:
            return await resolve_args(args, kwargs, self._wait)
        except asyncio.CancelledError:
            raise
        except DispatchError as e:
            raise RemoteError(spec.group, method, spec.context.rank, "asyncrl.errors.DispatchError",
                              str(e), traceback.format_exc(), cause=e) from None
        except AsyncRLError as e:  # a producer's failure, already named by resolve_args
            raise UpstreamError(spec.group, method, spec.context.rank, upstream=e) from None

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

    async def close(self) -> None:
        """Cancel the calls in flight, call each worker's `on_close`, then stop the thread."""
        self._lane.cancel_all()
        for w in self._workers.values():
            try:
                w.on_close()
            except Exception:  # closing must not fail the group's close
                traceback.print_exc()
        self._thread.stop()

    def abort(self) -> None:
        """Cancel every call in flight at once (the local backend's stand-in for killing the process)."""
        self._lane.cancel_all()

    def ping(self) -> int:
        return os.getpid()


class OrderedThread:
    """The host's one thread for plain ``def`` methods: a queue and a loop (no executor
    machinery); each outcome goes back to the event loop with one ``call_soon_threadsafe``."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run `fn` on the thread; the returned future (of the running loop) gets its outcome."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="asyncrl-ordered_0", daemon=True)
            self._thread.start()
        self._q.put((loop, fut, fn))
        return fut

    def _main(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            loop, fut, fn = item
            try:
                outcome: tuple[bool, Any] = (True, fn())
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting call
                outcome = (False, e)
            try:
                loop.call_soon_threadsafe(_settle, fut, outcome)
            except RuntimeError:  # that loop is closed
                pass

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(None)


def _settle(fut: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if fut.done():
        return
    ok, value = outcome
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


_DEFERRED = (DeferredShard, DeferredValue)


def has_deferred(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether an argument (or an item of a list or dict argument, the levels
    :func:`~asyncrl._deferred.resolve_args` looks at) is resolved on the worker."""
    for x in (*args, *kwargs.values()):
        if isinstance(x, _DEFERRED):
            return True
        if isinstance(x, list) and any(isinstance(i, _DEFERRED) for i in x):
            return True
        if isinstance(x, dict) and any(isinstance(i, _DEFERRED) for i in x.values()):
            return True
    return False


def _construct(spec: RoleSpec) -> Any:
    token = _CONTEXT.set(spec.context)
    try:
        return spec.cls(*spec.args, **spec.kwargs)
    finally:
        _CONTEXT.reset(token)


async def _await_plain(x: Any) -> Any:
    return await x
