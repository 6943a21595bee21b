"""The worker processes behind one group, or behind several colocated groups.

A :class:`HostSet` owns the processes' whole life: placement on a
:class:`~asyncrl.ResourcePool`, starting one host per rank (each host builds the
worker objects of every colocated role in its process), the torch.distributed
environment, the registered meshes, the ordered-call :class:`~asyncrl._call.Sequencer`,
and closing. Several :class:`~asyncrl.WorkerGroup` views (one per role) can share one
HostSet; the processes go when the last view closes.

A set started with ``restart="process"`` outlives the death of one of its processes: the lost process's
ranks refuse calls (``GroupBrokenError``) while the others serve on, and :meth:`HostSet.replace_process`
starts a new process for them in the lost one's bundle, with the same constructors, and resets their ordered
lanes. For ranks that do not join a collective with the others (rollout replicas), never for training ranks.

States: ``new`` → ``starting`` → ``ready`` → ``closed``. `setup()` runs the start-up
as one task that every caller awaits; `close()` at any point (during start-up too)
cancels that task, waits for it to unwind, and releases whatever exists by then:
hosts are killed, a pool the set made for itself is released. A closed set never
becomes ready.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any, Mapping

import structlog

from asyncrl._backend import Backend, BackendSpec, public_error
from asyncrl._call import Sequencer
from asyncrl.dispatch import MeshRank
from asyncrl.register import Mode, registered_methods
from asyncrl.errors import DispatchError, GroupClosedError, PlacementError
from asyncrl.resources import ResourcePool
from asyncrl.worker import RoleSpec, WorkerContext

__all__ = ["HostSet", "RESTART_POLICIES"]

RESTART_POLICIES = ("none", "process")
"""What a group does when one of its processes dies: ``"none"``, the whole group is broken (close it, create a
new one); ``"process"``, only that process's ranks are, until :meth:`HostSet.replace_process` replaces it."""

log = structlog.get_logger("asyncrl")

_CLOSE_GRACE_S = 10.0  # how long close() waits for the workers' on_close hooks before killing

LOCAL_RESULTS = 4
"""Default of :attr:`HostSet.local_results`; the environment variable
``ASYNCRL_LOCAL_RESULTS`` overrides it (``0`` turns same-process hand-off off)."""


def default_local_results() -> int:
    """``ASYNCRL_LOCAL_RESULTS`` if set (a non-negative int), else :data:`LOCAL_RESULTS`."""
    raw = os.environ.get("ASYNCRL_LOCAL_RESULTS")
    if raw is None or raw == "":
        return LOCAL_RESULTS
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"ASYNCRL_LOCAL_RESULTS must be a non-negative int, got {raw!r}")
    return n


def check_local_results(n: Any) -> int:
    """`n` as a number of kept results (None: the default), or a clear error."""
    if n is None:
        return default_local_results()
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"local_results must be a non-negative int (0 turns same-process hand-off off), got {n!r}")
    return n


HOST_KIND: str | None = None
"""``None``: each set picks its host kind (:attr:`HostSet.threaded`); ``"threaded"`` or
``"async"`` forces one (the tests run the protocol on both)."""


