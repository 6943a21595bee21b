"""Environments in the shape of SkyRL-gym / verifiers: ``reset`` then ``step(action) -> StepResult``.

Register an environment class by name and point ``RolloutConfig.episode`` at it; the rollout runs
:func:`environment_episode` for every row::

    @register_environment("guess")
    class Guess(Environment):
        async def reset(self, sample):                  # optional text appended after the prompt (mask 0)
            self.answer = sample.answer
        async def step(self, action: str) -> StepResult:
            ok = action.strip() == self.answer
            return StepResult(observation="" if ok else " wrong, again:", reward=float(ok), done=ok)

The loop (one per row, all in flight together)::

    reset ─► [ generate (≤ tokens_per_turn) ─► step(decoded action) ─► observe(observation) ]* ─► reward
    stop reasons: done (step said so) · max_turns · max_length (the row's R tokens are full)

The episode's reward is the sum of its step rewards. Tools (:mod:`asyncrl.roles.agentic.tools`) are called
from ``step``; :class:`ToolEnvironment` parses ``<name>args</name>`` calls out of the action, and a tool
that raises or passes its deadline becomes an ``<error>`` observation counted in ``tool_errors``.

Built-ins: ``char_class_retry`` (the toy multi-turn task a tiny model learns on CPU) and
``calculator`` (arithmetic problems with the ``calc`` tool).
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from asyncrl.roles.agentic.episodes import LLM, Sample, Trajectory, registered_episodes
from asyncrl.roles.errors import EpisodeConfigError
from asyncrl.roles.registry import Registry
from asyncrl.roles.agentic.tools import Tool, call_tool, check_tools

__all__ = ["Environment", "StepResult", "ToolEnvironment", "register_environment", "environment_names",
           "make_environment", "environment_episode", "environment_episode_for", "CharClassRetry", "Calculator",
           "episode_names", "resolve_episode"]


@dataclass
class StepResult:
    """What one ``step`` returns (SkyRL-gym's ``BaseTextEnvStepOutput``)."""

    observation: str = ""
    """Text the model sees next (appended as environment tokens, mask 0)."""
    reward: float = 0.0
    """This step's reward (the episode's reward is the sum)."""
    done: bool = False
    """The episode is over (stop reason ``done``)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Anything per turn; ``tool_error`` (a string) counts in the ``tool_errors`` metric."""


class Environment:
    """Base class of an environment: one instance per episode."""

    def __init__(self, **kwargs: Any) -> None:
        if kwargs:
            raise EpisodeConfigError(f"{type(self).__name__} takes no options, got {sorted(kwargs)}")

    async def reset(self, sample: Sample) -> str | None:
        """Start an episode on `sample`; returns text to append after the prompt, or None."""
        return None

    async def step(self, action: str) -> StepResult:
        """Take the model's decoded turn; return the observation, reward and whether it is done."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release what the episode held (called on every path)."""


_ENVS: Registry[Callable[..., Environment]] = Registry(
    "environment", error=EpisodeConfigError,
    how_to_register="Register one with @asyncrl.roles.register_environment(name)")


def register_environment(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Decorator: make an :class:`Environment` class (or factory) available as ``RolloutConfig.episode=name``."""

    def check(cls: Any) -> None:
        if inspect.isclass(cls) and not inspect.iscoroutinefunction(getattr(cls, "step", None)):
            raise EpisodeConfigError(f"environment {name!r}: step must be `async def step(self, action)`")

    return _ENVS.decorator(name, replace=replace, check=check)


def environment_names() -> list[str]:
    """Registered environment names."""
    return _ENVS.names()


def make_environment(name: str, **kwargs: Any) -> Environment:
    """A new instance of the environment registered as `name`."""
    return _ENVS.get(name)(**kwargs)


async def environment_episode(llm: LLM, sample: Sample, *, env: Environment, max_turns: int = 4,
                              tokens_per_turn: int = 16) -> Trajectory:
    """Run `env` on `sample`: generate, step, observe, until done, `max_turns` or the length limit."""
    traj = llm.start(sample)
    reward = 0.0
    try:
        first = await env.reset(sample)
        if first:
            traj.observe(llm.encode(first))
        traj.stop_reason = "max_turns"
        for _ in range(max_turns):
            if traj.stopped:
                break
            gen = await llm.generate(traj, max_new_tokens=tokens_per_turn)
            res = await env.step(llm.decode(gen.response_ids))
            reward += float(res.reward)
            traj.turns[-1].update(res.metadata, reward=float(res.reward))
            if res.metadata.get("tool_error"):
                traj.count("tool_errors")
            if res.done:
                traj.stop_reason = "done"
                break
            if traj.stopped:
                break
            if res.observation:
                traj.observe(llm.encode(res.observation))
    finally:
        await env.close()
    traj.reward = reward
    return traj


def environment_episode_for(name: str, *, max_turns: int | None = None, tokens_per_turn: int | None = None,
                            tools: list[Any] | None = None,
                            env_kwargs: dict[str, Any] | None = None) -> Callable[[LLM, Sample], Awaitable[Trajectory]]:
    """The episode of environment `name` with its options checked now (unknown name, bad option,
    tool that is not async: :class:`EpisodeConfigError` before any worker starts).

    `max_turns` / `tokens_per_turn` default to the environment's own defaults when its constructor takes
    them (it then sees the loop's limits), else to 4 and 16."""
    factory = _ENVS.get(name)  # the unknown-name error, before the options are looked at
    if env_kwargs is not None and not isinstance(env_kwargs, Mapping):
        raise EpisodeConfigError(f"environment {name!r}: env_kwargs must be a mapping of its options, got "
                                 f"{env_kwargs!r}")
    kwargs = dict(env_kwargs or {})
    accepts = inspect.signature(factory).parameters
    limits = {}
    for k, given, fallback in (("max_turns", max_turns, 4), ("tokens_per_turn", tokens_per_turn, 16)):
        own = accepts[k].default if k in accepts and accepts[k].default is not inspect.Parameter.empty else fallback
        limits[k] = given if given is not None else own
        if k in accepts:
            kwargs.setdefault(k, limits[k])  # an environment that scores by turn sees the loop's limits
    max_turns, tokens_per_turn = limits["max_turns"], limits["tokens_per_turn"]
    if max_turns < 1 or tokens_per_turn < 1:
        raise EpisodeConfigError(f"environment {name!r}: need max_turns >= 1 and tokens_per_turn >= 1, got "
                                 f"{max_turns}, {tokens_per_turn}")
    _check_options(name, set(env_kwargs or {}), tools is not None)
    if tools is not None:
        kwargs["tools"] = check_tools(list(tools))
    try:
        make_environment(name, **kwargs)  # a bad option fails here, not in a worker
    except TypeError as e:  # the constructor refused a value: a config error, named
        raise EpisodeConfigError(f"environment {name!r} cannot be built with options {sorted(kwargs)}: "
                                 f"{type(e).__name__}: {e}") from e

    async def episode(llm: LLM, sample: Sample) -> Trajectory:
        return await environment_episode(llm, sample, env=make_environment(name, **kwargs), max_turns=max_turns,
                                         tokens_per_turn=tokens_per_turn)

    episode.__qualname__ = f"environment:{name}"
    return episode


def _check_options(name: str, given: set[str], tools: bool) -> None:
    """An :class:`EpisodeConfigError` naming each ``env_kwargs`` key (or ``tools``) that the constructor of
    environment `name` does not take, and the options it does take (none checked when it takes ``**kwargs``)."""
    params = inspect.signature(_ENVS.get(name)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # it checks its own options (Environment.__init__ refuses any)
    accepted = sorted(n for n, p in params.items()
                      if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
    unknown = sorted(given - set(accepted))
    if unknown:
        raise EpisodeConfigError(f"environment {name!r} has no option {', '.join(map(repr, unknown))} "
                                 f"(env_kwargs); it accepts {accepted or 'no options'}")
    if tools and "tools" not in accepted:
        raise EpisodeConfigError(f"environment {name!r} takes no tools (its constructor has no `tools` option); "
                                 f"drop episode_kwargs.tools")


class ToolEnvironment(Environment):
    """An environment whose actions may call tools as ``<name>arguments</name>``.

    The first call in an action runs (within the tool's deadline) and its ``<result>`` or ``<error>``
    becomes the observation; an action without a call goes to :meth:`answer`.
    """

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self.tools = {t.name: t for t in check_tools(list(tools or []))}

    async def step(self, action: str) -> StepResult:
        """Run the action's tool call, or score the answer."""
        for name, t in self.tools.items():
            m = re.search(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", action, re.S)
            if m:
                res = await call_tool(t, m.group(1))
                meta: dict[str, Any] = {"tool": name}
                if res.error:
                    meta["tool_error"] = res.error
                return StepResult(observation=res.observation, metadata=meta)
        return await self.answer(action)

    async def answer(self, action: str) -> StepResult:
        """Score an action that calls no tool (the episode ends)."""
        return StepResult(done=True)


# ---- built-in environments ----------------------------------------------------------------------

_CLASSES = {"digits": set("0123456789"), "vowels": set("aeiou")}


def class_fraction(text: str, cls: str, slots: int) -> float:
    """Characters of `cls` in `text` over ``max(slots, non-space characters)`` (spaces are free)."""
    chars = [c for c in text if not c.isspace()]
    return sum(c in _CLASSES[cls] for c in chars) / max(slots, len(chars))


@register_environment("char_class_retry")
class CharClassRetry(Environment):
    """Guess, then correct with feedback: the toy multi-turn task a tiny model learns on CPU.

    The prompt (``toy_dataset("char_class")``) asks for digits or vowels. Each turn scores the
    turn's characters of that class (:func:`class_fraction`, over at least ``tokens_per_turn`` slots); a perfect turn
    ends the episode, otherwise the observation ``" k/n, again:"`` tells the score and the model
    retries. The reward is the mean score over ``max_turns`` turns, a perfect turn counting for the
    turns it saves, so a policy right at the first turn gets 1.0.
    """

    def __init__(self, max_turns: int = 2, tokens_per_turn: int = 4) -> None:
        self.max_turns, self.slots = max_turns, tokens_per_turn
        self._turn = 0
        self._cls = "digits"

    async def reset(self, sample: Sample) -> str | None:
        """Read the asked class from the answer (``"digits"`` or ``"vowels"``)."""
        self._cls = (sample.answer or "digits").strip()
        if self._cls not in _CLASSES:
            raise ValueError(f"char_class_retry: answer must be 'digits' or 'vowels', got {sample.answer!r}")
        return None

    async def step(self, action: str) -> StepResult:
        """Score the turn; done when perfect or out of turns."""
        self._turn += 1
        f = class_fraction(action, self._cls, self.slots)
        left = self.max_turns - self._turn
        if f >= 1.0 or left <= 0:
            return StepResult(reward=(f + (left if f >= 1.0 else 0)) / self.max_turns, done=True,
                              metadata={"score": f})
        return StepResult(observation=f" {round(f * self.slots)}/{self.slots}, again:", reward=f / self.max_turns,
                          metadata={"score": f})


@register_environment("calculator")
class Calculator(ToolEnvironment):
    """Arithmetic problems with the ``calc`` tool: ``<calc>17*23</calc>`` → ``<result>391</result>``;
    an action without a call is the answer (reward 1.0 when its last number equals the sample's answer)."""

    def __init__(self, tools: list[Tool] | None = None) -> None:
        super().__init__(tools if tools is not None else ["calc"])  # type: ignore[list-item]
        self._answer: str | None = None

    async def reset(self, sample: Sample) -> str | None:
        """Remember the answer."""
        self._answer = sample.answer
        return None

    async def answer(self, action: str) -> StepResult:
        """1.0 when the action's last number is the answer."""
        nums = re.findall(r"-?\d+(?:\.\d+)?", action)
        ok = bool(nums) and self._answer is not None and _same_number(nums[-1], self._answer)
        return StepResult(reward=float(ok), done=True, metadata={"correct": ok})


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(str(b).strip())
    except ValueError:
        return False


def episode_names() -> list[str]:
    """Registered episode and environment names (what ``rollout.episode`` may name; see :func:`resolve_episode`)."""
    return sorted(set(registered_episodes()) | set(environment_names()))


_ENVIRONMENT_KWARGS = {"max_turns", "tokens_per_turn", "tools", "env_kwargs"}
"""What ``episode_kwargs`` may hold for an environment (:func:`environment_episode_for`)."""


def resolve_episode(spec: str, kwargs: Mapping[str, Any] | None = None) -> Callable[[LLM, Sample], Awaitable[Trajectory]]:
    """The episode `spec` names, with `kwargs` bound, checked before any worker starts.

    `spec` is a registered episode, a registered environment (run by :func:`environment_episode` with
    `kwargs`: ``max_turns``, ``tokens_per_turn``, ``tools``, ``env_kwargs``), or ``"package.module:function"``.
    """
    kwargs = dict(kwargs or {})
    episodes = registered_episodes()
    if spec in episodes:
        fn: Any = episodes[spec]
    elif spec in environment_names():
        unknown = sorted(set(kwargs) - _ENVIRONMENT_KWARGS)
        if unknown:
            raise EpisodeConfigError(f"environment {spec!r}: unknown episode_kwargs {unknown}; it takes "
                                     f"{sorted(_ENVIRONMENT_KWARGS)} (the environment's own options go in "
                                     "env_kwargs)")
        return environment_episode_for(spec, **kwargs)
    elif ":" in spec:
        mod, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise EpisodeConfigError(f"episode {spec!r} cannot be imported ({type(e).__name__}: {e}); give "
                                     "'package.module:function' of an importable module") from None
        if not inspect.iscoroutinefunction(fn):
            raise EpisodeConfigError(f"episode {spec!r} must be an `async def` taking (llm, sample)")
    else:
        raise EpisodeConfigError(f"no episode or environment named {spec!r}; known: {episode_names()}. Register "
                                 "one with @register_episode / @register_environment, or give 'module:function'")
    if not kwargs:
        return fn  # type: ignore[no-any-return]

    async def bound(llm: LLM, sample: Sample) -> Trajectory:
        return await fn(llm, sample, **kwargs)  # type: ignore[no-any-return]

    bound.__qualname__ = getattr(fn, "__qualname__", spec)
    return bound
