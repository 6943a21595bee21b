"""Multi-turn episodes: the user's ``async def episode(llm, sample) -> Trajectory``.

An episode is any async Python that alternates model generations with tool calls and
environment steps. ``llm`` is a client of the rollout worker's request-level engine
(:class:`~asyncrl.roles.engines.batcher.RequestBatcher`): the pending ``generate`` requests of
every episode in flight on the worker are decoded together, one round at a time. Peers:
verl's ``AgentLoopBase.run() -> AgentLoopOutput(prompt_ids, response_ids, response_mask)``,
AReaL's ``arun_episode(engine, data)``::

    @register_episode("guess_twice")
    async def guess_twice(llm: LLM, sample: Sample) -> Trajectory:
        traj = llm.start(sample)                        # prompt_ids, empty response
        await llm.generate(traj, max_new_tokens=4)      # model tokens: mask 1, log-probs, versions
        traj.observe(llm.encode(" again:"))             # environment tokens: mask 0
        await llm.generate(traj, max_new_tokens=4)
        traj.reward = my_score(llm.decode(traj.model_ids()), sample.answer)
        return traj

Data flow on the rollout worker (``RolloutWorker.generate`` with ``RolloutConfig.episode``)::

    batch rows ─► Sample per row ─► episode(llm, sample) per row, all in flight (one task group)
      ─► validate_trajectory (names the episode and the field) ─► pack_trajectories
      ─► the batch layout of ``generate``: response_ids [B, R] holding model *and* environment
         tokens, response_mask 1 only on model tokens, attention_mask 1 on all of them,
         rollout_log_probs (0 on environment tokens), version (the oldest token's), plus
         token_versions, episode_reward, num_turns, tool_errors, stop_reason

so every stage after the rollout (reward, log-probs, advantages, update) works unchanged and
counts only model tokens.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Protocol, Sequence

import torch

from asyncrl.roles.engines.base import SamplingParams
from asyncrl.roles.engines.batcher import Generation
from asyncrl.roles.errors import EpisodeConfigError, TrajectoryError
from asyncrl.roles.registry import Registry

__all__ = ["Sample", "Trajectory", "LLM", "Episode", "STOP_REASONS", "register_episode", "registered_episodes",
           "single_turn", "validate_trajectory", "pack_trajectories", "episode_metrics"]

STOP_REASONS = ("done", "max_turns", "max_length", "stop")
"""Why an episode ended: the environment said done; ``max_turns`` reached; the response part reached the
most tokens a row holds (``RolloutConfig.max_new_tokens``); the episode ended on its own (``stop``)."""


@dataclass
class Sample:
    """One batch row as an episode sees it."""

    prompt_ids: list[int]
    """The prompt's token ids (padding removed)."""
    prompt: str | None = None
    """The prompt string (the batch's ``prompt`` field), when present."""
    answer: str | None = None
    """The ground truth (the batch's ``answer`` field), when present."""
    index: int = 0
    """The row's position in the batch this rank generates."""


