"""`RolloutConfig`: how a :class:`~asyncrl.roles.generation.rollout.RolloutWorker` samples and syncs weights.

:meth:`RolloutConfig.validate` checks every setting: the worker calls it when it is built (and checks
what needs its engine), and ``JobConfig.validate`` before any worker starts. Import it from
:mod:`asyncrl.roles` or :mod:`asyncrl.roles.generation.rollout` (which re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from asyncrl.roles.fields import MAX_ROWS, MAX_SEED, Range, Section, check_bounds
from asyncrl.roles.agentic.agents import resolve_agent
from asyncrl.roles.agentic.environments import episode_names, resolve_episode
from asyncrl.roles.engines.base import partial_rollout_modes
from asyncrl.roles.engines.batcher import PARTIAL_ROLLOUT_MODES
from asyncrl.roles.errors import EpisodeConfigError

__all__ = ["RolloutConfig"]


@dataclass(kw_only=True)
class RolloutConfig(Section):
    """How a rollout worker samples and syncs weights."""

    engine: str = "hf"
    """Generation engine by name (``"hf"``, ``"vllm"`` or one added with ``register_engine``)."""
    max_new_tokens: Annotated[int, Range(ge=1, le=1 << 20)] = 16
    """Response length R: every returned batch has ``response_ids`` of width R."""
    temperature: Annotated[float, Range(ge=0)] = 1.0
    """Sampling temperature (log-probs are of ``log_softmax(logits / temperature)``)."""
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: Annotated[int, Range(ge=1, le=1 << 20, also=(-1,))] = -1
    """Top-k sampling (-1 = off)."""
    seed: Annotated[int, Range(ge=0, le=MAX_SEED)] = 0
    """Base seed. A call's seed is derived from it, the weight version and the prompts, so the
    same prompts under the same weights sample the same responses whatever the call order."""
    sync_policy: Literal["wait", "abort"] = "wait"
    """On a weight update while generation is in flight: ``"wait"`` lets it finish under the
    old weights; ``"abort"`` stops it and regenerates the unfinished rows under the new weights."""
    verify_checksums: bool = False
    """Check after each update that the engine's weights hash equal to the received ones
    (and to ``expected_checksums`` when given); a mismatch rolls back and raises."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the engine factory."""
    model_dir: str | None = None
    """Directory the engine loads from (vLLM); None saves the initial model to a temp dir when the
    engine is not ``"hf"``."""
    sleep_level: Annotated[int, Range(ge=0, le=2, says="0, 1 or 2")] = 0
    """What ``sleep()`` releases while the policy trains on a shared GPU (colocated): 0 = nothing
    (``sleep`` is a no-op), 1 = weights offloaded to the CPU and the KV cache freed, 2 = weights
    discarded (the next weight sync restores them). verl's / vLLM's sleep levels."""
    episode: str | None = None
    """Run a multi-turn episode per row instead of one generation (:mod:`asyncrl.roles.agentic.episodes`): a
    registered episode, a registered environment (``"char_class_retry"``, ``"calculator"``, your own) or
    ``"package.module:function"``. ``max_new_tokens`` is then the most tokens after the prompt (model and
    environment together). Checked by :meth:`validate` (so before any worker starts in a training run)."""
    episode_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the episode; for an environment ``max_turns``, ``tokens_per_turn``,
    ``tools`` (tool names) and ``env_kwargs``."""
    agent: str | None = None
    """Run the user's OpenAI-client agent per row instead (:mod:`asyncrl.roles.agentic.agents`):
    ``"path/to/file.py:function"`` or ``"package.module:function"``, an ``async def fn(sample, base_url)
    -> float | None`` that talks to ``base_url`` (a session of the worker's OpenAI-compatible gateway;
    the URL is the session's capability: any client key works). Its last row trains, with the gateway's
    rendered chat as the prompt. Not with ``episode``. Checked by :meth:`validate`."""
    max_episodes_in_flight: Annotated[int, Range(ge=1, le=MAX_ROWS)] = 256
    """Most episodes one rank runs at once (the engine batches their pending requests)."""
    chunk_tokens: Annotated[int, Range(ge=1, le=1 << 20)] = 32
    """Tokens a request decodes per round of the request-level HF engine; round boundaries are where new
    requests join (and, with ``partial_rollout="off"``, where weights may change)."""
    partial_rollout: Literal["off", "keep", "recompute"] = "off"
    """What a weight update does to request-level generations in flight (episodes, the streaming trainer's
    calls; docs/partial_rollout.md): ``"off"`` waits for them to finish; ``"recompute"`` pauses the engine
    after its current decode step, loads, and the generations continue by prefilling prompt + tokens so far
    under the new weights; ``"keep"`` continues decoding on the KV cache the old weights computed. Every token
    carries the version that produced it. Batch :meth:`RolloutWorker.generate` rows keep one version each
    (an update still waits for them). Needs ``sync_policy="wait"`` and an engine that supports the mode."""
    record_rounds: bool = False
    """Keep the request-level HF engine's round log (:meth:`RolloutWorker.round_log`): each round's request
    keys and the version and decode steps of its segments, which :meth:`RolloutWorker.replay_rounds`
    replays bit for bit (docs/partial_rollout.md, "Exact replay"). HF engine only."""
    pause_deadline_s: Annotated[float, Range(gt=0, says="> 0 seconds")] = 60.0
    """Partial rollout: most seconds a weight update waits for the engine to pause; past it the update
    raises :class:`~asyncrl.roles.errors.PauseDeadlineError` and nothing is loaded."""

    def validate(self, section: str = "RolloutConfig") -> None:
        """Raise ValueError (:class:`~asyncrl.roles.errors.EpisodeConfigError` for the episode) for a setting
        no rollout worker can run with; each message names the field as ``{section}.{field}``.

        The worker calls it when it is built; ``JobConfig.validate`` calls it with ``section="rollout"`` and
        turns the error into a ``ConfigError``, so a run fails before any worker starts. Building the config
        checks nothing: a value set after construction is checked all the same."""
        s = section
        check_bounds(self, s)
        if self.episode is not None:
            self._check_episode(s)
        if self.agent is not None:
            if self.episode is not None:
                raise EpisodeConfigError(f"{s}.agent and {s}.episode are both set; a row runs one of them, so "
                                         "set the other to null")
            try:
                resolve_agent(str(self.agent))
            except EpisodeConfigError as e:
                raise EpisodeConfigError(f"{s}.agent: {e}") from e
        if self.sync_policy not in ("wait", "abort"):
            raise ValueError(f"{s}.sync_policy must be 'wait' or 'abort', got {self.sync_policy!r}")
        self._check_partial_rollout(s)

    def _check_episode(self, s: str) -> None:
        """Resolve the episode now: an unknown name, a module that does not import, a tool that is not async
        or an option the environment does not take fail here, not in a worker."""
        # a registered name is fine by itself, so what fails is in its options
        key = "episode_kwargs" if self.episode_kwargs and self.episode in episode_names() else "episode"
        try:
            resolve_episode(str(self.episode), self.episode_kwargs)
        except (EpisodeConfigError, TypeError) as e:
            raise EpisodeConfigError(f"{s}.{key}: {e}") from e

    def _check_partial_rollout(self, s: str) -> None:
        mode = self.partial_rollout
        if mode not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(f"{s}.partial_rollout must be one of {PARTIAL_ROLLOUT_MODES}, got {mode!r}")
        if self.record_rounds and self.engine != "hf":
            raise ValueError(f"{s}.record_rounds needs the request-level HF engine (engine='hf'); the "
                             f"{self.engine!r} engine schedules requests itself. Set record_rounds=False")
        if mode == "off":
            return
        if self.sync_policy == "abort":
            raise ValueError(f"{s}.partial_rollout={mode!r} continues generations across a weight update and "
                             "sync_policy='abort' throws them away; use sync_policy='wait' with partial rollout, "
                             "or partial_rollout='off' with 'abort'")
        modes = partial_rollout_modes(self.engine)
        if modes is not None and mode not in modes:
            raise ValueError(f"{s}.partial_rollout={mode!r}: the {self.engine!r} engine cannot do "
                             f"partial_rollout={mode!r} (it supports {list(modes) or 'none'}); use engine='hf' or "
                             "'vllm', another mode, or partial_rollout='off' (an engine declares its modes in "
                             "partial_rollout_modes)")
