"""A simulated generation engine: a GPU-like cost model, heavy-tailed response lengths.

For the schedules of ``benchmarks/longtail.py`` and for the cluster twin (``asyncrl.pipelines.twin``), not
for training a model. It keeps the contract of :class:`~.base.GenerationEngine` (token ids, one log-prob per
token, a finish reason) and models what decides a schedule's speed on a GPU:

* **Continuous batching.** Every running request gets one token per decoding step; requests join and leave at
  step boundaries, at most ``max_batch_size`` at once (vLLM's ``max_num_seqs``), first come first served. A
  batch whose rows finish at different lengths leaves slots idle until its longest row ends.
* **A decoding step's cost** is ``step_ms + step_ms_per_seq * R + step_ms_per_1k_kv * C / 1000`` for R running
  requests holding C context tokens (prompt + tokens so far): the weights are read once per step whatever the
  batch (``step_ms``), each request adds its own work, attention reads the KV cache. With the defaults (only
  ``step_ms``) a step of 1 request and a step of 64 cost the same: decoding is memory-bound.
* **Joining**: a request joins at the next step boundary (vLLM's continuous batching), or, with
  ``join_rounds``, only when the running *round* ends (every request in it finished, or ``round_steps`` steps
  run): the request-level HF engine's rounds (``RequestBatcher``, ``rollout.chunk_tokens``), where a request
  arriving mid-round waits for the round to end and slots freed mid-round stay empty.
* **Prefill**: a request admitted to a step adds ``prefill_ms_per_token`` per prompt token to it (chunked
  prefill rides along with decoding).
* **KV cache**: with ``kv_capacity_tokens`` set, a request is admitted only while the running requests'
  context fits, and when growing contexts overflow it the newest running request is preempted: it waits again
  (first in line) and re-prefills its prompt and tokens when it is admitted again (vLLM's recompute).
* **Response lengths are heavy-tailed**: log-normal with median ``median_tokens`` and log-space deviation
  ``sigma`` (p99/p50 = exp(2.326 sigma): 16x at sigma 1.2), or an empirical histogram (``length_histogram``),
  drawn from the request's sampling seed, capped by ``max_new_tokens``; reaching the cap ends with
  ``"length"``, any shorter response ends on EOS (``"stop"``). ``prompt_sigma`` spreads each prompt's own
  median (its responses share its difficulty).
* **Tokens per id** (``tokens_per_step`` k): the engine decodes simulated tokens (one per request and step,
  as above) but a response carries one id per k of them (``ceil(tokens / k)``; ``max_new_tokens`` counts ids,
  so the cap is k times as many tokens), so a twin of long responses moves k times fewer ids through the data
  plane while pauses and loads still land between single decoding steps. k = 1 (the default) is a token per
  id.
* The cost is **slept**, not computed, on an absolute clock, and the engine sleeps from one event to the next
  (a request finishing, a new request, a pause, a weight load, the KV cache filling up), not once per step: a
  stretch of n steps is one sleep, so hundreds of simulated engines fit on one CPU core. A late wake-up on a
  loaded CPU is caught up (at most ``catchup_ms`` behind) rather than added to every later step. With
  :attr:`on_step` set (tests) it stops after every step.
* **Shared devices** (``burn_threads`` set, the twin's ``devices.kind=shared``): the cost is not slept but
  **burned** as real CPU work (:class:`Burner`: a loop of small torch ops on ``burn_threads`` intra-op threads,
  sized to take the cost when it runs alone), in a thread as a real engine's decoding runs. A stretch is then
  measured in seconds of work done, not on the clock: when other processes of the run (the training ranks,
  the controller, other replicas) share the cores, it takes longer, as a CPU worker's generation does. The
  running requests' stretches burn in one thread call, each committed (its finished requests resolved) as it
  ends; a request, pause or load arriving cuts the call within half a millisecond of work, and the step in
  progress is finished. Weight loads burn too.

Weight updates follow the rollout worker's protocol for request-level generation
(``RolloutConfig.partial_rollout``, docs/partial_rollout.md). Without partial rollout the worker
waits for the generations in flight, so the engine loads idle; a load that does arrive with
requests in flight (:meth:`aload_weights`) waits for the end of the running *round* of
``round_steps`` decoding steps and the requests then re-prefill prompt + tokens so far
(``prefill_ms`` plus ``prefill_ms_per_token`` per context token, once for all of them). With partial
rollout the worker holds the engine with :meth:`apaused` after its current decoding step and loads inside the
pause; ``recompute`` then costs the re-prefill, ``keep`` decodes on (the KV cache kept). A load costs
``load_ms``. With partial rollout the worker submits through :meth:`agenerate_request`, and each
token records the worker's weight version at the step that produced it. :meth:`statistics` counts steps, the
decode slots used, tokens and the peak requests in flight, which a benchmark turns into the engine's idle
fraction: ``1 - slots used / (max_batch_size * elapsed / step_ms)`` (:meth:`idle_between` over a window).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable

from asyncrl.roles.errors import PauseDeadlineError
from asyncrl.roles.engines.base import Completion, SamplingParams, fail_requests, register_engine
from asyncrl.roles.engines.batcher import Generation, PauseInfo

__all__ = ["SimEngine", "SimStats", "Burner", "response_length", "draw_length"]


def response_length(seed: int, max_new_tokens: int, median_tokens: float, sigma: float) -> int:
    """The simulated response length of a request sampled with `seed`: log-normal (median
    `median_tokens`, log-space deviation `sigma`), at least 1, at most `max_new_tokens`."""
    draw = random.Random(seed).lognormvariate(math.log(median_tokens), sigma)
    return max(1, min(max_new_tokens, round(draw)))


def draw_length(seed: int, prompt: list[int] | tuple[int, ...], max_new_tokens: int, *, median_tokens: float,
                sigma: float, prompt_sigma: float = 0.0,
                histogram: tuple[list[float], list[float]] | None = None, tokens_per_id: int = 1) -> int:
    """The simulated response length, in tokens, of a request for `prompt` sampled with `seed`: a draw from the
    log-normal (median `median_tokens` times the prompt's own factor ``exp(prompt_sigma * z)``, z drawn from
    the prompt) or from `histogram` (``(edges, counts)``, uniform within a bin), at least 1, at most
    `max_new_tokens` ids of `tokens_per_id` tokens each. Without a prompt spread, a histogram or k > 1 it is
    :func:`response_length`."""
    rng = random.Random(seed)
    if histogram is not None:
        edges, counts = histogram
        i = rng.choices(range(len(counts)), weights=counts)[0]
        draw = rng.uniform(edges[i], edges[i + 1])
    else:
        median = median_tokens
        if prompt_sigma > 0:
            median *= math.exp(prompt_sigma * random.Random(hash(tuple(prompt))).gauss(0.0, 1.0))
        draw = rng.lognormvariate(math.log(median), sigma)
    return max(1, min(max_new_tokens * tokens_per_id, round(draw)))


class Burner:
    """Real CPU work sized in seconds of work as it runs alone: the twin's model of devices shared with the rest of
    the run (``devices.kind=shared``, docs/scale.md). A cost of s seconds is ``round(s * work / op_s)`` torch ops
    (a 64x64 matrix product and a tanh: the dispatcher and kernel mix of a tiny model's step, holding the GIL
    between kernels as a real CPU worker's thread does) on `threads` intra-op threads; the time one op takes alone
    (:attr:`op_s`) is measured once, the fastest of many short batches (a batch that shared the cores is slower,
    never faster). On cores the run shares, a burn takes longer than its cost, as the work it stands for would.

    Args:
        threads: torch intra-op threads of the burn (set for the process, as the real workers set theirs); None
            keeps the process's.
        work: seconds of work alone per second of cost (a cost measured on cores the run itself kept partly busy
            holds less work than it lasted; the twin's fit calibrates it, ``devices.work_per_s``).
    """

    SIZE = 64
    CHUNK = 32
    """Ops between two looks at the stop flag (about half a millisecond)."""

    def __init__(self, threads: int | None = None, work: float = 1.0) -> None:
        if (threads is not None and threads < 1) or not work > 0:
            raise ValueError(f"Burner needs threads >= 1 or None and work > 0, got {threads} and {work}")
        self.threads = threads
        self.work = work
        self._op_s: float | None = None
        self._lock = threading.Lock()
        self._tensors: tuple[Any, Any, Any] | None = None

    def _ops(self, n: int) -> None:
        import torch

        a, b, c = self._tensors  # type: ignore[misc]
        for _ in range(n):
            torch.mm(a, b, out=c)
            torch.tanh(c, out=c)

    @property
    def op_s(self) -> float:
        """Seconds one op takes alone (measured on first use)."""
        with self._lock:
            if self._op_s is None:
                import torch

                if self.threads is not None and torch.get_num_threads() != self.threads:
                    torch.set_num_threads(self.threads)
                g = torch.Generator().manual_seed(0)
                self._tensors = (torch.randn(self.SIZE, self.SIZE, generator=g) / self.SIZE ** 0.5,
                                 torch.randn(self.SIZE, self.SIZE, generator=g) / self.SIZE ** 0.5,
                                 torch.empty(self.SIZE, self.SIZE))
                self._ops(64)  # warm
                best = math.inf
                for _ in range(40):
                    t = time.perf_counter()
                    self._ops(16)
                    best = min(best, (time.perf_counter() - t) / 16)
                self._op_s = best
            return self._op_s

    def burn(self, seconds: float, stop: threading.Event | None = None) -> float:
        """Do the work of `seconds` of cost (``seconds * work`` as it takes alone); returns the seconds of cost
        done: all of them, or less when `stop` was set (it stops within :attr:`CHUNK` ops). Blocks: call it in a
        thread."""
        op = self.op_s / self.work  # seconds of cost per op
        left = round(seconds / op) if seconds > 0 else 0
        done = 0
        while left > 0 and not (stop is not None and stop.is_set()):
            n = min(self.CHUNK, left)
            self._ops(n)
            done += n
            left -= n
        return done * op


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
    """Tokens (ids) of the requests that finished."""
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
    preemptions: int = 0
    """Requests preempted because the KV cache was full (each re-prefilled when admitted again)."""
    busy_s: float = 0.0
    """Seconds with at least one request decoding."""
    burned_s: float = 0.0
    """Seconds of decoding cost burned as CPU work (shared devices; 0 when the costs are slept)."""

    @property
    def idle_fraction(self) -> float:
        """Share of the available decode slots left unused."""
        return 1.0 - self.slots_used / self.slots_available if self.slots_available > 0 else 0.0


class _Request:
    __slots__ = ("future", "length", "max_new_tokens", "seed", "done", "version_fn", "versions", "prompt_tokens",
                 "prefilled")

    def __init__(self, length: int, max_new_tokens: int, seed: int, future: asyncio.Future[Completion],
                 version_fn: Callable[[], int] | None, prompt_tokens: int) -> None:
        self.length = length
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.done = 0  # tokens decoded so far
        self.future = future
        self.version_fn = version_fn
        self.versions: list[tuple[int, int]] = []  # (version, tokens) runs, in order
        self.prompt_tokens = prompt_tokens
        self.prefilled = False  # its context is in the KV cache (admitted and not preempted since)

    def tokens(self, vocab: int, eos_id: int, k: int) -> list[int]:
        """Its ids, one per k tokens: uniform over the vocabulary but EOS, EOS last when it stopped short of the
        cap."""
        rng = random.Random(self.seed ^ 0x5EED)
        n, stopped = -(-self.length // k), self.length < self.max_new_tokens * k
        out = []
        for _ in range(n - stopped):
            tok = rng.randrange(vocab - 1)
            out.append(tok if tok < eos_id else tok + 1)  # never EOS before the end
        if stopped:
            out.append(eos_id)
        return out

    def version_list(self, k: int) -> list[int]:
        """The version of each id: the version its last token was decoded under."""
        out: list[int] = []
        end = 0
        for v, n in self.versions:
            end += n
            out.extend([v] * (end // k - len(out)))  # the ids whose last token is in this run
        if end % k:
            out.append(self.versions[-1][0])  # the last id, shorter than k tokens
        return out


class _Stretch:
    """A run of decoding steps with the same requests: one sleep (costs in seconds)."""

    __slots__ = ("start", "first", "a", "b", "n", "running")

    def __init__(self, start: float, first: float, a: float, b: float, n: int, running: int) -> None:
        self.start, self.first, self.a, self.b, self.n, self.running = start, first, a, b, n, running

    def end_of(self, m: int) -> float:
        """Clock time at which step m (1-based) of the stretch ends."""
        return self.start + self.first + m * self.a + self.b * m * (m - 1) / 2

    def steps_by(self, t: float) -> int:
        """Steps of the stretch finished by clock time `t`."""
        x = t - self.start - self.first
        if x < self.a:
            return 0
        if self.b <= 0:
            m = int(x / self.a)
        else:  # b/2 m^2 + (a - b/2) m - x <= 0
            h = self.a - self.b / 2
            m = int((-h + math.sqrt(h * h + 2 * self.b * x)) / self.b)
        m = max(0, min(self.n, m))
        while m < self.n and self.end_of(m + 1) <= t:
            m += 1
        while m > 0 and self.end_of(m) > t:
            m -= 1
        return m


@register_engine("sim")
class SimEngine:
    """A generation engine that sleeps a GPU-like cost (see the module docstring).

    Args:
        model: unused (the engine keeps the registry's factory signature).
        tokenizer: gives the vocabulary size and the EOS id of the sampled tokens.
        model_dir: unused.
        step_ms: a decoding step's fixed cost (whatever the number of requests in it).
        max_batch_size: decode slots: most requests in one step (the rest wait for a slot).
        median_tokens: median response length, in tokens.
        sigma: log-space standard deviation of the response lengths (the tail's weight).
        load_ms: cost of a weight load.
        prefill_ms: cost of re-prefilling the requests in flight after a weight load (not after ``keep``).
        round_steps: decoding steps per round: a load without partial rollout waits for a round's end.
        catchup_ms: most a late step is caught up on the engine's clock.
        step_ms_per_seq: a decoding step's cost per running request.
        step_ms_per_1k_kv: a decoding step's cost per 1000 context tokens of the running requests.
        prefill_ms_per_token: prefill cost per context token of an admitted (or re-prefilled) request.
        kv_capacity_tokens: context tokens the KV cache holds (None: unbounded).
        tokens_per_step: simulated tokens per emitted id (k; the cap is ``max_new_tokens`` ids of k tokens).
        prompt_tokens: a request's prompt length for the costs (None: its real prompt's).
        prompt_sigma: log-space spread of each prompt's own median response length.
        length_histogram: ``(edges, counts)`` in tokens: draw lengths from it instead of the log-normal.
        burn_threads: burn the costs as CPU work on this many torch threads instead of sleeping them (shared
            devices, module docstring); None: sleep.
        burn_work: seconds of work alone per second of cost (:class:`Burner`'s `work`).
        join_rounds: requests join only when the running round ends (module docstring); False: at the next step.
    """

    partial_rollout_modes = ("keep", "recompute")
    """The partial-rollout modes this engine can do (``RolloutConfig.partial_rollout``)."""

    def __init__(self, *, model: Any = None, tokenizer: Any = None, model_dir: str | None = None,
                 step_ms: float = 5.0, max_batch_size: int = 32, median_tokens: float = 16.0, sigma: float = 1.2,
                 load_ms: float = 0.0, prefill_ms: float = 0.0, round_steps: int = 32,
                 catchup_ms: float = 50.0, step_ms_per_seq: float = 0.0, step_ms_per_1k_kv: float = 0.0,
                 prefill_ms_per_token: float = 0.0, kv_capacity_tokens: int | None = None,
                 tokens_per_step: int = 1, prompt_tokens: int | None = None, prompt_sigma: float = 0.0,
                 length_histogram: tuple[list[float], list[float]] | None = None,
                 burn_threads: int | None = None, burn_work: float = 1.0, join_rounds: bool = False) -> None:
        if step_ms < 0 or max_batch_size < 1 or median_tokens < 1 or sigma < 0 or round_steps < 1:
            raise ValueError(f"SimEngine needs step_ms >= 0, max_batch_size >= 1, median_tokens >= 1, sigma >= 0 and "
                             f"round_steps >= 1; got {step_ms}, {max_batch_size}, {median_tokens}, {sigma}, {round_steps}")
        if step_ms_per_seq < 0 or step_ms_per_1k_kv < 0 or prefill_ms_per_token < 0 or step_ms + step_ms_per_seq <= 0:
            raise ValueError("SimEngine's step_ms_per_seq, step_ms_per_1k_kv and prefill_ms_per_token must be >= 0 "
                             "and a step must cost something (step_ms + step_ms_per_seq > 0)")
        if tokens_per_step < 1 or (kv_capacity_tokens is not None and kv_capacity_tokens < 1):
            raise ValueError(f"SimEngine needs tokens_per_step >= 1 and kv_capacity_tokens >= 1 or None; got "
                             f"{tokens_per_step}, {kv_capacity_tokens}")
        self.step_s = step_ms / 1e3
        self.burner = Burner(burn_threads, burn_work) if burn_threads is not None else None
        """Shared devices: what burns the costs (None: they are slept)."""
        self._burn_stop: threading.Event | None = None  # the interruptible burn in progress
        self.seq_s = step_ms_per_seq / 1e3
        self.kv_s = step_ms_per_1k_kv / 1e6  # per context token
        self.prefill_token_s = prefill_ms_per_token / 1e3
        self.kv_capacity = kv_capacity_tokens
        self.k = tokens_per_step
        self.prompt_tokens = prompt_tokens
        self.prompt_sigma = prompt_sigma
        self.histogram = (list(length_histogram[0]), list(length_histogram[1])) if length_histogram else None
        self.max_batch_size = max_batch_size
        self.median_tokens = median_tokens
        self.sigma = sigma
        self.load_s = load_ms / 1e3
        self.prefill_s = prefill_ms / 1e3
        self.round_steps = round_steps
        self.join_rounds = join_rounds
        self.catchup_s = catchup_ms / 1e3
        self.vocab = len(tokenizer) if tokenizer is not None else 256
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_id = int(eos) if eos is not None else self.vocab - 1
        self.log_prob = -math.log(self.vocab - 1)  # tokens are drawn uniformly from all but EOS
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []
        self._waker: asyncio.Future[None] | None = None  # the driver's sleep, cut short by _poke
        self._lock: asyncio.Lock | None = None
        self._driver: asyncio.Task[None] | None = None
        self._clock: float | None = None
        self._stretch: _Stretch | None = None  # the steps running now
        self._prefill_due = False
        self._round_pos = 0  # decoding steps into the running round
        self._loads_waiting: list[asyncio.Future[None]] = []  # loads waiting for a round's end
        self._pauses = 0  # apaused() blocks open
        self.on_step: Callable[[int], None] | None = None
        """Called with the step count after each decoding step, on the engine's loop (tests hook it); while it
        is set the engine stops after every step."""
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
        futures = [self._submit(base + i, prompts[i], params.max_new_tokens, loop) for i in range(len(prompts))]
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
        seed = params.seed if params.seed is not None else random.getrandbits(30)
        future = self._submit(seed, prompt, params.max_new_tokens, asyncio.get_running_loop(), version_fn)
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
        if self.load_s and self.burner is not None:
            self.burner.burn(self.load_s)
        elif self.load_s:
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
                await self._pay(cost)
            return None
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._loads_waiting.append(turn)
        self._poke()  # a stretch in progress ends at its next step boundary
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
        if self._burn_stop is not None:
            self._burn_stop.set()
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
        t0 = time.perf_counter()
        in_flight = len(self._active) + len(self._waiting)
        lock = self._step_lock()
        interrupted = lock.locked()
        self._pauses += 1
        self._poke()  # a stretch in progress ends at its next step boundary
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
                    await self._pay(self._load_sleep)
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
        self._preemptions = 0
        self._busy = 0.0
        self._burned = 0.0
        self._load_steps: list[int] = []
        self._peak = len(self._waiting) + len(self._active)
        self._log: list[tuple[float, float, int]] = []  # (monotonic start, end, slots used) of each stretch

    def idle_between(self, start: float, end: float) -> float:
        """Share of the decode slots left unused between two ``time.monotonic()`` readings (any process
        on this machine: the clock is system-wide) since the last reset."""
        used = 0.0
        for t0, t1, n in self._log:
            if t1 <= start or t0 >= end:
                continue
            if start <= t0 and t1 <= end:
                used += n
            else:  # a stretch across the window's edge: its share inside
                used += n * (min(t1, end) - max(t0, start)) / (t1 - t0)
        available = self.max_batch_size * (end - start) / self.step_s if self.step_s > 0 else 0.0
        return 1.0 - used / available if available > 0 else 0.0

    def statistics(self) -> SimStats:
        """What the engine did since the last :meth:`reset_statistics` (the steps of a stretch in progress
        counted as far as they went)."""
        elapsed = time.monotonic() - self._since
        steps, slots = self._steps, self._slots
        st = self._stretch
        if st is not None:
            m = st.steps_by(time.monotonic())
            steps, slots = steps + m, slots + m * st.running
        available = self.max_batch_size * elapsed / self.step_s if self.step_s > 0 else 0.0
        return SimStats(elapsed_s=elapsed, steps=steps, slots_used=slots, slots_available=available,
                        tokens=self._tokens, requests=self._requests, peak_in_flight=self._peak, loads=self._loads,
                        prefills=self._prefills, load_steps=list(self._load_steps), preemptions=self._preemptions,
                        busy_s=self._busy, burned_s=self._burned)

    # ---- the driver ------------------------------------------------------------------------

    def _poke(self) -> None:
        """Wake the driver from its sleep (a stretch in progress then ends at its next step boundary)."""
        if self._burn_stop is not None:
            self._burn_stop.set()
        w = self._waker
        if w is not None and not w.done():
            w.set_result(None)

    def _on_done(self, future: asyncio.Future[Completion]) -> None:
        if future.cancelled():
            self._poke()  # drop it at the next step boundary, not at the stretch's end

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
            await self._pay(self._load_sleep)
            self._load_sleep = 0.0
        self._clock = None

    def _step_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _submit(self, seed: int, prompt: list[int], max_new_tokens: int, loop: asyncio.AbstractEventLoop,
                version_fn: Callable[[], int] | None = None) -> asyncio.Future[Completion]:
        future: asyncio.Future[Completion] = loop.create_future()
        length = draw_length(seed, prompt, max_new_tokens, median_tokens=self.median_tokens, sigma=self.sigma,
                             prompt_sigma=self.prompt_sigma, histogram=self.histogram, tokens_per_id=self.k)
        tokens = self.prompt_tokens if self.prompt_tokens is not None else len(prompt)
        self._waiting.append(_Request(length, max_new_tokens, seed, future, version_fn, tokens))
        future.add_done_callback(self._on_done)
        self._peak = max(self._peak, len(self._waiting) + len(self._active))
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive(), name="asyncrl-sim-engine")
        if not (self.join_rounds and self._active):  # (mid-round it joins at the round's end: nothing to cut)
            self._poke()
        return future

    def _context(self, r: _Request) -> int:
        """Tokens `r` holds in the KV cache (prompt + its tokens so far)."""
        return r.prompt_tokens + r.done

    def _admit(self) -> float:
        """At a step boundary: move waiting requests into free slots while the KV cache holds them; returns
        their prefill cost (seconds)."""
        self._active = [r for r in self._active if not r.future.done()]
        self._waiting = [r for r in self._waiting if not r.future.done()]
        cost = 0.0
        if self.join_rounds:
            if not self._active:
                self._round_pos = 0  # the round ended with its last request: the next starts now
            elif self._round_pos:
                return cost  # mid-round: the waiting requests join when it ends
        if not self._waiting or len(self._active) >= self.max_batch_size:
            return cost
        used = sum(self._context(r) for r in self._active) if self.kv_capacity is not None else 0
        n = 0
        for r in self._waiting:
            if len(self._active) + n >= self.max_batch_size:
                break
            ctx = self._context(r)
            if self.kv_capacity is not None:
                if used + ctx + 1 > self.kv_capacity and (self._active or n):
                    break  # first come, first served: the head of the line waits for room
                used += ctx
            cost += ctx * self.prefill_token_s
            r.prefilled = True
            n += 1
        self._active += self._waiting[:n]
        del self._waiting[:n]
        return cost

    def _preempt(self) -> None:
        """The KV cache cannot hold the next step: the newest running requests wait again (first in line)."""
        assert self.kv_capacity is not None
        while len(self._active) > 1 and sum(self._context(r) + 1 for r in self._active) > self.kv_capacity:
            r = self._active.pop()
            r.prefilled = False
            self._waiting.insert(0, r)
            self._preemptions += 1

    def _plan(self, start: float, first: float) -> _Stretch:
        """The next stretch: the steps until the next event the engine can foresee (a request finishing, a
        round's end with a load waiting, the KV cache filling up), or one step while `on_step` is set."""
        active = self._active
        R = len(active)
        C = sum(self._context(r) for r in active)
        n = min(r.length - r.done for r in active)
        if self._loads_waiting:
            n = min(n, self.round_steps - self._round_pos)
        if self.kv_capacity is not None:
            n = min(n, max(1, (self.kv_capacity - C) // R))
        if self.on_step is not None:
            n = 1
        # step i of the stretch: R requests holding C + i * R tokens of context
        a = self.step_s + self.seq_s * R + self.kv_s * C
        return _Stretch(start, first, a, self.kv_s * R, max(1, n), R)

    async def _sleep_until(self, when: float, interruptible: bool) -> bool:
        """Sleep until `when` (``time.monotonic()``); True when :meth:`_poke` woke it first (only if
        `interruptible`)."""
        if not interruptible:
            await asyncio.sleep(max(0.0, when - time.monotonic()))
            return False
        loop = asyncio.get_running_loop()
        waker: asyncio.Future[None] = loop.create_future()
        self._waker = waker
        handle = loop.call_later(max(0.0, when - time.monotonic()), _wake, waker)
        try:
            await waker
        finally:
            handle.cancel()
            self._waker = None
        return time.monotonic() < when

    async def _pay(self, seconds: float) -> None:
        """A load's cost: slept, or burned (shared devices)."""
        if self.burner is None:
            await asyncio.sleep(seconds)
        else:
            await asyncio.to_thread(self.burner.burn, seconds)

    async def _burn(self, seconds: float) -> None:
        """Burn `seconds` of a step's cost in a thread (not cut short)."""
        assert self.burner is not None
        self._burned += await asyncio.to_thread(self.burner.burn, seconds)

    def _plan_run(self, prefill: float) -> list[_Stretch]:
        """Shared devices: the stretches the running requests go through until the last one ends, on a clock of
        seconds of work from 0 (nothing new arriving: a request, a pause or a load ends the run at its next step
        boundary). One stretch only while requests wait for a slot (they join when one ends), a load waits for a
        round's end, the KV cache is bounded or `on_step` is set."""
        joins_later = self.join_rounds and all(r.length - r.done <= self.round_steps - self._round_pos
                                               for r in self._active)  # the round ends with its last request
        if ((self._waiting and not joins_later) or self._loads_waiting or self.kv_capacity is not None
                or self.on_step is not None):
            return [self._plan(0.0, prefill)]
        reqs = [(r.length - r.done, self._context(r)) for r in self._active]
        out: list[_Stretch] = []
        start, first = 0.0, prefill
        while reqs:
            R, C, n = len(reqs), sum(c for _, c in reqs), min(k for k, _ in reqs)
            st = _Stretch(start, first, self.step_s + self.seq_s * R + self.kv_s * C, self.kv_s * R, n, R)
            out.append(st)
            start, first = st.end_of(n), 0.0
            reqs = [(k - n, c + n) for k, c in reqs if k > n]
        return out

    def _burn_run(self, run: list[_Stretch], stop: threading.Event, commit: Callable[[int], None],
                  loop: asyncio.AbstractEventLoop) -> tuple[int, float]:
        """In a thread: burn `run`'s stretches one after the other, each committed on the loop as it ends (its
        finished requests resolve then, without a return to the loop between stretches, as a real engine's
        decoding thread runs on); ``(stretches done, work done)``, cut short when `stop` is set."""
        assert self.burner is not None
        done = 0.0
        for i, st in enumerate(run):
            done += self.burner.burn(st.end_of(st.n) - done, stop)
            if stop.is_set():
                return i, done
            try:
                loop.call_soon_threadsafe(commit, st.n)
            except RuntimeError:  # the loop closed under the engine
                return len(run), done
        return len(run), done

    async def _burn_stretch(self, prefill: float) -> None:
        """Shared devices: burn the running requests' stretches (:meth:`_plan_run`) and commit their steps."""
        run = self._plan_run(prefill)
        mark = [time.monotonic()]

        def commit(m: int) -> None:
            self._commit(m, mark[0])
            mark[0] = time.monotonic()

        stop = threading.Event()
        self._burn_stop = stop
        try:
            i, done = await asyncio.to_thread(self._burn_run, run, stop, commit, asyncio.get_running_loop())
        finally:
            self._burn_stop = None
        self._burned += done
        if i < len(run):  # cut short: the step in progress ends first
            st = run[i]
            m = st.steps_by(done)
            if m < st.n:
                m += 1
                await self._burn(st.end_of(m) - done)
            commit(m)

    async def _drive(self) -> None:
        while True:
            prefill = self._admit()
            if self._loads_waiting and (self._round_pos == 0 or not self._active):
                async with self._step_lock():
                    await self._serve_loads()
                self._round_pos = 0
                continue
            if not self._active:
                self._clock = None
                self._round_pos = 0
                if not self._waiting:
                    await self._sleep_until(time.monotonic() + 3600.0, True)
                continue
            if self.kv_capacity is not None and self._active:
                self._preempt()
            async with self._step_lock():
                now = time.monotonic()
                if self.burner is not None:
                    if self._prefill_due:
                        prefill += self.prefill_s + sum(self._context(r) for r in self._active) * self.prefill_token_s
                        self._prefill_due = False
                        self._prefills += 1
                    await self._burn_stretch(prefill)
                    continue
                if self._clock is None or now - self._clock > self.catchup_s:
                    self._clock = now  # idle before this step (or too late to catch up)
                if self._prefill_due:
                    ctx = sum(self._context(r) for r in self._active)
                    prefill += self.prefill_s + ctx * self.prefill_token_s
                    self._prefill_due = False
                    self._prefills += 1
                st = self._stretch = self._plan(self._clock, prefill)
                t_start = now
                end = st.end_of(st.n)
                # always yield once: requests and pauses of other coroutines get in between stretches
                if await self._sleep_until(end, True):
                    m = st.steps_by(time.monotonic())
                    if m < st.n:  # the step in progress ends first
                        m += 1
                        await self._sleep_until(st.end_of(m), False)
                else:
                    m = st.n
                self._stretch = None
                self._clock = st.end_of(m)
                self._commit(m, t_start)

    def _commit(self, m: int, t_start: float) -> None:
        """`m` decoding steps of the running requests are done: their ids, the versions, the finished ones."""
        batch = [r for r in self._active if not r.future.done()]
        t_end = time.monotonic()
        self._busy += t_end - t_start
        for _ in range(m):
            self._steps += 1
            self._round_pos = (self._round_pos + 1) % self.round_steps
            if self.on_step is not None:
                self._record(batch, 1)
                self.on_step(self._steps)
        if self.on_step is None:
            self._record(batch, m)
        self._slots += m * len(batch)
        self._log.append((t_start, t_end, m * len(batch)))

    def _record(self, batch: list[_Request], m: int) -> None:
        for r in batch:
            if r.future.done():
                continue
            n = min(m, r.length - r.done)
            r.done += n
            if r.version_fn is not None:
                v = int(r.version_fn())
                if r.versions and r.versions[-1][0] == v:
                    r.versions[-1] = (v, r.versions[-1][1] + n)
                else:
                    r.versions.append((v, n))
            if r.done >= r.length:
                finish = "stop" if r.length < r.max_new_tokens * self.k else "length"
                ids = r.tokens(self.vocab, self.eos_id, self.k)
                self._tokens += len(ids)
                self._requests += 1
                logps = [self.log_prob] * len(ids)
                if r.version_fn is None:
                    r.future.set_result(Completion(ids, logps, finish))
                else:
                    r.future.set_result(Generation(ids, logps, finish, versions=r.version_list(self.k)))


def _wake(waker: asyncio.Future[None]) -> None:
    if not waker.done():
        waker.set_result(None)