@dataclass
class Trajectory:
    """What an episode returns: the prompt, then model and environment tokens in order.

    Build it with :meth:`LLM.start`, :meth:`LLM.generate` (model tokens) and :meth:`observe`
    (environment and tool tokens), or fill the lists yourself: :func:`validate_trajectory` checks them.
    """

    prompt_ids: list[int]
    """The prompt (must equal the sample's)."""
    response_ids: list[int] = field(default_factory=list)
    """Every token after the prompt: model and environment, in order."""
    response_mask: list[int] = field(default_factory=list)
    """1 on model tokens, 0 on environment and tool tokens (same length as ``response_ids``)."""
    log_probs: list[float | None] = field(default_factory=list)
    """Behaviour log-prob of each model token; None on environment tokens."""
    versions: list[int] = field(default_factory=list)
    """Weight version of each model token; -1 on environment tokens."""
    reward: float | None = None
    """The episode's score; None leaves it to the reward function (on the decoded model tokens)."""
    turns: list[dict[str, Any]] = field(default_factory=list)
    """Per-turn metadata (one dict per generation: ``tokens``, ``finish_reason``, what the episode adds)."""
    stop_reason: str = "stop"
    """One of :data:`STOP_REASONS`."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Counters summed over the batch's episodes (e.g. ``tool_errors``)."""
    max_response_tokens: int | None = None
    """Most tokens after the prompt (set by :meth:`LLM.start`); :meth:`observe` and generations stop there."""

    @property
    def context_ids(self) -> list[int]:
        """Prompt and response so far: what the next generation continues."""
        return self.prompt_ids + self.response_ids

    @property
    def room(self) -> int:
        """Tokens that still fit after the prompt."""
        if self.max_response_tokens is None:
            return 1 << 30
        return max(self.max_response_tokens - len(self.response_ids), 0)

    @property
    def stopped(self) -> bool:
        """True once the trajectory is full (``stop_reason == "max_length"``)."""
        return self.stop_reason == "max_length"

    def model_ids(self) -> list[int]:
        """The model's tokens only (mask 1), in order."""
        return [t for t, m in zip(self.response_ids, self.response_mask) if m]

    def add_generation(self, gen: Generation) -> None:
        """Append a generation's tokens as model tokens (mask 1, their log-probs and versions)."""
        self.response_ids += gen.response_ids
        self.response_mask += [1] * len(gen.response_ids)
        self.log_probs += list(gen.log_probs)
        self.versions += list(gen.versions) if gen.versions else [0] * len(gen.response_ids)
        self.turns.append({"tokens": len(gen.response_ids), "finish_reason": gen.finish_reason})
        if self.room == 0 and self.max_response_tokens is not None:
            self.stop_reason = "max_length"

    def observe(self, ids: Sequence[int]) -> None:
        """Append environment or tool tokens (mask 0); cut at the length limit (then ``stopped``)."""
        ids = list(ids)
        if len(ids) >= self.room and self.max_response_tokens is not None:
            ids = ids[:self.room]
            self.stop_reason = "max_length"
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.log_probs += [None] * len(ids)
        self.versions += [-1] * len(ids)

    def count(self, metric: str, n: float = 1.0) -> None:
        """Add `n` to a metric counter of this episode."""
        self.metrics[metric] = self.metrics.get(metric, 0.0) + n


