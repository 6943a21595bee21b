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
version that produced it. A weight update is taken under ``async with batcher.paused():
engine.load_weights(...)``; what it does to the requests in flight is the batcher's
``partial_rollout`` mode (docs/partial_rollout.md):

- ``"off"``: the pause waits for the running round to end (up to ``chunk_tokens`` steps); the
  next round prefills prompt + tokens so far under the new weights.
- ``"recompute"``: the pause interrupts the running round after its current decode step; the next
  round prefills prompt + tokens so far under the new weights and decodes on.
- ``"keep"``: the pause parks the running round after its current decode step, with its KV cache;
  after the swap the same round decodes on, on the cache the old weights computed.

The version is read (``version_fn()``) each time a round starts or resumes after a pause, which
are the only points where the weights can have changed; every token carries it. The batcher runs
rounds in a worker thread, so the event loop stays free.

Each request samples from its own generator (``params.seed``), so its tokens do not depend on
which other requests share its rounds (up to float rounding of different batch shapes). The
log-probs are the rounds' own (prefill, then KV-cached decode); the HF engine's
``exact_log_probs`` recomputation is not applied to requests.

Hand-over (a replica removed or told to stop, docs/nodes.md): :meth:`RequestBatcher.hand_over` stops the
named requests at the next decode-step boundary and returns what each decoded (:class:`Generation` with
``finish_reason=""``: its token ids, behaviour log-probs and versions); ``generate(..., prefix=...)`` on
another batcher continues such a request from its prefix: the next round prefills prompt + prefix (as
``recompute`` does after an update) and samples from a generator seeded by :func:`continuation_seed`
(row seed, prefix length), so a continuation is a function of the prefix. An empty prefix is the fresh
request; a prefix at ``max_new_tokens`` (or finished) is returned as it is, without a round.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Literal, get_args

import torch

from asyncrl.roles.errors import HandedOverError, PauseDeadlineError
from asyncrl.roles.modeling.models import position_ids_from_mask
from asyncrl.roles.engines.base import Completion, SamplingParams, fail_requests
from asyncrl.roles.engines.hf import HFEngine, _autocast, left_pad

__all__ = ["Generation", "RequestBatcher", "BatcherStats", "PauseInfo", "PartialRollout", "PARTIAL_ROLLOUT_MODES",
           "RoundRecord", "continuation_seed"]

PartialRollout = Literal["off", "keep", "recompute"]
PARTIAL_ROLLOUT_MODES: tuple[str, ...] = get_args(PartialRollout)


@dataclass
class Generation(Completion):
    """One request's completion, with the weight version of every token."""

    versions: list[int] = field(default_factory=list)
    """Weight version that produced each generated token (same length as ``response_ids``)."""


def continuation_seed(seed: int, decoded: int) -> int:
    """The sampling seed of a request continued after `decoded` tokens (a hand-over): `seed` itself for an
    empty prefix (the fresh request), else a digest of both, so the continuation is a function of the row's
    seed and its prefix, on any device."""
    if decoded <= 0:
        return int(seed)
    return int.from_bytes(hashlib.sha256(f"{int(seed)}|{int(decoded)}".encode()).digest()[:4], "little") & 0x3FFFFFFF


@dataclass
class BatcherStats:
    """What the batcher did so far (observable backpressure)."""

    rounds: int = 0
    """Decoding rounds run."""
    requests: int = 0
    """Requests finished."""
    tokens: int = 0
    """Tokens generated (by finished requests; a continued request's handed-over prefix is not counted)."""
    peak_active: int = 0
    """Most requests in one round."""
    pending: int = 0
    """Requests waiting now (in flight, not yet finished)."""
    pauses: int = 0
    """Pauses taken (``paused()`` blocks entered)."""
    interrupted_rounds: int = 0
    """Rounds a pause stopped between two decode steps (partial rollout)."""
    last_pause_latency_s: float = 0.0
    """Seconds from the last pause's request to the engine paused."""
    max_pause_latency_s: float = 0.0
    """Longest such wait so far."""
    tokens_per_version: dict[int, int] = field(default_factory=dict)
    """Tokens of finished requests by the weight version that produced them (decoded here, as ``tokens``)."""
    spanning_requests: int = 0
    """Finished requests whose tokens come from more than one weight version."""


