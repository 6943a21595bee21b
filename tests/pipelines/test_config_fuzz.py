"""Every config key is checked at ``JobConfig.validate()``: a value of the wrong type set in Python on a preset
(where no YAML loader or override parser looked at it) is a ConfigError naming that key, before any worker
starts; a NaN in any number is refused the same way, and so is every number just outside the ``Range`` declared
next to its field (:mod:`asyncrl.roles.fields`), every infinity and every choice outside a ``Literal``. The keys and
their bounds are read from the dataclasses, so a new field is fuzzed as soon as it exists."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from typing import Any

import pytest

from asyncrl.pipelines.job.config import ConfigError, JobConfig
from asyncrl.pipelines.job.presets import grpo_toy
from asyncrl.roles.fields import Range, Section, range_of


def _leaves(cfg: Any, path: str = "", *, extras: bool = False) -> list[tuple[str, Any]]:
    """``(dotted key, annotation)`` of every non-section field of the dataclass tree `cfg` (with `extras`, the
    annotation keeps its ``Annotated`` declarations)."""
    out = []
    hints = typing.get_type_hints(type(cfg), include_extras=extras)
    for f in dataclasses.fields(cfg):
        key = f"{path}.{f.name}" if path else f.name
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += _leaves(value, key, extras=extras)
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


DECLARED = _leaves(grpo_toy(), extras=True)


def _options(annotation: Any) -> tuple[Any, ...]:
    """The kinds a (union) annotation holds, ``Annotated`` stripped: ``int | None`` -> ``(int, NoneType)``."""
    bare = typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation
    args = typing.get_args(bare) if typing.get_origin(bare) in (typing.Union, types.UnionType) else (bare,)
    return tuple(typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in args)


def out_of_range() -> list[tuple[str, Any]]:
    """``(key, value)``: for every numeric key each value just outside its declared ``Range`` (inside a list or a
    mapping for those kinds), an infinity for every float, and a choice that is not one for every ``Literal``."""
    out: list[tuple[str, Any]] = []
    for key, annotation in DECLARED:
        options = _options(annotation)
        bound = range_of(annotation)
        for o in options:
            origin, args = typing.get_origin(o), typing.get_args(o)
            if origin is typing.Literal:
                out.append((key, "not-" + "-".join(map(str, args))))
            elif o in (int, float):
                out += [(key, v) for v in (bound.outside(o is int) if bound else [])]
                if o is float:
                    out.append((key, math.inf))
            elif origin is list and args[0] in (int, float) and bound is not None:
                out += [(key, [v]) for v in bound.outside(args[0] is int)]
            elif origin is tuple and args[0] is float and bound is not None:
                out += [(key, (v,) * len(args)) for v in bound.outside(False)]
            elif origin is dict and args[1] in (int, float) and bound is not None:
                out += [(key, {"node": v}) for v in bound.outside(args[1] is int)]
    return out


OUT_OF_RANGE = out_of_range()


def test_every_integer_key_declares_its_range_and_every_section_refuses_unknown_names():
    ints = [k for k, t in DECLARED if int in _options(t) or any(typing.get_args(o)[:1] == (int,) for o in _options(t))]
    assert [k for k, t in DECLARED if k in ints and range_of(t) is None] == []
    assert len(ints) >= 45
    sections = {type(getattr(grpo_toy(), f.name)) for f in dataclasses.fields(JobConfig)}
    assert all(issubclass(c, Section) for c in sections)
    assert len(OUT_OF_RANGE) > 150  # both sides of most ranges, an infinity per float, one per choice


@pytest.mark.parametrize("key, value", OUT_OF_RANGE, ids=[f"{k}={v!r}" for k, v in OUT_OF_RANGE])
def test_a_value_out_of_its_declared_range_is_a_config_error_naming_its_key(key, value):
    cfg = copy.deepcopy(grpo_toy())
    _set(cfg, key, value)
    with pytest.raises(ConfigError, match="^" + re.escape(key) + r"\b"):
        cfg.validate()


def test_the_range_says_which_side_was_crossed():
    r = Range(ge=1, le=8, also=(-1,))
    assert (r.describe(0), r.describe(9), r.describe()) == ("-1 or >= 1", "<= 8", "-1 or in [1, 8]")
    assert (r.accepts(-1), r.accepts(0), r.accepts(8), r.outside(True)) == (True, False, True, [0, 9])
    assert Range(gt=0, lt=1).outside(False) == [0.0, 1.0] and Range(gt=0).describe() == "> 0"


def test_validate_refuses_the_values_an_audit_found_it_accepted():
    for key, value, line in [
        ("trainer.num_cpus", -1, "trainer.num_cpus must be >= 1, got -1"),
        ("trainer.num_cpus", -4, "trainer.num_cpus must be >= 1, got -4"),
        ("trainer.cpus_per_worker", math.inf, "trainer.cpus_per_worker must be a finite number in (0, 65536], got inf"),
        ("trainer.batch_size", 10**12, "trainer.batch_size must be <= 1048576, got 1000000000000"),
    ]:
        cfg = copy.deepcopy(grpo_toy())
        _set(cfg, key, value)
        with pytest.raises(ConfigError) as e:
            cfg.validate()
        assert str(e.value) == line
    cfg = grpo_toy()
    cfg.trainer.rollout_mode = "stream"
    cfg.actor.rollout_correction.bypass_mode = "behaviour"
    with pytest.raises(ConfigError, match=r"^trainer.rollout_mode=stream with actor.rollout_correction.bypass_mode="
                                          r"behaviour: a streamed step mixes groups admitted at different versions.*"
                                          r"Use bypass_mode=off \(the default\), or trainer.rollout_mode=batch$"):
        cfg.validate()
    cfg.actor.rollout_correction.bypass_mode = "off"
    cfg.validate()


def test_the_simulated_engine_trains_only_a_simulated_policy():
    from asyncrl import Worker
    from asyncrl.pipelines.trainers.trainer import make_trainer

    cfg = grpo_toy()
    cfg.rollout.engine = "sim"
    with pytest.raises(ConfigError, match=r"^rollout.engine=sim is the benchmarks' simulated engine: its tokens and "
                                          r"log-probs come from a cost model, not from the policy"):
        cfg.validate()
    with pytest.raises(ConfigError, match="^rollout.engine=sim"):
        make_trainer(cfg)

    class SimulatedPolicy(Worker):
        """Stands in for the policy (as benchmarks/longtail.py's SimPolicy does)."""

    make_trainer(cfg, worker_overrides={"policy": SimulatedPolicy})  # no worker starts in the constructor
    from asyncrl.roles import PolicyWorker

    class MyPolicy(PolicyWorker):
        """A real policy of one's own: it trains on what the engine samples."""

    with pytest.raises(ConfigError, match="^rollout.engine=sim"):
        make_trainer(cfg, worker_overrides={"policy": MyPolicy})
    twin = copy.deepcopy(cfg)  # a twin run: every worker simulated (docs/scale.md)
    twin.twin.profile = "qwen2_7b_h100_vllm"
    assert twin.validate() is twin
