"""The in-process backend: workers are objects in the controller's process.

Same semantics as the Ray backend (ordering, padding, pipelining, errors); arguments
and results go through a serialization round trip, as they would through Ray's
object store, so a worker can never mutate the controller's batch by accident.
"""

from __future__ import annotations

import asyncio
import functools
import pickle
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from asyncrl._backend import Cancelled, Slot
from asyncrl._host import WorkerHost
from asyncrl._wire import CallMsg, Payload

try:
    from ray import cloudpickle as _pickle
except Exception:  # pragma: no cover
    _pickle = pickle


def _roundtrip(x: Any) -> Any:
    return pickle.loads(_pickle.dumps(x))


async def _await_local(ref: Any) -> Any:
    try:
        return await asyncio.shield(ref)
    except asyncio.CancelledError:
        if ref.cancelled():
            raise Cancelled() from None
        raise


class LocalBackend:
    """Worker hosts as objects on the controller's event loop."""

    name = "local"
    needs_pool = False
    top_level_inputs = False  # in process there is no argument path to save: every pipelined input stays nested
    sends_plain_lists = False  # every payload makes its pickling round trip (Payload.local_copy)

    async def start(self) -> "LocalBackend":
        return self

    async def make_hosts(self, group: str, slots: Sequence[Any], n: int, threaded: bool = False,
                         per_process: int = 1) -> list[WorkerHost]:
        # In process, every host runs on the controller's loop (`threaded` is a Ray host kind; every rank
        # shares this one process whatever `per_process` says).
        return [WorkerHost(wait=_await_local, local=True) for _ in range(n)]

    async def admin(self, host: WorkerHost, method: str, *args: Any) -> Any:
        result = getattr(host, method)(*args)
        if asyncio.iscoroutine(result):
            result = await result
        return result

    def submit(self, host: WorkerHost, msg: CallMsg) -> tuple[Any, Any]:
        loop = asyncio.get_running_loop()
        assert isinstance(msg.payload, Payload)
        arrived = replace(msg, payload=msg.payload.local_copy())
        want_meta = msg.want_meta

        async def run() -> Any:
            out = await host.call(arrived)
            return _roundtrip(out)

        task = loop.create_task(run())
        if not want_meta:
            task.add_done_callback(_retrieve)
            return task, None
        payload_fut: asyncio.Future[Any] = loop.create_future()
        meta: asyncio.Future[Any] = loop.create_future()

        def split(t: asyncio.Task[Any]) -> None:
            for f in (payload_fut, meta):
                if f.done():
                    continue
                if t.cancelled():
                    f.cancel()
                elif t.exception() is not None:
                    f.set_exception(t.exception())  # type: ignore[arg-type]
            if not t.cancelled() and t.exception() is None:
                value, m = t.result()
                payload_fut.set_result(value)
                meta.set_result(m)

        task.add_done_callback(split)
        for f in (payload_fut, meta):  # a failure nobody awaits must not be logged as "never retrieved"
            f.add_done_callback(_retrieve)
        return payload_fut, meta

    def cancel_calls(self, host: WorkerHost, entries: list[tuple[int, int | None]], deadline: bool,
                     behind: list[tuple[int, int]] = (),  # type: ignore[assignment]
                     replied: Callable[[Any, Callable[[list[tuple[int, int]]], None]], None] | None = None) -> None:
        # On one loop, a cancel is handled before any later call starts: the reply and the
        # verdict need no ordering of their own (wedged-lane of docs/protocol.md).
        wedge = host.cancel_calls(entries, deadline, list(behind))
        if replied is not None:
            replied(wedge, lambda refused: host.cancel_calls(refused) if refused else None)

    async def wait(self, ref: Any) -> Any:
        return await _await_local(ref)

    def fetch(self, refs: Sequence[Any]) -> "_LocalFetch":
        return _LocalFetch(refs)

    def translate(self, e: BaseException) -> BaseException:
        return e

    def get(self, refs: Sequence[Any], timeout: float | None) -> list[tuple[bool, Any]] | None:
        raise RuntimeError("LocalWorkerGroup futures have no blocking result(); await them inside an event loop")

    async def all_done(self, refs: Sequence[Any]) -> bool:
        return all(r.done() for r in refs)

    def watch(self, refs: Sequence[Any], callback: Callable[[], None]) -> None:
        pending = [r for r in refs if not r.done()]
        if not pending:
            callback()
            return
        left = [len(pending)]

        def one_done(_: Any) -> None:
            left[0] -= 1
            if left[0] == 0:
                callback()

        for r in pending:
            r.add_done_callback(one_done)

    def peek(self, refs: Sequence[Any], callback: Callable[[list[Any]], None]) -> None:
        def values() -> list[Any]:
            return [None if r.cancelled() else (r.exception() or r.result()) for r in refs]

        self.watch(refs, lambda: callback(values()))

    async def kill(self, hosts: Sequence[WorkerHost]) -> None:
        for h in hosts:
            h.abort()

    async def place(self, pool: Any) -> tuple[list[Any], list[Any]]:
        slots = []
        for node, count in enumerate(pool.bundles_per_node):
            for b in range(count):
                slots.append(Slot(None, b, node, b, pool.cpus_per_actor, pool.gpus_per_actor))
        return slots, []

    async def remove_placement(self, handles: list[Any]) -> None:
        pass


class _LocalFetch:
    """:meth:`LocalBackend.fetch`: the refs are futures on this loop; their done
    callbacks count down and the last one (or the first error) resolves `outcome`, once.
    Every ref's outcome is retrieved, so asyncio never logs one as never retrieved."""

    __slots__ = ("outcome", "_outcomes", "_left", "_live")

    def __init__(self, refs: Sequence[Any]) -> None:
        self.outcome: asyncio.Future[tuple[list[Any], int, float]] = asyncio.get_running_loop().create_future()
        self._outcomes: list[Any] = [None] * len(refs)
        self._left = len(refs)
        self._live = True
        for i, ref in enumerate(refs):
            ref.add_done_callback(functools.partial(self._one, i))

    def _one(self, i: int, ref: asyncio.Future[Any]) -> None:
        failed = ref.cancelled() or ref.exception() is not None  # (retrieves it)
        self._outcomes[i] = (Cancelled() if ref.cancelled() else ref.exception()) if failed else ref.result()
        self._left -= 1
        if not self._live or (self._left and not failed):
            return
        self._live = False
        if not self.outcome.done():
            self.outcome.set_result((self._outcomes, i if failed else -1, time.perf_counter()))

    def cancel(self) -> None:
        self._live = False


def _retrieve(f: asyncio.Future[Any]) -> None:
    if not f.cancelled():
        f.exception()
