"""Forcing an event at an exact decode step: a forward hook on an engine's model (shared by the
partial-rollout and streaming tests, so they never race a decoding round)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

import torch

__all__ = ["update_at_forwards"]


def update_at_forwards(model: torch.nn.Module, at: dict[int, Callable[[], Any]], interrupt: threading.Event):
    """After the listed forward calls of `model` (1 = the first), start ``at[n]()`` on the running loop and
    hold the step until the update's pause is requested (`interrupt` set)."""
    loop = asyncio.get_running_loop()
    calls = {"n": 0}
    started: list[Any] = []

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        calls["n"] += 1
        if calls["n"] in at:
            started.append(asyncio.run_coroutine_threadsafe(at[calls["n"]](), loop))
            assert interrupt.wait(30), "the update did not request its pause"

    return model.register_forward_hook(hook), started
