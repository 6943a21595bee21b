"""`RolloutWorker`: generates responses with a pluggable engine and takes versioned weights.

Data flow of one ``generate`` call::

    batch{prompt_ids (left-padded), prompt_mask, ...}
      -> strip padding, check prompt + max_new_tokens fits the context (never truncate)
      -> engine.stream(prompts)  (HF thread / vLLM), rows collected as each finishes
      -> batch + {response_ids, response_mask, input_ids, attention_mask, rollout_log_probs, version}

This module holds the worker's construction and batch generation (``generate``,
``stream_generate``, ``submit``/``poll``). Its settings are :class:`RolloutConfig`
(:mod:`asyncrl.roles.generation.rollout_config`, re-exported here). The rest are objects the worker holds, each
built with the values and callables it uses:

* ``self.weights``, a :class:`~asyncrl.roles.generation.rollout_weights.RolloutWeights` -- weight sync: the
  ``update_weights`` transaction (and its partial-rollout path), the receiving side of the weight transports and
  ``sleep``/``wake_up``; generation reads its version and waits at its gate;
* ``self.call_setup``, a :class:`~asyncrl.roles.generation.call_setup.CallSetup` -- what batch and request-level
  generation share: a call's prompt check, its sampling parameters, the ``replica`` field of its rows;
* ``self.requests``, a :class:`~asyncrl.roles.generation.rollout_requests.RequestGeneration` -- request-level
  generation: multi-turn episodes, ``generate_requests`` (the streaming trainer's calls), hand-overs, the round
  log and its replay, ``statistics``.

``self.weights`` and ``self.requests`` reach the engine through the same callable: the worker's ``engine``,
which ``restart_engine`` replaces (``requests.drop_batcher()`` before, ``weights.engine_replaced()`` after). Two
seams they call back stay worker methods, so subclasses can wrap them: ``_engine_load`` (every weight load) and
``_request_engine`` (the request-level engine). The worker's registered methods for weight sync and request-level
generation are declared here, each a delegation to its object.

Every row carries the version of the weights that generated all of its tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from dataclasses import replace
from typing import Any, AsyncIterator

import torch
from tensordict import TensorDict, TensorDictBase

from asyncrl import Dispatch, Execute, Worker, register

from asyncrl.roles._util import with_fields
from asyncrl.roles.modeling.device import check_gpu_memory, place_model, resolve_placement
from asyncrl.roles.engines import Completion, SamplingParams, make_engine
from asyncrl.roles.errors import DeviceError
from asyncrl.roles.generation.preemption import on_sigterm
from asyncrl.roles.modeling.models import ModelConfig, context_length, load_model, save_model_dir, set_torch_threads
from asyncrl.roles.modeling.threads import core_share_for, release_core_share
from asyncrl.roles.generation.call_setup import CallSetup
from asyncrl.roles.generation.rollout_config import RolloutConfig
from asyncrl.roles.generation.rollout_requests import RequestGeneration
from asyncrl.roles.generation.rollout_weights import Adoptable, RolloutWeights, unpack_weights
from asyncrl.roles.errors import ReplicaLostError

__all__ = ["RolloutConfig", "RolloutWorker", "unpack_weights"]


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

    Batch generation is here; request-level generation, weight sync and what the two kinds of generation share
    are the objects it holds (``self.requests``, ``self.weights``, ``self.call_setup``; module docstring).

    Args:
        model: the model to sample from (its initial weights are version 0).
        rollout: sampling and weight-sync settings.
    """

    def __init__(self, model: ModelConfig, rollout: RolloutConfig | None = None) -> None:
        self.model_config = model
        self.config = rollout or RolloutConfig()
        self.config.validate()  # the roles API's check point (a training run checked it before any worker)
        set_torch_threads(self.context.num_cpus, model.num_threads)
        self.placement = resolve_placement(model, self.context.num_gpus, trained=False, who="RolloutWorker")
        built, self.tokenizer = load_model(model)
        if self.config.engine == "hf":
            self.model = place_model(built, self.placement, trained=False, who="RolloutWorker")
        else:  # the engine (vLLM) loads its own copy onto the GPU; this one stays on the CPU
            self.model = built.to(dtype=self.placement.param_dtype)
        self.model.eval().requires_grad_(False)
        self.context_length = context_length(self.model)
        model_dir = self.config.model_dir
        if model_dir is None and self.config.engine != "hf":
            self._tmp = tempfile.TemporaryDirectory(prefix="asyncrl-rollout-")
            model_dir = save_model_dir(self.model, self.tokenizer, self._tmp.name)
        engine_kwargs = dict(self.config.engine_kwargs)
        if self.config.engine == "hf" and self.placement.autocast_dtype is not None:
            engine_kwargs.setdefault("autocast", self.placement.autocast_dtype)
        self.core_share = (core_share_for(model.num_threads, self.placement.device, self.model)
                           if self.config.engine == "hf" else None)
        if self.core_share is not None:
            engine_kwargs.setdefault("cores", self.core_share)
        if self.config.engine == "vllm":
            _check_vllm_memory(engine_kwargs, self.placement)
            if self.config.sleep_level:
                engine_kwargs.setdefault("sleep_mode", True)
        self._engine_spec = (model_dir, engine_kwargs)  # what restart_engine builds again
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
        self._jobs: set[_Job] = set()
        self._streams: dict[str, tuple[_Job, asyncio.Future[None], int, int]] = {}
        self._stream_batches: dict[str, TensorDictBase] = {}
        episode_tasks: set[asyncio.Task[Any]] = set()  # request-level calls in flight (an update waits or reaches)

        def engine() -> Any:  # how the objects reach the engine (restart_engine replaces it)
            return self.engine

        self.weights = RolloutWeights(engine=engine, model=self.model, config=self.config,
                                      device=self.placement.device, rank=self.rank, jobs=self._jobs,
                                      episode_tasks=episode_tasks, batcher=self._running_batcher,
                                      load=self._engine_load)
        self.call_setup = CallSetup(config=self.config, weights=self.weights, rank=self.rank,
                                    context_length=self.context_length)
        self.requests = RequestGeneration(call_setup=self.call_setup, engine=engine,
                                          request_engine=self._request_engine, model=self.model,
                                          tokenizer=self.tokenizer, episode_tasks=episode_tasks,
                                          colocated=self.colocated)
        on_sigterm(self.requests.on_preemption_notice)

    # ---- state --------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Version of the loaded weights (0 = initial)."""
        return self.weights.version

    @register(Dispatch.ONE_TO_ALL)
    def get_version(self) -> int:
        """Version of the loaded weights; as a group call, one int per rank."""
        return self.weights.version

    @register(Dispatch.ONE_TO_ALL)
    def weights_checksum(self) -> dict[str, str]:
        """``{name: checksum}`` of the engine's weights; as a group call, one dict per rank."""
        return self.engine.weights_checksum()

    # ---- generation ---------------------------------------------------------------------

    async def _run_job(self, job: _Job) -> None:
        """Generate every row of `job`, resubmitting unfinished rows after an abort."""
        gate = self.weights.gate()
        self._jobs.add(job)
        try:
            while job.pending:
                while not gate.is_set():
                    await gate.wait()
                idx = job.pending
                version = self.weights.version
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
        fields["replica"] = self.call_setup.replica_field(int(fields["response_ids"].shape[0]))
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
        if self.requests.episodic:
            return await self.generate_episodes(batch, max_new_tokens, temperature, seed)
        R = max_new_tokens if max_new_tokens is not None else self.config.max_new_tokens
        prompts = self.call_setup.prompts(batch, R)
        job = _Job(prompts, self.call_setup.params(prompts, max_new_tokens, temperature, seed))
        await self._run_job(job)
        return self._assemble(batch, self._rows(job, list(range(len(prompts))), R))

    async def stream_generate(self, batch: TensorDictBase, max_new_tokens: int | None = None,
                              temperature: float | None = None, seed: int | None = None) -> AsyncIterator[TensorDict]:
        """Like :meth:`generate`, but yields each row (a one-row batch with an ``index`` field,
        the row's position in `batch`) as soon as it finishes. In-process use; across
        processes use :meth:`submit` and :meth:`poll`."""
        R = max_new_tokens if max_new_tokens is not None else self.config.max_new_tokens
        prompts = self.call_setup.prompts(batch, R)
        job = _Job(prompts, self.call_setup.params(prompts, max_new_tokens, temperature, seed))
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
        prompts = self.call_setup.prompts(batch, R)
        job = _Job(prompts, self.call_setup.params(prompts, max_new_tokens, None, None))
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

    # ---- weight sync: the registered face of self.weights (roles/generation/rollout_weights.py) ----

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
        (docs/partial_rollout.md). See ``RolloutWeights.update``.
        """
        return await self.weights.update(weights, version, expected_checksums=expected_checksums)

    @register(Dispatch.ONE_TO_ALL)
    async def sleep(self, level: int | None = None) -> dict[str, Any]:
        """Release the engine's weights and KV cache until :meth:`wake_up` (`level` defaults to
        ``RolloutConfig.sleep_level``; 0 does nothing). In-flight generation finishes first."""
        return await self.weights.sleep(level)

    @register(Dispatch.ONE_TO_ALL)
    async def wake_up(self) -> dict[str, Any]:
        """Re-acquire what :meth:`sleep` released. Returns ``{"needs_weights", "version"}``: after a
        level-2 sleep the weights must be synced again (the same version is accepted) before generating."""
        return await self.weights.wake_up()

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{name: (shape, dtype)}`` of the weights this rollout holds (what a sync must bring)."""
        return self.weights.spec()

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def tied_weights(self) -> dict[str, str]:
        """``{name: the earlier name whose tensor it is}`` (tied weights: SmolLM2's ``lm_head.weight`` is its
        ``model.embed_tokens.weight``); a weight channel sends such a tensor once."""
        return self.weights.tied()

    @register(Dispatch.ONE_TO_ALL)
    def channel_member(self) -> dict[str, Any]:
        """This rank's process and device, for choosing a weight channel's backend."""
        return self.weights.member()

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def join_weight_channel(self, name: str, host: str, port: int, world_size: int, backend: str,
                                  timeout_s: float = 120.0, bucket_bytes: int = 256 << 20) -> dict[str, Any]:
        """Join weight channel `name` as channel rank ``1 + rank`` (policy rank 0 sends)."""
        return await self.weights.join_channel(name, host, port, world_size, backend, timeout_s, bucket_bytes)

    async def _engine_load(self, state: dict[str, torch.Tensor]) -> None:
        """Load `state` into the engine (what ``self.weights`` calls for every load; subclasses that inject
        faults wrap it): an engine with its own loop loads it there (vLLM), the HF engine adopts an
        :class:`~asyncrl.roles.generation.rollout_weights.Adoptable` state as its parameters (no copy), and
        copies anything else."""
        aload = getattr(self.engine, "aload_weights", None)  # engines with their own loop (vLLM)
        adopt = getattr(self.engine, "adopt_weights", None)  # the HF engine: no copy (docs/performance.md)
        if aload is not None:
            await aload(state.items())
        elif adopt is not None and isinstance(state, Adoptable):
            await asyncio.to_thread(adopt, state.items())
        else:
            await asyncio.to_thread(self.engine.load_weights, state.items())

    def _running_batcher(self) -> Any:
        """The request batcher now running, or None (``RequestGeneration.running_batcher``; what
        ``self.weights`` pauses for a partial-rollout load)."""
        return self.requests.running_batcher()

    # ---- request-level generation: the registered face of self.requests (rollout_requests.py) ----

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate_episodes(self, batch: TensorDictBase, max_new_tokens: int | None = None,
                                temperature: float | None = None, seed: int | None = None, *,
                                episode: str | None = None, episode_kwargs: dict[str, Any] | None = None,
                                max_in_flight: int | None = None) -> TensorDict:
        """One episode per row (``RolloutConfig.episode`` or ``agent``, or `episode` for this call), all in
        flight at once, in the layout of :meth:`generate` plus the episode fields
        (``RequestGeneration.generate_episodes``)."""
        return await self.requests.generate_episodes(batch, max_new_tokens, temperature, seed, episode=episode,
                                                     episode_kwargs=episode_kwargs, max_in_flight=max_in_flight)

    @register(Dispatch.DP_COMPUTE, concurrent=True, summary=("scores", "response_length"))
    async def generate_requests(self, batch: TensorDictBase, max_new_tokens: int | None = None,
                                temperature: float | None = None, seed: int | None = None,
                                resume: dict[str, dict[str, Any]] | None = None,
                                compute_reward: bool = False) -> TensorDict:
        """Every row through the request-level engine, so many concurrent calls (streaming rollout: one per
        prompt group) share its decoding rounds; `resume` continues rows another replica handed over, and
        `compute_reward` scores the rows with the colocated reward worker (``RequestGeneration.generate_requests``
        says the layout, the seeds and the hand-over)."""
        return await self.requests.generate_requests(batch, max_new_tokens, temperature, seed, resume, compute_reward)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def hand_over(self, seeds: list[int]) -> dict[int, dict[str, Any]]:
        """Hand the running ``generate_requests`` calls of `seeds` over (a resize past its drain deadline);
        returns what their rows decoded, ``{seed: {request key: row}}`` (``RequestGeneration.hand_over``). As a
        group call, one dict per rank."""
        return await self.requests.hand_over(seeds)

    @register(Dispatch.ONE_TO_ALL)
    def round_log(self, clear: bool = False) -> list[dict[str, Any]]:
        """The request batcher's recorded rounds so far (``RolloutConfig.record_rounds``), as JSON-able dicts
        (``RequestGeneration.round_log``); `clear` forgets what was returned. As a group call, one list per rank."""
        return self.requests.round_log(clear)

    @register(Dispatch.ONE_TO_ALL)
    def replay_rounds(self, rounds: list[dict[str, Any]], hold_unknown: bool = False) -> int:
        """Replay `rounds` (a recorded :meth:`round_log`) bit for bit; call before any request-level generation
        (``RequestGeneration.replay_rounds``). Returns the rounds."""
        return self.requests.replay_rounds(rounds, hold_unknown)

    @register(Dispatch.ALL_TO_ALL)
    def replay_rank_rounds(self, rounds: list[dict[str, Any]], hold_unknown: bool = False) -> int:
        """:meth:`replay_rounds` with each rank's own recorded rounds (a group call takes one list per rank,
        as :meth:`round_log` returned them, and `hold_unknown` once per rank)."""
        return self.requests.replay_rank_rounds(rounds, hold_unknown)

    @register(Dispatch.ONE_TO_ALL)
    def statistics(self) -> dict[str, Any]:
        """What this rank's request-level generation did (``RequestGeneration.statistics``). As a group call, one
        dict per rank."""
        return self.requests.statistics()

    def _request_engine(self) -> Any:
        """``submit(prompt_ids, params, key=None) -> Generation`` of request-level generation
        (``RequestGeneration.request_engine``; the seam test subclasses wrap)."""
        return self.requests.request_engine()

    @register(Dispatch.ONE_TO_ALL)
    def restart_engine(self) -> int:
        """Replace this replica's engine by a new one (its previous engine died: a ``ReplicaLostError``): the
        requests still in it fail, the new engine holds the initial weights (version 0) until the next
        ``update_weights``. The process and its other state (tokenizer, weight channel) stay. Returns the rank."""
        old = self.engine
        fail = getattr(old, "fail_in_flight", None)
        if fail is not None:
            fail(ReplicaLostError(f"rollout replica {self.rank}'s engine was replaced"))
        self.requests.drop_batcher()
        with contextlib.suppress(Exception):
            old.close()
        model_dir, engine_kwargs = self._engine_spec
        self.engine = make_engine(self.config.engine, model=self.model, tokenizer=self.tokenizer,
                                  model_dir=model_dir, **engine_kwargs)
        self.weights.engine_replaced()
        return self.rank

    def on_close(self) -> None:
        """Close the weight channel, request-level generation and the engine."""
        self.weights.close()
        self.requests.close()
        self.engine.close()
        release_core_share(self)


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
