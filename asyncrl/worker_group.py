"""`WorkerGroup`: binding registered methods to a group, and dispatching a call.

``wg.compute_log_prob(batch)`` looks up the method's :func:`~asyncrl.register`
contract, splits the arguments (dispatch), has the group's
:class:`~asyncrl._call.Sequencer` issue one call per executing rank and returns a :class:`~asyncrl.GroupFuture`
at once; awaiting it collects the per-rank results (:mod:`asyncrl.future`). The
processes behind a group are a :class:`~asyncrl.host_set.HostSet`; the same group logic
runs on two backends: Ray actors (:class:`RayWorkerGroup`) and in-process objects
(:class:`LocalWorkerGroup`). :func:`colocate` binds several roles to one HostSet.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Generic, Mapping, ParamSpec, Sequence, TypeVar

import structlog

from asyncrl import backends
from asyncrl._backend import BackendSpec
from asyncrl.dispatch import Sharded, World
from asyncrl.errors import (
    DispatchError,
    GroupBrokenError,
    GroupClosedError,
    RegistrationError,
)
from asyncrl._call import CallPlan, _Call
from asyncrl.future import GroupFuture
from asyncrl.host_set import HostSet, check_ranks_per_process
from asyncrl.register import Execute, MethodSpec, RegisteredMethod, registered_methods
from asyncrl.resources import AsyncResource, ResourcePool
from asyncrl.worker import PROTECTED_ENV, Worker

__all__ = ["WorkerGroup", "RayWorkerGroup", "LocalWorkerGroup", "GroupMethod", "GroupStats", "Colocated", "colocate"]

log = structlog.get_logger("asyncrl")

W = TypeVar("W", bound=Worker)
P = ParamSpec("P")
R = TypeVar("R")

_group_ids = itertools.count()


@dataclass
class GroupStats:
    """Counters of one group, for tests and benchmarks."""

    calls: int = 0
    """Group calls issued."""
    bytes_fetched: int = 0
    """Tensor payload bytes fetched into the controller by awaiting this group's futures."""
    results_fetched: int = 0
    """Per-rank results fetched into the controller."""
    inputs_top_level: int = 0
    """Pipelined per-rank inputs sent as top-level Ray arguments (a producer known to have
    finished successfully: see asyncrl._deferred); the others travel nested."""
    inputs_local: int = 0
    """Pipelined per-rank inputs handed over inside the worker process (the producer an
    earlier ordered call on the same process: see asyncrl._deferred, ``LocalShard``)."""


_KEEP: Any = object()  # an option not given to GroupMethod.options: the method's own stays


class GroupMethod(Generic[P, R]):
    """A registered worker method bound to a group; calling it issues a group call."""

    def __init__(self, group: "WorkerGroup[Any]", spec: MethodSpec, timeout: float | None = None,
                 rank: int | None = None) -> None:
        self._group = group
        self.spec = spec
        self._timeout = timeout
        self._rank = rank
        self.__signature__ = spec.signature.replace(parameters=list(spec.signature.parameters.values())[1:])
        self.__name__ = spec.name
        self.__doc__ = f"Group call of {spec.name} ({spec.dispatch_mode.name}, {spec.execute_mode.value}, {spec.mode.value})."

    def options(self, *, timeout: float | None = _KEEP, rank: int | None = _KEEP) -> "GroupMethod[P, R]":
        """The same method with call options (those not given keep this method's). `timeout` (seconds) fails
        the future with :class:`~asyncrl.CallTimeoutError` and cancels the remote work when it passes.
        `rank` runs the call on that rank alone, as if the group were that one worker: the whole arguments
        go to it (a data-parallel batch is not split) and the result is what a group of one returns (a
        batch, a one-item list, or the value of a ``RANK_ZERO`` method). In its lane the call keeps its
        issue order with the group calls that reach that rank. Not for mesh dispatch modes."""
        if timeout is _KEEP:
            timeout = self._timeout
        elif timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if rank is _KEEP:
            rank = self._rank
        elif rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise ValueError(f"rank must be a rank of the group (an int >= 0), got {rank!r}")
            if self.spec.dispatch_mode.mesh is not None:
                raise DispatchError(f"{self._group.name}.{self.spec.name} dispatches over mesh "
                                    f"{self.spec.dispatch_mode.mesh!r}; a call to one rank takes a non-mesh mode")
        return GroupMethod(self._group, self.spec, timeout=float(timeout) if timeout is not None else None, rank=rank)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> GroupFuture[R]:
        return self._group._issue(self.spec, args, kwargs, self._timeout, self._rank)

    def __repr__(self) -> str:
        at = f" on rank {self._rank}" if self._rank is not None else ""
        return f"<GroupMethod {self._group.name}.{self.spec.name}{self.__signature__}{at}>"


