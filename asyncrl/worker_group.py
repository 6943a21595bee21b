"""`WorkerGroup`: a group of workers that runs registered methods as one call.

``wg.compute_log_prob(batch)`` looks up the method's :func:`~asyncrl.register`
contract, splits the arguments (dispatch), submits one call per executing rank and
returns a :class:`~asyncrl.GroupFuture` at once. Awaiting it collects the per-rank
results. The same group logic runs on two backends: Ray actors
(:class:`RayWorkerGroup`) and in-process objects (:class:`LocalWorkerGroup`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Generic, Mapping, ParamSpec, Sequence, TypeVar

import structlog

from asyncrl import batch as B
from asyncrl._backend import Backend, Cancelled, Died
from asyncrl._deferred import DeferredShard, DeferredValue
from asyncrl._host import RoleSpec
from asyncrl.dispatch import MeshRank, Sharded, World
from asyncrl.errors import (
    AsyncRLError,
    CallCancelledError,
    CallTimeoutError,
    DispatchError,
    GroupBrokenError,
    GroupClosedError,
    RegistrationError,
    RemoteError,
    WorkerDiedError,
)
from asyncrl.future import _AWAIT_CHUNK, GroupFuture
from asyncrl.register import Execute, MethodSpec, Mode, RegisteredMethod, registered_methods
from asyncrl.resources import ResourcePool
from asyncrl.worker import PROTECTED_ENV, Worker, WorkerContext

__all__ = ["WorkerGroup", "RayWorkerGroup", "LocalWorkerGroup", "GroupMethod", "GroupStats", "colocate"]

log = structlog.get_logger("asyncrl")

W = TypeVar("W", bound=Worker)
P = ParamSpec("P")
R = TypeVar("R")

_group_ids = itertools.count()
_call_ids = itertools.count()


@dataclass
class GroupStats:
    """Counters of one group, for tests and benchmarks."""

    calls: int = 0
    """Group calls issued."""
    bytes_fetched: int = 0
    """Tensor payload bytes fetched into the controller by awaiting this group's futures."""
    results_fetched: int = 0
    """Per-rank results fetched into the controller."""


