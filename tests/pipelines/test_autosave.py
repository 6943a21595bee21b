"""When a checkpoint is due: every ``checkpoint_every`` steps and at least every
``checkpoint_every_s`` seconds, never after the last step (the end checkpoint covers it)."""

from __future__ import annotations

import pytest

from asyncrl.pipelines.checkpoints.checkpointing import checkpoint_due
from asyncrl.pipelines.job.config import ConfigError, TrainerConfig
from asyncrl.pipelines.job.presets import load_config


def _due(steps: int, every: int, every_s: float | None, ends: list[float]) -> list[int]:
    """Steps after which a checkpoint is written, for steps that end at times `ends` (seconds)."""
    t = TrainerConfig(steps=steps, checkpoint_every=every, checkpoint_every_s=every_s)
    out, last = [], 0.0
    for step, now in enumerate(ends):
        if checkpoint_due(t, step, now=now, last=last):
            out.append(step)
            last = now + 0.5  # the save itself takes 0.5 s
    return out


def test_time_based_checkpoints_count_from_the_last_one_written():
    ends = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert _due(10, 0, 2.5, ends) == [2, 5, 8]  # 3.0 - 0 >= 2.5; 6.0 - 3.5 >= 2.5; 9.0 - 6.5 >= 2.5
    assert _due(10, 0, None, ends) == []
    assert _due(10, 4, None, ends) == [3, 7]
    assert _due(10, 4, 2.5, ends) == [2, 3, 6, 7]  # either rule; each save restarts the clock
    assert _due(3, 0, 0.1, ends[:3]) == [0, 1]  # never after the last step


def test_checkpoint_every_s_must_be_positive_or_null():
    assert load_config(None, ["trainer.checkpoint_every_s=null"]).trainer.checkpoint_every_s is None
    with pytest.raises(ConfigError, match="trainer.checkpoint_every_s must be a positive number of seconds or null"):
        load_config(None, ["trainer.checkpoint_every_s=0"])
