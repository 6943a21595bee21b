"""The in-process backend: workers are objects in the controller's process.

Same semantics as the Ray backend (ordering, padding, pipelining, errors); arguments
and results go through a serialization round trip, as they would through Ray's
object store, so a worker can never mutate the controller's batch by accident.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Any, Sequence

from asyncrl._backend import Cancelled
from asyncrl._deferred import DeferredShard, DeferredValue
from asyncrl._host import WorkerHost

try:
    from ray import cloudpickle as _pickle
except Exception:  # pragma: no cover
    _pickle = pickle


def _roundtrip(x: Any) -> Any:
    if isinstance(x, (DeferredShard, DeferredValue)):
        return x
    if isinstance(x, list) and any(isinstance(i, (DeferredShard, DeferredValue)) for i in x):
        return [_roundtrip(i) for i in x]
    return pickle.loads(_pickle.dumps(x))


async def _await_local(ref: Any) -> Any:
    try:
        return await asyncio.shield(ref)
    except asyncio.CancelledError:
        if ref.cancelled():
            raise Cancelled() from None
        raise


class LocalBackend:
    name = "local"
    needs_pool = False

    def make_hosts(self, group: str, slots: Sequence[Any], n: int) -> list[WorkerHost]:
        return [WorkerHost(wait=_await_local, local=True) for _ in range(n)]

    async def admin(self, host: WorkerHost, method: str, *args: Any) -> Any:
        result = getattr(host, method)(*args)
        if asyncio.iscoroutine(result):
            result = await result
        return result

    def submit(self, host: WorkerHost, role: str, method: str, seq: int | None, call_id: int, args: tuple[Any, ...],
               kwargs: dict[str, Any], in_pad: int | None, want_meta: bool, keep: bool) -> tuple[Any, Any]:
        loop = asyncio.get_running_loop()
        args = tuple(_roundtrip(a) for a in args)
        kwargs = {k: _roundtrip(v) for k, v in kwargs.items()}

        async def run() -> Any:
            out = await host.call(role, method, seq, call_id, args, kwargs, in_pad, want_meta, keep)
            return _roundtrip(out)

        task = loop.create_task(run())
        if not want_meta:
            return task, None
        payload: asyncio.Future[Any] = loop.create_future()
        meta: asyncio.Future[Any] = loop.create_future()

        def split(t: asyncio.Task[Any]) -> None:
            for f in (payload, meta):
                if f.done():
                    continue
                if t.cancelled():
                    f.cancel()
                elif t.exception() is not None:
                    f.set_exception(t.exception())  # type: ignore[arg-type]
            if not t.cancelled() and t.exception() is None:
                value, m = t.result()
                payload.set_result(value)
                meta.set_result(m)

        task.add_done_callback(split)
        payload._asyncrl_task = task  # type: ignore[attr-defined]
        for f in (payload, meta):  # a failure nobody awaits must not be logged as "never retrieved"
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        return payload, meta

    def cancel_calls(self, host: WorkerHost, entries: list[tuple[int, int | None]]) -> None:
        host.cancel_calls(entries)

    def cancel(self, ref: Any) -> None:
        task = getattr(ref, "_asyncrl_task", ref)
        if not task.done():
            task.cancel()

    async def wait(self, ref: Any) -> Any:
        return await _await_local(ref)

    def get(self, refs: Sequence[Any], timeout: float | None) -> list[Any]:
        raise RuntimeError("LocalWorkerGroup futures have no blocking result(); await them inside an event loop")

    def all_done(self, refs: Sequence[Any]) -> bool:
        return all(r.done() for r in refs)

    def kill(self, host: WorkerHost) -> None:
        pass

    async def place(self, pool: Any) -> tuple[list[Any], list[Any]]:
        from asyncrl.resources import Slot

        slots, rank = [], 0
        for node, count in enumerate(pool.bundles_per_node):
            for b in range(count):
                slots.append(Slot(None, b, node, b, pool.cpus_per_actor, pool.gpus_per_actor))
                rank += 1
        return slots, []

    async def remove_placement(self, handles: list[Any]) -> None:
        pass
