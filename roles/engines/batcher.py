"""The request-level HF engine: many independent ``generate`` requests batched per decoding round.

``HFEngine.generate`` batches the rows of one call. Multi-turn episodes instead issue one
request each, from many coroutines, at unrelated times. :class:`RequestBatcher` keeps the set
of requests in flight and runs *decoding rounds* over whichever are pending::

    submit(prompt, params) ─► pending ─┐
                                       ├─► round: prefill (prompt + tokens so far) of every active
    submit(...) (joins next round) ────┘          request, then up to ``chunk_tokens`` KV-cached steps
                                                  ─► finished requests resolve; the rest stay active
                                       ◄── between rounds: ``paused()`` (swap weights), new requests join

Each token records its behaviour log-prob (as :class:`~.base.Completion`) and the weight
version the round ran with (``version_fn()`` read at the round's start). A weight update
taken at the round boundary (``async with batcher.paused(): engine.load_weights(...)``)
therefore reaches requests in flight: their next round prefills prompt + tokens so far under
the new weights and decodes on (the streaming issue's ``recompute``; ``keep`` is the same
boundary with the cache kept, which the HF engine does not do). The batcher runs a round in a
worker thread, so the event loop stays free.

Each request samples from its own generator (``params.seed``), so its tokens do not depend on
which other requests share its rounds (up to float rounding of different batch shapes). The
log-probs are the rounds' own (prefill, then KV-cached decode); the HF engine's
``exact_log_probs`` recomputation is not applied to requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch

from ..models import position_ids_from_mask
from .base import Completion, SamplingParams
from .hf import HFEngine, _autocast, left_pad

__all__ = ["Generation", "RequestBatcher", "BatcherStats"]


@dataclass
class Generation(Completion):
    """One request's completion, with the weight version of every token."""

    versions: list[int] = field(default_factory=list)
    """Weight version that produced each generated token (same length as ``response_ids``)."""


@dataclass
class BatcherStats:
    """What the batcher did so far (observable backpressure, STYLE 11)."""

    rounds: int = 0
    """Decoding rounds run."""
    requests: int = 0
    """Requests finished."""
    tokens: int = 0
    """Tokens generated."""
    peak_active: int = 0
    """Most requests in one round."""
    pending: int = 0
    """Requests waiting now (in flight, not yet finished)."""


class _Request:
    __slots__ = ("prompt", "params", "gen", "tokens", "log_probs", "versions", "future", "finish")

    def __init__(self, prompt: list[int], params: SamplingParams, gen: torch.Generator,
                 future: asyncio.Future[Generation]) -> None:
        self.prompt = prompt
        self.params = params
        self.gen = gen
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[int] = []
        self.future = future
        self.finish: str | None = None


