"""Starting Ray: an embedded local instance, or a connection to an existing cluster.

Who owns Ray's processes. Ray starts its GCS and raylet with ``PR_SET_PDEATHSIG``: the
kernel kills them when the *thread* that spawned them ends, not the process. Starting
Ray from a short-lived thread (``asyncio.to_thread`` inside ``asyncio.run``, whose
executor is shut down when the loop ends) therefore kills the embedded cluster behind
the driver's back: the next Ray call, or Ray's exception hook reporting the real
error, blocks for 60 s on the dead GCS and the process exits with "Failed to connect to
GCS". So every start and stop runs on one daemon thread that lives as long as the
process (`_RayOwner`); `init()` from any thread and `await ainit()` from a loop both
hand the work to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import random
import socket
import sys
import threading
from typing import Any, Callable, Coroutine, Iterator, Literal, TypeVar

import structlog

__all__ = ["init", "ainit", "shutdown", "ashutdown", "run", "loop_factory", "EventLoop", "free_port"]

_T = TypeVar("_T")


class _RayOwner:
    """A daemon thread, started once, that runs Ray's start and stop for the process.

    It never exits while the process runs, so the processes Ray starts from it (bound to
    it by the parent-death signal) live as long as the process does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """Run `fn` on the owner thread; the returned future holds its result or error."""
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
        if threading.current_thread() is self._thread:  # re-entrant use from the owner itself
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            return fut
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="asyncrl-ray-owner", daemon=True)
                self._thread.start()
        self._queue.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            fn, fut = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)


_OWNER = _RayOwner()


def quiet_tensor_warnings() -> None:
    """Silence the warnings Ray and torch print for zero-copy tensors: asyncrl's
    contract is that worker inputs are read-only (copy before writing in place)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Zero-copy tensor serialization is enabled.*")
    warnings.filterwarnings("ignore", message=".*The given NumPy array is not writable.*")

log = structlog.get_logger("asyncrl")


class _NoSigtermWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def _quiet_sigterm_warning() -> None:
    """Ray warns that it cannot install its driver SIGTERM handler off the main thread; by design
    Ray starts on the owner thread, and the controller handles SIGTERM itself (``fit_sync``)."""
    logger = logging.getLogger("ray._private.worker")
    if not any(isinstance(f, _NoSigtermWarning) for f in logger.filters):
        logger.addFilter(_NoSigtermWarning())


def init(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    zero_copy_tensors: bool = True,
    log_to_driver: bool = True,
    **ray_kwargs: Any,
) -> dict[str, Any]:
    """Start or connect to Ray once per process (later calls are no-ops).

    With no `address` (and no ``RAY_ADDRESS`` in the environment) asyncrl starts an
    embedded Ray bound to loopback (every Ray server listens on 127.0.0.1 only) with the
    dashboard off, quiet logs and Ray's token authentication (on by default in Ray 2.60). With an
    address (``"auto"`` or ``"host:6379"``) it connects to that cluster; a cluster with
    token authentication needs ``RAY_AUTH_TOKEN`` set as Ray documents.

    `zero_copy_tensors` lets torch tensors cross the object store without a copy
    (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``); a worker then receives read-only
    views and must copy an input before writing to it in place.

    The embedded Ray advertises `num_cpus` logical CPUs; by default at least 16 (or
    the machine's count if larger), so that a few small workers fit on a laptop. Ray
    CPUs are scheduling units, not cores: pass ``num_cpus=os.cpu_count()`` for strict
    accounting. A ``runtime_env`` passed here is merged with asyncrl's own (its
    ``env_vars`` are added to asyncrl's; asyncrl's zero-copy and loopback settings win).

    The start runs on a thread that lives as long as the process (see the module
    docstring), whatever thread calls this; from a running event loop use
    ``await ainit(...)``, which does not block the loop. Returns Ray's cluster resources.
    """
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()
    return _OWNER.submit(
        lambda: _init_here(address, num_cpus=num_cpus, num_gpus=num_gpus, zero_copy_tensors=zero_copy_tensors,
                           log_to_driver=log_to_driver, **ray_kwargs)
    ).result()


async def ainit(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    zero_copy_tensors: bool = True,
    log_to_driver: bool = True,
    **ray_kwargs: Any,
) -> dict[str, Any]:
    """`init` for a running event loop: Ray starts on the owner thread while the loop runs on
    (importing ray, a second or more the first time, happens there too)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # even the resource query is a GCS round trip: off the loop
        return await asyncio.get_running_loop().run_in_executor(None, ray.cluster_resources)
    fut = _OWNER.submit(
        lambda: _init_here(address, num_cpus=num_cpus, num_gpus=num_gpus, zero_copy_tensors=zero_copy_tensors,
                           log_to_driver=log_to_driver, **ray_kwargs)
    )
    return await asyncio.wrap_future(fut)


