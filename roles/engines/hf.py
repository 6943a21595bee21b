"""The in-process Hugging Face engine: a KV-cached sampling loop run in a thread.

Generation runs in a worker thread so the worker's event loop stays free (other
calls, weight-sync control, streaming). Cancelling the awaiting task stops the loop
at its next token step (cooperative abort) before the task finishes cancelling.

The loop runs on the model's device (a GPU when the rollout worker placed it there), in
batches of ``max_batch_size`` prompts, with one device-to-host copy per token step. Each
prompt samples from its own generator (seed + prompt index) on that device, so a call is
reproducible whatever the batching. ``sleep``/``wake_up`` release the GPU memory of the
weights between rollouts (see :meth:`HFEngine.sleep`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from typing import Any, AsyncIterator, Callable, Iterable

import torch

from asyncrl.roles.modeling.models import StateSlots, position_ids_from_mask, state_dict_checksums
from asyncrl.roles.engines.base import Completion, SamplingParams, register_engine
from asyncrl.roles._util import response_log_probs
from asyncrl.roles.errors import WeightSyncError

__all__ = ["HFEngine"]


class _Aborted(Exception):
    pass


@register_engine("hf")
class HFEngine:
    """Samples from an in-process ``transformers`` causal LM.

    Args:
        model: the causal LM (the engine samples from it in place; ``load_weights`` writes into it,
            ``adopt_weights`` swaps its parameters' storage).
        tokenizer: supplies the EOS and pad ids.
        model_dir: unused (the vLLM engine loads from it).
        max_batch_size: prompts per forward batch.
        seed: seed of the engine's generator, used when ``SamplingParams.seed`` is None.
        autocast: run the forward under ``torch.autocast`` in this dtype (None: the weights' dtype).
        exact_log_probs: after sampling a batch, recompute its log-probs with one full forward pass
            over prompt + response -- the computation the policy's ``compute_log_prob`` does -- instead
            of keeping the KV-cached decode's. The two differ by fp32 rounding that grows with depth
            (measured on the 30-layer SmolLM2-135M: max 1.5e-5, mean 3e-6; on the 2-layer tiny model
            below 1e-6). Costs one extra forward pass per batch; rows are emitted when their batch is
            done. Not with top-k/top-p filtering (the recomputation has no filter).
        cores: the worker's :class:`~asyncrl.roles.modeling.threads.CoreShare` (``ModelConfig.num_threads="follow"``):
            marked busy while a generation call decodes. None: threads are not shared.
    """

    partial_rollout_modes = ("keep", "recompute")
    """Partial rollout is done by the request-level :class:`~.batcher.RequestBatcher` over this engine."""

    def __init__(self, *, model: torch.nn.Module, tokenizer: Any, model_dir: str | None = None,
                 max_batch_size: int = 64, seed: int = 0, autocast: torch.dtype | None = None,
                 exact_log_probs: bool = False, cores: Any = None) -> None:
        self.model = model.eval()
        self.cores = cores
        self.exact_log_probs = exact_log_probs
        self.autocast = autocast
        self.sleep_level = 0  # 0 awake; 1 weights on the CPU; 2 weights discarded
        self.needs_weights = False  # woken from level 2: the next load_weights restores them
        self._home: torch.device | None = None
        self._param_specs: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._adopted: dict[str, torch.Tensor] | None = None  # what the parameters are (adopt_weights)
        self._slots = StateSlots(self.model)  # {state_dict name: the parameter or buffer}, built once
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)
        self.max_batch_size = max_batch_size
        self._rng = torch.Generator().manual_seed(seed)
        self._rng_lock = threading.Lock()
        self._weights_lock = threading.Lock()  # a forward step never sees half-loaded weights
        self._closed = False
        # transformers >= 5.2x renamed past_key_values to cache
        params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # the LM head on the last position only (as generate() does): the prompt's other positions'
        # logits are never read, and over a 49k vocabulary they cost a third of a batch-64 prefill
        self._keep_last = {k: 1 for k in ("logits_to_keep", "num_logits_to_keep") if k in params}
        self._keep_last = dict(list(self._keep_last.items())[:1])  # the newer name where a model has both

    # ---- public interface --------------------------------------------------------------

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions of every prompt, in prompt order."""
        out: list[Completion | None] = [None] * len(prompts)
        async for i, c in self.stream(prompts, params):
            out[i] = c
        return out  # type: ignore[return-value]

    async def stream(self, prompts: list[list[int]], params: SamplingParams) -> AsyncIterator[tuple[int, Completion]]:
        """``(prompt index, completion)`` as each finishes; cancelling stops the sampling thread."""
        self._check(prompts, params)
        if not prompts:
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Completion]] = asyncio.Queue()
        abort = threading.Event()
        seed = params.seed if params.seed is not None else self._next_seed()

        def emit(i: int, c: Completion) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (i, c))

        worker = asyncio.ensure_future(asyncio.to_thread(self._run, prompts, params, seed, emit, abort))
        try:
            for _ in range(len(prompts)):
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, worker}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    worker.result()  # the thread failed: raise its error
                    getter = asyncio.ensure_future(queue.get())  # finished normally: items are queued
                yield await getter
            await worker
        finally:
            if not worker.done():
                abort.set()
                try:
                    await asyncio.shield(worker)
                except BaseException:
                    pass

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the named tensors into the model (every parameter and buffer name must match;
        floating tensors are cast to the model's dtype, and moved to its device). A load that fails
        part-way leaves :attr:`needs_weights` set: generation is refused until a load succeeds.

        While the engine holds adopted tensors (:meth:`adopt_weights`) it never writes into them: the
        load then copies into fresh memory and swaps, as an adoption does."""
        state = dict(named_tensors)
        if self.sleep_level == 2:
            raise RuntimeError("the HF engine is asleep at level 2 (weights discarded); call wake_up() before loading")
        if self._adopted is not None:  # the model's memory may be read-only shared memory: swap, never copy_
            copies = {k: t.detach().to(device=self.device, dtype=t.dtype, copy=True) for k, t in state.items()}
            self.adopt_weights(copies.items())
            self._adopted = None  # the copies are the engine's own: a later in-place load may write into them
            return
        with self._weights_lock, torch.no_grad():
            try:
                missing, unexpected = self.model.load_state_dict(state, strict=False)
            except BaseException:
                self.needs_weights = True  # some tensors were copied, some not: refuse to generate on them
                raise
            own = set(self.model.state_dict())
            missing = [k for k in missing if k in own and k not in state]
            if unexpected or missing:
                self.needs_weights = True  # the matching names were loaded before the check
                raise WeightSyncError(
                    f"weights do not match the engine's model: unexpected {sorted(unexpected)[:5]}, "
                    f"missing {sorted(missing)[:5]}; export the full state_dict of the same architecture"
                )
            self.needs_weights = False

    def adopt_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Make the named tensors the model's parameters and buffers, without copying them.

        Every name of the model's ``state_dict`` must be given, with its shape; a floating tensor of
        another dtype is cast, and a tensor on another device moved (that is then the one copy).
        Everything is checked and cast first; then, under the weights lock, every parameter's storage
        is swapped for the given tensor's at once, so a forward step sees the old weights or the new,
        and a refused load leaves the old weights whole. Tied parameters (one parameter under two
        names, e.g. ``lm_head`` and ``embed_tokens``) stay tied: the first name's tensor is adopted.

        The engine keeps the tensors (:attr:`adopted`) until the next adoption, load or level-2 sleep,
        and from then on never writes into them (they may be read-only views of Ray's object store,
        a colocated policy's snapshot, or a weight channel's receive buffers): a later load swaps
        storage again. Whoever hands them over must not write into them while :attr:`adopted` holds
        them (the snapshot pool and the channel's receive buffers check it)."""
        state = dict(named_tensors)
        if self.sleep_level == 2:
            raise RuntimeError("the HF engine is asleep at level 2 (weights discarded); call wake_up() before loading")
        slots = self._slots()
        unknown = sorted(set(state) - set(slots))
        missing = sorted(set(slots) - set(state))
        if unknown or missing:
            raise WeightSyncError(
                f"weights do not match the engine's model: unexpected {unknown[:5]}, missing {missing[:5]}; "
                "export the full state_dict of the same architecture"
            )
        device = self.device
        new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(slot) -> (slot, tensor it adopts)
        adopted: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in state.items():
                slot = slots[name]
                if id(slot) not in new:  # a tied parameter: its first name's tensor
                    if not isinstance(t, torch.Tensor) or t.shape != slot.shape:
                        got = f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                        raise WeightSyncError(f"weight {name!r}: expected shape {tuple(slot.shape)}, got {got}")
                    if t.dtype != slot.dtype and not (t.is_floating_point() and slot.is_floating_point()):
                        raise WeightSyncError(f"weight {name!r}: expected {slot.dtype}, got {t.dtype}")
                    if t.dtype != slot.dtype or t.device != device:
                        t = t.detach().to(device=device, dtype=slot.dtype)  # the one copy
                    new[id(slot)] = (slot, t)
                adopted[name] = new[id(slot)][1]  # the very objects handed over: their holders count references
        with self._weights_lock:
            for slot, t in new.values():
                slot.data = t
            self._adopted = adopted
            self.needs_weights = False

    @property
    def adopted(self) -> dict[str, torch.Tensor] | None:
        """The tensors the model's parameters are (:meth:`adopt_weights`), or None when it owns its memory."""
        return self._adopted

    def weights_checksum(self) -> dict[str, str]:
        """``{name: checksum}`` of the model's state dict."""
        with self._weights_lock:
            return state_dict_checksums(self.model.state_dict().items())

    def close(self) -> None:
        """Nothing to release (the model belongs to the caller)."""
        self._closed = True

    @property
    def device(self) -> torch.device:
        """Where the weights are (the CPU while asleep at level 1)."""
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def sleep(self, level: int = 1) -> None:
        """Release the GPU memory of the weights until :meth:`wake_up` (verl's / vLLM's sleep levels).

        Level 1 moves the weights to the CPU (restored by ``wake_up``); level 2 discards them
        (``wake_up`` reallocates, and the next ``load_weights`` must restore them before
        generating). The KV cache is per call here, so nothing else is held; on a GPU the
        allocator's cached blocks are returned to the driver for other processes. On the CPU
        level 1 keeps the weights where they are. Generating while asleep raises.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard weights), got {level}")
        with self._weights_lock:
            if self.sleep_level:
                return
            self._home = self.device
            self._param_specs = {n: (p.shape, p.dtype) for n, p in self.model.named_parameters()}
            with torch.no_grad():
                for p in self.model.parameters():
                    if level == 1:
                        if self._home.type != "cpu":
                            p.data = p.data.to("cpu")
                    else:
                        p.data = torch.empty(0, dtype=p.dtype, device=self._home)
            if level == 2 or self._home.type != "cpu":
                self._adopted = None  # no longer the parameters: release them (their pin, their buffer set)
            self.sleep_level = level
        _empty_cache(self._home)

    def wake_up(self) -> None:
        """Undo :meth:`sleep`: weights back on their device (level 1) or reallocated, awaiting a
        ``load_weights`` (level 2: :attr:`needs_weights` is then True)."""
        with self._weights_lock:
            if not self.sleep_level:
                return
            home = self._home or torch.device("cpu")
            with torch.no_grad():
                params = dict(self.model.named_parameters())
                for n, p in params.items():
                    if self.sleep_level == 1:
                        if home.type != "cpu":
                            p.data = p.data.to(home)
                    else:
                        shape, dtype = self._param_specs[n]
                        p.data = torch.empty(shape, dtype=dtype, device=home)
            self.needs_weights = self.sleep_level == 2
            self.sleep_level = 0

    # ---- sampling ----------------------------------------------------------------------

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if self._closed:
            raise RuntimeError("the HF engine is closed")
        if self.sleep_level:
            raise RuntimeError(f"the HF engine is asleep (level {self.sleep_level}); call wake_up() before generating")
        if self.needs_weights:
            raise RuntimeError("the HF engine holds no usable weights (discarded by sleep(level=2), or a load that "
                               "failed part-way); load weights before generating")
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {params.temperature}, {params.top_p}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if self.exact_log_probs and params.temperature > 0 and (0 < params.top_k or params.top_p < 1.0):
            raise ValueError("exact_log_probs recomputes unfiltered log-probs; it cannot be used with top-k/top-p "
                             "sampling (set top_k=-1 and top_p=1.0, or exact_log_probs=False)")

    def _next_seed(self) -> int:
        with self._rng_lock:
            return int(torch.randint(0, 2**31 - 1, (1,), generator=self._rng))

    def _run(self, prompts: list[list[int]], params: SamplingParams, seed: int,
             emit: Callable[[int, Completion], None], abort: threading.Event) -> None:
        with self.busy():
            for start in range(0, len(prompts), self.max_batch_size):
                idx = list(range(start, min(start + self.max_batch_size, len(prompts))))
                self._run_batch(idx, [prompts[i] for i in idx], params, seed, emit, abort)

    def busy(self) -> Any:
        """A context that marks this engine's worker busy while a decode runs (no-op without `cores`)."""
        return self.cores.busy() if self.cores is not None else contextlib.nullcontext()

    @torch.no_grad()
    def _run_batch(self, idx: list[int], prompts: list[list[int]], params: SamplingParams, seed: int,
                   emit: Callable[[int, Completion], None], abort: threading.Event) -> None:
        B = len(prompts)
        dev = self.device
        ids, mask = left_pad(prompts, self.pad_id, dev)
        P = ids.shape[1]
        pos = position_ids_from_mask(mask)
        gens = [torch.Generator(device=dev).manual_seed(seed + i) for i in idx]
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        done = [False] * B
        finished: list[tuple[int, str]] = []

        def finish(b: int, reason: str) -> None:
            if self.exact_log_probs:
                finished.append((b, reason))  # emitted after the batch's recomputation
            else:
                emit(idx[b], Completion(tokens[b], logps[b], reason))

        past = None
        step_ids, step_pos = ids, pos
        for _ in range(params.max_new_tokens):
            if abort.is_set():
                raise _Aborted()
            with self._weights_lock, _autocast(dev, self.autocast):
                out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                 use_cache=True, **{self._cache_kw: past}, **self._keep_last)
            past = getattr(out, "cache", None) if self._cache_kw == "cache" else out.past_key_values
            logits = out.logits[:, -1, :].float()
            nxt = self._sample(logits, params, gens, done).tolist()  # one device-to-host copy per step
            for b in range(B):
                if done[b]:
                    continue
                tokens[b].append(int(nxt[b][0]))
                logps[b].append(nxt[b][1])
                if tokens[b][-1] == self.eos_id:
                    done[b] = True
                    finish(b, "stop")
            if all(done):
                break
            tok = torch.tensor([t[-1] if t else self.pad_id for t in tokens], dtype=torch.long)[:, None]
            step_ids = tok.to(dev)
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long, device=dev)], dim=1)
        for b in range(B):
            if not done[b]:
                finish(b, "length")
        if finished:
            self._recompute_log_probs(ids, mask[:, :P], tokens, logps, params)
            for b, reason in finished:
                emit(idx[b], Completion(tokens[b], logps[b], reason))

    def _recompute_log_probs(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokens: list[list[int]],
                             logps: list[list[float]], params: SamplingParams) -> None:
        """Replace `logps` by the log-probs of one full forward pass (``exact_log_probs``)."""
        B, L = len(tokens), max(len(t) for t in tokens)
        resp = torch.full((B, L), self.pad_id, dtype=torch.long)
        rmask = torch.zeros((B, L), dtype=torch.long)
        for b, t in enumerate(tokens):
            resp[b, :len(t)] = torch.tensor(t, dtype=torch.long)
            rmask[b, :len(t)] = 1
        resp, rmask = resp.to(prompt_ids.device), rmask.to(prompt_ids.device)
        temperature = params.temperature if params.temperature > 0 else 1.0
        with self._weights_lock, _autocast(prompt_ids.device, self.autocast):
            lp, _ = response_log_probs(self.model, torch.cat([prompt_ids, resp], 1), torch.cat([prompt_mask, rmask], 1),
                                       resp, temperature, with_entropy=False)
        for b, t in enumerate(tokens):
            logps[b] = lp[b, :len(t)].double().tolist()

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams, gens: list[torch.Generator],
                done: list[bool]) -> torch.Tensor:
        """``[B, 2]`` on the CPU (float64): sampled token and its log-prob under the distribution it
        was sampled from, ``log_softmax`` of the tempered logits after top-k/top-p filtering (the
        behaviour policy that off-policy correction divides by; as vLLM's ``processed_logprobs``).
        float32 math on the logits' device, one copy to the host; rows that are done get 0, 0."""
        t = params.temperature
        scaled = logits / t if t > 0 else logits
        filt = scaled.clone()
        if t > 0 and params.top_k > 0 and params.top_k < filt.shape[-1]:
            kth = torch.topk(filt, params.top_k, dim=-1).values[:, -1:]
            filt[filt < kth] = float("-inf")
        if t > 0 and params.top_p < 1.0:
            sorted_l, order = torch.sort(filt, dim=-1, descending=True)
            cum = torch.softmax(sorted_l, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_l, dim=-1) > params.top_p  # keep the token that crosses top_p
            sorted_l[drop] = float("-inf")
            filt = torch.full_like(filt, float("-inf")).scatter(-1, order, sorted_l)
        logp = torch.log_softmax(filt, dim=-1)  # == log_softmax(scaled) when nothing is filtered
        B = logits.shape[0]
        if t == 0:
            toks = torch.argmax(logits, dim=-1)
        else:
            probs = logp.exp()
            zero = torch.zeros((1,), dtype=torch.long, device=logits.device)
            toks = torch.cat([zero if done[b] else torch.multinomial(probs[b], 1, generator=gens[b])
                              for b in range(B)])
        lp = logp.gather(-1, toks[:, None]).squeeze(-1)
        out = torch.stack([toks.to(torch.float64), lp.to(torch.float64)], dim=1).cpu()
        out[torch.tensor(done, dtype=torch.bool)] = 0.0
        return out


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one left-padded ``[B, P]`` batch of ids and its attention mask, on `device`."""
    P = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for b, x in enumerate(seqs):
        ids[b, P - len(x):] = torch.tensor(x, dtype=torch.long)
        mask[b, P - len(x):] = 1
    return ids.to(device), mask.to(device)


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    import contextlib

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _empty_cache(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
