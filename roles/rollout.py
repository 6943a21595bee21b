"""`RolloutWorker`: generates responses with a pluggable engine and takes versioned weights.

Data flow of one ``generate`` call::

    batch{prompt_ids (left-padded), prompt_mask, ...}
      -> strip padding, check prompt + max_new_tokens fits the context (never truncate)
      -> engine.stream(prompts)  (HF thread / vLLM), rows collected as each finishes
      -> batch + {response_ids, response_mask, input_ids, attention_mask, rollout_log_probs, version}

Weight sync is a transaction (``update_weights``): *begin* checks the version is newer
and the tensors match the model (names, shapes, dtypes) before anything changes, and
closes the gate to new generation; in-flight generation is then either waited for
(``sync_policy="wait"``) or aborted and resubmitted after the update
(``"abort"``); *transfer* loads the tensors; *commit* publishes the version (and, in
verify mode, checks checksums first) and reopens the gate. Every row carries the
version of the weights that generated all of its tokens.

``update_weights`` takes weights by any transport (:mod:`asyncrl.roles.transfer`): the
``(version, state_dict)`` of ``export_weights`` through the object store, or a
:class:`~asyncrl.roles.transfer.WeightHandle` from ``stage_weights`` -- ``local`` (copied
from the colocated policy's snapshot in this process) or ``collective`` (received over the
weight channel first, then loaded in the same transaction). Floating tensors are cast to
the rollout's dtype (e.g. the policy's float32 master weights into a bf16 rollout).

Memory on a shared GPU: ``sleep()`` releases the engine's weights (level 1: to the CPU;
level 2: discarded) and KV cache around training, ``wake_up()`` re-acquires them; after a
level-2 sleep the next sync may reload the same version (``RolloutConfig.sleep_level``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Literal, Mapping

import torch
from tensordict import TensorDict, TensorDictBase

from asyncrl import Dispatch, Execute, Mode, Worker, register

from ._util import require, text_list, with_fields
from .device import check_gpu_memory, place_model, resolve_placement
from .engines import Completion, SamplingParams, make_engine
from .errors import DeviceError, EpisodeError, PromptTooLongError, StaleWeightsError, WeightSyncError
from .models import ModelConfig, context_length, load_model, save_model_dir, set_torch_threads, state_dict_checksums
from .transfer import OK, SNAPSHOTS, STALE, WeightChannel, WeightHandle, layout_of, member_info

__all__ = ["RolloutConfig", "RolloutWorker", "unpack_weights"]


@dataclass(kw_only=True)
class RolloutConfig:
    """How a rollout worker samples and syncs weights."""

    engine: str = "hf"
    """Generation engine by name (``"hf"``, ``"vllm"`` or one added with ``register_engine``)."""
    max_new_tokens: int = 16
    """Response length R: every returned batch has ``response_ids`` of width R."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are of ``log_softmax(logits / temperature)``)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    seed: int = 0
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
    sleep_level: int = 0
    """What ``sleep()`` releases while the policy trains on a shared GPU (colocated): 0 = nothing
    (``sleep`` is a no-op), 1 = weights offloaded to the CPU and the KV cache freed, 2 = weights
    discarded (the next weight sync restores them). verl's / vLLM's sleep levels."""
    episode: str | None = None
    """Run a multi-turn episode per row instead of one generation (:mod:`asyncrl.roles.episodes`): a
    registered episode, a registered environment (``"char_class_retry"``, ``"calculator"``, your own) or
    ``"package.module:function"``. ``max_new_tokens`` is then the most tokens after the prompt (model and
    environment together). Checked when the config is built, before any worker starts."""
    episode_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the episode; for an environment ``max_turns``, ``tokens_per_turn``,
    ``tools`` (tool names) and ``env_kwargs``."""
    max_episodes_in_flight: int = 256
    """Most episodes one rank runs at once (the engine batches their pending requests)."""
    chunk_tokens: int = 32
    """Tokens a request decodes per round of the request-level HF engine; round boundaries are where new
    requests join (and, with ``partial_rollout="off"``, where weights may change)."""
    partial_rollout: Literal["off", "keep", "recompute"] = "off"
    """What a weight update does to request-level generations in flight (episodes, the streaming trainer's
    calls; docs/partial_rollout.md): ``"off"`` waits for them to finish; ``"recompute"`` pauses the engine
    after its current decode step, loads, and the generations continue by prefilling prompt + tokens so far
    under the new weights; ``"keep"`` continues decoding on the KV cache the old weights computed. Every token
    carries the version that produced it. Batch :meth:`RolloutWorker.generate` rows keep one version each
    (an update still waits for them). Needs ``sync_policy="wait"`` and an engine that supports the mode."""
    pause_deadline_s: float = 60.0
    """Partial rollout: most seconds a weight update waits for the engine to pause; past it the update
    raises :class:`~asyncrl.roles.errors.PauseDeadlineError` and nothing is loaded."""

    def __post_init__(self) -> None:
        if self.episode is not None:
            from .episodes import resolve_episode

            resolve_episode(self.episode, self.episode_kwargs)  # unknown names and non-async tools fail here
        if self.max_episodes_in_flight < 1 or self.chunk_tokens < 1:
            raise ValueError(f"RolloutConfig: max_episodes_in_flight and chunk_tokens must be >= 1, got "
                             f"{self.max_episodes_in_flight}, {self.chunk_tokens}")
        self._check_partial_rollout()

    def _check_partial_rollout(self) -> None:
        from .engines.base import partial_rollout_modes
        from .engines.batcher import PARTIAL_ROLLOUT_MODES

        mode = self.partial_rollout
        if mode not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(f"RolloutConfig.partial_rollout must be one of {PARTIAL_ROLLOUT_MODES}, got {mode!r}")
        if not self.pause_deadline_s > 0:
            raise ValueError(f"RolloutConfig.pause_deadline_s must be > 0 seconds, got {self.pause_deadline_s!r}")
        if mode == "off":
            return
        if self.sync_policy == "abort":
            raise ValueError(f"RolloutConfig: partial_rollout={mode!r} continues generations across a weight update "
                             "and sync_policy='abort' throws them away; use sync_policy='wait' with partial rollout, "
                             "or partial_rollout='off' with 'abort'")
        modes = partial_rollout_modes(self.engine)
        if modes is not None and mode not in modes:
            raise ValueError(f"RolloutConfig: the {self.engine!r} engine cannot do partial_rollout={mode!r} (it "
                             f"supports {list(modes) or 'none'}); use engine='hf' or 'vllm', another mode, or "
                             "partial_rollout='off' (an engine declares its modes in partial_rollout_modes)")


def unpack_weights(weights: Any, version: int | None) -> tuple[int, dict[str, torch.Tensor]]:
    """Normalise what ``update_weights`` receives to ``(version, state_dict)``.

    Accepts the ``(version, state_dict)`` pair of ``PolicyWorker.export_weights`` (also
    pipelined as a future), a state dict, or ``(name, tensor)`` pairs with `version`.
    """
    if (isinstance(weights, list) and len(weights) == 1 and isinstance(weights[0], tuple) and len(weights[0]) == 2
            and isinstance(weights[0][0], int)):
        weights = weights[0]  # the per-rank list of a ONE_TO_ALL (not RANK_ZERO) export
    if isinstance(weights, tuple) and len(weights) == 2 and isinstance(weights[0], int):
        exported, sd = weights
        if version is not None and version != exported:
            raise WeightSyncError(
                f"update_weights(version={version}) but the weights were exported as version {exported}; "
                "pass the policy's export_weights() result and omit version, or pass the matching version"
            )
        version = exported
    else:
        sd = weights
    if isinstance(sd, Mapping):
        sd = dict(sd)
    else:
        try:
            sd = dict(sd)
        except (TypeError, ValueError):
            raise WeightSyncError(
                f"weights must be a state dict, (name, tensor) pairs or (version, state_dict); got {type(sd).__name__}"
            ) from None
    if version is None:
        raise WeightSyncError("update_weights needs a version: pass version=..., or the (version, state_dict) "
                              "pair that PolicyWorker.export_weights returns")
    if isinstance(version, bool) or not isinstance(version, int):
        raise WeightSyncError(f"version must be an int, got {version!r}")
    return version, sd


class _Job:
    """One generate call's rows, resubmittable after an abort."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self.prompts = prompts
        self.params = params
        self.results: list[tuple[Completion, int] | None] = [None] * len(prompts)
        self.task: asyncio.Task[None] | None = None
        self.aborted = False
        self.attempt = 0
        self.finished: asyncio.Queue[int] = asyncio.Queue()

    @property
    def pending(self) -> list[int]:
        return [i for i, r in enumerate(self.results) if r is None]