class _AsyncResource:
    """`async with` for objects with `setup()` and `close()`: close on every path."""

    async def setup(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    async def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def __aenter__(self) -> Any:
        try:
            return await self.setup()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _HostSet:
    """The worker processes behind one group, or behind several colocated groups."""

    def __init__(self, backend: Backend, pool: ResourcePool | None, world_size: int, roles: list[tuple[str, type, tuple, dict]],
                 env: Mapping[str, str], name: str, owns_pool: bool) -> None:
        self.backend = backend
        self.pool = pool
        self.world_size = world_size
        self.roles = roles
        self.env = dict(env)
        self.name = name
        self.owns_pool = owns_pool
        self.hosts: list[Any] = []
        self.next_seq = [0] * world_size
        self.meshes: dict[str, dict[str, tuple[MeshRank, ...]]] = {}
        self.contexts: list[WorkerContext] = []
        self.state = "new"  # new -> ready -> closed
        self.views = 0
        self._setup_lock: asyncio.Lock | None = None

    async def setup(self) -> None:
        if self.state == "ready":
            return
        if self.state == "closed":
            raise GroupClosedError(f"group {self.name!r} is closed; create a new group")
        if self._setup_lock is None:
            self._setup_lock = asyncio.Lock()
        async with self._setup_lock:
            if self.state == "ready":
                return
            try:
                await self._setup()
            except BaseException:
                await self.close()
                raise
            self.state = "ready"

    async def _setup(self) -> None:
        n = self.world_size
        slots = []
        if self.pool is not None:
            await self.pool.place(self.backend)
            if self.pool.world_size < n:
                raise ValueError(f"group {self.name!r} needs {n} bundles but its pool has {self.pool.world_size}")
            slots = self.pool.slots[:n]
        self.hosts = self.backend.make_hosts(self.name, slots, n)
        info = await self.backend.admin(self.hosts[0], "node_info")
        local_world: dict[Any, int] = {}
        for s in slots:
            local_world[s.node_key] = local_world.get(s.node_key, 0) + 1
        specs_per_host = []
        self.contexts = []
        for rank in range(n):
            slot = slots[rank] if slots else None
            ctx = WorkerContext(
                rank=rank, world_size=n, local_rank=slot.local_rank if slot else rank,
                group=self.name, role=self.roles[0][0],
                num_cpus=slot.num_cpus if slot else 1.0, num_gpus=slot.num_gpus if slot else 0.0,
            )
            self.contexts.append(ctx)
            env = {
                "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(ctx.local_rank),
                "LOCAL_WORLD_SIZE": str(local_world.get(slot.node_key, n) if slot else n),
                "MASTER_ADDR": str(info["ip"]), "MASTER_PORT": str(info["port"]),
                **self.env,
            }
            specs_per_host.append([
                RoleSpec(role=role, group=gname, cls=cls, args=args, kwargs=kwargs,
                         context=WorkerContext(**{**ctx.__dict__, "role": role, "group": gname}), env=env)
                for role, cls, args, kwargs, gname in self._role_names()
            ])
        results = await asyncio.gather(*(self.backend.admin(h, "init_workers", specs)
                                         for h, specs in zip(self.hosts, specs_per_host)))
        self.meshes = {role: _check_meshes(self.name, role, [r[role] for r in results]) for role, *_ in self.roles}

    def _role_names(self) -> list[tuple[str, type, tuple, dict, str]]:
        if len(self.roles) == 1:
            role, cls, args, kwargs = self.roles[0]
            return [(role, cls, args, kwargs, self.name)]
        return [(role, cls, args, kwargs, f"{self.name}.{role}") for role, cls, args, kwargs in self.roles]

    async def close(self) -> None:
        if self.state == "closed":
            return
        self.state = "closed"
        if self.hosts:
            try:
                await asyncio.wait_for(asyncio.gather(*(self.backend.admin(h, "close") for h in self.hosts),
                                                      return_exceptions=True), timeout=10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
            finally:
                for h in self.hosts:
                    self.backend.kill(h)
        if self.pool is not None and self.owns_pool:
            await self.pool.release()


def _check_meshes(group: str, role: str, per_rank: list[dict[str, MeshRank]]) -> dict[str, tuple[MeshRank, ...]]:
    names = set().union(*per_rank) if per_rank else set()
    out = {}
    for name in sorted(names):
        missing = [r for r, m in enumerate(per_rank) if name not in m]
        if missing:
            raise DispatchError(f"group {group!r}: mesh {name!r} is registered on some ranks but not on ranks {missing}")
        ranks = tuple(m[name] for m in per_rank)
        sizes = {r.dp_size for r in ranks}
        if len(sizes) != 1:
            raise DispatchError(f"group {group!r}: mesh {name!r} ranks disagree on dp_size: {sorted(sizes)}")
        dp = sizes.pop()
        collectors = sorted(r.dp_rank for r in ranks if r.collect)
        if collectors != list(range(dp)):
            raise DispatchError(
                f"group {group!r}: mesh {name!r} must have exactly one collecting rank per DP rank "
                f"0..{dp - 1}; collecting DP ranks are {collectors}"
            )
        out[name] = ranks
    return out


class _Call:
    """One issued group call: the state shared by its futures."""

    def __init__(self, group: "WorkerGroup[Any]", spec: MethodSpec, ranks: list[int], refs: list[Any],
                 metas: list[Any] | None, ids: list[tuple[int, int, int | None]], timeout: float | None) -> None:
        self.group = group
        self.spec = spec
        self.method = spec.name
        self.ranks = ranks
        self.refs = refs
        self.metas = metas
        self.ids = ids  # (rank, call id, ordered sequence number or None)
        self.cancelled = False
        self.data_parallel = spec.dispatch_mode.data_parallel
        self.rank_zero = spec.execute_mode is Execute.RANK_ZERO
        self.world = group.world
        self.collect_fn = spec.dispatch_mode.collect
        # Which of the executing ranks' results are collected, in collect (DP) order.
        mesh = spec.dispatch_mode.mesh
        order = list(range(len(ranks)))
        if mesh is not None and not self.rank_zero:
            mranks = self.world.meshes[mesh]
            order = sorted((i for i, r in enumerate(ranks) if mranks[r].collect), key=lambda i: mranks[ranks[i]].dp_rank)
        self.collect_index = order
        self.collect_refs = [refs[i] for i in order]
        self.collect_metas = [metas[i] for i in order] if metas is not None else None
        self._task: asyncio.Future[Any] | None = None
        self._timed_out = False
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        if timeout is not None:
            self._deadline = time.monotonic() + timeout
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                self._timer = loop.call_later(timeout, self._expire)

    # ---- state --------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        return self.group._hostset.backend

    def is_done(self) -> bool:
        return self.cancelled or self.backend.all_done(self.refs)

    def _expire(self) -> None:
        if not self.backend.all_done(self.refs):
            self._timed_out = True
            self._cancel_remote()

    def cancel(self) -> bool:
        if self.backend.all_done(self.refs) and not self.cancelled:
            return False
        self.cancelled = True
        self._cancel_remote()
        return True

    def _cancel_remote(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for ref in self.refs:
            self.backend.cancel(ref)
        hs = self.group._hostset
        if hs.state == "ready":
            for rank, call_id, seq in self.ids:
                self.backend.cancel_calls(hs.hosts[rank], [(call_id, seq)])

    # ---- resolution ---------------------------------------------------------------

    def resolution(self) -> asyncio.Future[Any]:
        if self._task is None:
            self._task = asyncio.ensure_future(self._resolve())
            # The awaiter may be gone (cancelled); do not report the error as never retrieved.
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return self._task

    def _timeout_error(self) -> CallTimeoutError:
        return CallTimeoutError(
            f"{self.group.name}.{self.method} did not finish within its timeout; the remote work was cancelled"
        )

    async def _wait(self, pos: int, ref: Any) -> Any:
        rank = self.ranks[pos]
        try:
            return await self.backend.wait(ref)
        except Died as e:
            self.group._mark_broken(rank, str(e))
            raise WorkerDiedError(self.group.name, self.method, rank, str(e)) from None
        except Cancelled:
            if self._timed_out:
                raise self._timeout_error() from None
            raise CallCancelledError(f"{self.group.name}.{self.method} was cancelled") from None

    async def _gather(self, positions: list[int], refs: list[Any]) -> list[Any]:
        out: list[Any] = []
        for i in range(0, len(refs), _AWAIT_CHUNK):
            out.extend(await asyncio.gather(*(self._wait(p, r) for p, r in zip(positions[i:i + _AWAIT_CHUNK], refs[i:i + _AWAIT_CHUNK]))))
        return out

    async def _resolve(self) -> Any:
        try:
            if self._deadline is not None:
                async with asyncio.timeout(max(0.0, self._deadline - time.monotonic())):
                    return await self._fetch_and_collect()
            return await self._fetch_and_collect()
        except TimeoutError as e:
            if isinstance(e, AsyncRLError):
                raise
            self._timed_out = True
            self._cancel_remote()
            raise self._timeout_error() from None
        finally:
            if self._timer is not None:
                self._timer.cancel()

    async def _fetch_and_collect(self) -> Any:
        if self.cancelled:
            raise CallCancelledError(f"{self.group.name}.{self.method} was cancelled")
        positions = self.collect_index
        if len(self.refs) == 1 and not self.data_parallel:  # fast path: one rank, nothing to merge
            return self._finish([await self._wait(0, self.refs[0])])
        others = [i for i in range(len(self.refs)) if i not in set(positions)]
        # One round trip: payloads, the non-collecting ranks (their errors surface too)
        # and the padding metadata, awaited together.
        refs = self.collect_refs + [self.refs[i] for i in others] + (self.collect_metas or [])
        got = await self._gather(positions + others + (positions if self.collect_metas else []), refs)
        values = got[:len(positions)]
        if self.collect_metas is not None:
            metas = got[len(positions) + len(others):]
            values = [B.strip_tail(v, pad) for v, (_, pad) in zip(values, metas)]
        return self._finish(values)

    def _finish(self, values: list[Any]) -> Any:
        stats = self.group.stats
        stats.results_fetched += len(values)
        stats.bytes_fetched += B.payload_nbytes(values)
        if self.rank_zero:
            return values[0]
        return self.collect_fn(self.world, values)

    def resolve_blocking(self, timeout: float | None) -> Any:
        if self.cancelled:
            raise CallCancelledError(f"{self.group.name}.{self.method} was cancelled")
        try:
            values = self.backend.get(self.refs, timeout)
            metas = self.backend.get(self.collect_metas, timeout) if self.collect_metas is not None else None
        except TimeoutError:
            self._timed_out = True
            self._cancel_remote()
            raise self._timeout_error() from None
        except Died as e:
            rank = getattr(e, "position", None)
            self.group._mark_broken(rank, str(e))
            raise WorkerDiedError(self.group.name, self.method, rank, str(e)) from None
        except Cancelled:
            raise CallCancelledError(f"{self.group.name}.{self.method} was cancelled") from None
        values = [values[i] for i in self.collect_index]
        if metas is not None:
            values = [B.strip_tail(v, pad) for v, (_, pad) in zip(values, metas)]
        return self._finish(values)

    async def stream(self) -> AsyncIterator[tuple[int, Any]]:
        async def one(i: int) -> tuple[int, Any]:
            value = await self._wait(i, self.collect_refs[i])
            if self.data_parallel:
                _, pad = await self._wait(i, self.collect_metas[i])  # type: ignore[index]
                value = B.strip_tail(value, pad)
            self.group.stats.results_fetched += 1
            self.group.stats.bytes_fetched += B.payload_nbytes(value)
            return self.ranks[self.collect_index[i]], value

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(self.collect_refs))]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for t in tasks:
                t.cancel()


class GroupMethod(Generic[P, R]):
    """A registered worker method bound to a group; calling it issues a group call."""

    def __init__(self, group: "WorkerGroup[Any]", spec: MethodSpec, timeout: float | None = None) -> None:
        self._group = group
        self.spec = spec
        self._timeout = timeout
        self.__signature__ = spec.signature.replace(parameters=list(spec.signature.parameters.values())[1:])
        self.__name__ = spec.name
        self.__doc__ = f"Group call of {spec.name} ({spec.dispatch_mode.name}, {spec.execute_mode.value}, {spec.mode.value})."

    def options(self, *, timeout: float | None = None) -> "GroupMethod[P, R]":
        """The same method with call options. `timeout` (seconds) fails the future with
        :class:`~asyncrl.CallTimeoutError` and cancels the remote work when it passes."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return GroupMethod(self._group, self.spec, timeout=float(timeout) if timeout is not None else None)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> GroupFuture[R]:
        return self._group._issue(self.spec, args, kwargs, self._timeout)

    def __repr__(self) -> str:
        return f"<GroupMethod {self._group.name}.{self.spec.name}{self.__signature__}>"


class WorkerGroup(_AsyncResource, Generic[W]):
    """A group of `world_size` workers of class `cls`, run by a backend.

    Build it, then ``await wg.setup()`` (or ``async with wg:``) to start the workers;
    ``await wg.close()`` releases them. Every method registered on `cls` is an
    attribute that issues a group call and returns a :class:`GroupFuture`.
    """

    def __init__(
        self,
        cls: type[W],
        pool: ResourcePool | None = None,
        *,
        world_size: int | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        backend: Backend,
        _hostset: _HostSet | None = None,
        _role: str | None = None,
    ) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"a WorkerGroup runs subclasses of asyncrl.Worker, got {cls!r}")
        if env:
            bad = PROTECTED_ENV & set(env)
            if bad:
                raise ValueError(
                    f"env may not set {sorted(bad)}: asyncrl sets them per worker; remove them from env"
                )
        self.cls = cls
        self._methods = registered_methods(cls)
        if _hostset is None:
            if pool is None and world_size is None:
                raise ValueError("give a ResourcePool or a world_size")
            n = world_size if world_size is not None else pool.world_size  # type: ignore[union-attr]
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"world_size must be a positive int, got {n!r}")
            if pool is not None and n > pool.world_size:
                raise ValueError(f"world_size={n} is larger than the pool's {pool.world_size} bundles")
            owns = pool is None and backend.needs_pool
            if owns:
                pool = ResourcePool([n])
            self.name = name or f"{cls.__name__}_{next(_group_ids)}"
            _hostset = _HostSet(backend, pool, n, [("worker", cls, tuple(args), dict(kwargs or {}))], env or {},
                                self.name, owns_pool=owns)
            self._role = "worker"
        else:
            self._role = _role  # type: ignore[assignment]
            self.name = name or f"{_hostset.name}.{_role}"
        self._hostset = _hostset
        _hostset.views += 1
        self.stats = GroupStats()
        self._broken: tuple[int | None, str] | None = None
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self._hostset.world_size

    @property
    def world(self) -> World:
        """What dispatch functions see: world size, group name and registered meshes."""
        return World(self.world_size, self.name, self._hostset.meshes.get(self._role, {}))

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed or self._hostset.state == "closed"

    @property
    def broken(self) -> bool:
        """True once a worker of this group has died."""
        return self._broken is not None

    async def setup(self) -> "WorkerGroup[W]":
        """Start the workers (placement, processes, constructors). Idempotent."""
        if self._closed:
            raise GroupClosedError(f"group {self.name!r} is closed; create a new group")
        await self._hostset.setup()
        return self

    async def close(self) -> None:
        """Stop the workers and release their placement groups (every path: call it in
        ``finally`` or use ``async with``). Colocated groups release the shared
        processes when the last of them closes."""
        if self._closed:
            return
        self._closed = True
        self._hostset.views -= 1
        if self._hostset.views <= 0:
            await asyncio.shield(self._hostset.close())

    async def __aenter__(self) -> "WorkerGroup[W]":
        return await super().__aenter__()  # type: ignore[no-any-return,unused-ignore]

    def _mark_broken(self, rank: int | None, detail: str) -> None:
        if self._broken is None:
            self._broken = (rank, detail)
            log.warning("group.broken", group=self.name, rank=rank, detail=detail)

    # ---- calls ---------------------------------------------------------------------

    def __getattr__(self, name: str) -> GroupMethod[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        cache = self.__dict__.setdefault("_bound", {})
        if name in cache:
            return cache[name]
        spec = self.__dict__.get("_methods", {}).get(name)
        if spec is None:
            attr = getattr(self.__dict__.get("cls"), name, None)
            hint = ""
            if callable(attr):
                hint = (f"; {self.cls.__name__}.{name} exists but is not registered: decorate it with "
                        f"@asyncrl.register(dispatch_mode=...) to call it on the group")
            raise AttributeError(f"{type(self).__name__} {self.__dict__.get('name')!r} has no method {name!r}{hint}")
        cache[name] = GroupMethod(self, spec)
        return cache[name]

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._methods))

    def method(self, fn: RegisteredMethod[P, Any, R]) -> GroupMethod[P, R]:
        """Typed access to a group method: ``wg.method(PolicyWorker.update)(batch)``
        has the worker method's signature for type checkers."""
        if not isinstance(fn, RegisteredMethod):
            raise RegistrationError(f"{fn!r} is not a registered worker method; decorate it with @asyncrl.register")
        return getattr(self, fn.spec.name)

    def _check_usable(self) -> None:
        if self.closed:
            raise GroupClosedError(f"group {self.name!r} is closed; create a new group")
        if self._hostset.state != "ready":
            raise RuntimeError(f"group {self.name!r} is not started; `await wg.setup()` or use `async with wg:` first")
        if self._broken is not None:
            rank, detail = self._broken
            raise GroupBrokenError(
                f"group {self.name!r} is broken: worker rank {rank} died ({detail}). Close it and create a new group"
            )

    def _issue(self, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None) -> GroupFuture[Any]:
        self._check_usable()
        world = self.world
        mode = spec.dispatch_mode
        try:
            spec.signature.bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.name}.{spec.name}: {e}") from None
        sharded = mode.dispatch(world, *args, **kwargs)
        if not isinstance(sharded, Sharded):
            try:
                a, k = sharded
            except (TypeError, ValueError):
                raise DispatchError(
                    f"dispatch function of mode {mode.name!r} must return (args, kwargs) of per-rank lists, "
                    f"got {type(sharded).__name__}"
                ) from None
            sharded = Sharded(tuple(a), dict(k))
        n = world.world_size
        for i, a in enumerate([*sharded.args, *sharded.kwargs.values()]):
            if not isinstance(a, (list, tuple)) or len(a) != n:
                raise DispatchError(
                    f"dispatch mode {mode.name!r} produced {len(a) if isinstance(a, (list, tuple)) else type(a).__name__} "
                    f"values for an argument of a group of {n} workers; it must produce one per rank"
                )
        ranks = [0] if spec.execute_mode is Execute.RANK_ZERO else list(range(n))
        keep = [True] * n
        if mode.mesh is not None and spec.execute_mode is not Execute.RANK_ZERO:
            keep = [r.collect for r in world.mesh(mode.mesh)]
        hs = self._hostset
        refs, metas, ids = [], [], []
        for r in ranks:
            a = tuple(_defer(x[r]) for x in sharded.args)
            k = {key: _defer(v[r]) for key, v in sharded.kwargs.items()}
            seq = None
            if spec.mode is Mode.ORDERED:
                seq = hs.next_seq[r]
                hs.next_seq[r] += 1
            call_id = next(_call_ids)
            ids.append((r, call_id, seq))
            pad = sharded.pad[r] if sharded.pad is not None else None
            ref, meta = hs.backend.submit(hs.hosts[r], self._role, spec.name, seq, call_id, a, k, pad,
                                          mode.data_parallel, keep[r])
            refs.append(ref)
            metas.append(meta)
        self.stats.calls += 1
        call = _Call(self, spec, ranks, refs, metas if mode.data_parallel else None, ids, timeout)
        return GroupFuture(call)