@dataclass(frozen=True)
class PauseInfo:
    """What one pause found (yielded by :meth:`RequestBatcher.paused`)."""

    latency_s: float
    """Seconds from the pause's request to the engine paused."""
    in_flight: int
    """Requests in flight (active or waiting) when the pause was requested."""
    interrupted: bool
    """Whether a round was stopped between two decode steps to pause (partial rollout)."""


class _Request:
    __slots__ = ("prompt", "params", "gen", "tokens", "log_probs", "versions", "future", "finish", "key", "kept")

    def __init__(self, prompt: list[int], params: SamplingParams, gen: torch.Generator,
                 future: asyncio.Future[Generation], key: str) -> None:
        self.key = key
        self.prompt = prompt
        self.params = params
        self.gen = gen
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[int] = []
        self.future = future
        self.finish: str | None = None
        self.kept = 0  # tokens of a handed-over prefix (decoded elsewhere)


class _Round:
    """One round's decoding state; a ``keep`` pause parks it here (KV cache included) and resumes it."""

    __slots__ = ("batch", "budget", "done", "past", "step_ids", "step_pos", "mask", "step")

    def __init__(self, batch: list[_Request], budget: list[int], done: list[bool], ids: torch.Tensor,
                 pos: torch.Tensor, mask: torch.Tensor) -> None:
        self.batch = batch
        self.budget = budget
        self.done = done
        self.past: Any = None
        self.step_ids, self.step_pos, self.mask = ids, pos, mask
        self.step = 0

    @property
    def finished(self) -> bool:
        return all(self.done) or self.step >= max(self.budget)


