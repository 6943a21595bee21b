"""Ctrl-C and SIGTERM keep the run's progress.

The first SIGINT or SIGTERM asks the trainer to stop after the step in progress
(:meth:`~asyncrl.pipelines.trainers.trainer.Trainer.request_stop`): it finishes that step, writes a
checkpoint, releases every worker and ``fit()`` returns with ``trainer.interrupted`` set
(the step reached and the checkpoint to resume from). A second signal abandons the step in
progress: the run is cancelled at once, every worker is released, no new checkpoint is
written (the last one stays), and ``fit_sync()`` raises :class:`RunAbandoned`. A signal
that arrives before training has started cancels the setup.

``fit_sync()`` (so ``asyncrl train``) installs these handlers for its duration; an app that
runs ``await trainer.fit()`` on its own loop uses ``with handle_signals(trainer) as route:``
(then ``route.reinstall()`` once Ray has started) or calls ``trainer.request_stop()`` itself.
Handlers can only be installed from the main thread; elsewhere the context manager does nothing.

Ray's driver installs a C++ failure-signal handler for SIGTERM when it starts (it prints a
native stack dump and, chained to Python's handler, left the process to abort at exit);
:meth:`SignalRoute.reinstall` puts the controller's handlers back on top after Ray started.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

__all__ = ["Interruption", "RunAbandoned", "SignalRoute", "handle_signals"]


@dataclass(frozen=True)
class Interruption:
    """How a run that was asked to stop ended."""

    reason: str
    """``"SIGINT"``, ``"SIGTERM"`` or the reason given to ``request_stop``."""
    steps_done: int
    """Steps finished (the checkpoint holds the state after them)."""
    steps: int
    """``trainer.steps`` of the run."""
    checkpoint: Path | None
    """The checkpoint to resume from."""


class RunAbandoned(KeyboardInterrupt):
    """Raised by ``fit_sync()`` when a second signal abandoned the step in progress."""

    def __init__(self, reason: str, last_checkpoint: Path | None) -> None:
        self.reason = reason
        self.last_checkpoint = last_checkpoint
        super().__init__(f"{reason}: the step in progress was abandoned; "
                         + (f"last checkpoint {last_checkpoint}" if last_checkpoint else "no checkpoint was written"))


class SignalRoute:
    """The signal handlers :func:`handle_signals` installed; `received` lists the signals seen."""

    def __init__(self, trainer: Any, target: asyncio.Task[Any] | None) -> None:
        self.trainer = trainer
        self.target = target
        self.received: list[str] = []
        self.installed: list[signal.Signals] = []

    def on_signal(self, sig: signal.Signals) -> None:
        self.received.append(sig.name)
        if len(self.received) == 1 and self.trainer.fitting:
            self.trainer.request_stop(sig.name)
        else:
            self.trainer.abandoned = sig.name
            if self.target is not None:
                self.target.cancel()

    def install(self) -> None:
        """(Re)install the handlers on the running loop; a no-op off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.on_signal, sig)
            except (NotImplementedError, RuntimeError, ValueError):  # no signals here
                continue
            if sig not in self.installed:
                self.installed.append(sig)

    reinstall = install

    def remove(self) -> None:
        """Remove the handlers (the default ones return)."""
        loop = asyncio.get_running_loop()
        for sig in self.installed:
            loop.remove_signal_handler(sig)
        self.installed = []


@contextlib.contextmanager
def handle_signals(trainer: Any, task: asyncio.Task[Any] | None = None) -> Iterator[SignalRoute]:
    """Route SIGINT and SIGTERM to `trainer` while the block runs (on the running loop, main
    thread only). `task` is what a second signal (or one before training started) cancels;
    default: the current task. Call ``reinstall()`` on the yielded route after Ray started."""
    route = SignalRoute(trainer, task or asyncio.current_task())
    route.install()
    try:
        yield route
    finally:
        route.remove()