class LLM:
    """An episode's client of the rollout engine (one per episode).

    Args:
        submit: the engine's request call (``RequestBatcher.generate`` or an equivalent).
        tokenizer: the rollout's tokenizer (``encode``/``decode``/chat templates).
        params: default sampling params; ``seed`` is this episode's base seed (call k uses
            ``seed + 7919 * k``, so an episode samples the same tokens whatever else is in flight).
        max_response_tokens: most tokens after the prompt (:meth:`start` puts it on the trajectory).
        key: names this episode's requests in the engine's round log (call 0 is ``key``, call k
            ``f"{key}/{k}"``), so a recorded run's rounds can be replayed; None: the engine numbers them.
    """

    def __init__(self, submit: Callable[..., Awaitable[Generation]], tokenizer: Any,
                 params: SamplingParams, max_response_tokens: int, *, key: str | None = None) -> None:
        self._submit = submit
        self.tokenizer = tokenizer
        self.params = params
        self.max_response_tokens = max_response_tokens
        self.key = key
        self._calls = 0

    @property
    def submit(self) -> Callable[..., Awaitable[Generation]]:
        """The engine's request call this client samples with (the gateway serves agents over it)."""
        return self._submit

    def start(self, sample: Sample) -> Trajectory:
        """An empty trajectory of `sample` with this rollout's length limit."""
        return Trajectory(prompt_ids=list(sample.prompt_ids), max_response_tokens=self.max_response_tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens removed)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of chat `messages` with the generation prompt (the tokenizer's chat template)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass token ids to llm.generate (llm.encode(text))")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(str(text))  # (tokenize=True returns a BatchEncoding in recent transformers)

    async def generate(self, prompt: Trajectory | list[int] | list[dict[str, str]], *,
                       max_new_tokens: int | None = None, temperature: float | None = None) -> Generation:
        """Sample a continuation. A :class:`Trajectory` is continued in place (its room caps the length,
        the tokens are appended as model tokens); token ids or chat messages return the generation only."""
        if isinstance(prompt, Trajectory):
            ids = prompt.context_ids
            room = prompt.room
        elif prompt and isinstance(prompt[0], dict):
            ids, room = self.chat(prompt), self.max_response_tokens  # type: ignore[arg-type]
        else:
            ids, room = [int(t) for t in prompt], self.max_response_tokens  # type: ignore[union-attr]
        n = self.params.max_new_tokens if max_new_tokens is None else max_new_tokens
        n = min(n, room)
        if n < 1:
            if isinstance(prompt, Trajectory):
                prompt.stop_reason = "max_length"
            return Generation([], [], "length", versions=[])
        params = replace(self.params, max_new_tokens=n, seed=(self.params.seed or 0) + 7919 * self._calls,
                         temperature=self.params.temperature if temperature is None else temperature)
        key = None if self.key is None else self.key if self._calls == 0 else f"{self.key}/{self._calls}"
        self._calls += 1
        gen = await (self._submit(ids, params) if key is None else self._submit(ids, params, key=key))
        if isinstance(prompt, Trajectory):
            prompt.add_generation(gen)
        return gen


async def single_turn(llm: LLM, sample: Sample) -> Trajectory:
    """The row program of a plain request: one generation of up to the row's room after the prompt."""
    traj = llm.start(sample)
    await llm.generate(traj)
    return traj


class Episode(Protocol):
    """``async def episode(llm, sample, **kwargs) -> Trajectory``."""

    def __call__(self, llm: LLM, sample: Sample, /, **kwargs: Any) -> Awaitable[Trajectory]: ...


_EPISODES: Registry[Episode] = Registry(
    "episode", error=EpisodeConfigError,
    how_to_register="Register one with @asyncrl.roles.register_episode(name)")


def register_episode(name: str, *, replace: bool = False) -> Callable[[Episode], Episode]:
    """Decorator: make an ``async def episode(llm, sample)`` available as ``RolloutConfig.episode=name``."""

    def check(fn: Episode) -> None:
        if not inspect.iscoroutinefunction(fn):
            raise EpisodeConfigError(f"episode {name!r} must be an `async def` taking (llm, sample)")

    return _EPISODES.decorator(name, replace=replace, check=check)


def registered_episodes() -> dict[str, Episode]:
    """``{name: episode}`` of every :func:`register_episode` (environments are resolved by
    :func:`asyncrl.roles.agentic.environments.resolve_episode`, which accepts both)."""
    return _EPISODES.entries()


def validate_trajectory(traj: Any, episode: str, sample: Sample, max_response_tokens: int, vocab_size: int) -> Trajectory:
    """`traj` if well formed; else a :class:`TrajectoryError` naming `episode`, the row and the field."""
    where = f"episode {episode!r} (row {sample.index})"
    if not isinstance(traj, Trajectory):
        raise TrajectoryError(f"{where} returned {type(traj).__name__}, not a Trajectory; return llm.start(sample) "
                              "after generating into it")
    n = len(traj.response_ids)
    if list(traj.prompt_ids) != list(sample.prompt_ids):
        raise TrajectoryError(f"{where}: field 'prompt_ids' differs from the sample's prompt; put tokens the "
                              "environment adds after the prompt with traj.observe(ids)")
    for name in ("response_mask", "log_probs", "versions"):
        if len(getattr(traj, name)) != n:
            raise TrajectoryError(f"{where}: field {name!r} has {len(getattr(traj, name))} entries for {n} "
                                  "response_ids; one per token (use llm.generate(traj) and traj.observe(ids))")
    if n > max_response_tokens:
        raise TrajectoryError(f"{where}: field 'response_ids' holds {n} tokens, more than max_new_tokens="
                              f"{max_response_tokens}; stop at traj.room")
    if any(m not in (0, 1) for m in traj.response_mask):
        raise TrajectoryError(f"{where}: field 'response_mask' must hold only 0 and 1")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in traj.response_ids):
        raise TrajectoryError(f"{where}: field 'response_ids' holds a token outside [0, {vocab_size})")
    for i, (m, lp) in enumerate(zip(traj.response_mask, traj.log_probs)):
        if m and (lp is None or not math.isfinite(lp)):
            raise TrajectoryError(f"{where}: field 'log_probs' is missing for model token {i} (mask 1); model "
                                  "tokens need the behaviour log-prob the engine returned")
    if traj.reward is not None and not (isinstance(traj.reward, (int, float)) and math.isfinite(traj.reward)):
        raise TrajectoryError(f"{where}: field 'reward' must be a finite float or None, got {traj.reward!r}")
    if traj.stop_reason not in STOP_REASONS:
        raise TrajectoryError(f"{where}: field 'stop_reason' must be one of {STOP_REASONS}, got {traj.stop_reason!r}")
    return traj