@dataclass
class RoundRecord:
    """One decoding round: which requests, in which batch order, and its segments between pauses."""

    keys: list[str]
    """The requests' keys in batch order."""
    segments: list[tuple[int, int]] = field(default_factory=list)
    """``(weight version, decode steps)`` of each segment; a ``keep`` pause splits a round into several."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {"keys": list(self.keys), "segments": [list(s) for s in self.segments]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RoundRecord":
        """The record :meth:`to_dict` wrote."""
        return cls([str(k) for k in d["keys"]], [(int(v), int(n)) for v, n in d["segments"]])


class RequestBatcher:
    """Batches the pending requests of many coroutines into decoding rounds on one :class:`HFEngine`.

    Args:
        engine: the HF engine whose model, sampler, weight lock and sleep state are used.
        max_batch_size: most requests in one round (the rest wait for the next).
        chunk_tokens: most tokens a request decodes per round; the round boundary after them is
            where new requests join (and, with ``partial_rollout="off"``, where weights may change).
        version_fn: the current weight version (read when a round starts or resumes; 0 when None).
        partial_rollout: what a pause does to the round in flight: ``"off"`` waits for it to end,
            ``"recompute"`` stops it after the current decode step (the next round re-prefills),
            ``"keep"`` parks it after the current decode step and resumes it on its KV cache.
        record_rounds: keep a :class:`~.round_log.RoundRecord` of every round (its requests' keys in
            batch order, the version and decode steps of each segment between pauses), for
            :class:`~.round_log.ReplayBatcher` to regenerate the same tokens bit for bit.
    """

    def __init__(self, engine: HFEngine, *, max_batch_size: int = 64, chunk_tokens: int = 32,
                 version_fn: Callable[[], int] | None = None, partial_rollout: PartialRollout = "off",
                 record_rounds: bool = False) -> None:
        if max_batch_size < 1 or chunk_tokens < 1:
            raise ValueError(f"need max_batch_size >= 1 and chunk_tokens >= 1, got {max_batch_size}, {chunk_tokens}")
        if partial_rollout not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(f"partial_rollout must be one of {PARTIAL_ROLLOUT_MODES}, got {partial_rollout!r}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.chunk_tokens = chunk_tokens
        self.version_fn = version_fn or (lambda: 0)
        self.partial_rollout = partial_rollout
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []
        self._wakeup: asyncio.Event | None = None
        self._round_lock: asyncio.Lock | None = None
        self._driver: asyncio.Task[None] | None = None
        self._abort = threading.Event()
        self._interrupt = threading.Event()  # set while a partial-rollout pause waits for the round
        self._pausers = 0
        self._halt = threading.Event()  # set while a hand-over waits for the round (any mode)
        self._halts = 0
        self._stats = BatcherStats()
        self._rounds: list[Any] | None = [] if record_rounds else None
        self._submitted = 0

    # ---- public ----------------------------------------------------------------------------

    async def generate(self, prompt: list[int], params: SamplingParams, *, key: str | None = None,
                       prefix: Generation | None = None) -> Generation:
        """The completion of one prompt, decoded in the rounds it shares with other requests.
        Cancelling drops the request at the next decode step boundary. `key` names the request in the
        round log (default: its submission index; a replay needs keys stable across runs).

        `prefix`: what another batcher decoded of this request before handing it over
        (:meth:`hand_over`): the completion begins with its tokens, log-probs and versions, and decoding
        continues after them with a generator seeded by :func:`continuation_seed`. A finished prefix, or one
        at ``max_new_tokens``, is the completion (no round runs)."""
        if prefix is not None and (prefix.finish_reason or len(prefix.response_ids) >= params.max_new_tokens):
            if len(prefix.response_ids) > params.max_new_tokens:
                raise ValueError(f"a handed-over prefix of {len(prefix.response_ids)} tokens is longer than "
                                 f"max_new_tokens={params.max_new_tokens}; continue it with the sampling params it "
                                 "was decoded under")
            return Generation(list(prefix.response_ids), list(prefix.log_probs), prefix.finish_reason or "length",
                              versions=list(prefix.versions))
        key = self._key(key)
        self.engine._check([prompt], params)
        seed = params.seed if params.seed is not None else self.engine._next_seed()
        loop = asyncio.get_running_loop()
        self._ensure_driver(loop)
        done = len(prefix.response_ids) if prefix is not None else 0
        gen = torch.Generator(device=self.engine.device).manual_seed(continuation_seed(seed, done))
        req = _Request(list(prompt), params, gen, loop.create_future(), key)
        if prefix is not None:
            if not len(prefix.log_probs) == len(prefix.versions) == done:
                raise ValueError(f"a handed-over prefix needs one log-prob and one version per token; got {done} "
                                 f"tokens, {len(prefix.log_probs)} log-probs, {len(prefix.versions)} versions")
            req.tokens, req.log_probs = list(prefix.response_ids), list(prefix.log_probs)
            req.versions, req.kept = list(prefix.versions), done
        self._waiting.append(req)
        assert self._wakeup is not None
        self._wakeup.set()
        return await req.future

    @contextlib.asynccontextmanager
    async def paused(self, deadline_s: float | None = None) -> AsyncIterator[PauseInfo]:
        """Hold the batcher still (load weights inside); requests in flight continue afterwards.

        With ``partial_rollout="off"`` the pause waits for the running round to end; otherwise it
        stops the round after its current decode step. No decode step runs until the block exits.
        Raises :class:`~asyncrl.roles.errors.PauseDeadlineError` when the engine is not paused
        within `deadline_s` seconds (nothing changed; the round runs on)."""
        t0 = time.perf_counter()
        in_flight = sum(not r.future.done() for r in self._active + self._waiting)
        lock = self._lock()
        partial = self.partial_rollout != "off" and self._rounds_to_replay() is None
        interrupting = partial and lock.locked()
        if partial:
            self._pausers += 1
            self._interrupt.set()
        try:
            try:
                await self._pause_point()  # a replay's hold until its rounds need the update: not the engine's wait
                async with asyncio.timeout(deadline_s):
                    await lock.acquire()
            except TimeoutError:
                raise PauseDeadlineError(
                    f"the engine did not pause within pause_deadline_s={deadline_s:g} s (a decode step or a "
                    "round that does not return); nothing was changed and generation runs on -- raise "
                    "RolloutConfig.pause_deadline_s if steps are that slow") from None
        finally:
            if partial:
                self._pausers -= 1
                if not self._pausers:
                    self._interrupt.clear()
        try:
            info = PauseInfo(time.perf_counter() - t0, in_flight, interrupting)
            s = self._stats
            s.pauses += 1
            s.last_pause_latency_s = info.latency_s
            s.max_pause_latency_s = max(s.max_pause_latency_s, info.latency_s)
            yield info
        finally:
            lock.release()
            self._paused_done()

    def fail_in_flight(self, error: BaseException) -> int:
        """Fail every request in flight with `error` (a weight load that failed mid-generation left
        weights they cannot continue on); returns how many. Call it inside :meth:`paused`."""
        return fail_requests(self._waiting + self._active, error)

    async def hand_over(self, keys: Iterable[str]) -> dict[str, Generation]:
        """Stop the requests named `keys` at the next decode-step boundary (any ``partial_rollout`` mode; a
        weight update's pause in progress goes first) and take them away: each one's future fails with
        :class:`HandedOverError`, and what it decoded so far is returned by key (``finish_reason=""``), for
        ``generate(..., prefix=...)`` elsewhere. Keys not in flight here are left out. The round's other
        requests decode on (``keep``: in the same round; else in the next one, prefilled again)."""
        wanted = {str(k) for k in keys}
        lock = self._lock()
        self._halts += 1
        self._halt.set()
        try:
            await lock.acquire()
        finally:
            self._halts -= 1
            if not self._halts:
                self._halt.clear()
        try:
            out: dict[str, Generation] = {}
            for r in self._active + self._waiting:
                if r.key in wanted and not r.future.done():
                    out[r.key] = Generation(list(r.tokens), list(r.log_probs), "", versions=list(r.versions))
                    r.future.set_exception(HandedOverError(f"request {r.key!r} was handed over after "
                                                           f"{len(r.tokens)} tokens"))
                    r.future.exception()  # (retrieved: its awaiter may be gone)
            return out
        finally:
            lock.release()

    async def settled(self) -> None:
        """Until the driver's turn queued before this call has run: after a :meth:`hand_over`, the round it
        stopped has ended and is in the round log (``keep``: after its segment that decodes the rest)."""
        async with self._lock():
            pass

    def round_log(self, clear: bool = False) -> list[Any]:
        """The :class:`~.round_log.RoundRecord` of every round run so far (``record_rounds=True``);
        `clear` forgets the returned records (a journal that stores them per step)."""
        if self._rounds is None:
            raise RuntimeError("this batcher does not record its rounds; build it with record_rounds=True")
        out = list(self._rounds)
        if clear:
            del self._rounds[:len(out)]
        return out

    def statistics(self) -> BatcherStats:
        """Counters of rounds, requests, tokens (per version), pauses and the requests in flight."""
        s = self._stats
        pending = sum(not r.future.done() for r in self._waiting + self._active)
        return BatcherStats(
            rounds=s.rounds, requests=s.requests, tokens=s.tokens, peak_active=s.peak_active, pending=pending,
            pauses=s.pauses, interrupted_rounds=s.interrupted_rounds, last_pause_latency_s=s.last_pause_latency_s,
            max_pause_latency_s=s.max_pause_latency_s, tokens_per_version=dict(s.tokens_per_version),
            spanning_requests=s.spanning_requests)

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

    # ---- seams of the replaying batcher (round_log.ReplayBatcher) ----------------------------

    def _key(self, key: str | None) -> str:
        self._submitted += 1
        return str(self._submitted - 1) if key is None else str(key)

    def _rounds_to_replay(self) -> list[Any] | None:
        return None

    async def _pause_point(self) -> None:
        """Where a pause may start (a replay holds it until the recorded rounds need the next version)."""

    def _paused_done(self) -> None:
        """Called when a pause's block exits."""

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
            rnd: _Round | None = None
            segments: list[tuple[int, int]] = []
            while True:  # one round: a first segment, then (keep) the segments after each pause
                async with lock:  # paused() holds this between rounds (and between decode steps)
                    if rnd is None:
                        batch = [r for r in self._active if not r.future.done()]
                        if not batch:
                            break
                    else:
                        batch = rnd.batch
                        for b, r in enumerate(batch):  # cancelled during the pause: decode no further
                            rnd.done[b] = rnd.done[b] or r.future.done()
                    version = int(self.version_fn())
                    first = rnd.step if rnd is not None else 0
                    try:
                        rnd, interrupted = await asyncio.to_thread(self._busy_segment, batch, rnd, version)
                        segments.append((version, rnd.step - first))
                    except Exception as e:  # the round failed: every request in it gets the error
                        for r in batch:
                            if not r.future.done():
                                r.future.set_exception(e)
                        self._active = [r for r in self._active if r not in batch]
                        rnd = None
                        break
                if interrupted:
                    self._stats.interrupted_rounds += 1
                if not interrupted or self.partial_rollout != "keep" or rnd.finished:
                    break
            if rnd is None:
                continue
            if self._rounds is not None:
                self._rounds.append(RoundRecord([r.key for r in rnd.batch], segments))
            self._finish_round(rnd)

    def _finish_round(self, rnd: _Round) -> None:
        """Count the round and resolve the requests it finished."""
        s = self._stats
        s.rounds += 1
        s.peak_active = max(s.peak_active, len(rnd.batch))
        for r in rnd.batch:
            if r.finish is not None and not r.future.done():
                s.requests += 1
                s.tokens += len(r.tokens) - r.kept
                for v in r.versions[r.kept:]:
                    s.tokens_per_version[v] = s.tokens_per_version.get(v, 0) + 1
                s.spanning_requests += len(set(r.versions)) > 1
                r.future.set_result(Generation(r.tokens, r.log_probs, r.finish, versions=r.versions))

    def _begin(self, batch: list[_Request]) -> _Round:
        eng = self.engine
        eng._check([r.prompt for r in batch], batch[0].params)
        seqs = [r.prompt + r.tokens for r in batch]
        ids, mask = left_pad(seqs, eng.pad_id, eng.device)
        budget = [min(self.chunk_tokens, r.params.max_new_tokens - len(r.tokens)) for r in batch]
        done = [n <= 0 for n in budget]
        for b, r in enumerate(batch):
            if done[b]:
                r.finish = "length"
        return _Round(batch, budget, done, ids, position_ids_from_mask(mask), mask)

    @torch.no_grad()
    def _busy_segment(self, batch: Any, rnd: Any, version: int) -> Any:
        """:meth:`_segment` with the engine's worker marked busy (``num_threads="follow"``)."""
        busy = getattr(self.engine, "busy", None)
        with busy() if busy is not None else contextlib.nullcontext():
            return self._segment(batch, rnd, version)

    @torch.no_grad()
    def _segment(self, batch: list[_Request], rnd: _Round | None, version: int,
                 steps: int | None = None) -> tuple[_Round, bool]:
        """Prefill prompt + tokens so far of every request (a new round), then decode up to ``chunk_tokens``
        each; returns the round and whether a partial-rollout pause stopped it between two steps.
        `steps` (a replay) runs exactly that many decode steps (fewer only when the round ends)."""
        if rnd is None:
            rnd = self._begin(batch)
        first = rnd.step
        eng, dev, B = self.engine, self.engine.device, len(batch)
        done, budget = rnd.done, rnd.budget
        partial = self.partial_rollout != "off"
        while rnd.step < max(budget) and not all(done):  # (all done: every request was cancelled in a pause)
            if self._abort.is_set():
                return rnd, False
            if steps is not None:
                if rnd.step - first >= steps:
                    return rnd, True
            elif (partial and self._interrupt.is_set()) or self._halt.is_set():
                return rnd, True
            step = rnd.step
            with eng._weights_lock, _autocast(dev, eng.autocast):
                out = eng.model(input_ids=rnd.step_ids, attention_mask=rnd.mask, position_ids=rnd.step_pos,
                                use_cache=True, **{eng._cache_kw: rnd.past})
            rnd.past = getattr(out, "cache", None) if eng._cache_kw == "cache" else out.past_key_values
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
            rnd.step = step + 1
            if all(done):
                break
            tok_col = torch.tensor([r.tokens[-1] if r.tokens else eng.pad_id for r in batch], dtype=torch.long)
            rnd.step_ids = tok_col[:, None].to(dev)
            rnd.step_pos = rnd.step_pos[:, -1:] + 1
            rnd.mask = torch.cat([rnd.mask, torch.ones((B, 1), dtype=torch.long, device=dev)], dim=1)
        return rnd, False

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