class WorkerGroup(AsyncResource, Generic[W]):
    """A group of `world_size` workers of class `cls`, run by a backend.

    Build it, then ``await wg.setup()`` (or ``async with wg:``) to start the workers;
    ``await wg.close()`` releases them. Every method registered on `cls` is an
    attribute that issues a group call and returns a :class:`GroupFuture`.

    `local_results`: how many of its latest ordered calls' results each worker process
    keeps, so that a later ordered call in the same process takes one as its pipelined
    input from memory instead of through the controller (default 4, or the environment
    variable ``ASYNCRL_LOCAL_RESULTS``; 0 turns it off).

    `ranks_per_process`: how many ranks each worker process hosts (default 1; the Ray backend). Each
    rank keeps its own worker object and ordered lane, so calls, cancellation and errors stay per rank,
    while the ranks of a process share its memory and die with it: for workers light enough to share a
    process (simulated ones: the cluster twin runs hundreds of replicas this way), never for ranks that
    each join a torch.distributed group. A pool then needs ``ceil(world_size / ranks_per_process)`` bundles.

    `restart`: what the death of one of its processes does. ``"none"`` (the default): the group is broken, every
    later call fails (close it, create a new one). ``"process"``: only that process's ranks are; calls that
    reach them fail with :class:`~asyncrl.GroupBrokenError` while the other ranks serve on, and
    :meth:`replace_process` starts a new process for them. For ranks that join no collective with the others
    (rollout replicas), never for training ranks.
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
        backend: BackendSpec,
        local_results: int | None = None,
        ranks_per_process: int = 1,
        restart: str = "none",
        _hostset: HostSet | None = None,
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
            procs = _processes(n, ranks_per_process)
            if pool is not None and procs > pool.world_size:
                raise ValueError(f"world_size={n} is larger than the pool's {pool.world_size} bundles"
                                 + (f" hold at {ranks_per_process} ranks per process" if ranks_per_process > 1 else ""))
            owns = pool is None and backend.needs_pool
            if owns:
                pool = ResourcePool([procs])
            self.name = name or f"{cls.__name__}_{next(_group_ids)}"
            _hostset = HostSet(backend, pool, n, [("worker", cls, tuple(args), dict(kwargs or {}))], env or {},
                                self.name, owns_pool=owns, local_results=local_results,
                                ranks_per_process=ranks_per_process, restart=restart)
            self._role = "worker"
        else:
            self._role = _role  # type: ignore[assignment]
            self.name = name or f"{_hostset.name}.{_role}"
        self._hostset = _hostset
        _hostset.views += 1
        self.stats = GroupStats()
        self.time_calls = False
        """Every call returns its workers' times (:meth:`GroupFuture.worker_times`), not only
        ``DP_COMPUTE`` calls (which carry them in their metadata anyway): one more small
        return object per rank for the other modes. A tracer sets it."""
        self._broken: tuple[int | None, str] | None = None
        self._closed = False
        self._world: World | None = None  # once the group is ready: one World for every call
        self._layouts: dict[str, tuple[tuple[int, ...], tuple[int, ...], list[bool]]] = {}  # per method, of _world

    # ---- lifecycle -----------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self._hostset.world_size

    @property
    def world(self) -> World:
        """What dispatch functions see: world size, group name and registered meshes."""
        if self._world is not None:
            return self._world
        w = World(self.world_size, self.name, self._hostset.meshes.get(self._role, {}))
        if self._hostset.state == "ready":  # the meshes are known: one World for every call
            self._world = w
        return w

    def _layout(self, spec: MethodSpec, world: World) -> tuple[tuple[int, ...], tuple[int, ...], list[bool]]:
        """``(executing ranks, collect order, keep per rank)`` of `spec`'s calls: the same for
        every call of a started group, so computed once (and shared by every call's state)."""
        if world is not self._world:  # not ready yet: the meshes may still change
            return _layout(spec, world)
        got = self._layouts.get(spec.name)
        if got is None:
            got = self._layouts[spec.name] = _layout(spec, world)
        return got

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

    @property
    def restart(self) -> str:
        """The restart policy: ``"none"`` (a lost process breaks the group) or ``"process"`` (see the class)."""
        return self._hostset.restart

    def process_ranks(self, rank: int) -> list[int]:
        """The ranks that share `rank`'s process (they live and die together), `rank` among them."""
        hs = self._hostset
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < hs.world_size:
            raise ValueError(f"group {self.name!r} has ranks 0..{hs.world_size - 1}, got {rank!r}")
        return hs.ranks_of(hs.process_of(rank))

    @property
    def replaced(self) -> list[tuple[list[int], float]]:
        """``(ranks, seconds to start)`` of each process :meth:`replace_process` replaced, in order."""
        return list(self._hostset.replaced)

    @property
    def lost_ranks(self) -> list[int]:
        """Ranks whose process died and was not replaced yet (``restart="process"``; else always empty)."""
        hs = self._hostset
        return hs.lost_ranks(range(hs.world_size)) if hs.lost else []

    async def replace_process(self, rank: int, *, timeout_s: float | None = None) -> list[int]:
        """Replace the process hosting `rank` (``restart="process"``): a new one in its bundle, with the same
        constructors, its ranks' ordered lanes started again; the other processes and their calls are left
        alone (a colocated group's other roles are replaced with it: they share the process). Returns the
        replaced ranks. Raises ``RuntimeError`` without that policy or before setup, ``ValueError`` for a rank
        outside the group, :class:`~asyncrl.PlacementError` when the process has not started within
        `timeout_s`, and the constructor's :class:`~asyncrl.RemoteError` when it raised."""
        self._check_open()
        return await self._hostset.replace_process(rank, timeout_s=timeout_s)

    def _check_open(self) -> None:
        if self.closed:
            raise GroupClosedError(f"group {self.name!r} is closed; create a new group")

    def _mark_broken(self, rank: int | None, detail: str) -> None:
        if rank is not None and self._hostset.restart == "process":
            self._hostset.lose(rank, detail)
            return
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

    def _issue(self, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None,
               rank: int | None = None) -> GroupFuture[Any]:
        self._check_usable()
        world = self.world
        if rank is not None:  # one rank, as a group of one (GroupMethod.options)
            if rank >= world.world_size:
                raise ValueError(f"{self.name}.{spec.name}: rank {rank} is not a rank of this group of "
                                 f"{world.world_size} workers")
            world = World(1, self.name, {})
        mode = spec.dispatch_mode
        if not _positional_fits(spec, args, kwargs):
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
        for a in [*sharded.args, *sharded.kwargs.values()]:
            if not isinstance(a, (list, tuple)) or len(a) != n:
                raise DispatchError(
                    f"dispatch mode {mode.name!r} produced {len(a) if isinstance(a, (list, tuple)) else type(a).__name__} "
                    f"values for an argument of a group of {n} workers; it must produce one per rank"
                )
        if sharded.pad is not None and len(sharded.pad) != n:
            raise DispatchError(f"dispatch mode {mode.name!r} reported padding for {len(sharded.pad)} ranks; "
                                f"a group of {n} workers needs one entry per rank")
        ranks: tuple[int, ...]
        order: tuple[int, ...]
        if rank is not None:
            sharded = _at_rank(sharded, rank, self.world_size)
            ranks, order, keep = (rank,), (0,), [True] * self.world_size
        else:
            ranks, order, keep = self._layout(spec, world)
        if self._hostset.lost:
            self._refuse_lost(ranks)
        plan = CallPlan(self, self._role, spec, world, sharded, ranks, order, keep, producers_of(args, kwargs),
                        timeout, self.time_calls)
        call = self._hostset.sequencer.issue(plan)
        return GroupFuture(call)

    def _refuse_lost(self, ranks: Sequence[int]) -> None:
        """A call that would reach a lost process's rank fails before it is sent (``restart="process"``)."""
        hs = self._hostset
        lost = hs.lost_ranks(ranks)
        if lost:
            raise GroupBrokenError(
                f"group {self.name!r} is broken: worker rank {lost[0]} died ({hs.lost[hs.process_of(lost[0])]}); "
                f"ranks {lost} take no call until `await wg.replace_process({lost[0]})` replaced their process",
                ranks=tuple(lost))


def _at_rank(sharded: Sharded, rank: int, n: int) -> Sharded:
    """A group of one's per-rank arguments (`sharded`) placed at `rank` of a group of `n` (the Builder reads a
    rank's arguments at its index; the other indices are never read)."""
    def place(xs: Any) -> list[Any]:
        out: list[Any] = [None] * n
        out[rank] = xs[0]
        return out

    pad = None
    if sharded.pad is not None:
        pad = [0] * n
        pad[rank] = sharded.pad[0]
    return Sharded(tuple(place(a) for a in sharded.args), {k: place(v) for k, v in sharded.kwargs.items()}, pad=pad)


def _processes(world_size: int, ranks_per_process: int) -> int:
    """Processes (bundles) a group of `world_size` ranks needs at `ranks_per_process` ranks each."""
    return -(-world_size // check_ranks_per_process(ranks_per_process))


def producers_of(args: Sequence[Any], kwargs: dict[str, Any]) -> "Sequence[_Call]":
    """The calls whose futures are among a call's arguments (top level, in a list, or in the lists of a list: one
    list per rank, as ``Dispatch.ALL_TO_ALL`` and the like take them)."""
    out: list[_Call] = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, GroupFuture):
            out.append(x._call)
        elif isinstance(x, (list, tuple)):
            for i in x:
                if isinstance(i, GroupFuture):
                    out.append(i._call)
                elif isinstance(i, (list, tuple)):
                    out.extend(j._call for j in i if isinstance(j, GroupFuture))
    return out or ()  # (most calls have none: no list kept per call)


def _layout(spec: MethodSpec, world: World) -> tuple[tuple[int, ...], tuple[int, ...], list[bool]]:
    """See :meth:`WorkerGroup._layout`."""
    n = world.world_size
    rank_zero = spec.execute_mode is Execute.RANK_ZERO
    ranks = (0,) if rank_zero else tuple(range(n))
    keep = [True] * n
    order = tuple(range(len(ranks)))
    mesh = spec.dispatch_mode.mesh
    if mesh is not None and not rank_zero:
        mranks = world.mesh(mesh)
        keep = [r.collect for r in mranks]
        order = tuple(sorted((i for i, r in enumerate(ranks) if mranks[r].collect), key=lambda i: mranks[ranks[i]].dp_rank))
    return ranks, order, keep


class _BackendGroup(WorkerGroup[W]):
    _BACKEND: str

    def __init__(self, cls: type[W], pool: ResourcePool | None = None, *, world_size: int | None = None,
                 args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, name: str | None = None,
                 local_results: int | None = None, ranks_per_process: int = 1, restart: str = "none") -> None:
        super().__init__(cls, pool, world_size=world_size, args=args, kwargs=kwargs, env=env, name=name,
                         backend=backends.named(self._BACKEND), local_results=local_results,
                         ranks_per_process=ranks_per_process, restart=restart)


class RayWorkerGroup(_BackendGroup[W]):
    """A :class:`WorkerGroup` whose workers are Ray actors placed on a :class:`ResourcePool`.

    The constructor only records what to build; ``await wg.setup()`` (or ``async with``)
    starts an embedded local Ray if none is running (:func:`asyncrl.ainit`, off the
    event loop), places the pool and starts the actors.
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


class Colocated(AsyncResource):
    """Several worker classes sharing each worker process; each is its own group.

    ``async with colocate({"actor": PolicyWorker, "ref": ReferenceWorker}, pool) as groups:``
    then ``groups["actor"].compute_log_prob(...)``. Ordered calls of all roles in one
    process share one order (they share the device).
    """

    def __init__(self, hostset: HostSet, groups: dict[str, WorkerGroup[Any]]) -> None:
        self._hostset = hostset
        self.groups = groups

    def __getitem__(self, role: str) -> WorkerGroup[Any]:
        return self.groups[role]

    async def setup(self) -> "Colocated":
        """Start the shared worker processes."""
        await self._hostset.setup()
        return self

    async def close(self) -> None:
        """Close every colocated group and release the processes (also during setup)."""
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
    local_results: int | None = None,
    ranks_per_process: int = 1,
    restart: str = "none",
) -> Colocated:
    """Put several worker classes in the same processes (e.g. policy and reference).

    `roles` maps a role name to a worker class, or to ``(cls, args, kwargs)``.
    `local_results`: how many of its latest ordered calls' results each process keeps
    so that a later ordered call there (any role) takes one as its pipelined input from
    memory instead of through the controller (default 4, or ``ASYNCRL_LOCAL_RESULTS``;
    0 turns it off). `ranks_per_process`: ranks each process hosts (default 1; see
    :class:`WorkerGroup`); without `world_size` a pool's bundles hold that many ranks each. `restart`: the
    restart policy of the shared processes (see :class:`WorkerGroup`; ``"process"``: a lost process is replaced
    alone, every role's view with it).
    """
    if not roles:
        raise ValueError("colocate() needs at least one role")
    be = backends.named(backend)
    n = world_size if world_size is not None else (pool.world_size * ranks_per_process if pool is not None else None)
    if n is None:
        raise ValueError("give a ResourcePool or a world_size")
    procs = _processes(n, ranks_per_process)
    if pool is not None and procs > pool.world_size:
        raise ValueError(f"world_size={n} at {ranks_per_process} ranks per process needs {procs} bundles; the pool "
                         f"has {pool.world_size}")
    owns = pool is None and be.needs_pool
    if owns:
        pool = ResourcePool([procs])
    specs = []
    for role, v in roles.items():
        cls, a, k = (v, (), {}) if isinstance(v, type) else v
        specs.append((role, cls, tuple(a), dict(k)))
    if env and PROTECTED_ENV & set(env):
        raise ValueError(f"env may not set {sorted(PROTECTED_ENV & set(env))}")
    hs = HostSet(be, pool, n, specs, env or {}, name, owns_pool=owns, local_results=local_results,
                 ranks_per_process=ranks_per_process, restart=restart)
    groups = {role: WorkerGroup(cls, backend=be, _hostset=hs, _role=role, name=f"{name}.{role}")
              for role, cls, _, _ in specs}
    return Colocated(hs, groups)


_ARITY: dict[int, tuple[MethodSpec, "_Params | None"]] = {}


class _Params:
    """What `_positional_fits` needs of a method's parameters (without self): how many can
    be passed positionally, each name's position, and the required positions."""

    __slots__ = ("positional", "names", "index", "required")

    def __init__(self, params: "list[inspect.Parameter]") -> None:
        self.positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        self.names = tuple(p.name for p in params)  # positional-or-keyword first, then keyword-only
        self.index = {name: i for i, name in enumerate(self.names)}
        self.required = tuple(i for i, p in enumerate(params) if p.default is p.empty)


def _positional_fits(spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when `args` and `kwargs` surely bind to the method's parameters (plain
    positional-or-keyword and keyword-only ones: no ``*args``, ``**kwargs`` or
    positional-only): no more positional arguments than it takes, every keyword names a
    parameter not given positionally, every required parameter given. A few dict look-ups
    instead of ``Signature.bind``; whatever this does not accept goes through
    ``Signature.bind``, for its error message (or its verdict on the rare signature)."""
    entry = _ARITY.get(id(spec))
    if entry is None or entry[0] is not spec:  # (the spec is kept in the entry: its id stays its own)
        params = list(spec.signature.parameters.values())[1:]  # without self
        plain = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
        entry = _ARITY[id(spec)] = (spec, _Params(params) if plain else None)
    info = entry[1]
    if info is None:
        return False
    n = len(args)
    if n > info.positional:
        return False
    required = info.required
    if not kwargs:
        return not required or required[-1] < n
    index = info.index
    for k in kwargs:
        i = index.get(k)
        if i is None or i < n:
            return False  # an unknown name, or one given positionally as well
    names = info.names
    return all(i < n or names[i] in kwargs for i in required)