def _defer(x: Any) -> Any:
    """A future left in a rank's arguments (by a non-DP or custom mode) is resolved
    whole on the worker."""
    src = getattr(x, "_as_source", None)
    if src is not None:
        return DeferredValue(src())
    if isinstance(x, list) and any(hasattr(i, "_as_source") for i in x):
        return [_defer(i) for i in x]
    return x


def _backend(name: str) -> Backend:
    if name == "ray":
        from asyncrl.backends.ray import RayBackend

        return RayBackend()
    if name == "local":
        from asyncrl.backends.local import LocalBackend

        return LocalBackend()
    raise ValueError(f"backend must be 'ray' or 'local', got {name!r}")


class _BackendGroup(WorkerGroup[W]):
    _BACKEND: str

    def __init__(self, cls: type[W], pool: ResourcePool | None = None, *, world_size: int | None = None,
                 args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, name: str | None = None) -> None:
        super().__init__(cls, pool, world_size=world_size, args=args, kwargs=kwargs, env=env, name=name,
                         backend=_backend(self._BACKEND))


class RayWorkerGroup(_BackendGroup[W]):
    """A :class:`WorkerGroup` whose workers are Ray actors placed on a :class:`ResourcePool`.

    Starts an embedded local Ray if none is running (see :func:`asyncrl.init`).
    """

    _BACKEND = "ray"


