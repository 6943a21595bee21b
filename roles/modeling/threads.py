"""Threads that follow the work: busy workers on one machine split its cores (``num_threads="follow"``).

On shared cores one torch thread per worker leaves a core idle whenever one side waits (the
rollout idles while the trainer, the critical path, runs on one thread), and every core per
worker oversubscribes the machine while both compute. With ``ModelConfig.num_threads="follow"``
each *busy* opted-in worker runs ``cores // busy`` torch threads (at least 1): a lone busy worker
takes every core, two busy take half each, and the machine is never oversubscribed.

The busy marks: each opted-in worker keeps one empty file in a directory that every worker of the
run on the same machine sees (``/dev/shm/asyncrl-cores-<Ray node id>``; the node id is new for
each Ray start, so two runs never share marks). A worker holds an exclusive ``flock`` on its file
while a compute call runs (:meth:`CoreShare.busy`); the others count the held locks. The kernel
drops a lock with its process, so a worker that dies releases its share at once.

``torch.set_num_threads`` sets the OpenMP team of the *calling* thread, so the count is set in the
thread that computes, at fine points: :meth:`CoreShare.attach` hooks each decoder layer's forward
and, through a gradient hook on the layer's input, the same layer's backward (autograd runs CPU
work on the thread that called ``backward``). A change of the other workers' marks therefore
takes effect at the next layer. On a GPU the threads do not matter: no share is made.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["FOLLOW", "CoreShare", "available_cores", "computing", "core_share_for", "marks_dir", "release_core_share"]

FOLLOW = "follow"
"""The ``ModelConfig.num_threads`` value that opts a worker in."""

F = TypeVar("F", bound=Callable[..., Any])


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def marks_dir() -> Path:
    """The machine-local directory of this run's busy marks: keyed by the Ray node id (one per Ray start
    on each machine), or by the process id outside Ray (in-process workers share one process)."""
    key = f"pid{os.getpid()}"
    import ray

    if ray.is_initialized():
        key = ray.get_runtime_context().get_node_id()
    root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    return root / f"{_MARKS_PREFIX}{key}"


class CoreShare:
    """One worker's busy mark and the torch-thread count that follows the other marks.

    Args:
        directory: the marks of every worker sharing the machine's cores (created if missing).
        cores: the cores they share (default: :func:`available_cores`).
        name: this worker's mark file name (default: ``<pid>-<random>``; the pid lets a later worker
            remove a dead worker's file).
    """

    def __init__(self, directory: str | os.PathLike[str], *, cores: int | None = None, name: str | None = None) -> None:
        if cores is not None and not (isinstance(cores, int) and cores >= 1):
            raise ValueError(f"CoreShare cores must be an integer >= 1, got {cores!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cores = cores or available_cores()
        self.name = name or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._sweep()
        self._sweep_ended_runs()
        self._fd: int | None = self._open_mark()
        self._depth = 0  # nested or concurrent compute calls of this worker
        self._lock = threading.Lock()
        self._handles: list[Any] = []

    # ---- the mark ------------------------------------------------------------------------

    @contextlib.contextmanager
    def busy(self) -> Iterator[int]:
        """Mark this worker busy while the block runs (re-entrant, thread-safe); yields the thread count
        set on the calling thread at entry."""
        with self._lock:
            if self._fd is None:
                raise RuntimeError("CoreShare.busy after close(): this worker's share was released")
            self._depth += 1
            if self._depth == 1:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield self.sync()
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def is_busy(self) -> bool:
        """Whether a compute call of this worker runs now."""
        return self._depth > 0

    def others_busy(self) -> int:
        """How many other workers sharing these cores are busy now (their marks are locked)."""
        n = 0
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return 0
        for entry in entries:
            if entry.name == self.name:
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY)
            except FileNotFoundError:  # released between the listing and the open
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                n += 1
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        return n

    def threads(self) -> int:
        """The torch threads a computing thread of this worker should run now: ``cores // busy`` (this
        worker counted as busy: it is computing), at least 1."""
        return max(1, self.cores // (self.others_busy() + 1))

    def sync(self) -> int:
        """Set the calling thread's torch threads to :meth:`threads` if that changed; returns the count."""
        n = self.threads()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    # ---- the hooks -----------------------------------------------------------------------

    def attach(self, model: nn.Module) -> int:
        """Sync the threads before `model`'s forward and before each of its decoder layers' forward and
        backward; returns how many layers were hooked. The layers are the longest ``nn.ModuleList`` in
        the model (a transformers decoder's ``layers``)."""
        layers: list[nn.Module] = []
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and len(m) > len(layers):
                layers = list(m)
        self._handles.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        return len(layers)

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.sync()
        if torch.is_grad_enabled():
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(self._before_backward)  # fires once this layer's backward is done

    def _before_backward(self, grad: torch.Tensor) -> None:
        self.sync()

    # ---- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks and this worker's mark (its file; the directory too when it is empty)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.directory / self.name)
        os.close(fd)
        with contextlib.suppress(OSError):
            self.directory.rmdir()

    def _open_mark(self) -> int:
        """Create and open this worker's mark file (again after another run's sweep removed the
        directory between its creation and the open: :meth:`_sweep_ended_runs`)."""
        for _ in range(2):
            self.directory.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                return os.open(self.directory / self.name, os.O_CREAT | os.O_RDWR, 0o644)
        self.directory.mkdir(parents=True, exist_ok=True)
        return os.open(self.directory / self.name, os.O_CREAT | os.O_RDWR, 0o644)  # a third miss raises

    def _sweep(self) -> None:
        """Remove the files of workers whose process is gone (their locks went with them)."""
        for entry in os.scandir(self.directory):
            if _process_gone(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def _sweep_ended_runs(self) -> None:
        """Remove the marks directories of earlier runs on this machine (``asyncrl-cores-<other Ray node
        id>`` beside this one) whose workers are all gone: a worker killed without closing leaves its
        file, and each Ray start makes a new directory."""
        if not self.directory.name.startswith(_MARKS_PREFIX):
            return
        for entry in os.scandir(self.directory.parent):
            if (not entry.name.startswith(_MARKS_PREFIX) or entry.name == self.directory.name
                    or not entry.is_dir(follow_symlinks=False)):
                continue
            try:
                files = list(os.scandir(entry.path))
            except OSError:
                continue
            if all(_process_gone(f.name) for f in files):
                for f in files:
                    with contextlib.suppress(OSError):
                        os.unlink(f.path)
                with contextlib.suppress(OSError):  # not empty: a worker of that run started meanwhile
                    os.rmdir(entry.path)


_MARKS_PREFIX = "asyncrl-cores-"


def _process_gone(mark: str) -> bool:
    """Whether mark file `mark` (``<pid>-<random>``) belongs to a process that no longer exists (a name
    without a pid, or this process's own, never does)."""
    pid = mark.split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def core_share_for(num_threads: int | str | None, device: torch.device | str, model: nn.Module | None = None,
                   *, cores: int | None = None) -> CoreShare | None:
    """The worker's :class:`CoreShare` when its ``ModelConfig.num_threads`` is ``"follow"`` and it computes
    on the CPU (hooked into `model` when given); None otherwise."""
    if num_threads != FOLLOW or torch.device(device).type != "cpu":
        return None
    share = CoreShare(marks_dir(), cores=cores)
    if model is not None:
        share.attach(model)
    return share


def release_core_share(worker: Any) -> None:
    """Close the worker's ``core_share`` (its hooks and busy mark), if :func:`core_share_for` made one;
    every role that makes one calls this from its ``on_close``."""
    if (share := getattr(worker, "core_share", None)) is not None:
        share.close()


def computing(method: F) -> F:
    """Mark a worker method as a compute call: while it runs, the worker's ``core_share`` (if any) is busy."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        share: CoreShare | None = getattr(self, "core_share", None)
        if share is None:
            return method(self, *args, **kwargs)
        with share.busy():
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
