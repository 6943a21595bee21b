"""Rollout modes: the registry behind ``trainer.rollout_mode``, and what the rest of the trainer asks a mode.

A rollout mode is a :class:`RolloutMode` subclass registered under a name with
:func:`register_rollout_mode`. It owns everything that differs between producers of batches::

    config.validate()      mode.check(job)                 its own config checks (ConfigError)
                           mode.weights                    what trainer.rollout_weights=auto resolves to
                           mode.splits_batches             a step's prompts are split over the rollout pool
                           mode.hands_over                 resizes and preemptions beside generations in flight
    Trainer.__init__       mode.build(services)            the producer the train loop consumes (a Rollout,
                                                           a replaying one when services.journal.replaying)
    checkpoint save        rollout.settle_for_checkpoint() then rollout.checkpoint_state()  -> state.json[name]
    checkpoint restore     rollout.restore(state.json[name], loop state)
    journal                mode.records_rounds(job)        the engines' round log (rounds.jsonl) is written
    precompute             rollout.upcoming(step)          which batch the next step trains, when decided

The built-in ``batch`` (:mod:`asyncrl.pipelines.rollout.rollout_loop`) and ``stream``
(:mod:`asyncrl.pipelines.rollout.stream_replay`) register themselves the same way when their modules are
imported, which importing ``asyncrl.pipelines`` (any of its modules) does, through the trainer. This module
names none of them: they import the config, which imports this registry. docs/rollout_modes.md shows a mode
written from scratch.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, TypeVar

from asyncrl.pipelines.configlib import ConfigError
from asyncrl.roles.registry import Registry

__all__ = ["RolloutMode", "register_rollout_mode", "rollout_mode", "rollout_mode_names"]


class RolloutMode:
    """A way of producing the batches a run trains on (``trainer.rollout_mode``).

    Subclass it, override :meth:`build` (and what differs from the defaults below), and register the class
    with :func:`register_rollout_mode`. A mode holds no state of a run (one instance serves every run of the
    process); what a run keeps lives in the producer :meth:`build` returns."""

    name: str = ""
    """The name it is registered under (set by :func:`register_rollout_mode`)."""
    weights: Literal["fixed_lag", "latest"] = "fixed_lag"
    """What ``trainer.rollout_weights=auto`` resolves to: ``fixed_lag`` (batch t with version
    ``t - max_staleness``) or ``latest`` (the newest exported version)."""
    splits_batches: bool = True
    """True when a step's prompts are split evenly over the rollout pool (so every pool size must divide a
    step's prompts); False when each prompt group is routed whole to one replica."""
    hands_over: bool = False
    """True when the rollout pool can be replaced beside generations in flight, handing them over
    (``trainer.rollout_autoscale``, ``preempt_rollout``, an elastic pool started beside the old one)."""
    replaces_processes: bool = False
    """True when the producer replaces a lost rollout process alone (the pool's group then gets the core's
    ``"process"`` restart policy, where :func:`~asyncrl.pipelines.run.build.rollout_restart` allows it); False:
    a lost process breaks the pool's group, and the pool is replaced."""

    def check(self, job: Any) -> None:
        """Raise :class:`ConfigError` for a setting of `job` (a ``JobConfig``) this mode cannot run, saying
        what to change; called by ``JobConfig.validate`` before any worker starts. Default: none."""

    def build(self, services: Any) -> Any:
        """The producer of batches (a :class:`~asyncrl.pipelines.loop.loop_state.Rollout`; typed ``Any`` here
        because this registry sits below the loop, in the config's layer) built with `services` (a
        :class:`~asyncrl.pipelines.rollout.rollout_loop.RolloutServices`: the run's config, the current attempt's
        groups and loop state, its journal, weight sync, ...). It is built once per trainer and runs again after a
        restart, reading the new attempt through ``services.current()``; when ``services.journal.replaying`` it must
        follow the replayed journal."""
        raise NotImplementedError(f"rollout mode {self.name!r} ({type(self).__name__}) does not override build()")

    def records_rounds(self, job: Any) -> bool:
        """Whether a run of `job` records its engines' decoding rounds (``rounds.jsonl``, what an exact replay
        of interleaved requests needs). Default: False."""
        return False


M = TypeVar("M", bound=type[RolloutMode])

_HOW = ("Register one with @asyncrl.pipelines.job.modes.register_rollout_mode(name) on a RolloutMode subclass, "
        "in a module imported before the config is validated (docs/rollout_modes.md)")
_MODES: Registry[type[RolloutMode]] = Registry("rollout mode", how_to_register=_HOW, error=ConfigError)
"""The modes by name (each module that defines one registers it on import)."""
_INSTANCES: dict[type[RolloutMode], RolloutMode] = {}


def register_rollout_mode(name: str, *, replace: bool = False) -> Callable[[M], M]:
    """Class decorator: make the :class:`RolloutMode` subclass available as ``trainer.rollout_mode=<name>``.
    A second, different class under a taken name is a ``ValueError`` unless `replace`."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"a rollout mode's name is a non-empty word without surrounding spaces, got {name!r}")

    def deco(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, RolloutMode)):
            raise TypeError(f"register_rollout_mode({name!r}) decorates a RolloutMode subclass, got {cls!r}")
        _MODES.add(name, cls, replace=replace)
        cls.name = name
        return cls

    return deco


def rollout_mode(name: str) -> RolloutMode:
    """The mode registered as `name`; :class:`ConfigError` naming the registered ones (and how to register)
    when there is none."""
    if not isinstance(name, str):
        raise ConfigError(f"trainer.rollout_mode must be a string naming a registered rollout mode "
                          f"({rollout_mode_names()}), got {name!r}")
    try:
        cls = _MODES.get(name)
    except ConfigError as e:
        raise ConfigError(f"trainer.rollout_mode: {e}") from None
    mode = _INSTANCES.get(cls)
    if mode is None:  # one per class: a mode holds no state of a run, and the stream asks it once per group
        mode = _INSTANCES[cls] = cls()
    return mode


def rollout_mode_names() -> list[str]:
    """Every registered mode's name, sorted."""
    return _MODES.names()