class LocalWorkerGroup(_BackendGroup[W]):
    """A :class:`WorkerGroup` whose workers are objects in this process.

    Same dispatch, ordering, padding, pipelining and error semantics as
    :class:`RayWorkerGroup` (arguments and results are serialized as Ray would), so
    worker code can be stepped through in a debugger and unit-tested without Ray.
    Needs a running event loop; ``result()`` is not available.
    """

    _BACKEND = "local"


class Colocated(_AsyncResource):
    """Several worker classes sharing each worker process; each is its own group.

    ``async with colocate({"actor": PolicyWorker, "ref": ReferenceWorker}, pool) as groups:``
    then ``groups["actor"].compute_log_prob(...)``. Ordered calls of all roles in one
    process share one order (they share the device).
    """

    def __init__(self, hostset: _HostSet, groups: dict[str, WorkerGroup[Any]]) -> None:
        self._hostset = hostset
        self.groups = groups

    def __getitem__(self, role: str) -> WorkerGroup[Any]:
        return self.groups[role]

    async def setup(self) -> "Colocated":
        """Start the shared worker processes."""
        await self._hostset.setup()
        return self

    async def close(self) -> None:
        """Close every colocated group and release the processes."""
        for g in self.groups.values():
            await g.close()

    async def __aenter__(self) -> "Colocated":
        return await super().__aenter__()  # type: ignore[no-any-return,unused-ignore]


