"""The ways a group runs its workers, for tests that must hold on every one of them.

``ray``: Ray actors with the async host (an event loop per process); ``ray-threaded``:
Ray actors with the threaded host (calls in Ray's threads); ``local``: in-process.
A group picks its Ray host kind by its workers' methods; these tests force each kind so
that every contract is checked on both, whatever the worker class.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Iterator

from asyncrl import LocalWorkerGroup, RayWorkerGroup

BACKENDS = ["ray", "ray-threaded", "local"]


@contextlib.contextmanager
def forced(backend: str) -> Iterator[None]:
    """Groups set up inside get `backend`'s host kind."""
    from asyncrl import hosts

    prev = hosts.HOST_KIND
    hosts.HOST_KIND = {"ray": "async", "ray-threaded": "threaded"}.get(backend)
    try:
        yield
    finally:
        hosts.HOST_KIND = prev


def group_class(backend: str) -> type:
    return RayWorkerGroup if backend.startswith("ray") else LocalWorkerGroup


@contextlib.asynccontextmanager
async def group(backend: str, cls: type, **kw: Any) -> AsyncIterator[Any]:
    """``async with`` a group of `cls` on `backend`, set up with its host kind."""
    g = group_class(backend)(cls, **kw)
    try:
        with forced(backend):
            await g.setup()
        yield g
    finally:
        await g.close()
