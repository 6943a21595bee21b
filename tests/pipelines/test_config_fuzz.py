"""Every config key is checked at ``JobConfig.validate()``: a value of the wrong type set in Python on a preset
(where no YAML loader or override parser looked at it) is a ConfigError naming that key, before any worker
starts; a NaN in any number is refused the same way."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from typing import Any

import pytest

from asyncrl.pipelines.job.config import ConfigError, JobConfig
from asyncrl.pipelines.job.presets import grpo_toy


def _leaves(cfg: Any, path: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, annotation)`` of every non-section field of the dataclass tree `cfg`."""
    out = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        key = f"{path}.{f.name}" if path else f.name
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += _leaves(value, key)
        else:
            out.append((key, hints[f.name]))
    return out


def _set(cfg: JobConfig, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    obj = cfg
    for p in parents:
        obj = getattr(obj, p)
    object.__setattr__(obj, leaf, value)


LEAVES = [(k, t) for k, t in _leaves(grpo_toy()) if t is not Any]


def test_the_fuzz_covers_every_section():
    sections = {k.split(".")[0] for k, _ in LEAVES}
    assert sections == {f.name for f in dataclasses.fields(JobConfig)}
    assert len(LEAVES) > 100


class _Wrong:
    def __repr__(self) -> str:
        return "<wrong>"


@pytest.mark.parametrize("key", [k for k, _ in LEAVES])
def test_a_value_of_the_wrong_type_is_a_config_error_naming_its_key(key):
    cfg = copy.deepcopy(grpo_toy())
    _set(cfg, key, _Wrong())
    with pytest.raises(ConfigError, match="^" + re.escape(key) + r"\b"):
        cfg.validate()


NUMBERS = [k for k, t in LEAVES if float in (typing.get_args(t) or (t,))]


@pytest.mark.parametrize("key", NUMBERS)
def test_a_nan_in_a_number_is_a_config_error_naming_its_key(key):
    cfg = copy.deepcopy(grpo_toy())
    _set(cfg, key, math.nan)
    with pytest.raises(ConfigError, match="^" + re.escape(key) + r"\b"):
        cfg.validate()


def test_loading_normalises_what_python_set_as_a_file_would():
    cfg = grpo_toy()
    cfg.actor.lr = 1  # an int where a float is annotated
    cfg.actor.betas = [0.9, 0.99]  # type: ignore[assignment]  # a list where a tuple is
    cfg.validate()
    assert (type(cfg.actor.lr), cfg.actor.betas) == (float, (0.9, 0.99))
