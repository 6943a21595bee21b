"""Backends that run worker hosts: Ray actors (`ray`) and in-process objects (`local`).

A group is built with a :class:`NamedBackend` stand-in: importing a backend's module
(``ray``, a second or more the first time) happens in ``await setup()``, in a thread,
never in a group's constructor on the event loop.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

__all__ = ["NamedBackend", "named"]

_MODULES = {"ray": ("asyncrl.backends.ray", "RayBackend", True), "local": ("asyncrl.backends.local", "LocalBackend", False)}


class NamedBackend:
    """What a group knows of its backend before it starts: the name and whether it
    places pools. :meth:`start` imports the real backend off the loop and returns it."""

    def __init__(self, name: str) -> None:
        if name not in _MODULES:
            raise ValueError(f"backend must be 'ray' or 'local', got {name!r}")
        self.name = name
        self.needs_pool = _MODULES[name][2]

    async def start(self) -> Any:
        module, cls, _ = _MODULES[self.name]
        # Importing it and building it (ray.remote inspects the host class: tens of ms) in a thread.
        backend = await asyncio.get_running_loop().run_in_executor(
            None, lambda: getattr(importlib.import_module(module), cls)())
        return await backend.start()

    def __repr__(self) -> str:
        return f"<backend {self.name!r}, not started>"


def named(name: str) -> NamedBackend:
    """The backend called `name` (``"ray"`` or ``"local"``), to be started by a group's setup."""
    return NamedBackend(name)
