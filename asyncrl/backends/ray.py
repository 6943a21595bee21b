"""The Ray backend: every worker process is a Ray actor hosting the worker objects.

The controller's side of Ray: the hosts' actors (the hosts of :mod:`asyncrl._host` as they
are, each call routed to its concurrency group), their placement, submitting calls and
control messages; its error translation is :mod:`asyncrl.backends._ray_errors` and its
fetch machinery :mod:`asyncrl.backends._ray_fetch`. With them, the only modules that import
ray (with :mod:`asyncrl.runtime`, which starts it).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from typing import Any, Callable, Sequence

import ray
import structlog
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl._backend import Slot
from asyncrl._host import RanksHost, ThreadedHost, WorkerHost
from asyncrl._wire import CallMsg, Payload
from asyncrl.backends._ray_errors import _input_failed, _translate, await_ray
from asyncrl.backends._ray_fetch import _RESOLVER, _Fetch, _Peek, _Watch
from asyncrl.errors import PlacementError
from asyncrl.runtime import ainit

_MAX_CONCURRENCY = 100_000  # in-flight calls per async host; ordering is by sequence number, not by slot
THREADED_CALLS = 64
"""Concurrent calls a threaded host runs or holds at once (Ray threads of its ``calls``
concurrency group); more wait in Ray's queue."""
THREADED_GROUPS = {"ordered": 1, "calls": THREADED_CALLS, "control": 1}
"""The threaded host's concurrency groups (:class:`~asyncrl._host.ThreadedHost`): ``ordered``,
the one thread that runs the constructors and every ordered call (Ray keeps their order:
one-thread-group-order of docs/protocol.md); ``calls``, concurrent calls; ``control``, cancel
messages, close and the other admin calls (never queued behind a call)."""

log = structlog.get_logger("asyncrl")


class _Methods:
    """One host's Ray methods, each with its options (made once per host: ``.options()``
    builds a new method object)."""

    __slots__ = ("threaded", "ordered", "ordered_meta", "concurrent", "concurrent_meta", "_host")

    def __init__(self, host: Any, threaded: bool) -> None:
        self.threaded = threaded
        self._host = host
        call = host.call
        if threaded:
            self.ordered = call.options(concurrency_group="ordered")
            self.ordered_meta = call.options(concurrency_group="ordered", num_returns=2)
            self.concurrent = call.options(concurrency_group="calls")
            self.concurrent_meta = call.options(concurrency_group="calls", num_returns=2)
        else:
            self.ordered = self.concurrent = call
            self.ordered_meta = self.concurrent_meta = call.options(num_returns=2)

    def admin(self, method: str) -> Any:
        """A set-up, control or test method; a threaded host builds its workers on the
        ``ordered`` thread and answers everything else on ``control``."""
        m = getattr(self._host, method)
        if not self.threaded:
            return m
        return m.options(concurrency_group="ordered" if method == "init_workers" else "control")


def _all_ready(refs: list[Any]) -> bool:
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    return len(ready) == len(refs)


class _RankMethod:
    """A method of a :class:`~asyncrl._host.RanksHost` actor bound to one rank's host: ``.remote(*args)`` and ``.options(...)``
    as an actor method's, the rank's index passed first."""

    __slots__ = ("_method", "_index")

    def __init__(self, method: Any, index: int) -> None:
        self._method, self._index = method, index

    def remote(self, *args: Any) -> Any:
        return self._method.remote(self._index, *args)

    def options(self, **kwargs: Any) -> "_RankMethod":
        return _RankMethod(self._method.options(**kwargs), self._index)


class _RankHandle:
    """One rank's host inside a :class:`~asyncrl._host.RanksHost` process: what the group holds per rank (its lane, its control
    messages, its calls) in place of an actor handle; `actor` is the process's."""

    __slots__ = ("actor", "index")

    def __init__(self, actor: Any, index: int) -> None:
        self.actor, self.index = actor, index

    def __getattr__(self, name: str) -> _RankMethod:
        return _RankMethod(getattr(self.actor, name), self.index)