def colocate(
    roles: Mapping[str, type[Worker] | tuple[type[Worker], Sequence[Any], Mapping[str, Any]]],
    pool: ResourcePool | None = None,
    *,
    world_size: int | None = None,
    env: Mapping[str, str] | None = None,
    name: str = "colocated",
    backend: str = "ray",
) -> Colocated:
    """Put several worker classes in the same processes (e.g. policy and reference).

    `roles` maps a role name to a worker class, or to ``(cls, args, kwargs)``.
    """
    if not roles:
        raise ValueError("colocate() needs at least one role")
    be = _backend(backend)
    n = world_size if world_size is not None else (pool.world_size if pool is not None else None)
    if n is None:
        raise ValueError("give a ResourcePool or a world_size")
    owns = pool is None and be.needs_pool
    if owns:
        pool = ResourcePool([n])
    specs = []
    for role, v in roles.items():
        cls, a, k = (v, (), {}) if isinstance(v, type) else v
        specs.append((role, cls, tuple(a), dict(k)))
    if env and PROTECTED_ENV & set(env):
        raise ValueError(f"env may not set {sorted(PROTECTED_ENV & set(env))}")
    hs = _HostSet(be, pool, n, specs, env or {}, name, owns_pool=owns)
    groups = {role: WorkerGroup(cls, backend=be, _hostset=hs, _role=role, name=f"{name}.{role}")
              for role, cls, _, _ in specs}
    return Colocated(hs, groups)
