"""Preemption notices in a worker process: a SIGTERM reaches a callback before the process exits.

A Ray worker process answers SIGTERM by leaving its task loop (Ray's handler raises ``SystemExit`` in the
main thread) and exits. Python lets only the main thread install
a signal handler, and an actor's methods run elsewhere (an async actor's event loop thread), so
:func:`on_sigterm` wraps the exit hook Ray's handler calls: the callbacks run first (in the main thread; they
hand the notice over, e.g. ``loop.call_soon_threadsafe``, and may wait a bounded time), then Ray exits as it
would have: its calls still queued fail as a dead worker's. A rollout worker stops its requests at their next
decoding step and waits for them to return :class:`~asyncrl.roles.errors.PreemptedError` (at most
``PREEMPT_DEADLINE_S``), so the controller hears of the notice before the process is gone.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["on_sigterm", "PREEMPT_DEADLINE_S"]

PREEMPT_DEADLINE_S = 10.0
"""How long a told-to-stop rollout worker waits for its generations to stop (at their next decoding step)
before its process exits anyway."""

_lock = threading.Lock()
_callbacks: list[Callable[[], None]] = []


def on_sigterm(callback: Callable[[], None]) -> bool:
    """Call `callback` (with no arguments, in the main thread) when this Ray worker process gets SIGTERM,
    before Ray's own exit. Returns False where that cannot be arranged (not a Ray worker process, or a Ray
    whose SIGTERM handler this does not know); the process then exits as Ray decides."""
    try:
        import ray._private.worker as rw
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    with _lock:
        hook: Any = getattr(rw, "raise_sys_exit_with_custom_error_message", None)
        if hook is None:
            return False
        if not getattr(hook, "_asyncrl_preemption", False):
            original = hook

            def exit_hook(message: str, *args: Any, **kwargs: Any) -> Any:
                if "SIGTERM" in message:
                    for cb in list(_callbacks):
                        try:
                            cb()
                        except Exception:  # noqa: BLE001 - a notice that fails must not keep the process alive
                            pass
                return original(message, *args, **kwargs)

            exit_hook._asyncrl_preemption = True  # type: ignore[attr-defined]
            rw.raise_sys_exit_with_custom_error_message = exit_hook
        _callbacks.append(callback)
    return True