class RequestBatcher:
    """Batches the pending requests of many coroutines into decoding rounds on one :class:`HFEngine`.

    Args:
        engine: the HF engine whose model, sampler, weight lock and sleep state are used.
        max_batch_size: most requests in one round (the rest wait for the next).
        chunk_tokens: most tokens a request decodes per round; the round boundary after them is
            where new requests join and weights may change.
        version_fn: the current weight version (read at each round's start; 0 when None).
    """

    def __init__(self, engine: HFEngine, *, max_batch_size: int = 64, chunk_tokens: int = 32,
                 version_fn: Callable[[], int] | None = None) -> None:
        if max_batch_size < 1 or chunk_tokens < 1:
            raise ValueError(f"need max_batch_size >= 1 and chunk_tokens >= 1, got {max_batch_size}, {chunk_tokens}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.chunk_tokens = chunk_tokens
        self.version_fn = version_fn or (lambda: 0)
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []
        self._wakeup: asyncio.Event | None = None
        self._round_lock: asyncio.Lock | None = None
        self._driver: asyncio.Task[None] | None = None
        self._abort = threading.Event()
        self._stats = BatcherStats()

    # ---- public ----------------------------------------------------------------------------

    async def generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        """The completion of one prompt, decoded in the rounds it shares with other requests.
        Cancelling drops the request at the next round boundary."""
        self.engine._check([prompt], params)
        seed = params.seed if params.seed is not None else self.engine._next_seed()
        loop = asyncio.get_running_loop()
        self._ensure_driver(loop)
        gen = torch.Generator(device=self.engine.device).manual_seed(seed)
        req = _Request(list(prompt), params, gen, loop.create_future())
        self._waiting.append(req)
        assert self._wakeup is not None
        self._wakeup.set()
        return await req.future

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Hold the batcher at a round boundary: waits for the running round to end; no round starts
        until the block exits (load weights inside; requests in flight continue afterwards)."""
        lock = self._lock()
        async with lock:
            yield

    def statistics(self) -> BatcherStats:
        """Counters of rounds, requests and tokens, the peak round size and the requests in flight."""
        s = self._stats
        return BatcherStats(s.rounds, s.requests, s.tokens, s.peak_active, len(self._waiting) + len(self._active))

    async def aclose(self) -> None:
        """Stop the driver; requests in flight are cancelled."""
        self._abort.set()
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(BaseException):
                await self._driver
        for r in self._waiting + self._active:
            if not r.future.done():
                r.future.cancel()
        self._waiting.clear()
        self._active.clear()

    # ---- the driver ------------------------------------------------------------------------

    def _lock(self) -> asyncio.Lock:
        if self._round_lock is None:
            self._round_lock = asyncio.Lock()
        return self._round_lock

    def _ensure_driver(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive(), name="asyncrl-request-batcher")

    async def _drive(self) -> None:
        assert self._wakeup is not None
        lock = self._lock()
        while True:
            self._active = [r for r in self._active if not r.future.done()]
            room = self.max_batch_size - len(self._active)
            self._waiting = [r for r in self._waiting if not r.future.done()]
            if room > 0 and self._waiting:
                self._active += self._waiting[:room]
                del self._waiting[:room]
            if not self._active:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with lock:  # paused() holds this between rounds
                batch = [r for r in self._active if not r.future.done()]
                if not batch:
                    continue
                version = int(self.version_fn())
                try:
                    await asyncio.to_thread(self._round, batch, version)
                except Exception as e:  # the round failed: every request in it gets the error
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(e)
                    self._active = [r for r in self._active if r not in batch]
                    continue
            self._stats.rounds += 1
            self._stats.peak_active = max(self._stats.peak_active, len(batch))
            for r in batch:
                if r.finish is not None and not r.future.done():
                    self._stats.requests += 1
                    self._stats.tokens += len(r.tokens)
                    r.future.set_result(Generation(r.tokens, r.log_probs, r.finish, versions=r.versions))

    @torch.no_grad()
    def _round(self, batch: list[_Request], version: int) -> None:
        """Prefill prompt + tokens so far of every request, then decode up to ``chunk_tokens`` each."""
        eng = self.engine
        eng._check([r.prompt for r in batch], batch[0].params)
        B = len(batch)
        seqs = [r.prompt + r.tokens for r in batch]
        dev = eng.device
        ids, mask = left_pad(seqs, eng.pad_id, dev)
        pos = position_ids_from_mask(mask)
        budget = [min(self.chunk_tokens, r.params.max_new_tokens - len(r.tokens)) for r in batch]
        done = [n <= 0 for n in budget]
        for b, r in enumerate(batch):
            if done[b]:
                r.finish = "length"
        past = None
        step_ids, step_pos = ids, pos
        for step in range(max(budget)):
            if self._abort.is_set():
                return
            with eng._weights_lock, _autocast(dev, eng.autocast):
                out = eng.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                                use_cache=True, **{eng._cache_kw: past})
            past = getattr(out, "cache", None) if eng._cache_kw == "cache" else out.past_key_values
            logits = out.logits[:, -1, :].float()
            nxt = self._sample(logits, batch, done)
            for b, r in enumerate(batch):
                if done[b]:
                    continue
                tok = int(nxt[b][0])
                r.tokens.append(tok)
                r.log_probs.append(float(nxt[b][1]))
                r.versions.append(version)
                if tok == eng.eos_id:
                    done[b], r.finish = True, "stop"
                elif len(r.tokens) >= r.params.max_new_tokens:
                    done[b], r.finish = True, "length"
                elif step + 1 >= budget[b]:
                    done[b] = True  # this round's chunk is used up; the request continues next round
            if all(done):
                break
            tok_col = torch.tensor([r.tokens[-1] if r.tokens else eng.pad_id for r in batch], dtype=torch.long)
            step_ids = tok_col[:, None].to(dev)
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long, device=dev)], dim=1)

    def _sample(self, logits: torch.Tensor, batch: list[_Request], done: list[bool]) -> torch.Tensor:
        """``[B, 2]`` (token, log-prob) rows; requests with different sampling params are sampled in
        groups of equal params (the HF engine's sampler takes one ``SamplingParams``)."""
        out = torch.zeros((len(batch), 2), dtype=torch.float64)
        groups: dict[tuple[float, float, int], list[int]] = {}
        for b, r in enumerate(batch):
            p = r.params
            groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(b)
        for rows in groups.values():
            sel = torch.tensor(rows, device=logits.device)
            out[torch.tensor(rows)] = HFEngine._sample(logits.index_select(0, sel), batch[rows[0]].params,
                                                        [batch[b].gen for b in rows], [done[b] for b in rows])
        return out


def request_batcher(engine: Any, **kwargs: Any) -> RequestBatcher | None:
    """A :class:`RequestBatcher` over `engine` when it is an :class:`HFEngine`, else None (engines with
    their own request scheduling -- vLLM's async engine -- take one-prompt calls directly)."""
    return RequestBatcher(engine, **kwargs) if isinstance(engine, HFEngine) else None