class HostSet:
    """The worker processes behind one group, or behind several colocated groups."""

    def __init__(self, backend: BackendSpec, pool: ResourcePool | None, world_size: int,
                 roles: list[tuple[str, type, tuple[Any, ...], dict[str, Any]]],
                 env: Mapping[str, str], name: str, owns_pool: bool, local_results: int | None = None,
                 ranks_per_process: int = 1, restart: str = "none") -> None:
        self.restart = check_restart(restart)
        """The restart policy (:data:`RESTART_POLICIES`)."""
        self.lost: dict[int, str] = {}
        """Process index -> what killed it, for processes lost and not replaced yet (``restart="process"``)."""
        self._specs: list[list[RoleSpec]] = []  # per rank: what its host builds (kept for a replacement)
        self._slots: list[Any] = []  # per process: its bundle
        self._replacing: dict[int, asyncio.Future[list[int]]] = {}  # process index -> its replacement under way
        self.replaced: list[tuple[list[int], float]] = []
        """``(ranks, seconds)`` of each process replaced: its ranks, and how long the new process took to start
        (kill, placement, process, constructors)."""
        self.backend: Backend = backend  # type: ignore[assignment]  # a stand-in until _start()
        self.pool = pool
        self.world_size = world_size
        self.ranks_per_process = check_ranks_per_process(ranks_per_process)
        """Ranks each process hosts (1: a process per rank). With more, each rank still has its own host, worker
        objects and ordered lane (so its calls are numbered and cancelled on their own), but the ranks of one
        process share its Python and die with it; they must not each join a torch.distributed group."""
        self.roles = roles
        self.env = dict(env)
        self.name = name
        self.owns_pool = owns_pool
        self.hosts: list[Any] = []
        self.local_results = check_local_results(local_results)
        """How many of its latest ordered calls' outcomes each process keeps, so that a
        later ordered call in the same process takes such a result as its input from
        memory (see asyncrl._deferred, ``LocalShard``); 0: off."""
        self.sequencer = Sequencer(self.backend, self.hosts, world_size, self.local_results)
        self.meshes: dict[str, dict[str, tuple[MeshRank, ...]]] = {}
        self.contexts: list[WorkerContext] = []
        self.state = "new"  # new -> starting -> ready -> closed
        self.views = 0
        self._starting: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[None] | None = None

    @property
    def closed(self) -> bool:
        return self.state == "closed"

    @property
    def processes(self) -> int:
        """Worker processes (bundles of the pool) the set starts: ``ceil(world_size / ranks_per_process)``."""
        return -(-self.world_size // self.ranks_per_process)

    @property
    def threaded(self) -> bool:
        """Whether the processes get threaded hosts: when no hosted role has a concurrent
        method (those may run unboundedly many calls at once, which an event loop carries
        and a thread per call would not). ``HOST_KIND`` overrides it (tests). Processes that host
        several ranks always run them on an event loop (async hosts, one per rank)."""
        if self.ranks_per_process > 1:
            return False
        if HOST_KIND is not None:
            return HOST_KIND == "threaded"
        return not any(m.mode is Mode.CONCURRENT for _, cls, *_ in self.roles for m in registered_methods(cls).values())

    # ---- start-up -----------------------------------------------------------------------

    async def setup(self) -> None:
        """Start the processes (idempotent; concurrent callers share one start-up)."""
        if self.state == "ready":
            return
        if self.state == "closed":
            raise GroupClosedError(f"group {self.name!r} is closed; create a new group")
        if self._starting is None:
            self.state = "starting"
            self._starting = asyncio.ensure_future(self._start())
        task = self._starting
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self.state == "closed":  # close() stopped the start-up, not our caller
                current = asyncio.current_task()
                if current is None or not current.cancelling():
                    raise GroupClosedError(f"group {self.name!r} was closed during setup()") from None
            await self.close()  # the caller gave up: nothing of a half-started group stays
            raise
        except BaseException:
            await self.close()
            raise
        if self.state != "ready":
            raise GroupClosedError(f"group {self.name!r} was closed during setup()")

    async def _start(self) -> None:
        self.backend = self.sequencer.backend = await self.backend.start()
        # Ray (and torch) are imported and running now: their objects live as long as the
        # process. Freeze them before the set-up allocates, or the collector's next full
        # pass walks them all on the loop (measured: a 270 ms stall in the middle of
        # setup(), benchmarks/loop_lag.py). The same reasoning as the freeze below.
        gc.freeze()
        n, k, procs = self.world_size, self.ranks_per_process, self.processes
        slots = []
        if self.pool is not None:
            await self.pool.place(self.backend)
            if self.pool.world_size < procs:
                raise ValueError(f"group {self.name!r} needs {procs} bundles but its pool has {self.pool.world_size}")
            slots = self.pool.slots[:procs]
        self._slots = list(slots)
        threaded = self.threaded
        if k > 1:
            self.hosts.extend(await self.backend.make_hosts(self.name, slots, n, threaded=threaded, per_process=k))
        else:
            self.hosts.extend(await self.backend.make_hosts(self.name, slots, n, threaded=threaded))
        info = await self._admin(0, "node_info", "node_info")
        local_world: dict[Any, int] = {}
        for r in range(n if slots else 0):
            key = slots[r // k].node_key
            local_world[key] = local_world.get(key, 0) + 1
        specs_per_host = []
        self.contexts = []
        for rank in range(n):
            slot = slots[rank // k] if slots else None
            ctx = WorkerContext(
                rank=rank, world_size=n, local_rank=(slot.local_rank * k + rank % k) if slot else rank,
                group=self.name, role=self.roles[0][0],
                num_cpus=slot.num_cpus / k if slot else 1.0, num_gpus=slot.num_gpus / k if slot else 0.0,
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
                for role, cls, args, kwargs, gname in self.role_names()
            ])
        self._specs = specs_per_host
        label = self._init_label()
        results = await asyncio.gather(*(self._admin(rank, "init_workers", label, specs, self.local_results)
                                         for rank, specs in enumerate(specs_per_host)))
        self.meshes = {role: _check_meshes(self.name, role, [r[role] for r in results]) for role, *_ in self.roles}
        if self.state == "starting":
            self.state = "ready"
            # Everything alive now (imported modules, Ray's and torch's objects, the hosts)
            # lives as long as the process: move it out of the collector's full passes.
            # Thousands of calls in flight trigger full collections; over these objects
            # each took 0.4-1.1 s on a loaded machine (benchmarks/inflight.py), after
            # the freeze 20-80 ms. The workers do the same after their constructors.
            gc.freeze()

    def _init_label(self) -> str:
        return "/".join(f"{cls.__name__}.__init__" for _, cls, *_ in self.roles)

    # ---- one lost process (restart="process") --------------------------------------------

    def process_of(self, rank: int) -> int:
        """The index of the process (pool bundle) hosting `rank`."""
        return rank // self.ranks_per_process

    def ranks_of(self, process: int) -> list[int]:
        """The ranks process `process` hosts."""
        k = self.ranks_per_process
        return list(range(process * k, min(self.world_size, (process + 1) * k)))

    def lose(self, rank: int, detail: str) -> None:
        """The process hosting `rank` died: its ranks refuse calls until it is replaced."""
        p = self.process_of(rank)
        if p not in self.lost:
            self.lost[p] = detail
            log.warning("group.process_lost", group=self.name, process=p, ranks=self.ranks_of(p), detail=detail)

    def lost_ranks(self, ranks: Any) -> list[int]:
        """Those of `ranks` whose process is lost."""
        return [r for r in ranks if self.process_of(r) in self.lost]

    async def replace_process(self, rank: int, *, timeout_s: float | None = None) -> list[int]:
        """Start a new process for the ranks of the process hosting `rank` (in its bundle; where its node is gone,
        wherever Ray places the bundle again) with the same constructors; the set's other processes, and the calls
        they run, are left alone. Returns the replaced ranks. The old process is killed first (it may still be
        alive: a caller may replace a process it gave up on). Their ordered lanes start again from the first
        number; calls still pending on the old process fail as its death says. Concurrent callers for one
        process share one replacement.

        Raises ``RuntimeError`` unless the set was started with ``restart="process"`` and is ready,
        ``ValueError`` for a rank outside the set, :class:`~asyncrl.PlacementError` when the new process has not
        started within `timeout_s` (no capacity: it is killed, the ranks stay lost), and the constructor's error
        (a :class:`~asyncrl.RemoteError`) when it raised."""
        if self.restart != "process":
            raise RuntimeError(f"group {self.name!r} has no restart policy: create it with restart='process' to "
                               "replace one lost process (or close it and create a new one)")
        if self.state != "ready":
            raise RuntimeError(f"group {self.name!r} is {self.state}; only a started group replaces a process")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"replace_process needs a rank of group {self.name!r} (0..{self.world_size - 1}), "
                             f"got {rank!r}")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or timeout_s <= 0):
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        p = self.process_of(rank)
        fut = self._replacing.get(p)
        if fut is None:
            fut = self._replacing[p] = asyncio.ensure_future(self._replace(p, timeout_s))
            fut.add_done_callback(lambda _: self._replacing.pop(p, None))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.cancelled() and self.state == "closed":  # close() stopped it, not our caller
                raise GroupClosedError(f"group {self.name!r} was closed while a process was being replaced") from None
            raise

    async def _replace(self, p: int, timeout_s: float | None) -> list[int]:
        t0 = time.perf_counter()
        ranks = self.ranks_of(p)
        self.lose(ranks[0], "replaced")  # (a live process being replaced takes no call meanwhile)
        await self.backend.kill([self.hosts[r] for r in ranks])
        slots = [self._slots[p]] if self._slots else []
        k = self.ranks_per_process
        new: list[Any] = []
        try:
            async with asyncio.timeout(timeout_s):
                if k > 1:
                    new = await self.backend.make_hosts(self.name, slots, len(ranks), threaded=False, per_process=k)
                else:
                    new = await self.backend.make_hosts(self.name, slots, 1, threaded=self.threaded)
                label = self._init_label()
                await asyncio.gather(*(self._init(host, r, label) for host, r in zip(new, ranks)))
        except TimeoutError:
            await self.backend.kill(new)
            raise PlacementError(f"group {self.name!r}: the new process for ranks {ranks} did not start within "
                                 f"{timeout_s:g} s (no capacity for its bundle?); it stays lost: close the group "
                                 "and create a new one, or try again") from None
        except BaseException:
            await self.backend.kill(new)
            raise
        if self.state != "ready":  # closed meanwhile
            await self.backend.kill(new)
            raise GroupClosedError(f"group {self.name!r} was closed while a process was being replaced")
        for r, host in zip(ranks, new):
            self.hosts[r] = host
        self.sequencer.reset_lanes(ranks)
        self.lost.pop(p, None)
        self.replaced.append((ranks, time.perf_counter() - t0))
        log.warning("group.process_replaced", group=self.name, process=p, ranks=ranks,
                    seconds=round(self.replaced[-1][1], 2))
        return ranks

    async def _init(self, host: Any, rank: int, label: str) -> None:
        try:
            await self.backend.admin(host, "init_workers", self._specs[rank], self.local_results)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise public_error(e, group=self.name, method=label, rank=rank, closed=self.closed) from None

    async def _admin(self, rank: int, method: str, label: str, *args: Any) -> Any:
        try:
            return await self.backend.admin(self.hosts[rank], method, *args)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise public_error(e, group=self.name, method=label, rank=rank, closed=self.closed) from None

    def role_names(self) -> list[tuple[str, type, tuple[Any, ...], dict[str, Any], str]]:
        """``(role, class, args, kwargs, group name)`` per role hosted in each process."""
        if len(self.roles) == 1:
            role, cls, args, kwargs = self.roles[0]
            return [(role, cls, args, kwargs, self.name)]
        return [(role, cls, args, kwargs, f"{self.name}.{role}") for role, cls, args, kwargs in self.roles]

    # ---- closing --------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop the processes and release what the set owns, on every path (idempotent;
        concurrent callers wait for the same close)."""
        if self._closing is None:
            self.state = "closed"
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        replacing = list(self._replacing.values())
        for fut in replacing:  # a process being replaced: its start stops (a new host made by then is killed)
            fut.cancel()
        if replacing:
            await asyncio.gather(*replacing, return_exceptions=True)
        starting = self._starting
        if starting is not None and not starting.done():
            starting.cancel()
            try:
                await starting  # placement and host start-up unwind before anything is released
            except BaseException:  # noqa: BLE001 - the start-up's own error is its caller's
                pass
        hosts = list(self.hosts)
        if hosts:
            try:
                await asyncio.wait_for(asyncio.gather(*(self.backend.admin(h, "close") for h in hosts),
                                                      return_exceptions=True), timeout=_CLOSE_GRACE_S)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
            finally:
                await self.backend.kill(hosts)
        if self.pool is not None and self.owns_pool:
            await self.pool.release()


def check_restart(policy: Any) -> str:
    """`policy` as a restart policy (:data:`RESTART_POLICIES`), or a clear error."""
    if policy not in RESTART_POLICIES:
        raise ValueError(f"restart must be one of {RESTART_POLICIES} ('process': a lost process is replaced alone, "
                         f"for ranks that join no collective), got {policy!r}")
    return str(policy)


def check_ranks_per_process(k: Any) -> int:
    """`k` as a number of ranks per process, or a clear error."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"ranks_per_process must be a positive int (1: a process per rank), got {k!r}")
    return k


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
