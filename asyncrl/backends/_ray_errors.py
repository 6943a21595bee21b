"""The Ray backend's error translation: a Ray error as one of the internal outcomes of :mod:`asyncrl._backend`."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
    RayError,
    RayTaskError,
    TaskCancelledError,
)

from asyncrl._backend import Cancelled, Died, Failed, InputFailed
from asyncrl._wire import CallCancelled
from asyncrl.errors import AsyncRLError

__all__ = ["await_ray"]

_DEATH = (ActorDiedError, ActorUnavailableError, RayActorError, OwnerDiedError, ObjectLostError)


def _input_failed(e: BaseException) -> bool:
    """Whether `e` (a call's outcome) says Ray failed the task before running it because
    a top-level argument could not be read: Ray raises it from
    ``ray._raylet.raise_if_dependency_failed`` (in the task's traceback), and its cause
    is a Ray error (ObjectLostError, RaySystemError for an argument that failed to
    unpickle, a dead producer's ActorDiedError). The host itself only ever fails a call
    with an asyncrl error or a cancellation."""
    if not isinstance(e, RayTaskError):
        return False
    if "raise_if_dependency_failed" in (getattr(e, "traceback_str", "") or ""):
        return True
    cause = getattr(e, "cause", None)
    return isinstance(cause, RayError) and not isinstance(cause, (TaskCancelledError, ActorDiedError,
                                                                     ActorUnavailableError, RayActorError))


def _translate(e: BaseException) -> BaseException:
    """A Ray error as one of the internal outcomes of :mod:`asyncrl._backend` (or the
    asyncrl error a worker raised on purpose)."""
    if isinstance(e, TaskCancelledError):
        return Cancelled(str(e))
    if isinstance(e, RayTaskError):
        cause = getattr(e, "cause", None)
        if _input_failed(e):  # named by the Ray error that made the argument unreadable
            what = cause if cause is not None else e
            return InputFailed(Failed(f"{type(what).__module__}.{type(what).__qualname__}",
                                      str(what).splitlines()[0] if str(what) else "", str(e)))
        if isinstance(cause, AsyncRLError):
            return cause
        if isinstance(cause, (TaskCancelledError, asyncio.CancelledError, CallCancelled)):
            return Cancelled(str(e))
        if isinstance(cause, _DEATH):
            return Died(str(cause).splitlines()[0])
        name = f"{type(cause).__module__}.{type(cause).__qualname__}" if cause is not None else "ray.exceptions.RayTaskError"
        return Failed(name, str(cause) if cause is not None else str(e).splitlines()[0], str(e))
    if isinstance(e, _DEATH):
        return Died(str(e).splitlines()[0])
    if isinstance(e, AsyncRLError):
        return e
    if isinstance(e, CallCancelled):
        return Cancelled(str(e))
    return Failed(f"{type(e).__module__}.{type(e).__qualname__}", str(e), "")


async def await_ray(ref: Any) -> Any:
    """Await an ObjectRef, turning Ray's errors into asyncrl's (used on workers too)."""
    try:
        return await ref
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise _translate(e) from None
