"""The worker side of a group: one host per worker process.

A host constructs the worker objects of one process (several, for colocated
groups), resolves pipelined arguments, and runs calls. Ordered calls carry a
sequence number the controller assigned when it issued them; the host runs them
one at a time in that order, whatever order they arrive in (an async Ray actor
does not keep submission order). Concurrent calls run as soon as they arrive.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import os
import pickle
import socket
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from asyncrl import batch as B
from asyncrl._backend import Died
from asyncrl._deferred import resolve_args
from asyncrl.errors import AsyncRLError, DispatchError, RemoteError, UpstreamError, WorkerDiedError
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


class WorkerHost:
    """Runs the worker objects of one process. Wrapped as a Ray actor by the Ray backend
    and used directly by the local backend."""

    def __init__(self, wait: Callable[[Any], Awaitable[Any]] | None = None, local: bool = False) -> None:
        self._local = local
        self._running: dict[int, asyncio.Task[Any]] = {}  # call id -> the task running it
        self._cancelled: collections.OrderedDict[int, None] = collections.OrderedDict()  # cancelled before arrival
        self._workers: dict[str, Any] = {}
        self._specs: dict[str, RoleSpec] = {}
        self._methods: dict[str, dict[str, Any]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncrl-ordered")
        self._next_seq = 0
        self._finished: set[int] = set()
        self._turns: dict[int, asyncio.Future[None]] = {}
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
                worker = await self._run_sync(_construct, spec)
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

    async def _run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        fut = loop.run_in_executor(self._executor, ctx.run, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # A sync method cannot be interrupted: let it finish so the next ordered
            # call never overlaps it, then report the cancellation.
            try:
                await fut
            except BaseException:
                pass
            raise

    # ---- ordering -----------------------------------------------------------------------

    async def _wait_turn(self, seq: int) -> None:
        if seq < self._next_seq or seq in self._finished:
            raise asyncio.CancelledError(f"ordered call {seq} was cancelled before it started")
        if seq == self._next_seq:
            return
        fut = asyncio.get_running_loop().create_future()
        self._turns[seq] = fut
        try:
            await fut
        finally:
            self._turns.pop(seq, None)

    def _release(self, seq: int) -> None:
        if seq < self._next_seq:
            return
        self._finished.add(seq)
        while self._next_seq in self._finished:
            self._finished.remove(self._next_seq)
            self._next_seq += 1
        waiter = self._turns.get(self._next_seq)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def cancel_calls(self, entries: list[tuple[int, int | None]]) -> None:
        """Cancel calls by id: a running or waiting call's task is cancelled; a call
        that has not arrived yet is refused when it does, and its ordered turn is
        released now so later calls do not wait for it. (Ray's own cancellation can
        lose the race with a call that is just being delivered; this cannot.)"""
        for call_id, seq in entries:
            task = self._running.get(call_id)
            if task is not None:
                task.cancel()
                continue
            self._cancelled[call_id] = None
            while len(self._cancelled) > 100_000:
                self._cancelled.popitem(last=False)
            if seq is not None:
                self._release(seq)

    # ---- calls --------------------------------------------------------------------------

    async def call(
        self,
        role: str,
        method: str,
        seq: int | None,
        call_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_pad: int | None,
        want_meta: bool,
        keep: bool = True,
    ) -> Any:
        """Run `role.method`; ordered when `seq` is given. With `want_meta` returns
        ``(result, (rows, trailing padding rows))``."""
        spec = self._specs[role]
        worker = self._workers[role]
        mspec = self._methods[role].get(method)
        if mspec is None:
            raise RemoteError(spec.group, method, spec.context.rank, "RegistrationError",
                              f"{spec.cls.__name__}.{method} is not registered", "")
        if call_id in self._cancelled:
            del self._cancelled[call_id]
            raise asyncio.CancelledError(f"call {call_id} was cancelled before it arrived")
        task = asyncio.current_task()
        if task is not None:
            self._running[call_id] = task
        resolving = asyncio.ensure_future(self._resolve(spec, method, args, kwargs))
        try:
            if seq is not None:
                await self._wait_turn(seq)
            args2, kwargs2, pipe_pad = await resolving
            pad = in_pad if in_pad is not None else (pipe_pad or 0)
            fn = getattr(worker, method)
            try:
                if mspec.is_async:
                    result = await fn(*args2, **kwargs2)
                else:
                    result = await self._run_sync(lambda: fn(*args2, **kwargs2))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                raise RemoteError(
                    spec.group, method, spec.context.rank,
                    f"{type(e).__module__}.{type(e).__qualname__}", str(e),
                    traceback.format_exc(), cause=_picklable(e),
                ) from None
            if not want_meta:
                return result if keep else None
            meta = self._meta(spec, method, args2, kwargs2, result, pad)
            return (result if keep else None), meta
        finally:
            if not resolving.done():
                resolving.cancel()
            self._running.pop(call_id, None)
            if seq is not None:
                self._release(seq)

    async def _resolve(self, spec: RoleSpec, method: str, args: Any, kwargs: Any) -> Any:
        try:
            return await resolve_args(args, kwargs, self._wait)
        except asyncio.CancelledError:
            raise
        except DispatchError as e:
            raise RemoteError(spec.group, method, spec.context.rank, "asyncrl.errors.DispatchError",
                              str(e), traceback.format_exc(), cause=e) from None
        except BaseException as e:
            upstream = _unwrap(e)
            if isinstance(upstream, Died):  # a producer's worker process died
                upstream = WorkerDiedError("(producer of a pipelined argument)", "(unknown)", None, str(upstream))
            raise UpstreamError(spec.group, method, spec.context.rank, upstream=upstream) from None

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
        """Call each worker's `on_close`, then stop the thread."""
        for w in self._workers.values():
            try:
                w.on_close()
            except Exception:  # closing must not fail the group's close
                traceback.print_exc()
        self._executor.shutdown(wait=False)

    def ping(self) -> int:
        return os.getpid()



def _construct(spec: RoleSpec) -> Any:
    token = _CONTEXT.set(spec.context)
    try:
        return spec.cls(*spec.args, **spec.kwargs)
    finally:
        _CONTEXT.reset(token)


async def _await_plain(x: Any) -> Any:
    return await x


def _unwrap(e: BaseException) -> BaseException:
    """The asyncrl error inside a Ray error, when there is one."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, AsyncRLError):
        return cause
    return e