class RayBackend:
    """Worker hosts as Ray actors; every blocking Ray call runs off the event loop."""

    name = "ray"
    needs_pool = True
    top_level_inputs = True
    sends_plain_lists = True
    """Plain arguments travel as msgpack lists (:meth:`asyncrl._wire.Payload.wire`, packed by the builder)."""

    def __init__(self) -> None:
        # Local wrappers: need no running Ray.
        self._actor_cls = ray.remote(WorkerHost)
        self._threaded_cls = ray.remote(concurrency_groups=THREADED_GROUPS)(ThreadedHost)
        self._ranks_cls = ray.remote(RanksHost)
        self._methods: dict[int, _Methods] = {}  # id(host) -> its methods (host: an actor, or a _RankHandle)
        # id(host) -> control messages sent (or reserved) to it: each is numbered and every
        # call carries the count, so it runs only after them (control-before-call of docs/protocol.md).
        self._notes: dict[int, int] = {}
        self._notes_lock = threading.Lock()  # (a release can be sent from Ray's thread)

    async def start(self) -> "RayBackend":
        if not ray.is_initialized():
            await ainit()
        return self

    async def make_hosts(self, group: str, slots: Sequence[Any], n: int, threaded: bool = False,
                         per_process: int = 1) -> list[Any]:
        # Creating an actor is a GCS round trip (and, the first time, Ray imports what it
        # needs to export the class): in a thread, like every blocking Ray call.
        return await asyncio.get_running_loop().run_in_executor(None, self._make_hosts, list(slots), n, threaded,
                                                                per_process)

    def _make_hosts(self, slots: list[Any], n: int, threaded: bool, per_process: int = 1) -> list[Any]:
        if per_process > 1:  # one async actor per slot, hosting `per_process` ranks (the last one fewer)
            actors = self._start_actors(self._ranks_cls, {"max_concurrency": _MAX_CONCURRENCY}, slots,
                                        -(-n // per_process), lambda i: min(per_process, n - i * per_process))
            hosts = [_RankHandle(actors[r // per_process], r % per_process) for r in range(n)]
            threaded = False
        else:
            cls, kind = ((self._threaded_cls, {}) if threaded else
                         (self._actor_cls, {"max_concurrency": _MAX_CONCURRENCY}))
            hosts = self._start_actors(cls, kind, slots, n, None)
        for host in hosts:
            self._methods[id(host)] = _Methods(host, threaded)
        return hosts

    def _start_actors(self, cls: Any, kind: dict[str, Any], slots: list[Any], n: int,
                      ranks: Callable[[int], int] | None) -> list[Any]:
        hosts = []
        for rank in range(n):
            slot = slots[rank]
            args = {"wait": await_ray} if ranks is None else {"wait": await_ray, "ranks": ranks(rank)}
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
            ).remote(**args))
        # No runtime_env: Ray gives an actor's process OMP_NUM_THREADS = its CPUs (at least 1) unless the cluster's
        # environment sets it, and the host sets torch's threads from its slot (_host.WorkerHost._set_threads). A
        # runtime_env of the actor's own with that env var cost each process about 0.5 s more CPU to start (a group
        # of 4 trivial workers: 15.5 s of the machine's CPU and 7.8 s of wall time, against 13.5 s and 6.8 s).
        return hosts

    async def admin(self, host: Any, method: str, *args: Any) -> Any:
        return await await_ray(self._methods[id(host)].admin(method).remote(*args))

    def submit(self, host: Any, msg: CallMsg) -> tuple[Any, Any]:
        # One Ray argument, the message as a list (CallMsg.wire), not nine: Ray serializes
        # each argument on its own (~10 µs each). A list, not a tuple or the dataclass: Ray
        # encodes lists, strings and numbers with msgpack and pickles anything else, so a
        # call whose arguments are plain scalars (`payload.sent`, packed by the builder:
        # Payload.wire) crosses without pickling on either side.
        msg.after = self._notes.get(id(host), 0)
        packed = msg.wire()
        payload = msg.payload
        assert isinstance(payload, Payload)
        m = self._methods[id(host)]
        seq = msg.seq
        if msg.want_meta:
            top = payload.top  # (only data-parallel calls, which return their meta, take top-level inputs)
            if top:
                ref, meta = (m.ordered_meta if seq is not None else m.concurrent_meta).remote(packed, *top)
                if seq is not None and not m.threaded:
                    self._observe(meta, host, msg.call_id, seq)
            else:
                ref, meta = (m.ordered_meta if seq is not None else m.concurrent_meta).remote(packed)
            return ref, meta
        return (m.ordered if seq is not None else m.concurrent).remote(packed), None

    def _observe(self, ref: Any, host: Any, call_id: int, seq: int | None) -> None:
        """Watch an ordered call sent to an async host with top-level inputs: if Ray fails
        it before its host runs it (an input lost, or not unpicklable there: see
        asyncrl._deferred), the host never saw its number, so release it with the one
        cancel message (cancelled-before-arrival of docs/protocol.md; idempotent). `ref` is
        the call's metadata ref (a few bytes); Ray calls back on its own thread; nothing
        runs on the loop unless it failed so. (A threaded host's lane waits for no number:
        one-thread-group-order.)"""
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
                     behind: list[tuple[int, int]] = (),  # type: ignore[assignment]
                     replied: Callable[[Any, Callable[[list[tuple[int, int]]], None]], None] | None = None) -> None:
        """Send the cancel message. With `deadline`, `behind` and `replied` (wedged-lane of
        docs/protocol.md): the message after it to that host is reserved for the
        controller's answer to the host's reply, so every call sent meanwhile waits for it
        (control-before-call); ``replied(wedge or None, verdict)`` runs on the caller's loop,
        and ``verdict(entries)`` sends the reserved message: cancel `entries` (it must be
        called once)."""
        cancel = self._methods[id(host)].admin("cancel_calls")
        if not deadline or replied is None:
            self._control(host, cancel, entries, False, [])
            return
        with self._notes_lock:
            note = self._notes.get(id(host), 0) + 1
            ref = cancel.remote(entries, True, list(behind), note)
            self._notes[id(host)] = note + 1  # note + 1: the verdict's, sent by `replied`
        verdict = functools.partial(self._verdict, host, cancel, note + 1)
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        ref._on_completed(functools.partial(_cancel_replied, loop, replied, verdict))

    def _verdict(self, host: Any, cancel: Any, note: int, entries: list[tuple[int, int]]) -> None:
        try:
            cancel.remote(entries, False, [], note)
        except Exception as e:  # the process is gone (its lane with it) or Ray is shutting down
            log.warning("cancel.unsent", calls=len(entries), error=repr(e))

    def _control(self, host: Any, method: Any, *args: Any) -> Any:
        """Send a control message to `host`, numbered in the order sent (control-before-call of
        docs/protocol.md); the count moves on only once Ray took the message."""
        with self._notes_lock:
            note = self._notes.get(id(host), 0) + 1
            ref = method.remote(*args, note)
            self._notes[id(host)] = note
        return ref

    async def wait(self, ref: Any) -> Any:
        return await _RESOLVER.wait(ref)

    def fetch(self, refs: Sequence[Any]) -> _Fetch:
        return _RESOLVER.fetch(refs)

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

    def peek(self, refs: Sequence[Any], callback: Callable[[list[Any]], None]) -> None:
        _Peek(refs, callback)

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


def _cancel_replied(loop: asyncio.AbstractEventLoop | None, replied: Callable[..., None], verdict: Any,
                    reply: Any) -> None:  # on Ray's thread
    wedge = tuple(reply) if isinstance(reply, (list, tuple)) and len(reply) == 4 else None  # (None, or a Ray error)
    _on_loop(loop, replied, wedge, verdict)


def _kill_all(hosts: list[Any]) -> None:
    actors = {id(a): a for a in (getattr(h, "actor", h) for h in hosts)}  # a process hosting several ranks once
    for a in actors.values():
        try:
            ray.kill(a, no_restart=True)
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
    if not pool.wait_for_capacity:
        _check_capacity(pool)
    bundle = pool.bundle
    nodes = _pick_nodes(pool.bundles_per_node, bundle) if len(pool.bundles_per_node) > 1 else None
    pgs = []
    try:
        for i, count in enumerate(pool.bundles_per_node):
            kw: dict[str, Any] = {}
            if nodes is not None:  # one placement group per node, on distinct nodes
                kw["bundle_label_selector"] = [{"ray.io/node-id": nodes[i]}] * count
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


def _fits(have: dict[str, float], need: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def _free_per_node() -> dict[str, dict[str, float]]:
    """Each alive node's free resources (its totals where Ray cannot say)."""
    alive = {n["NodeID"]: dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")}
    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
        return {k: dict(free.get(k, v)) for k, v in alive.items()}
    except Exception:  # a Ray without it: the totals
        return alive


def _pick_nodes(counts: list[int], bundle: dict[str, float]) -> list[str] | None:
    """A distinct alive node for each entry of `counts` whose free resources hold its bundles (the
    one with the most free CPUs first, worker nodes before the head), or None when there is no
    such choice (then Ray places each entry's group where it fits, nodes possibly shared)."""
    head = {n["NodeID"] for n in ray.nodes() if n.get("IsHeadNode")}
    free = _free_per_node()
    chosen: list[str] = []
    for count in counts:
        need = {k: v * count for k, v in bundle.items()}
        fit = [n for n in free if n not in chosen and _fits(free[n], need)]
        if not fit:
            return None
        chosen.append(max(fit, key=lambda n: (free[n].get("CPU", 0.0), n not in head, n)))
    return chosen


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
    short = {k: v * pool.world_size for k, v in pool.resources_per_bundle.items()
             if v * pool.world_size > total.get(k, 0.0) + 1e-9}
    if short:
        raise PlacementError(
            f"{pool!r} needs {short} but the Ray cluster has {({k: total.get(k, 0.0) for k in short})} in all; "
            "start nodes that advertise them (ray start --resources='{...}') or lower the amounts"
        )


def _wait_ready(pgs: list[Any], pool: Any, stop: threading.Event) -> None:
    deadline = time.monotonic() + pool.placement_timeout
    while True:
        if all(_state(pg) == "CREATED" for pg in pgs):
            return
        for pg in pgs:
            table = placement_group_table(pg)
            if _state(pg, table) == "INFEASIBLE" and not pool.wait_for_capacity:
                raise PlacementError(
                    f"{pool!r} cannot be placed: a placement group of {len(table.get('bundles', {}))} bundles "
                    f"{table.get('bundles')} fits on no node of the cluster (scheduling state INFEASIBLE); "
                    "use fewer bundles per node or smaller bundles"
                )
        if time.monotonic() > deadline:
            missing = [f"{count} x {pool.bundle} on one node" for pg, count in zip(pgs, pool.bundles_per_node)
                       if _state(pg) != "CREATED"]
            free = {n[:8]: {k: v for k, v in r.items()
                            if "memory" not in k and not k.startswith("node:") and "_group_" not in k}
                    for n, r in _free_per_node().items()}
            raise PlacementError(
                f"{pool!r} was not placed within {pool.placement_timeout:g}s: missing {'; '.join(missing)} "
                f"(free per alive node: {free}); free resources, add a node or raise the deadline"
            )
        if stop.wait(0.05):
            raise _Stopped()


def _state(pg: Any, table: dict[str, Any] | None = None) -> str:
    table = table if table is not None else placement_group_table(pg)
    if table.get("state") == "CREATED":
        return "CREATED"
    return str(table.get("stats", {}).get("scheduling_state") or table.get("state"))