def _init_here(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    zero_copy_tensors: bool = True,
    log_to_driver: bool = True,
    **ray_kwargs: Any,
) -> dict[str, Any]:
    """Start or connect to Ray on the calling thread (the owner thread; see `init`)."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()
    quiet_tensor_warnings()
    _quiet_sigterm_warning()
    if zero_copy_tensors:
        os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
        # Ray reads the variable once, when it is imported; the controller's own
        # serializer is built at ray.init from this constant, so set it too.
        try:
            from ray._private import ray_constants

            ray_constants.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS = os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "1"
        except (ImportError, AttributeError):  # a Ray without the constant: the variable is all there is
            pass
    env_vars = {k: os.environ[k] for k in ("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS",) if k in os.environ}
    address = address or os.environ.get("RAY_ADDRESS")
    user_env = dict(ray_kwargs.pop("runtime_env", None) or {})
    env_vars = {**dict(user_env.pop("env_vars", None) or {}), **env_vars}
    kwargs: dict[str, Any] = dict(
        log_to_driver=log_to_driver,
        logging_level=logging.WARNING,
        runtime_env={**user_env, "env_vars": env_vars},
        namespace=ray_kwargs.pop("namespace", "asyncrl"),
    )
    if address:
        ray.init(address=address, **kwargs, **ray_kwargs)
        _freeze_startup_objects()
        log.info("ray.connected", address=address)
        return ray.cluster_resources()
    # Workers of an embedded Ray import the driver's local modules (worker classes
    # defined next to the script) the way the driver does.
    paths = [os.getcwd(), *filter(None, env_vars.get("PYTHONPATH", "").split(os.pathsep)),
             *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env_vars["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    with _loopback_only(env_vars):
        _start_embedded(ray, num_cpus, num_gpus, kwargs, ray_kwargs)
    _freeze_startup_objects()
    log.info("ray.started", cpus=ray.cluster_resources().get("CPU"))
    return ray.cluster_resources()


def _freeze_startup_objects() -> None:
    """Move what exists after Ray's start (its modules, torch's) out of the garbage
    collector's full passes: they live as long as the process, and the next full pass
    over them stalls whatever thread triggers it (the controller's event loop: 270-340 ms
    measured at the start of the first ``setup()``, benchmarks/loop_lag.py)."""
    import gc

    gc.freeze()


@contextlib.contextmanager
def _loopback_only(env_vars: dict[str, str]) -> Iterator[None]:
    """Bind every Ray server of the embedded instance to 127.0.0.1.

    Ray rewrites a loopback node address to the machine's routable IP unless its
    multi-node switch is off (as Ray does on macOS and Windows). The embedded Ray is
    one node: switch it off for ``ray.init`` and the processes it starts (and their
    workers, through `env_vars`), then restore it so later connections to real
    clusters in this process behave as usual.
    """
    from ray._private import ray_constants

    key = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    env_vars[key] = "0"
    saved_env, saved_flag = os.environ.get(key), getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[key] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved_env
        if saved_flag is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved_flag


def _start_embedded(ray: Any, num_cpus: int | None, num_gpus: int | None, kwargs: dict[str, Any],
                    ray_kwargs: dict[str, Any]) -> None:
    ray.init(
        address="local",  # always a new embedded instance, never another driver's
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus if num_cpus is not None else max(os.cpu_count() or 1, 16),
        num_gpus=num_gpus,
        configure_logging=True,
        **kwargs,
        **ray_kwargs,
    )


def shutdown() -> None:
    """Stop the embedded Ray (or disconnect from the cluster); runs on the owner thread."""
    import ray

    if ray.is_initialized():
        _OWNER.submit(ray.shutdown).result()


async def ashutdown() -> None:
    """`shutdown` for a running event loop."""
    import ray

    if ray.is_initialized():
        await asyncio.wrap_future(_OWNER.submit(ray.shutdown))


EventLoop = Literal["auto", "uvloop", "asyncio"]
"""Which event loop :func:`run` gives the controller: ``uvloop`` (libuv's loop, a declared dependency on
Linux and macOS), ``asyncio`` (the standard library's), or ``auto`` (uvloop's when it imports, else asyncio's)."""

_LOOPS = ("auto", "uvloop", "asyncio")


def loop_factory(kind: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of a new event loop of `kind` (see :data:`EventLoop`), for ``asyncio.Runner`` or
    anyio's ``backend_options={"loop_factory": ...}``;
    None means asyncio's default loop. Raises ``ValueError`` for an unknown kind, and for
    ``"uvloop"`` when uvloop cannot be imported (say ``"asyncio"`` or ``"auto"`` instead)."""
    if kind not in _LOOPS:
        raise ValueError(f"unknown event loop {kind!r}: use one of {', '.join(map(repr, _LOOPS))}")
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as e:
        if kind == "auto":
            return None
        raise ValueError(f"event loop 'uvloop' asked for, but uvloop cannot be imported ({e}); install it "
                         "(pip install uvloop; it is a dependency of asyncrl except on Windows) or use "
                         "'asyncio'") from None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, _T], *, loop: str = "auto") -> _T:
    """Run the coroutine `main` on a new event loop and return its result: ``anyio.run`` on the
    asyncio backend with the loop chosen by `loop` (:data:`EventLoop`; by default uvloop's when
    installed).

    The same semantics as ``asyncio.run`` (a fresh loop, closed at the end; Ctrl-C cancels
    `main`; pending tasks are cancelled, async generators and the default executor shut
    down). uvloop makes each of the controller's loop iterations cheaper (the wake-ups of
    awaited calls, scheduling); measured in ``benchmarks/overlap.py --loop``. An app that
    owns its loop keeps it: ``await trainer.fit()`` runs on whatever loop calls it.
    """
    import anyio

    try:
        factory = loop_factory(loop)
    except ValueError:
        main.close()  # never started: no "was never awaited" warning on top of the error
        raise

    async def main_() -> _T:
        return await main

    return anyio.run(main_, backend="asyncio", backend_options={"loop_factory": factory} if factory else {})


PORTS_BELOW_EPHEMERAL = (20000, 32768)
"""Where :func:`free_port` looks first: above Ray's worker ports (10002-19999 by default) and below Linux's default
ephemeral range (32768-60999), from which every outgoing connection on the host takes its local port."""


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return PORTS_BELOW_EPHEMERAL[1]


def free_port(tries: int = 64) -> int:
    """A TCP port free on this host now, for a server that binds it a moment later (a ``torch.distributed``
    rendezvous, a weight channel).

    Picked at random below the kernel's ephemeral range (:data:`PORTS_BELOW_EPHEMERAL`) and checked by binding it:
    between the check and the server's bind the port is up for grabs, and on a busy host (Ray's many gRPC
    connections) an outgoing connection takes a port in the ephemeral range often; one outside it is taken only by
    another server binding that very port. Falls back to a port the kernel picks (``bind(("", 0))``) when `tries`
    random ports were all taken."""
    lo, hi = PORTS_BELOW_EPHEMERAL[0], min(PORTS_BELOW_EPHEMERAL[1], _ephemeral_low())
    candidates = [random.randrange(lo, hi) for _ in range(tries)] if hi > lo else []
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free TCP port on this host")  # (bind to port 0 failed: the kernel has none)
