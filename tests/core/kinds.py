"""The ways a group runs its workers, for tests that must hold on every one of them.

``ray``: Ray actors with the async host (an event loop per process); ``ray-threaded``:
Ray actors with the threaded host (calls in Ray's threads); ``local``: in-process.
A group picks its Ray host kind by its workers' methods; these tests force each kind so
that every contract is checked on both, whatever the worker class.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import pytest

from asyncrl import CallCancelledError, CallTimeoutError, LocalWorkerGroup, RayWorkerGroup

BACKENDS = ["ray", "ray-threaded", "local"]


@contextlib.contextmanager
def forced(backend: str) -> Iterator[None]:
    """Groups set up inside get `backend`'s host kind."""
    from asyncrl import host_set as hosts

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


async def until(predicate: Callable[[], Awaitable[bool]], deadline: float = 30.0) -> None:
    """Poll a remote condition that cannot be awaited directly, with a deadline."""
    async with asyncio.timeout(deadline):
        while not await predicate():
            await asyncio.sleep(0.02)


async def cancelled_and_timed_out(cancelled: Any, timed: Any) -> None:
    """Cancel `cancelled` and await both calls, held behind a blocked call: the cancelled one raises
    ``CallCancelledError``, `timed` (issued with a short ``timeout``) ``CallTimeoutError``."""
    assert cancelled.cancel()
    with pytest.raises(CallCancelledError):
        await cancelled
    with pytest.raises(CallTimeoutError):
        await timed


async def run_script(code: str, timeout: float = 240) -> str:
    """Run `code` in a fresh Python process at the repository root, with an environment
    free of this session's Ray settings (it starts a Ray cluster of its own); returns
    its stdout, and fails the test with its stderr if it exits non-zero."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, cwd=root, env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    assert proc.returncode == 0, err.decode()[-3000:]
    return out.decode()


def top_from(fut: Any) -> tuple | None:
    """The producers whose results `fut`'s call received as top-level arguments."""
    return fut._call.top_from


def expect_top(g: Any, fut: Any, producer: tuple[str, str]) -> None:
    """`fut` got its input top-level on the Ray backend; the local backend keeps it nested."""
    want = (producer,) if g._hostset.backend.name == "ray" else None
    assert top_from(fut) == want
