"""When the trainer writes a checkpoint during a run: every ``trainer.checkpoint_every`` steps, and
at least every ``trainer.checkpoint_every_s`` seconds (default 600), so that with the default
settings a killed controller or training worker never loses more than about ten minutes of work."""

from __future__ import annotations

from typing import Any

__all__ = ["checkpoint_due"]


def checkpoint_due(trainer: Any, step: int, *, now: float, last: float) -> bool:
    """True when a checkpoint is due after step `step` (0-based, just finished) of a run with
    `trainer` (a ``TrainerConfig``): ``checkpoint_every`` divides ``step + 1``, or at least
    ``checkpoint_every_s`` seconds passed between `last` (the previous checkpoint, or the start of
    the run) and `now` (same clock). Never after the last step: the end checkpoint
    (``checkpoint_at_end``) covers it."""
    if step + 1 >= trainer.steps:
        return False
    if trainer.checkpoint_every and (step + 1) % trainer.checkpoint_every == 0:
        return True
    every_s = trainer.checkpoint_every_s
    return every_s is not None and now - last >= every_s