class RolloutWorker(Worker):
    """Generates responses for prompt batches and receives versioned policy weights.

    Args:
        model: the model to sample from (its initial weights are version 0).
        rollout: sampling and weight-sync settings.
    """

    def __init__(self, model: ModelConfig, rollout: RolloutConfig | None = None) -> None:
        self.model_config = model
        self.config = rollout or RolloutConfig()
        if self.config.sync_policy not in ("wait", "abort"):
            raise ValueError(f"RolloutConfig.sync_policy must be 'wait' or 'abort', got {self.config.sync_policy!r}")
        if self.config.sleep_level not in (0, 1, 2):
            raise ValueError(f"RolloutConfig.sleep_level must be 0, 1 or 2, got {self.config.sleep_level!r}")
        set_torch_threads(self.context.num_cpus, model.num_threads)
        self.placement = resolve_placement(model, self.context.num_gpus, trained=False, who="RolloutWorker")
        built, self.tokenizer = load_model(model)
        if self.config.engine == "hf":
            self.model = place_model(built, self.placement, trained=False, who="RolloutWorker")
        else:  # the engine (vLLM) loads its own copy onto the GPU; this one stays on the CPU
            self.model = built.to(dtype=self.placement.param_dtype)
        self.model.eval().requires_grad_(False)
        self.context_length = context_length(self.model)
        self._shapes = {k: (tuple(v.shape), v.dtype) for k, v in self.model.state_dict().items()}
        model_dir = self.config.model_dir
        if model_dir is None and self.config.engine != "hf":
            self._tmp = tempfile.TemporaryDirectory(prefix="asyncrl-rollout-")
            model_dir = save_model_dir(self.model, self.tokenizer, self._tmp.name)
        engine_kwargs = dict(self.config.engine_kwargs)
        if self.config.engine == "hf" and self.placement.autocast_dtype is not None:
            engine_kwargs.setdefault("autocast", self.placement.autocast_dtype)
        if self.config.engine == "vllm":
            _check_vllm_memory(engine_kwargs, self.placement)
            if self.config.sleep_level:
                engine_kwargs.setdefault("sleep_mode", True)
        self.engine = make_engine(self.config.engine, model=self.model, tokenizer=self.tokenizer,
                                  model_dir=model_dir, **engine_kwargs)
        modes = tuple(getattr(self.engine, "partial_rollout_modes", ()))
        if self.config.partial_rollout != "off" and self.config.partial_rollout not in modes:
            raise ValueError(f"RolloutConfig.partial_rollout={self.config.partial_rollout!r} but the "
                             f"{self.config.engine!r} engine supports {list(modes) or 'no partial rollout'}; pick one "
                             "of those or partial_rollout='off'")
        if self.config.sleep_level and not callable(getattr(self.engine, "sleep", None)):
            raise ValueError(f"RolloutConfig.sleep_level={self.config.sleep_level} but the {self.config.engine!r} "
                             "engine has no sleep/wake_up; set sleep_level=0")
        self._asleep = 0
        self._needs_weights = False
        self._channel: WeightChannel | None = None
        self._version = 0
        self._committed: dict[str, torch.Tensor] | None = None
        self._initial_state = ({k: v.detach().clone() for k, v in self.model.state_dict().items()}
                               if self.config.verify_checksums else {})
        self._gate: asyncio.Event | None = None  # created on the worker's loop
        self._jobs: set[_Job] = set()
        self._streams: dict[str, tuple[_Job, asyncio.Future[None], int, int]] = {}
        self._stream_batches: dict[str, TensorDictBase] = {}
        self._episode_fn = None
        if self.config.episode is not None:
            from .episodes import resolve_episode

            self._episode_fn = resolve_episode(self.config.episode, self.config.episode_kwargs)
        self._batcher: Any = None  # the request-level engine, built on the worker's loop at first use
        self._episode_tasks: set[asyncio.Task[Any]] = set()
        self._updates: list[dict[str, Any]] = []  # partial rollout: what each update's pause found
        self._rolled_back = False  # the last failed load was undone (verify_checksums)
        self._trajectories = [0, 0]  # episodes returned, and those whose model tokens span versions

    # ---- state --------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Version of the loaded weights (0 = initial)."""
        return self._version

    @register(Dispatch.ONE_TO_ALL)
    def get_version(self) -> int:
        """Version of the loaded weights; as a group call, one int per rank."""
        return self._version

    @register(Dispatch.ONE_TO_ALL)
    def weights_checksum(self) -> dict[str, str]:
        """``{name: checksum}`` of the engine's weights; as a group call, one dict per rank."""
        return self.engine.weights_checksum()

    def _gate_event(self) -> asyncio.Event:
        if self._gate is None:
            self._gate = asyncio.Event()
            self._gate.set()
        return self._gate

    # ---- generation ---------------------------------------------------------------------

    def _check_weights(self) -> None:
        if self._needs_weights:
            raise RuntimeError(f"rollout rank {self.rank} has no usable weights (it discarded its weights in "
                               "sleep(level=2), or a weight load failed part-way); sync weights (update_weights, after "
                               "wake_up() if asleep) before generating")

    def _prompts(self, batch: TensorDictBase, max_new_tokens: int) -> list[list[int]]:
        if self._asleep:
            raise RuntimeError(f"rollout rank {self.rank} is asleep (level {self._asleep}); call wake_up() before "
                               "generating")
        self._check_weights()
        require(batch, ["prompt_ids", "prompt_mask"], "RolloutWorker.generate")
        ids, mask = batch["prompt_ids"], batch["prompt_mask"]
        prompts = [ids[b][mask[b].bool()].tolist() for b in range(ids.shape[0])]
        for b, p in enumerate(prompts):
            if not p:
                raise ValueError(f"row {b} has an empty prompt (prompt_mask is all 0)")
            if len(p) + max_new_tokens > self.context_length:
                raise PromptTooLongError(
                    f"row {b}: prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                    f"context of {self.context_length} positions; shorten or filter prompts longer than "
                    f"{self.context_length - max_new_tokens} tokens, lower max_new_tokens, or use a model with a "
                    "longer context (prompts are never truncated silently)"
                )
        return prompts

    def _params(self, prompts: list[list[int]], max_new_tokens: int | None, temperature: float | None,
                seed: int | None) -> SamplingParams:
        c = self.config
        h = hashlib.sha256(f"{c.seed}|{seed}|{self._version}|".encode())
        for p in prompts:
            h.update(torch.tensor(p, dtype=torch.int64).numpy().tobytes() + b"|")
        return SamplingParams(
            max_new_tokens=max_new_tokens if max_new_tokens is not None else c.max_new_tokens,
            temperature=temperature if temperature is not None else c.temperature,
            top_p=c.top_p, top_k=c.top_k, seed=int.from_bytes(h.digest()[:4], "little") & 0x3FFFFFFF,
        )

    async def _run_job(self, job: _Job) -> None:
        """Generate every row of `job`, resubmitting unfinished rows after an abort."""
        gate = self._gate_event()
        self._jobs.add(job)
        try:
            while job.pending:
                while not gate.is_set():
                    await gate.wait()
                idx = job.pending
                version = self._version
                params = job.params if job.attempt == 0 else replace(job.params, seed=(job.params.seed or 0) + 7919 * job.attempt)
                job.aborted = False
                job.task = asyncio.ensure_future(self._consume(job, idx, version, params))
                try:
                    await job.task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if job.aborted and current is not None and not current.cancelling():
                        job.attempt += 1
                        continue  # aborted by a weight update: resubmit the unfinished rows
                    job.task.cancel()
                    raise
                finally:
                    job.task = None
        finally:
            self._jobs.discard(job)

    async def _consume(self, job: _Job, idx: list[int], version: int, params: SamplingParams) -> None:
        stream = self.engine.stream([job.prompts[i] for i in idx], params)
        try:
            async for j, c in stream:
                job.results[idx[j]] = (c, version)
                job.finished.put_nowait(idx[j])
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _rows(self, job: _Job, rows: list[int], R: int) -> dict[str, torch.Tensor]:
        pad = int(self.tokenizer.pad_token_id)
        n = len(rows)
        resp = torch.full((n, R), pad, dtype=torch.long)
        rmask = torch.zeros((n, R), dtype=torch.long)
        logp = torch.zeros((n, R), dtype=torch.float32)
        ver = torch.zeros(n, dtype=torch.long)
        for k, i in enumerate(rows):
            c, v = job.results[i]  # type: ignore[misc]
            L = len(c.response_ids)
            if L > R or len(c.log_probs) != L:
                raise RuntimeError(f"engine returned {L} tokens and {len(c.log_probs)} log-probs for max_new_tokens={R}")
            resp[k, :L] = torch.tensor(c.response_ids, dtype=torch.long)
            rmask[k, :L] = 1
            logp[k, :L] = torch.tensor(c.log_probs, dtype=torch.float32)
            ver[k] = v
        return {"response_ids": resp, "response_mask": rmask, "rollout_log_probs": logp, "version": ver}

    def _assemble(self, batch: TensorDictBase, fields: dict[str, torch.Tensor]) -> TensorDict:
        fields["input_ids"] = torch.cat([batch["prompt_ids"].long(), fields["response_ids"]], dim=1)
        fields["attention_mask"] = torch.cat([batch["prompt_mask"].long(), fields["response_mask"]], dim=1)
        return with_fields(batch, fields)

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate(self, batch: TensorDictBase, max_new_tokens: int | None = None,
                       temperature: float | None = None, seed: int | None = None) -> TensorDict:
        """One response per row (row-preserving; GRPO repeats rows before calling).

        Returns the batch plus ``response_ids``, ``response_mask``, ``input_ids``,
        ``attention_mask``, ``rollout_log_probs`` and ``version`` (see docs/roles_api.md).
        `max_new_tokens`/`temperature` override the config for this call; `seed` is mixed
        into the derived sampling seed.
        """
        if self._episode_fn is not None:
            return await self.generate_episodes(batch, max_new_tokens, temperature, seed)
        R = max_new_tokens if max_new_tokens is not None else self.config.max_new_tokens
        prompts = self._prompts(batch, R)
        job = _Job(prompts, self._params(prompts, max_new_tokens, temperature, seed))
        await self._run_job(job)
        return self._assemble(batch, self._rows(job, list(range(len(prompts))), R))

    # ---- multi-turn episodes --------------------------------------------------------------

    def _request_engine(self) -> Any:
        """``submit(prompt_ids, params) -> Generation``: the request-level HF engine (one batcher per
        worker), or one-prompt calls of an engine that schedules requests itself (vLLM)."""
        from .engines.batcher import Generation, request_batcher

        if self._batcher is None:
            self._batcher = request_batcher(self.engine, max_batch_size=getattr(self.engine, "max_batch_size", 64),
                                            chunk_tokens=self.config.chunk_tokens, version_fn=lambda: self._version,
                                            partial_rollout=self.config.partial_rollout)
        batcher = self._batcher
        if batcher is not None:
            async def request(ids: list[int], params: SamplingParams) -> Generation:
                self._check_weights()
                return await batcher.generate(ids, params)

            return request

        arequest = getattr(self.engine, "agenerate_request", None)  # per-token versions (vLLM)
        if arequest is not None and self.config.partial_rollout != "off":
            async def versioned(ids: list[int], params: SamplingParams) -> Generation:
                self._check_weights()
                return await arequest(ids, params, version_fn=lambda: self._version)

            return versioned

        async def submit(ids: list[int], params: SamplingParams) -> Generation:
            version = self._version
            c = (await self.engine.generate([ids], params))[0]
            return Generation(c.response_ids, c.log_probs, c.finish_reason, versions=[version] * len(c.response_ids))

        return submit

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate_episodes(self, batch: TensorDictBase, max_new_tokens: int | None = None,
                                temperature: float | None = None, seed: int | None = None, *,
                                episode: str | None = None, episode_kwargs: dict[str, Any] | None = None,
                                max_in_flight: int | None = None) -> TensorDict:
        """One episode per row (``RolloutConfig.episode``, or `episode` for this call), all in flight at
        once; returns the layout of :meth:`generate` (see :func:`asyncrl.roles.episodes.pack_trajectories`):
        ``response_ids`` of width R hold model and environment tokens, ``response_mask`` is 1 only on
        model tokens, plus ``token_versions``, ``episode_reward``, ``num_turns``, ``tool_errors``,
        ``stop_reason``. Rows repeated for GRPO run separate episodes (their ``uid`` is kept, so a
        group is the episodes of one sample). A malformed trajectory raises
        :class:`~asyncrl.roles.errors.TrajectoryError` naming the episode and the field. `max_in_flight`
        overrides ``RolloutConfig.max_episodes_in_flight`` for this call (1: one episode at a time)."""
        import anyio

        from .episodes import LLM, Sample, pack_trajectories, resolve_episode, validate_trajectory

        if episode is not None:
            fn, name = resolve_episode(episode, episode_kwargs), episode
        elif self._episode_fn is not None:
            fn, name = self._episode_fn, str(self.config.episode)
        else:
            raise ValueError("generate_episodes needs an episode: set RolloutConfig.episode or pass episode=...")
        R = max_new_tokens if max_new_tokens is not None else self.config.max_new_tokens
        prompts = self._prompts(batch, R)
        gate = self._gate_event()
        while not gate.is_set():  # a weight update is loading: start under the new weights
            await gate.wait()
        base = self._params(prompts, R, temperature, seed)
        submit = self._request_engine()
        prompt_text, answers = text_list(batch, "prompt"), text_list(batch, "answer")
        trajs: list[Any] = [None] * len(prompts)
        limit = anyio.Semaphore(max_in_flight or self.config.max_episodes_in_flight)
        vocab = int(self.model.get_output_embeddings().weight.shape[0])

        async def run(i: int) -> None:
            sample = Sample(prompts[i], prompt=prompt_text[i] if prompt_text else None,
                            answer=answers[i] if answers else None, index=i)
            llm = LLM(submit, self.tokenizer, replace(base, seed=((base.seed or 0) + 104729 * i) & 0x3FFFFFFF), R)
            async with limit:
                try:
                    traj = await fn(llm, sample)
                except Exception as e:  # the user's code: say whose and which row (tools never get here)
                    raise EpisodeError(f"episode {name!r} (row {i}) raised {type(e).__name__}: {e}; fix the "
                                       "episode or its environment (tool errors are observations, not raises)") from e
                trajs[i] = validate_trajectory(traj, name, sample, R, vocab)

        me = asyncio.current_task()
        if me is not None:
            self._episode_tasks.add(me)  # weight updates and sleep wait for the episodes in flight
        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(run, i)
        except BaseExceptionGroup as group:  # the first episode's error cancelled the rest: raise it alone
            raise _first_leaf(group) from None
        finally:
            if me is not None:
                self._episode_tasks.discard(me)
        fields = pack_trajectories(trajs, batch["prompt_ids"], batch["prompt_mask"], R,
                                   int(self.tokenizer.pad_token_id), self._version)
        tv, model_tokens = fields["token_versions"], fields["response_mask"].bool()
        self._trajectories[0] += len(trajs)
        self._trajectories[1] += sum(len(set(tv[b][model_tokens[b]].tolist())) > 1 for b in range(len(trajs)))
        return with_fields(batch, fields)

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate_requests(self, batch: TensorDictBase, max_new_tokens: int | None = None,
                                temperature: float | None = None, seed: int | None = None) -> TensorDict:
        """Like :meth:`generate`, with every row an independent request of the request-level engine
        (:meth:`_request_engine`), so many concurrent calls (streaming rollout: one per prompt group)
        share its decoding rounds. Like episodes, a call counts among the request-level generations
        a weight update handles: with ``partial_rollout="off"`` an update waits for it (its rows keep
        one version); with ``"keep"``/``"recompute"`` the update reaches its rows in flight without
        waiting and they decode on under the new weights (each token records its version).

        Returns the layout of :meth:`generate` plus ``token_versions`` (``[B, R]``: each generated
        token's weight version, -1 past the response); ``version`` is a row's first token's version.
        Row ``i``'s sampling seed comes from the config's seed, `seed`, the row's index in the whole
        batch and its prompt (not the weight version): the same call regenerates the same rows under
        the same weights, and the rows of one prompt differ."""
        R = max_new_tokens if max_new_tokens is not None else self.config.max_new_tokens
        prompts = self._prompts(batch, R)
        gate = self._gate_event()
        while not gate.is_set():  # a weight update is loading: start under the new weights
            await gate.wait()
        base = self._params(prompts, R, temperature, seed)
        offset = self.rank * len(prompts)  # rows before this rank's shard (data-parallel shards are equal)
        submit = self._request_engine()

        def row_seed(i: int) -> int:
            h = hashlib.sha256(f"{self.config.seed}|{seed}|{offset + i}|{prompts[i]}".encode())
            return int.from_bytes(h.digest()[:4], "little") & 0x3FFFFFFF

        me = asyncio.current_task()
        if me is not None:
            self._episode_tasks.add(me)  # what a weight update waits for (partial_rollout="off") or reaches
        try:
            gens = await asyncio.gather(*(submit(p, replace(base, seed=row_seed(i))) for i, p in enumerate(prompts)))
        finally:
            if me is not None:
                self._episode_tasks.discard(me)
        n, pad = len(prompts), int(self.tokenizer.pad_token_id)
        resp = torch.full((n, R), pad, dtype=torch.long)
        rmask = torch.zeros((n, R), dtype=torch.long)
        logp = torch.zeros((n, R), dtype=torch.float32)
        tver = torch.full((n, R), -1, dtype=torch.long)
        ver = torch.full((n,), self._version, dtype=torch.long)
        for b, c in enumerate(gens):
            L = len(c.response_ids)
            if L > R or len(c.log_probs) != L or len(c.versions) != L:
                raise RuntimeError(f"the request engine returned {L} tokens, {len(c.log_probs)} log-probs and "
                                   f"{len(c.versions)} versions for max_new_tokens={R}")
            if L:
                resp[b, :L] = torch.tensor(c.response_ids, dtype=torch.long)
                rmask[b, :L] = 1
                logp[b, :L] = torch.tensor(c.log_probs, dtype=torch.float32)
                tver[b, :L] = torch.tensor(c.versions, dtype=torch.long)
                ver[b] = c.versions[0]
        fields = {"response_ids": resp, "response_mask": rmask, "rollout_log_probs": logp, "version": ver,
                  "token_versions": tver}
        return self._assemble(batch, fields)

    async def stream_generate(self, batch: TensorDictBase, max_new_tokens: int | None = None,
                              temperature: float | None = None, seed: int | None = None) -> AsyncIterator[TensorDict]:
        """Like :meth:`generate`, but yields each row (a one-row batch with an ``index`` field,
        the row's position in `batch`) as soon as it finishes. In-process use; across
        processes use :meth:`submit` and :meth:`poll`."""
        R = max_new_tokens if max_new_tokens is not None else self.config.max_new_tokens
        prompts = self._prompts(batch, R)
        job = _Job(prompts, self._params(prompts, max_new_tokens, temperature, seed))
        runner = asyncio.ensure_future(self._run_job(job))
        try:
            for _ in range(len(prompts)):
                i = await self._next_finished(job, runner)
                row = self._assemble(batch[i:i + 1], self._rows(job, [i], R))
                row.set("index", torch.tensor([i], dtype=torch.long))
                yield row
            await runner
        finally:
            if not runner.done():
                runner.cancel()
                try:
                    await runner
                except BaseException:
                    pass

    @staticmethod
    async def _next_finished(job: _Job, runner: asyncio.Future[None]) -> int:
        getter = asyncio.ensure_future(job.finished.get())
        waiters: set[asyncio.Future[Any]] = {getter, runner}
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        runner.result()  # raises the job's error
        return job.finished.get_nowait()

    @register(Dispatch.DP_COMPUTE_METRIC, concurrent=True)
    async def submit(self, batch: TensorDictBase, request_id: str, max_new_tokens: int | None = None) -> int:
        """Start generating `batch` in the background under `request_id`; returns the rows this
        rank accepted. Fetch finished rows with :meth:`poll`."""
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already running on rank {self.rank}; use a new id")
        R = max_new_tokens if max_new_tokens is not None else self.config.max_new_tokens
        prompts = self._prompts(batch, R)
        job = _Job(prompts, self._params(prompts, max_new_tokens, None, None))
        runner = asyncio.ensure_future(self._run_job(job))
        runner.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._streams[request_id] = (job, runner, R, len(prompts))
        self._stream_batches[request_id] = batch
        return len(prompts)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def poll(self, request_id: str) -> dict[str, Any]:
        """Wait until at least one more row of `request_id` finished on this rank (or all did).

        Returns ``{"rows": TensorDict | None, "done": bool}``: the newly finished rows
        (with ``index`` = the row's position in the submitted batch, i.e. ``rank * shard
        rows + local row``; indices past the batch are dispatch padding) and whether this
        rank has no more. As a group call, one such dict per rank.
        """
        try:
            job, runner, R, n = self._streams[request_id]
        except KeyError:
            raise KeyError(f"no request {request_id!r} on rank {self.rank}; submit it first (or it was drained)") from None
        batch = self._stream_batches[request_id]
        rows: list[int] = []
        if job.finished.empty() and not runner.done():
            rows.append(await self._next_finished(job, runner))
        while not job.finished.empty():
            rows.append(job.finished.get_nowait())
        if runner.done():
            runner.result()
        done = runner.done() and job.finished.empty()
        if done:
            del self._streams[request_id]
            del self._stream_batches[request_id]
        if not rows:
            return {"rows": None, "done": done}
        rows.sort()
        td = self._assemble(batch[torch.tensor(rows)], self._rows(job, rows, R))
        td.set("index", torch.tensor(rows, dtype=torch.long) + self.rank * n)
        return {"rows": td, "done": done}

    # ---- weight sync ----------------------------------------------------------------------

    def _vote(self, version: int) -> int:
        """A collective transfer's vote on `version` (before any bytes move)."""
        if version < self._version or (version == self._version and not self._needs_weights):
            return STALE
        return OK

    def _check_version(self, version: int) -> None:
        if self._vote(version) != OK:
            raise StaleWeightsError(
                f"refusing weights of version {version}: rank {self.rank} already has version {self._version}; "
                "updates must carry strictly increasing versions (sync after each policy update, in order)"
            )

    def _validate(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self._check_version(version)
        unknown = sorted(set(state) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(state))
        if unknown or missing:
            raise WeightSyncError(
                f"weights of version {version} do not match the rollout model: unknown names {unknown[:5]}, "
                f"missing names {missing[:5]}; export the full state_dict of the same architecture"
            )
        for k, t in state.items():
            shape, dtype = self._shapes[k]
            ok = isinstance(t, torch.Tensor) and tuple(t.shape) == shape and (
                t.dtype == dtype or (t.is_floating_point() and dtype.is_floating_point))
            if not ok:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise WeightSyncError(f"weight {k!r}: expected {shape} {dtype}, got {got}")

    def _cast(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with floating tensors in the rollout's dtypes (what the engine will hold)."""
        return {k: t if t.dtype == self._shapes[k][1] else t.to(self._shapes[k][1]) for k, t in state.items()}

    # ---- weight transports ----------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{name: (shape, dtype)}`` of the weights this rollout holds (what a sync must bring)."""
        return {k: (shape, str(dtype).removeprefix("torch.")) for k, (shape, dtype) in self._shapes.items()}

    @register(Dispatch.ONE_TO_ALL)
    def channel_member(self) -> dict[str, Any]:
        """This rank's process and device, for choosing a weight channel's backend."""
        return member_info(self.placement.device)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def join_weight_channel(self, name: str, host: str, port: int, world_size: int, backend: str,
                                  timeout_s: float = 120.0, bucket_bytes: int = 256 << 20) -> dict[str, Any]:
        """Join weight channel `name` as channel rank ``1 + rank`` (policy rank 0 sends)."""
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        ch = await asyncio.to_thread(WeightChannel, name, host, port, 1 + self.rank, world_size, backend=backend,
                                     device=self.placement.device, timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        self._channel = ch
        return {"rank": ch.rank, "backend": ch.backend, "world_size": world_size}

    async def _receive(self, handle: WeightHandle) -> dict[str, torch.Tensor]:
        ch = self._channel
        if ch is None or ch.name != handle.channel:
            raise WeightSyncError(f"rollout rank {self.rank} has no open weight channel {handle.channel!r}; call "
                                  "open_weight_channel(policy, rollout) first")
        layout = layout_of(self.weight_spec())
        target = self.placement.device if self.config.engine == "hf" else torch.device("cpu")
        return await asyncio.to_thread(ch.receive, handle.version, layout, self._vote, target, self._on_bucket_received)

    def _on_bucket_received(self, what: str) -> None:
        """Called after each bucket a transfer receives (a seam for fault-injection tests)."""

    async def _resolve_weights(self, weights: Any, version: int | None) -> tuple[int, dict[str, torch.Tensor]]:
        if isinstance(weights, list) and len(weights) == 1 and isinstance(weights[0], WeightHandle):
            weights = weights[0]
        if not isinstance(weights, WeightHandle):
            return unpack_weights(weights, version)
        if version is not None and version != weights.version:
            raise WeightSyncError(f"update_weights(version={version}) but the handle holds version {weights.version}")
        if weights.transport == "local":
            self._check_version(weights.version)
            return weights.version, SNAPSHOTS.take_local(weights)
        if weights.transport == "collective":
            return weights.version, await self._receive(weights)
        raise WeightSyncError(f"unknown weight transport {weights.transport!r}")

    # ---- memory on a shared GPU ----------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    async def sleep(self, level: int | None = None) -> dict[str, Any]:
        """Release the engine's weights and KV cache until :meth:`wake_up` (`level` defaults to
        ``RolloutConfig.sleep_level``; 0 does nothing). In-flight generation finishes first."""
        lvl = self.config.sleep_level if level is None else level
        if lvl == 0 or self._asleep:
            return {"asleep": bool(self._asleep), "level": self._asleep}
        gate = self._gate_event()
        gate.clear()
        try:
            tasks = [j.task for j in self._jobs if j.task is not None] + list(self._episode_tasks)
            if tasks:
                await asyncio.wait(tasks)
            asleep = getattr(self.engine, "asleep", None)
            if asleep is not None:
                await asleep(lvl)
            else:
                await asyncio.to_thread(self.engine.sleep, lvl)  # type: ignore[attr-defined]
            self._asleep = lvl
        finally:
            gate.set()
        return {"asleep": True, "level": lvl}

    @register(Dispatch.ONE_TO_ALL)
    async def wake_up(self) -> dict[str, Any]:
        """Re-acquire what :meth:`sleep` released. Returns ``{"needs_weights", "version"}``: after a
        level-2 sleep the weights must be synced again (the same version is accepted) before generating."""
        if self._asleep:
            awake = getattr(self.engine, "awake_up", None)
            if awake is not None:
                await awake()
            else:
                await asyncio.to_thread(self.engine.wake_up)  # type: ignore[attr-defined]
            self._needs_weights = self._needs_weights or self._asleep == 2
            self._asleep = 0
        return {"needs_weights": self._needs_weights, "version": self._version}

    @register(Dispatch.ONE_TO_ALL)
    async def update_weights(self, weights: Any, version: int | None = None, *,
                             expected_checksums: dict[str, str] | None = None) -> dict[str, Any]:
        """Load policy weights as one transaction (begin, transfer, commit).

        `weights` is the ``(version, state_dict)`` pair of ``PolicyWorker.export_weights`` --
        pass that future straight in so the tensors go through the object store, not the
        controller -- a state dict with `version`, or a ``WeightHandle`` of ``stage_weights``
        (``local``: copied from the colocated policy's snapshot; ``collective``: received over
        the weight channel while ``PolicyWorker.send_weights`` sends it). Refuses a version <=
        the current one (:class:`StaleWeightsError`) and malformed weights
        (:class:`WeightSyncError`) without changing anything. Returns ``{"version",
        "num_tensors", "waited", "aborted", "checksums_verified"}``. With
        ``RolloutConfig.partial_rollout`` the update does not wait for request-level generations
        in flight (episodes, streaming calls): it pauses the engine, loads, publishes the version
        and resumes; the receipt adds ``pause_latency_s``, ``in_flight`` and ``interrupted``
        (docs/partial_rollout.md).
        """
        if self._asleep == 2:
            raise RuntimeError(f"rollout rank {self.rank} is asleep at level 2 (weights discarded); call wake_up() "
                               "before syncing weights")
        handle = weights[0] if isinstance(weights, list) and len(weights) == 1 else weights
        version, state = await self._resolve_weights(weights, version)
        # begin: every check before anything changes
        self._validate(version, state)
        state = self._cast(state)
        if self.config.partial_rollout != "off":
            return await self._update_in_flight(version, state, handle, expected_checksums)
        gate = self._gate_event()
        gate.clear()
        try:
            jobs = [j for j in self._jobs if j.task is not None]
            aborted = 0
            if self.config.sync_policy == "abort":
                for j in jobs:
                    j.aborted = True
                    j.task.cancel()  # type: ignore[union-attr]
                    aborted += len(j.pending)
            tasks = [j.task for j in jobs if j.task is not None]
            tasks += [t for t in self._episode_tasks if t is not asyncio.current_task()]  # episodes finish first
            if tasks:
                await asyncio.wait(tasks)  # abort: until the engine stopped; wait: until they finished
            verify = await self._load_and_commit(version, state, handle, expected_checksums)
            return {"version": version, "num_tensors": len(state), "waited": 0 if aborted else len(tasks),
                    "aborted": aborted, "checksums_verified": verify}
        finally:
            gate.set()

    async def _load_and_commit(self, version: int, state: dict[str, torch.Tensor], handle: Any,
                               expected_checksums: dict[str, str] | None) -> bool:
        """Transfer `state` into the engine, verify it if asked, publish `version`; returns whether it
        verified checksums."""
        verify = self.config.verify_checksums or expected_checksums is not None
        self._rolled_back = False
        await self._engine_load(state)
        # commit (verify first)
        if verify:
            got = await self._engine_checksum()
            want = expected_checksums if expected_checksums is not None else state_dict_checksums(state.items())
            bad = sorted(k for k in want if got.get(k) != want[k])
            if bad or set(want) != set(got):
                if self.config.verify_checksums:  # roll back to the last verified weights
                    await self._engine_load(self._committed or self._initial_state)
                    self._rolled_back = True
                    outcome = f"rolled back to version {self._version}"
                else:
                    outcome = "the engine holds unverified weights: sync again (verify_checksums=True rolls back)"
                raise WeightSyncError(
                    f"checksum mismatch after loading version {version} on rank {self.rank} for {bad[:5]}; {outcome}"
                )
        if self.config.verify_checksums:
            self._committed = state  # what a later failed verification rolls back to
        self._version = version
        self._needs_weights = False
        if isinstance(handle, WeightHandle) and handle.transport == "local":
            SNAPSHOTS.drop_older(handle.owner, version)
        return verify

    async def _update_in_flight(self, version: int, state: dict[str, torch.Tensor], handle: Any,
                                expected_checksums: dict[str, str] | None) -> dict[str, Any]:
        """Partial rollout: pause the engine (after its current decode step), load, publish the version,
        resume -- generations in flight continue under the new weights (docs/partial_rollout.md).

        Batch :meth:`generate` calls in flight are waited for first (their rows carry one version). A
        pause not reached within ``pause_deadline_s`` raises :class:`PauseDeadlineError` with nothing
        loaded. A load that fails inside the pause fails every request in flight with
        :class:`WeightSyncError` (the weights they would continue on are no longer known) and refuses
        generation until an update succeeds (the same version is accepted again). Cancelled once the
        load has begun (a stop signal), the update still finishes -- load and version together, the
        engine paused meanwhile -- and then raises ``CancelledError``: the engine never resumes on
        half-loaded weights or under the wrong version."""
        gate = self._gate_event()
        gate.clear()  # new batch calls and new episodes start after the update
        try:
            tasks = [j.task for j in self._jobs if j.task is not None]
            if tasks:
                await asyncio.wait(tasks)
            cancelled = False
            async with self._engine_paused() as paused:
                load = asyncio.ensure_future(self._load_and_commit(version, state, handle, expected_checksums))
                while not load.done():
                    try:
                        await asyncio.wait([load])  # cancelling the update does not cancel the load
                    except asyncio.CancelledError:
                        cancelled = True  # a stop signal: finish the load first, then stop
                try:
                    verify = load.result()
                except BaseException as e:
                    if not self._rolled_back:  # a verified rollback restored the weights: requests continue
                        self._needs_weights = True  # a sync of any version >= the current one restores them
                        failed = self._fail_in_flight(WeightSyncError(
                            f"weights of version {version} failed to load on rollout rank {self.rank} while this "
                            f"request was in flight ({type(e).__name__}: {e}); it was stopped, since the weights it "
                            "would continue on are no longer known -- sync weights again and resubmit"))
                        self._updates.append({"version": version, "failed": True, "failed_requests": failed})
                    raise
            receipt = {"version": version, "num_tensors": len(state), "waited": len(tasks), "aborted": 0,
                       "checksums_verified": verify, "pause_latency_s": paused.latency_s,
                       "in_flight": paused.in_flight, "interrupted": paused.interrupted}
            self._updates.append({k: receipt[k] for k in ("version", "pause_latency_s", "in_flight", "interrupted")})
            if cancelled:
                raise asyncio.CancelledError(f"update_weights was cancelled while loading; version {version} was "
                                             "loaded and published before it stopped")
            return receipt
        finally:
            gate.set()

    def _engine_paused(self) -> Any:
        """The engine held still for a weight load (the request batcher's pause, or the engine's own)."""
        from .engines.batcher import PauseInfo

        deadline = self.config.pause_deadline_s
        if self._batcher is not None:
            return self._batcher.paused(deadline)
        apaused = getattr(self.engine, "apaused", None)  # engines that schedule requests themselves (vLLM)
        if apaused is not None:
            return apaused(self.config.partial_rollout, deadline)

        @contextlib.asynccontextmanager
        async def idle() -> AsyncIterator[PauseInfo]:  # no request-level generation was ever started
            yield PauseInfo(0.0, 0, False)

        return idle()

    def _fail_in_flight(self, error: BaseException) -> int:
        if self._batcher is not None:
            return self._batcher.fail_in_flight(error)
        fail = getattr(self.engine, "fail_in_flight", None)
        return fail(error) if fail is not None else 0

    @register(Dispatch.ONE_TO_ALL)
    def statistics(self) -> dict[str, Any]:
        """What this rank's request-level generation did: the request batcher's counters (rounds, tokens
        per version, requests spanning versions, pauses and their latency), the episodes returned
        (``trajectories``) and those whose model tokens span versions (``spanning_trajectories``) and,
        with partial rollout, one record per weight update (``version``, ``pause_latency_s``,
        ``in_flight``, ``interrupted``). As a group call, one dict per rank."""
        from dataclasses import asdict

        stats = self._batcher.statistics() if self._batcher is not None else None
        if stats is None:
            engine_stats = getattr(self.engine, "request_statistics", None)
            stats = engine_stats() if engine_stats is not None else None
        out: dict[str, Any] = {"version": self._version, "partial_rollout": self.config.partial_rollout,
                               "updates": [dict(u) for u in self._updates], "trajectories": self._trajectories[0],
                               "spanning_trajectories": self._trajectories[1]}
        if stats is not None:
            out.update(asdict(stats) if not isinstance(stats, dict) else stats)
        return out

    async def _engine_load(self, state: dict[str, torch.Tensor]) -> None:
        aload = getattr(self.engine, "aload_weights", None)  # engines with their own loop (vLLM)
        if aload is not None:
            await aload(state.items())
        else:
            await asyncio.to_thread(self.engine.load_weights, state.items())

    async def _engine_checksum(self) -> dict[str, str]:
        achecksum = getattr(self.engine, "aweights_checksum", None)
        if achecksum is not None:
            return await achecksum()
        return await asyncio.to_thread(self.engine.weights_checksum)

    def on_close(self) -> None:
        """Close the weight channel and the engine."""
        if self._channel is not None:
            self._channel.close()
        if self._batcher is not None:
            self._batcher._abort.set()
        self.engine.close()


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first non-group exception of `group` (an anyio task group wraps its tasks' errors)."""
    e: BaseException = group
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


def _check_vllm_memory(engine_kwargs: dict[str, Any], placement: Any) -> None:
    """A colocated vLLM engine takes ``gpu_memory_utilization`` of the whole GPU up front: refuse at
    setup when that much is not free (other roles on the GPU hold the rest)."""
    if not placement.is_cuda:
        return
    share = float(engine_kwargs.get("gpu_memory_utilization", 0.2))
    free, total = torch.cuda.mem_get_info(placement.device)
    try:
        check_gpu_memory(int(share * total), free, total, who=f"RolloutWorker (vLLM, gpu_memory_utilization={share:g})",
                         device=placement.device)
    except DeviceError as e:
        raise DeviceError(f"{e}; or lower engine_kwargs.gpu_memory_utilization") from None