def pack_trajectories(trajs: list[Trajectory], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, width: int,
                      pad_id: int, version: int) -> dict[str, Any]:
    """The ``generate`` batch fields of `trajs` (rows in order; responses right-padded to `width`).

    ``attention_mask`` is the prompt's mask then 1 on every trajectory token (model and environment);
    ``response_mask`` is 1 on model tokens only; ``version`` is the oldest version among a row's model
    tokens (`version` when it has none), ``token_versions`` each token's (-1 off the model tokens).
    """
    from tensordict import NonTensorStack

    B = len(trajs)
    # each field's tokens of every row as one flat list, made a tensor once and put in place by one mask (not a
    # tensor and a slice per row and field: a rollout of many small groups spent a tenth of its CPU there)
    lens = [len(t.response_ids) for t in trajs]
    filled = torch.arange(width) < torch.tensor(lens, dtype=torch.long).reshape(B, 1)  # row-major: the rows in order
    ids, masks, lps, tvs, vers = [], [], [], [], []
    for t in trajs:
        mask = [1 if m else 0 for m in t.response_mask]
        ids += t.response_ids
        masks += mask
        lps += [lp if m else 0.0 for lp, m in zip(t.log_probs, mask)]
        tvs += [v if m else -1 for v, m in zip(t.versions, mask)]
        model_versions = [v for v, m in zip(t.versions, mask) if m]
        vers.append(min(model_versions) if model_versions else version)

    def place(values: list[Any], fill: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((B, width), fill, dtype=dtype)
        out[filled] = torch.tensor(values, dtype=dtype)
        return out

    resp = place(ids, pad_id, torch.long)
    rmask = place(masks, 0, torch.long)
    attn = filled.long()
    logp = place(lps, 0.0, torch.float32)
    tver = place(tvs, -1, torch.long)
    ver = torch.tensor(vers, dtype=torch.long).reshape(B)
    reward = torch.tensor([math.nan if t.reward is None else float(t.reward) for t in trajs],
                          dtype=torch.float32).reshape(B)
    turns = torch.tensor([len(t.turns) for t in trajs], dtype=torch.long).reshape(B)
    tool_errors = torch.tensor([int(t.metrics.get("tool_errors", 0)) for t in trajs], dtype=torch.long).reshape(B)
    return {
        "response_ids": resp,
        "response_mask": rmask,
        "rollout_log_probs": logp,
        "version": ver,
        "token_versions": tver,
        "input_ids": torch.cat([prompt_ids.long(), resp], dim=1),
        "attention_mask": torch.cat([prompt_mask.long(), attn], dim=1),
        "episode_reward": reward,
        "num_turns": turns,
        "tool_errors": tool_errors,
        "stop_reason": NonTensorStack(*[t.stop_reason for t in trajs]),
    }


def episode_metrics(batch: Any, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """``episode/*`` metrics of a packed batch (over every rank when `all_reduce` sums across them):
    mean turns, model and environment tokens per episode, tool errors (a count), and the fraction of
    episodes per stop reason."""
    mask = batch["response_mask"].long()
    R = mask.shape[1]
    env = batch["attention_mask"][:, -R:].long().sum(1) - mask.sum(1)
    reasons = list(batch["stop_reason"]) if mask.shape[0] else []
    local = torch.tensor([float(mask.shape[0]), float(batch["num_turns"].sum()), float(mask.sum()), float(env.sum()),
                          float(batch["tool_errors"].sum()), *[float(reasons.count(r)) for r in STOP_REASONS]],
                         dtype=torch.float64)
    total = (all_reduce(local) if all_reduce is not None else local).tolist()
    n = max(total[0], 1.0)
    out = {"episode/turns_mean": total[1] / n, "episode/model_tokens_mean": total[2] / n,
           "episode/env_tokens_mean": total[3] / n, "episode/tool_errors": total[4]}
    out.update({f"episode/stop_{r}_frac": total[5 + i] / n for i, r in enumerate(STOP_REASONS)})
    return out
