"""A simulated generation engine: GPU-like decoding cost, heavy-tailed response lengths.

For benchmarks of the rollout schedule (``benchmarks/longtail.py``), not for training. It
keeps the contract of :class:`~.base.GenerationEngine` (token ids, one log-prob per token,
a finish reason) and models what decides a schedule's speed on a GPU:

* **A decoding step costs the same whatever the batch size** (``step_ms``, up to
  ``max_batch_size`` requests): decoding is memory-bound, so a step of 1 request and a step
  of 64 take the same time. Every active request gets one token per step; requests join
  and leave at step boundaries (continuous batching, as vLLM schedules). A batch whose
  rows finish at different lengths therefore leaves slots idle until its longest row ends.
* **Response lengths are heavy-tailed**: log-normal with median ``median_tokens`` and
  log-space deviation ``sigma`` (p99/p50 = exp(2.326 sigma): 16x at sigma 1.2), drawn from
  the request's sampling seed, capped by ``max_new_tokens``; reaching the cap ends with
  ``"length"``, any shorter response ends on EOS (``"stop"``).
* The cost is **slept**, not computed, on an absolute clock: step k of a busy stretch ends
  at ``start + k * step_ms``, so a late wake-up on a loaded CPU is caught up (at most
  ``catchup_ms`` behind) rather than added to every later step.

Weight updates follow the rollout worker's protocol for request-level generation
(``RolloutConfig.partial_rollout``, docs/partial_rollout.md). Without partial rollout the worker
waits for the generations in flight, so the engine loads idle; a load that does arrive with
requests in flight (:meth:`aload_weights`) waits for the end of the running *round* of
``round_steps`` decoding steps and the requests then re-prefill prompt + tokens so far
(``prefill_ms``, once for all of them). With partial rollout the worker
holds the engine with :meth:`apaused` after its current decoding step and loads inside the pause;
``recompute`` then costs the re-prefill, ``keep`` decodes on (the KV cache kept). A load costs
``load_ms``. With partial rollout the worker submits through :meth:`agenerate_request`, and each
token records the worker's weight version at the step that produced it. :meth:`statistics` counts steps, the decode slots used, tokens and the peak
requests in flight, which a benchmark turns into the engine's idle fraction:
``1 - slots used / (max_batch_size * elapsed / step_ms)`` (:meth:`idle_between` over a window).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable

from asyncrl.roles.errors import PauseDeadlineError
from asyncrl.roles.engines.base import Completion, SamplingParams, fail_requests, register_engine

__all__ = ["SimEngine", "SimStats", "response_length"]


def response_length(seed: int, max_new_tokens: int, median_tokens: float, sigma: float) -> int:
    """The simulated response length of a request sampled with `seed`: log-normal (median
    `median_tokens`, log-space deviation `sigma`), at least 1, at most `max_new_tokens`."""
    draw = random.Random(seed).lognormvariate(math.log(median_tokens), sigma)
    return max(1, min(max_new_tokens, round(draw)))


@dataclass
class SimStats:
    """What the simulated engine did since its last :meth:`SimEngine.reset_statistics`."""

    elapsed_s: float
    """Seconds since the reset."""
    steps: int
    """Decoding steps run."""
    slots_used: int
    """Decode slots that produced a token (the sum over steps of the active requests)."""
    slots_available: float
    """``max_batch_size * elapsed_s / step_s``: the slots a never-idle engine would have had."""
    tokens: int
    """Tokens of the requests that finished."""
    requests: int
    """Requests that finished."""
    peak_in_flight: int
    """Most requests in the engine at once (decoding plus waiting for a slot)."""
    loads: int
    """Weight loads."""
    prefills: int
    """Re-prefills of the requests in flight after a load (each costs ``prefill_ms``)."""
    load_steps: list[int]
    """The decoding step count at each load (a load without partial rollout lands at a round's end)."""

    @property
    def idle_fraction(self) -> float:
        """Share of the available decode slots left unused."""
        return 1.0 - self.slots_used / self.slots_available if self.slots_available > 0 else 0.0


class _Request:
    __slots__ = ("future", "length", "max_new_tokens", "rng", "tokens", "version_fn", "versions")

    def __init__(self, length: int, max_new_tokens: int, seed: int, future: asyncio.Future[Completion],
                 version_fn: Callable[[], int] | None = None) -> None:
        self.length = length
        self.max_new_tokens = max_new_tokens
        self.rng = random.Random(seed ^ 0x5EED)
        self.tokens: list[int] = []
        self.future = future
        self.version_fn = version_fn
        self.versions: list[int] = []


@register_engine("sim")
class SimEngine:
    """A generation engine that sleeps a GPU-like decoding cost (see the module docstring).

    Args:
        model: unused (the engine keeps the registry's factory signature).
        tokenizer: gives the vocabulary size and the EOS id of the sampled tokens.
        model_dir: unused.
        step_ms: cost of one decoding step, whatever the number of requests in it.
        max_batch_size: decode slots: most requests in one step (the rest wait for a slot).
        median_tokens: median response length.
        sigma: log-space standard deviation of the response lengths (the tail's weight).
        load_ms: cost of a weight load.
        prefill_ms: cost of re-prefilling the requests in flight after a weight load (not after ``keep``).
        round_steps: decoding steps per round: a load without partial rollout waits for a round's end.
        catchup_ms: most a late step is caught up on the engine's clock.
    """

    partial_rollout_modes = ("keep", "recompute")
    """The partial-rollout modes this engine can do (``RolloutConfig.partial_rollout``)."""

    def __init__(self, *, model: Any = None, tokenizer: Any = None, model_dir: str | None = None,
                 step_ms: float = 5.0, max_batch_size: int = 32, median_tokens: float = 16.0, sigma: float = 1.2,
                 load_ms: float = 0.0, prefill_ms: float = 0.0, round_steps: int = 32,
                 catchup_ms: float = 50.0) -> None:
        if step_ms <= 0 or max_batch_size < 1 or median_tokens < 1 or sigma < 0 or round_steps < 1:
            raise ValueError(f"SimEngine needs step_ms > 0, max_batch_size >= 1, median_tokens >= 1, sigma >= 0 and "
                             f"round_steps >= 1; got {step_ms}, {max_batch_size}, {median_tokens}, {sigma}, {round_steps}")
        self.step_s = step_ms / 1e3
        self.max_batch_size = max_batch_size
        self.median_tokens = median_tokens
        self.sigma = sigma
        self.load_s = load_ms / 1e3
        self.prefill_s = prefill_ms / 1e3
        self.round_steps = round_steps
        self.catchup_s = catchup_ms / 1e3
        self.vocab = len(tokenizer) if tokenizer is not None else 256
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_id = int(eos) if eos is not None else self.vocab - 1
        self.log_prob = -math.log(self.vocab - 1)  # tokens are drawn uniformly from all but EOS
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []
        self._wakeup: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._driver: asyncio.Task[None] | None = None
        self._clock: float | None = None
        self._prefill_due = False
        self._round_pos = 0  # decoding steps into the running round
        self._loads_waiting: list[asyncio.Future[None]] = []  # loads waiting for a round's end
        self._pauses = 0  # apaused() blocks open
        self.on_step: Callable[[int], None] | None = None
        """Called with the step count after each decoding step, on the engine's loop (tests hook it)."""
        self._round_done = asyncio.Event()
        self._load_sleep = 0.0  # the cost of the last load, paid by the driver or the pause
        self.reset_statistics()

    # ---- the engine interface --------------------------------------------------------------

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions of every prompt, in prompt order (they decode together, one token per step)."""
        out: list[Completion | None] = [None] * len(prompts)
        async for i, c in self.stream(prompts, params):
            out[i] = c
        return [c for c in out if c is not None]

    async def stream(self, prompts: list[list[int]], params: SamplingParams) -> AsyncIterator[tuple[int, Completion]]:
        """``(prompt index, completion)`` as each finishes; closing the stream drops the rest."""
        loop = asyncio.get_running_loop()
        base = params.seed if params.seed is not None else random.getrandbits(30)
        futures = [self._submit(base + i, params.max_new_tokens, loop) for i in range(len(prompts))]
        index = {f: i for i, f in enumerate(futures)}
        pending = set(futures)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for f in sorted(done, key=index.__getitem__):
                    yield index[f], f.result()
        finally:
            for f in pending:
                f.cancel()  # the driver drops cancelled requests at the next step boundary

    async def agenerate_request(self, prompt: list[int], params: SamplingParams, *,
                                version_fn: Callable[[], int]) -> Any:
        """One request's completion with the weight version of every token (``version_fn()`` read at the
        step that produced it): a :class:`~.batcher.Generation`."""
        from asyncrl.roles.engines.batcher import Generation

        seed = params.seed if params.seed is not None else random.getrandbits(30)
        future = self._submit(seed, params.max_new_tokens, asyncio.get_running_loop(), version_fn)
        try:
            c = await future
        finally:
            future.cancel()
        assert isinstance(c, Generation)
        return c

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Take the weights at once (not used for sampling); costs ``load_ms``. The requests in flight
        re-prefill before their next token."""
        for _ in named_tensors:
            pass
        if self.load_s:
            time.sleep(self.load_s)
        self._loads += 1
        self._load_steps.append(self._steps)
        self._prefill_due = bool(self._active)

    async def aload_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Take the weights: at once inside :meth:`apaused` (the pause pays ``load_ms``) or when idle,
        else at the end of the running round; the requests in flight re-prefill before their next token."""
        if self._pauses:
            return self._load_now(named_tensors, prefill=True)
        if not (self._active or self._waiting):
            self._load_now(named_tensors, prefill=False)
            cost, self._load_sleep = self._load_sleep, 0.0
            if cost:
                await asyncio.sleep(cost)
            return None
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._loads_waiting.append(turn)
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            await turn  # the driver stopped at a round's end and waits for this load
            self._load_now(named_tensors, prefill=True)
        finally:
            self._round_done.set()
        return None

    def _load_now(self, named_tensors: Iterable[tuple[str, Any]], *, prefill: bool) -> None:
        for _ in named_tensors:
            pass
        self._loads += 1
        self._load_steps.append(self._steps)
        self._prefill_due = self._prefill_due or (prefill and bool(self._active))
        self._load_sleep = self.load_s

    def weights_checksum(self) -> dict[str, str]:
        """One pseudo-checksum: how many weight loads the engine took."""
        return {"sim/loads": str(self._loads)}

    def close(self) -> None:
        """Stop the driver; requests in flight are cancelled."""
        if self._driver is not None:
            self._driver.cancel()
        for r in self._waiting + self._active:
            r.future.cancel()
        self._waiting, self._active = [], []

    # ---- simulation controls ---------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def apaused(self, mode: str, deadline_s: float | None = None) -> AsyncIterator[Any]:
        """Hold the engine after its current decoding step until the block exits (load weights inside);
        the requests stay in flight. `mode` ``"recompute"`` re-prefills them after the block, ``"keep"``
        decodes on. Yields a :class:`~.batcher.PauseInfo`; raises
        :class:`~asyncrl.roles.errors.PauseDeadlineError` when no step ends within `deadline_s`."""
        from asyncrl.roles.engines.batcher import PauseInfo

        t0 = time.perf_counter()
        in_flight = len(self._active) + len(self._waiting)
        lock = self._step_lock()
        interrupted = lock.locked()
        self._pauses += 1
        try:
            try:
                async with asyncio.timeout(deadline_s):
                    await lock.acquire()
            except TimeoutError:
                raise PauseDeadlineError(f"the simulated engine did not pause within {deadline_s:g} s") from None
            try:
                yield PauseInfo(time.perf_counter() - t0, in_flight, interrupted)
                if mode == "keep":
                    self._prefill_due = False
                if self._load_sleep:
                    await asyncio.sleep(self._load_sleep)
                    self._load_sleep = 0.0
            finally:
                self._clock = None  # the pause was idle time, not a late step
                lock.release()
        finally:
            self._pauses -= 1

    def fail_in_flight(self, error: BaseException) -> int:
        """Fail every request in flight with `error` (a load failed inside :meth:`apaused`); returns how many."""
        return fail_requests(self._waiting + self._active, error)

    def request_statistics(self) -> dict[str, Any]:
        """The counters of :meth:`statistics` as a dict (the rollout worker's ``statistics()`` reports them)."""
        from dataclasses import asdict

        return {f"sim_{k}": v for k, v in asdict(self.statistics()).items()}

    def reset_statistics(self) -> None:
        """Start counting again (steps, slots, tokens, the peak in flight) from now."""
        self._since = time.monotonic()
        self._steps = self._slots = self._tokens = self._requests = self._loads = self._prefills = 0
        self._load_steps: list[int] = []
        self._peak = len(self._waiting) + len(self._active)
        self._log: list[tuple[float, int]] = []  # (monotonic end, slots used) of each step

    def idle_between(self, start: float, end: float) -> float:
        """Share of the decode slots left unused between two ``time.monotonic()`` readings (any process
        on this machine: the clock is system-wide) since the last reset."""
        used = sum(n for t, n in self._log if start < t <= end)
        available = self.max_batch_size * (end - start) / self.step_s
        return 1.0 - used / available if available > 0 else 0.0

    def statistics(self) -> SimStats:
        """What the engine did since the last :meth:`reset_statistics`."""
        elapsed = time.monotonic() - self._since
        return SimStats(elapsed_s=elapsed, steps=self._steps, slots_used=self._slots,
                        slots_available=self.max_batch_size * elapsed / self.step_s, tokens=self._tokens,
                        requests=self._requests, peak_in_flight=self._peak, loads=self._loads,
                        prefills=self._prefills, load_steps=list(self._load_steps))

    # ---- the driver ------------------------------------------------------------------------

    async def _serve_loads(self) -> None:
        """At a round's end: let each waiting load in (one at a time), then pay what they cost."""
        while self._loads_waiting:
            turn = self._loads_waiting.pop(0)
            if turn.done():
                continue
            self._round_done.clear()
            turn.set_result(None)
            await self._round_done.wait()
        if self._load_sleep:
            await asyncio.sleep(self._load_sleep)
            self._load_sleep = 0.0
        self._clock = None

    def _step_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _submit(self, seed: int, max_new_tokens: int, loop: asyncio.AbstractEventLoop,
                version_fn: Callable[[], int] | None = None) -> asyncio.Future[Completion]:
        future: asyncio.Future[Completion] = loop.create_future()
        length = response_length(seed, max_new_tokens, self.median_tokens, self.sigma)
        self._waiting.append(_Request(length, max_new_tokens, seed, future, version_fn))
        self._peak = max(self._peak, len(self._waiting) + len(self._active))
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive(), name="asyncrl-sim-engine")
        self._wakeup.set()
        return future

    async def _drive(self) -> None:
        from asyncrl.roles.engines.batcher import Generation

        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            self._active = [r for r in self._active if not r.future.done()]
            self._waiting = [r for r in self._waiting if not r.future.done()]
            room = self.max_batch_size - len(self._active)
            if room > 0 and self._waiting:
                self._active += self._waiting[:room]
                del self._waiting[:room]
            if self._loads_waiting and (self._round_pos == 0 or not self._active):
                async with self._step_lock():
                    await self._serve_loads()
                self._round_pos = 0
                continue
            if not self._active:
                self._clock = None
                self._round_pos = 0
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with self._step_lock():
                now = loop.time()
                if self._clock is None or now - self._clock > self.catchup_s:
                    self._clock = now  # idle before this step (or too late to catch up)
                self._clock += self.step_s
                if self._prefill_due:
                    self._clock += self.prefill_s
                    self._prefill_due = False
                    self._prefills += 1
                # always yield once: requests and pauses of other coroutines get in between steps
                await asyncio.sleep(max(0.0, self._clock - loop.time()))
                batch = [r for r in self._active if not r.future.done()]
                self._steps += 1
                self._round_pos = (self._round_pos + 1) % self.round_steps
                self._slots += len(batch)
                self._log.append((time.monotonic(), len(batch)))
                for r in batch:
                    if r.version_fn is not None:
                        r.versions.append(int(r.version_fn()))
                    last = len(r.tokens) + 1 == r.length
                    if last and r.length < r.max_new_tokens:
                        r.tokens.append(self.eos_id)
                    else:
                        tok = r.rng.randrange(self.vocab - 1)
                        r.tokens.append(tok if tok < self.eos_id else tok + 1)  # never EOS before the end
                    if last:
                        finish = "stop" if r.length < r.max_new_tokens else "length"
                        self._tokens += len(r.tokens)
                        self._requests += 1
                        logps = [self.log_prob] * len(r.tokens)
                        if r.version_fn is None:
                            r.future.set_result(Completion(list(r.tokens), logps, finish))
                        else:
                            r.future.set_result(Generation(list(r.tokens), logps, finish, versions=list(r.versions)))
                if self.on_step is not None:
                    self.on_step(self._steps)
