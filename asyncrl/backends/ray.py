"""The Ray backend: every worker process is a Ray actor hosting the worker objects.

The only module that imports ray (with :mod:`asyncrl.runtime`, which starts it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Sequence

import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    GetTimeoutError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
    RayTaskError,
    TaskCancelledError,
)
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl._backend import Cancelled, Died
from asyncrl._host import WorkerHost
from asyncrl.errors import AsyncRLError, PlacementError, RemoteError

_MAX_CONCURRENCY = 100_000  # in-flight calls per worker process; ordering is by sequence number, not by slot

_DEATH = (ActorDiedError, ActorUnavailableError, RayActorError, OwnerDiedError, ObjectLostError)


def _translate(e: BaseException) -> BaseException:
    if isinstance(e, TaskCancelledError):
        return Cancelled(str(e))
    if isinstance(e, RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, AsyncRLError):
            return cause
        if isinstance(cause, TaskCancelledError) or isinstance(cause, asyncio.CancelledError):
            return Cancelled(str(e))
        if isinstance(cause, _DEATH):
            return Died(str(cause).splitlines()[0])
        return RemoteError("?", "?", None, type(cause).__name__ if cause else "RayTaskError", str(cause or e), str(e))
    if isinstance(e, _DEATH):
        return Died(str(e).splitlines()[0])
    return e


async def await_ray(ref: Any) -> Any:
    """Await an ObjectRef, turning Ray's errors into asyncrl's (used on workers too)."""
    try:
        return await ref
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise _translate(e) from None


_NATIVE_LIMIT = 256  # refs awaited through Ray's asyncio integration at once; more go to the resolver thread
_DELIVER_BATCH = 128  # results handed to the event loop per loop iteration


class _Resolver:
    """Resolves ObjectRefs in a background thread once many are in flight.

    Awaiting thousands of refs through Ray's asyncio integration makes their
    completions land on the event loop all at once (measured here: the loop stalls
    for more than a second with 10,000 refs). Past `_NATIVE_LIMIT` outstanding refs,
    a thread waits on them with ``ray.wait``, fetches the values, and hands them to
    the loop in batches of `_DELIVER_BATCH` per iteration.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[Any, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]]] = {}
        self._thread: threading.Thread | None = None
        self.native = 0

    async def wait(self, ref: Any) -> Any:
        if self.native < _NATIVE_LIMIT:
            self.native += 1
            try:
                return await await_ray(ref)
            finally:
                self.native -= 1
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._cond:
            self._pending.setdefault(ref, []).append((loop, fut))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="asyncrl-resolver", daemon=True)
                self._thread.start()
            self._cond.notify()
        ok, value = await fut
        if ok:
            return value
        raise _translate(value) from None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    if not self._cond.wait(timeout=5.0) and not self._pending:
                        self._thread = None
                        return
                refs = list(self._pending)
            try:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.002, fetch_local=True)
            except Exception:  # Ray shut down under us
                ready = refs
            if not ready:
                continue
            done = []
            for r in ready:
                try:
                    done.append((r, (True, ray.get(r))))
                except Exception as e:
                    done.append((r, (False, e)))
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
            with self._cond:
                for r, outcome in done:
                    for loop, fut in self._pending.pop(r, []):
                        by_loop.setdefault(loop, []).append((fut, outcome))
            for loop, items in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_deliver, loop, items)
                except RuntimeError:  # that loop is closed
                    pass


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for fut, outcome in items[:_DELIVER_BATCH]:
        if not fut.done():
            fut.set_result(outcome)
    if len(items) > _DELIVER_BATCH:
        loop.call_soon(_deliver, loop, items[_DELIVER_BATCH:])


_RESOLVER = _Resolver()


class RayBackend:
    name = "ray"
    needs_pool = True

    def __init__(self) -> None:
        from asyncrl.runtime import init

        init()
        self._actor_cls = ray.remote(WorkerHost)
        self._call2: dict[int, Any] = {}

    def make_hosts(self, group: str, slots: Sequence[Any], n: int) -> list[Any]:
        hosts = []
        for rank in range(n):
            slot = slots[rank]
            hosts.append(self._actor_cls.options(
                name=None,
                num_cpus=slot.num_cpus,
                num_gpus=slot.num_gpus,
                max_concurrency=_MAX_CONCURRENCY,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=slot.placement_group,
                    placement_group_bundle_index=slot.bundle_index,
                ),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(max(1, int(slot.num_cpus)))}},
            ).remote(wait=await_ray))
        return hosts

    async def admin(self, host: Any, method: str, *args: Any) -> Any:
        return await await_ray(getattr(host, method).remote(*args))

    def submit(self, host: Any, role: str, method: str, seq: int | None, call_id: int, args: tuple[Any, ...],
               kwargs: dict[str, Any], in_pad: int | None, want_meta: bool, keep: bool) -> tuple[Any, Any]:
        if want_meta:
            call2 = self._call2.get(id(host))
            if call2 is None:  # .options() builds a new method object: once per host, not per call
                call2 = self._call2[id(host)] = host.call.options(num_returns=2)
            ref, meta = call2.remote(role, method, seq, call_id, args, kwargs, in_pad, True, keep)
            return ref, meta
        return host.call.remote(role, method, seq, call_id, args, kwargs, in_pad, False, keep), None

    def cancel_calls(self, host: Any, entries: list[tuple[int, int | None]]) -> None:
        host.cancel_calls.remote(entries)

    def cancel(self, ref: Any) -> None:
        try:
            ray.cancel(ref)
        except Exception:  # already finished, or its worker is gone
            pass

    async def wait(self, ref: Any) -> Any:
        return await _RESOLVER.wait(ref)

    def get(self, refs: Sequence[Any], timeout: float | None) -> list[Any]:
        try:
            return ray.get(list(refs), timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError() from None
        except Exception as e:
            raise _translate(e) from None

    def all_done(self, refs: Sequence[Any]) -> bool:
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0, fetch_local=False)
        return len(ready) == len(refs)

    def kill(self, host: Any) -> None:
        self._call2.pop(id(host), None)
        try:
            ray.kill(host, no_restart=True)
        except Exception:
            pass

    async def place(self, pool: Any) -> tuple[list[Any], list[Any]]:
        from asyncrl.resources import Slot

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
            await _wait_ready(pgs, pool)
        except BaseException:
            for pg in pgs:
                remove_placement_group(pg)
            raise
        slots = []
        for node, (pg, count) in enumerate(zip(pgs, pool.bundles_per_node)):
            for b in range(count):
                slots.append(Slot(pg, b, node, b, pool.cpus_per_actor, pool.gpus_per_actor))
        return slots, pgs

    async def remove_placement(self, handles: list[Any]) -> None:
        for pg in handles:
            try:
                remove_placement_group(pg)
            except Exception:
                pass


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


async def _wait_ready(pgs: list[Any], pool: Any) -> None:
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
        await asyncio.sleep(0.05)


def _state(pg: Any, table: dict[str, Any] | None = None) -> str:
    table = table if table is not None else placement_group_table(pg)
    if table.get("state") == "CREATED":
        return "CREATED"
    return str(table.get("stats", {}).get("scheduling_state") or table.get("state"))
