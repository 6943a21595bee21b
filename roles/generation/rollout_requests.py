"""Request-level generation of a rollout worker: :class:`RequestGeneration`, the object a
:class:`~asyncrl.roles.generation.rollout.RolloutWorker` holds as ``self.requests``.

Every row is a program over the request-level engine (:meth:`_request_engine`: the HF request
batcher, or an engine that schedules requests itself), so many concurrent calls share its decoding
rounds and each token records the weight version that produced it. One seam, :meth:`_run_rows`,
runs every row: a program ``async (llm, sample) -> Trajectory`` -- a plain request
(:func:`~asyncrl.roles.agentic.episodes.single_turn`), an episode, or an agent whose gateway session samples
through the row's ``llm`` -- so a new kind of row is one such function::

    call ─► _start_requests (gate: start under the newest weights) ─► _run_rows
              row i: LLM(submit, params[i], key[i]) ─► program(llm, sample) ─► engine requests
              ─► pack_trajectories ─► the generate layout (+ token_versions; episode fields for episodes)

* ``generate_episodes`` -- batch mode's episodes (seeds from the whole call, as ``generate``'s);
* ``generate_requests`` -- the streaming trainer's calls: one response, episode or agent session per
  row, version-free per-row seeds and round-log keys; ``resume`` continues rows another replica handed
  over (``hand_over``, or a preemption notice) from their decoded prefixes;
* ``round_log`` / ``replay_rounds`` -- the batcher's recorded rounds and their exact replay;
* ``statistics`` -- what this rank's request-level generation did.

It owns the request batcher, the calls in flight and the round-log replay; what it shares with batch generation
(the prompt check, the sampling parameters, the replica field) is the worker's
:class:`~asyncrl.roles.generation.call_setup.CallSetup`, and each token's version and the gate a call waits at come
from the worker's :class:`~asyncrl.roles.generation.rollout_weights.RolloutWeights` (its ``weights``).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from tensordict import TensorDict, TensorDictBase

from typing import TYPE_CHECKING

from asyncrl.roles._util import text_list, with_fields
from asyncrl.roles.engines import SamplingParams
from asyncrl.roles.errors import EpisodeError, PreemptedError
from asyncrl.roles.agentic.agents import AgentEpisode
from asyncrl.roles.agentic.environments import resolve_episode
from asyncrl.roles.generation.preemption import PREEMPT_DEADLINE_S
from asyncrl.roles.agentic.episodes import LLM, Sample, Trajectory, pack_trajectories, single_turn, validate_trajectory
from asyncrl.roles.engines.batcher import Generation, RequestBatcher, request_batcher
from asyncrl.roles.engines.round_log import ReplayBatcher, RoundRecord

if TYPE_CHECKING:
    from asyncrl.roles.generation.call_setup import CallSetup

__all__ = ["RequestGeneration", "RequestCall", "partial_row", "prefix_of"]


@dataclass
class RequestCall:
    """One running ``generate_requests`` call on a rollout worker: what a hand-over needs of it."""

    loop: asyncio.AbstractEventLoop
    """The loop it runs on (a SIGTERM's notice reaches it from the main thread)."""
    seed: int | None
    """The call's seed (the prompt group's, in streaming)."""
    keys: list[str] = field(default_factory=list)
    """Its rows' request keys, once its requests start."""
    plain: bool = False
    """Plain requests (one response per row): only those are handed over with their tokens; an episode's or
    agent's rows are generated again from their seeds (their environment's state does not travel)."""
    finished: dict[str, Any] = field(default_factory=dict)
    """Rows whose generation returned, by key."""
    handing: bool = False
    """A hand-over stopped it: it raises ``PreemptedError`` carrying ``handed``."""
    handed: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What its rows decoded, by key (:func:`partial_row`), once handed over."""
    started: set[str] = field(default_factory=set)
    """Plain rows submitted to the engine (or returned from a finished prefix), by key."""
    all_started: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once every plain row started: a hand-over then finds each in the engine or among the finished."""
    rounds: list[dict[str, Any]] | None = None
    """On a SIGTERM's notice: the rank's round log since its last fetch, carried by its ``PreemptedError``."""


def partial_row(gen: Any) -> dict[str, Any]:
    """A row's generation (finished, or a prefix with ``finish_reason=""``) in the JSON-able form that travels
    to the controller and back into ``generate_requests(resume=...)``."""
    return {"ids": [int(t) for t in gen.response_ids], "log_probs": [float(x) for x in gen.log_probs],
            "versions": [int(v) for v in gen.versions], "finish": str(gen.finish_reason or "")}


def prefix_of(row: dict[str, Any]) -> Any:
    """The :class:`~asyncrl.roles.engines.batcher.Generation` a :func:`partial_row` dict stands for."""
    ids, lps, vs = list(row["ids"]), list(row["log_probs"]), list(row["versions"])
    if not len(ids) == len(lps) == len(vs):
        raise ValueError(f"a handed-over row needs one log-prob and one version per token; got {len(ids)} ids, "
                         f"{len(lps)} log-probs, {len(vs)} versions")
    return Generation([int(t) for t in ids], [float(x) for x in lps], str(row.get("finish") or ""),
                      versions=[int(v) for v in vs])


class RequestGeneration:
    """Request-level generation of a rollout worker: episodes, ``generate_requests``, hand-overs, the round log
    and ``statistics``. A :class:`~asyncrl.roles.generation.rollout.RolloutWorker` holds one (``self.requests``);
    its registered request-level methods delegate here.

    It owns the request batcher, the calls in flight, the round-log replay and the episode program; it is given
    what it uses of the worker.

    Args:
        call_setup: the worker's :class:`~asyncrl.roles.generation.call_setup.CallSetup`, shared with batch
            generation: the rollout's settings, rank, context and
            :class:`~asyncrl.roles.generation.rollout_weights.RolloutWeights` (each token's version, the gate a call
            starts behind, the updates ``statistics`` reports), the prompt check, the sampling parameters and the
            replica field.
        engine: the worker's current engine (``restart_engine`` replaces it, after :meth:`drop_batcher`).
        request_engine: the worker's ``_request_engine`` (the seam test subclasses wrap), whose default is
            :meth:`request_engine`.
        model: the rollout's model (its vocabulary bounds an episode's tokens).
        tokenizer: the model's tokenizer.
        episode_tasks: the request-level calls in flight (shared with the weights: an update waits for or reaches
            them).
        colocated: the worker's ``colocated`` (the reward worker a ``compute_reward`` call scores with).
    """

    def __init__(self, *, call_setup: CallSetup, engine: Callable[[], Any], request_engine: Callable[[], Any],
                 model: Any, tokenizer: Any, episode_tasks: set[asyncio.Task[Any]],
                 colocated: Callable[[str], Any]) -> None:
        self.call_setup = call_setup
        self.config = call_setup.config
        self.rank = call_setup.rank
        self.context_length = call_setup.context_length
        self.weights = call_setup.weights
        self._engine = engine
        self._request_engine = request_engine
        self.model = model
        self.tokenizer = tokenizer
        self._episode_tasks = episode_tasks
        self.colocated = colocated
        self._episode_fn: Any = None
        if self.config.episode is not None:
            self._episode_fn = resolve_episode(self.config.episode, self.config.episode_kwargs)
        elif self.config.agent is not None:
            self._episode_fn = AgentEpisode(self.config.agent, context_length=self.context_length)
        self._batcher: Any = None  # the request-level engine, built on the worker's loop at first use
        self._trajectories = [0, 0]  # episodes returned, and those whose model tokens span versions
        self._replay: list[dict[str, Any]] | None = None  # rounds to replay (replay_rounds)
        self._replay_hold = False  # the replay holds requests no recorded round ran (replay_rounds(hold_unknown))
        self._preempted = False  # told to stop (SIGTERM): generate_requests raises PreemptedError
        self._request_calls: dict[asyncio.Task[Any], RequestCall] = {}  # running generate_requests calls
        self._reward_thread: Any = None  # generate_requests(compute_reward=True): the colocated reward's thread
        self._notices: set[asyncio.Task[Any]] = set()  # hand-overs a SIGTERM started (held until they end)

    @property
    def engine(self) -> Any:
        """The worker's current engine."""
        return self._engine()

    @property
    def episodic(self) -> bool:
        """Rows are episodes or agent sessions (``RolloutConfig.episode``/``agent``), not plain requests."""
        return self._episode_fn is not None

    def running_batcher(self) -> Any:
        """The request batcher now running, or None; a replay's is built first (its weight updates wait until
        its recorded rounds need them)."""
        if self._batcher is None and self._replay is not None:
            self._request_engine()
        return self._batcher

    def drop_batcher(self) -> None:
        """Stop the request batcher (the worker replaces its engine: a new one is built on the new engine)."""
        if self._batcher is not None:
            self._batcher._abort.set()
            self._batcher = None

    def close(self) -> None:
        """Stop the request batcher, the agent gateway and the reward thread (the worker's ``on_close``)."""
        if self._batcher is not None:
            self._batcher._abort.set()
        gateway = getattr(self._episode_fn, "gateway", None)  # rollout.agent: the worker's gateway
        if gateway is not None:
            gateway.request_stop()
        if self._reward_thread is not None:
            self._reward_thread.shutdown(wait=False)

    def on_preemption_notice(self) -> None:
        """SIGTERM (main thread, before the process exits): stop the running ``generate_requests`` calls at
        their next decoding step, handing their rows over (:meth:`_hand_over_calls`); they raise
        ``PreemptedError`` carrying what the rows decoded (a call whose generation returned meanwhile returns its
        rows instead, scored with ``compute_reward``), and the process exits once they ended (at most
        ``PREEMPT_DEADLINE_S`` later), so the controller learns of the notice before the process is gone."""
        self._preempted = True
        calls = list(self._request_calls.items())
        ended = threading.Event()

        def check(_: Any = None) -> None:
            if all(task.done() for task, _ in calls):
                ended.set()

        loops: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Task[Any], RequestCall]]] = {}
        for task, call in calls:
            loops.setdefault(call.loop, []).append((task, call))
        for loop, mine in loops.items():
            def start(mine: list[tuple[asyncio.Task[Any], RequestCall]] = mine,
                      loop: asyncio.AbstractEventLoop = loop) -> None:
                for t, _ in mine:
                    t.add_done_callback(check)
                task = loop.create_task(self._hand_over_calls(mine))
                self._notices.add(task)
                task.add_done_callback(self._notices.discard)

            loop.call_soon_threadsafe(start)
        if calls:
            ended.wait(PREEMPT_DEADLINE_S)

    # ---- multi-turn episodes --------------------------------------------------------------

    def request_engine(self) -> Any:
        """``submit(prompt_ids, params, key=None) -> Generation``: the request-level HF engine (one batcher
        per worker; `key` names the request in its round log), or one-prompt calls of an engine that
        schedules requests itself (vLLM; `key` unused)."""
        if self._batcher is None:
            kwargs: dict[str, Any] = dict(max_batch_size=getattr(self.engine, "max_batch_size", 64),
                                          chunk_tokens=self.config.chunk_tokens, version_fn=lambda: self.weights.version,
                                          partial_rollout=self.config.partial_rollout)
            if self._replay is not None:
                self._batcher = ReplayBatcher(self.engine, [RoundRecord.from_dict(d) for d in self._replay],
                                              hold_unknown=self._replay_hold, **kwargs)
            else:
                self._batcher = request_batcher(self.engine, record_rounds=self.config.record_rounds, **kwargs)
        batcher = self._batcher
        if batcher is not None:
            async def request(ids: list[int], params: SamplingParams, key: str | None = None,
                              prefix: Generation | None = None) -> Generation:
                self.call_setup.check_weights()
                if prefix is not None:
                    return await batcher.generate(ids, params, key=key, prefix=prefix)
                return await batcher.generate(ids, params, key=key)

            return request

        arequest = getattr(self.engine, "agenerate_request", None)  # per-token versions (vLLM)
        if arequest is not None and self.config.partial_rollout != "off":
            async def versioned(ids: list[int], params: SamplingParams, key: str | None = None) -> Generation:
                self.call_setup.check_weights()
                return await arequest(ids, params, version_fn=lambda: self.weights.version)

            return versioned

        async def submit(ids: list[int], params: SamplingParams, key: str | None = None) -> Generation:
            version = self.weights.version
            c = (await self.engine.generate([ids], params))[0]
            return Generation(c.response_ids, c.log_probs, c.finish_reason, versions=[version] * len(c.response_ids))

        return submit

    async def _start_requests(self, batch: TensorDictBase, max_new_tokens: int | None, temperature: float | None,
                              seed: int | None) -> tuple[int, list[list[int]], SamplingParams, Any]:
        """``(R, prompts, base params, submit)`` for a call whose rows become requests, once no weight update is
        loading (so the first round runs under the new weights)."""
        R = max_new_tokens if max_new_tokens is not None else self.config.max_new_tokens
        prompts = self.call_setup.prompts(batch, R)
        gate = self.weights.gate()
        while not gate.is_set() and self._replay is None:  # an update is loading: start under the new weights
            await gate.wait()  # (a replay's rounds decide that; its updates wait for them, so must its requests not)
        return R, prompts, self.call_setup.params(prompts, R, temperature, seed), self._request_engine()

    # ---- the one seam: every request-level row -------------------------------------------------

    def _row_program(self, episode: str | None = None,
                     episode_kwargs: dict[str, Any] | None = None) -> tuple[Any, str]:
        """``(program, name)`` of this call's rows: `episode` when given, else the configured episode or agent
        (``RolloutConfig.episode``/``agent``), else :func:`~asyncrl.roles.agentic.episodes.single_turn`."""
        if episode is not None:
            return resolve_episode(episode, episode_kwargs), episode
        if self._episode_fn is not None:
            return self._episode_fn, str(self.config.episode or self.config.agent)
        return single_turn, "request"

    async def _run_rows(self, batch: TensorDictBase, R: int, prompts: list[list[int]], submit: Any,
                        params: list[SamplingParams], keys: list[str] | None, program: Any, name: str, *,
                        max_in_flight: int | None = None) -> TensorDict:
        """The one entry of request-level generation: row ``i`` runs ``program(llm, sample)`` with an
        :class:`~asyncrl.roles.agentic.episodes.LLM` over the request engine `submit` (sampling `params[i]`, round-log
        key ``keys[i]``), every row in flight at once; the trajectories are packed in the ``generate`` layout.

        A program is :func:`~asyncrl.roles.agentic.episodes.single_turn` (a plain request), an episode, or an agent
        (:class:`~asyncrl.roles.agentic.agents.AgentEpisode`: the row's LLM serves a gateway session), so each of them
        gets admission, partial rollout across turns and per-token versions from the same engine. The call
        counts among the generations a weight update waits for (``partial_rollout="off"``) or reaches."""
        import anyio


        plain = program is single_turn  # the engine's own rows: trusted, no episode fields
        agent = getattr(program, "agent", None) is not None  # rows come from the gateway, with its prompts
        prompt_text, answers = text_list(batch, "prompt"), text_list(batch, "answer")
        trajs: list[Any] = [None] * len(prompts)
        limit = anyio.Semaphore(len(prompts) if plain else max_in_flight or self.config.max_episodes_in_flight)
        vocab = int(self.model.get_output_embeddings().weight.shape[0])

        async def run(i: int) -> None:
            sample = Sample(prompts[i], prompt=prompt_text[i] if prompt_text else None,
                            answer=answers[i] if answers else None, index=i)
            llm = LLM(submit, self.tokenizer, params[i], R, key=keys[i] if keys is not None else None)
            async with limit:
                if plain:
                    trajs[i] = await program(llm, sample)
                    return
                try:
                    traj = await program(llm, sample)
                except Exception as e:  # the user's code: say whose and which row (tools never get here)
                    raise EpisodeError(f"episode {name!r} (row {i}) raised {type(e).__name__}: {e}; fix the "
                                       "episode or its environment (tool errors are observations, not raises)") from e
                if agent and isinstance(traj, Trajectory):  # the prompt is the gateway's rendered chat
                    sample = replace(sample, prompt_ids=list(traj.prompt_ids))
                trajs[i] = validate_trajectory(traj, name, sample, R, vocab)

        me = asyncio.current_task()
        if me is not None:
            self._episode_tasks.add(me)  # weight updates and sleep wait for (or reach) the rows in flight
        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(run, i)
        except BaseExceptionGroup as group:  # the first row's error cancelled the rest: raise it alone,
            first = _first_leaf(group)  # with its own cause (the user's exception and its traceback)
            raise first from first.__cause__
        finally:
            if me is not None:
                self._episode_tasks.discard(me)
        pad = int(self.tokenizer.pad_token_id)
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
        if agent:  # one width on every rank (their batches are concatenated): the longest prompt a row fits
            prompt_ids, prompt_mask = left_pad_prompts([t.prompt_ids for t in trajs], pad,
                                                       self.context_length - R)
        fields = pack_trajectories(trajs, prompt_ids, prompt_mask, R, pad, self.weights.version)
        if plain:  # a plain request's row keeps generate's layout (plus token_versions)
            for k in _EPISODE_FIELDS:
                del fields[k]
        else:
            tv, model_tokens = fields["token_versions"], fields["response_mask"].bool()
            self._trajectories[0] += len(trajs)
            self._trajectories[1] += sum(len(set(tv[b][model_tokens[b]].tolist())) > 1 for b in range(len(trajs)))
        if agent:
            fields.update(prompt_ids=prompt_ids, prompt_mask=prompt_mask)
        fields["replica"] = self.call_setup.replica_field(len(trajs))
        return with_fields(batch, fields)

    async def generate_episodes(self, batch: TensorDictBase, max_new_tokens: int | None = None,
                                temperature: float | None = None, seed: int | None = None, *,
                                episode: str | None = None, episode_kwargs: dict[str, Any] | None = None,
                                max_in_flight: int | None = None) -> TensorDict:
        """One episode per row (``RolloutConfig.episode`` or ``agent``, or `episode` for this call), all in
        flight at once; returns the layout of :meth:`generate` (see :func:`asyncrl.roles.agentic.episodes.pack_trajectories`):
        ``response_ids`` of width R hold model and environment tokens, ``response_mask`` is 1 only on
        model tokens, plus ``token_versions``, ``episode_reward``, ``num_turns``, ``tool_errors``,
        ``stop_reason``. Rows repeated for GRPO run separate episodes (their ``uid`` is kept, so a
        group is the episodes of one sample). A malformed trajectory raises
        :class:`~asyncrl.roles.errors.TrajectoryError` naming the episode and the field. `max_in_flight`
        overrides ``RolloutConfig.max_episodes_in_flight`` for this call (1: one episode at a time).
        Batch mode's call: row ``i``'s seed derives from the whole call's (its prompts and the weight version);
        :meth:`generate_requests` runs the same rows with version-free per-row seeds."""
        program, name = self._row_program(episode, episode_kwargs)
        if program is single_turn:
            raise ValueError("generate_episodes needs an episode: set RolloutConfig.episode or pass episode=...")
        R, prompts, base, submit = await self._start_requests(batch, max_new_tokens, temperature, seed)
        params = [replace(base, seed=((base.seed or 0) + 104729 * i) & 0x3FFFFFFF) for i in range(len(prompts))]
        return await self._run_rows(batch, R, prompts, submit, params, None, program, name,
                                    max_in_flight=max_in_flight)

    async def generate_requests(self, batch: TensorDictBase, max_new_tokens: int | None = None,
                                temperature: float | None = None, seed: int | None = None,
                                resume: dict[str, dict[str, Any]] | None = None,
                                compute_reward: bool = False) -> TensorDict:
        """Every row through the request-level engine (:meth:`_run_rows`): one response per row, or with
        ``RolloutConfig.episode``/``agent`` one episode or agent session per row (the layout of
        :meth:`generate_episodes`), so many concurrent calls (streaming rollout: one per prompt group)
        share its decoding rounds. A call counts among the request-level generations a weight update
        handles: with ``partial_rollout="off"`` an update waits for it (its rows keep one version); with
        ``"keep"``/``"recompute"`` the update reaches its rows in flight without waiting -- also an
        episode's turn in flight -- and they decode on under the new weights (each token records its version).

        Returns the layout of :meth:`generate` plus ``token_versions`` (``[B, R]``: each generated
        token's weight version, -1 off the model tokens); ``version`` is a row's first model token's version.
        Row ``i``'s sampling seed comes from the config's seed, `seed`, the row's index in the whole
        batch and its prompt (not the weight version): the same call regenerates the same rows under
        the same weights, and the rows of one prompt differ. Its requests are named ``f"{seed}:{row}"``
        in the round log (an episode's later turns ``f"{seed}:{row}/{turn}"``). A preemption notice (SIGTERM
        to the process) or :meth:`hand_over` stops the rows at their next decoding step and raises
        ``PreemptedError`` whose ``partial`` holds what each plain row decoded (roles/generation/preemption.py).

        `resume` (pass it as ``asyncrl.Broadcast``: every rank picks its rows): such ``partial`` rows by
        request key, from the same call on another replica. A plain row found there begins with its
        tokens, log-probs and versions and decodes on from them (a finished one is returned as it is); the
        other rows (and every episode row) are generated from their seeds.

        `compute_reward`: score the rows here, with the reward worker that shares this process and rank
        (``Worker.colocated("reward")``: its ``compute_reward``, one call at a time, in a thread of its own), and
        return its fields (``scores``, ``response_length``) with the rows: one call per prompt group instead of
        a generate and a score call. Those two fields also ride in the call's reply
        (``GroupFuture.summary()``: the controller reads a group's scores without fetching its rows)."""
        if self._preempted:
            raise PreemptedError(f"rollout rank {self.rank} was told to stop (SIGTERM); generate elsewhere")
        me = asyncio.current_task()
        assert me is not None  # a coroutine the actor's loop runs as a task
        call = self._request_calls[me] = RequestCall(asyncio.get_running_loop(), seed)  # a notice hands it over
        try:
            out = await self._generate_requests(batch, max_new_tokens, temperature, seed, resume or {}, call)
        except (asyncio.CancelledError, Exception):
            if not (self._preempted or call.handing):
                raise
            why = "was told to stop (SIGTERM)" if self._preempted else "handed its rows over (a resize)"
            kept = sum(len(r["ids"]) for r in call.handed.values())
            raise PreemptedError(f"rollout rank {self.rank} {why}: its rows stopped at their next decoding step "
                                 f"({len(call.handed)} rows with {kept} tokens decoded kept); continue them elsewhere "
                                 "with the same seed", call.handed, call.rounds) from None
        finally:
            self._request_calls.pop(me, None)
        if compute_reward:
            out.update(await self._score(out))
        return out

    async def _score(self, rows: TensorDict) -> TensorDictBase:
        """The colocated reward worker's ``compute_reward`` of `rows` (see :meth:`generate_requests`): in one
        thread, so the engine's loop decodes on meanwhile and reward calls never run at once (as on the reward's
        own ordered lane)."""
        reward = self.colocated("reward")
        if self._reward_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._reward_thread = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-reward")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._reward_thread, reward.compute_reward, rows)

    async def _generate_requests(self, batch: TensorDictBase, max_new_tokens: int | None,
                                 temperature: float | None, seed: int | None,
                                 resume: dict[str, dict[str, Any]], call: RequestCall) -> TensorDict:
        program, name = self._row_program()
        R, prompts, base, submit = await self._start_requests(batch, max_new_tokens, temperature, seed)
        offset = self.rank * len(prompts)  # rows before this rank's shard (data-parallel shards are equal)

        def row_seed(i: int) -> int:
            h = hashlib.sha256(f"{self.config.seed}|{seed}|{offset + i}|{prompts[i]}".encode())
            return int.from_bytes(h.digest()[:4], "little") & 0x3FFFFFFF

        params = [replace(base, seed=row_seed(i)) for i in range(len(prompts))]
        keys = [f"{seed}:{offset + i}" for i in range(len(prompts))]
        call.keys, call.plain = keys, program is single_turn
        if call.plain:
            submit = self._resuming(submit, resume, call)
        return await self._run_rows(batch, R, prompts, submit, params, keys, program, name)

    def _resuming(self, submit: Any, resume: dict[str, dict[str, Any]], call: RequestCall) -> Any:
        """`submit` that starts a row found in `resume` from its prefix (a finished one: its completion, no
        decoding) and notes every returned row in `call` (a hand-over returns them too)."""
        prefixes = {str(k): prefix_of(v) for k, v in resume.items()}
        continues = self._batcher is not None  # an engine scheduling requests itself: unfinished rows start over

        async def request(ids: list[int], params: SamplingParams, key: str | None = None) -> Any:
            pre = prefixes.get(key) if key is not None else None
            if key is not None:  # (submitted below before any other task runs: no await in between)
                call.started.add(key)
                if call.started.issuperset(call.keys):
                    call.all_started.set()
            if pre is not None and pre.finish_reason:
                gen = pre
            elif pre is not None and continues:
                gen = await submit(ids, params, key=key, prefix=pre)
            else:
                gen = await submit(ids, params, key=key)
            if key is not None:
                call.finished[key] = gen
            return gen

        return request

    async def _hand_over_calls(self, calls: list[tuple[asyncio.Task[Any], RequestCall]]) -> dict[int, dict[str, Any]]:
        """Stop `calls` at their rows' next decoding step and take what the rows decoded (their request
        batcher's :meth:`~asyncrl.roles.engines.batcher.RequestBatcher.hand_over`, plus the rows that
        already returned); each call still generating raises ``PreemptedError`` carrying it, and one whose
        generation returned meanwhile finishes with its rows (scored, with ``compute_reward``). Returns them
        by call seed."""
        for _, c in calls:
            c.handing = True
        for task, c in calls:  # every row submitted (or finished) first: a replay takes each where it stands
            if c.plain and c.keys and not c.all_started.is_set() and not task.done():
                started = asyncio.ensure_future(c.all_started.wait())
                await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
                started.cancel()
        keys = [k for _, c in calls if c.plain for k in c.keys if k not in c.finished]
        batcher = self._batcher
        taken = await batcher.hand_over(keys) if isinstance(batcher, RequestBatcher) and keys else {}
        if taken:
            await batcher.settled()  # the round it stopped is in the round log (keep: after its last segment)
        if self._preempted and self.config.record_rounds:  # the process exits with them: they go in the answer
            rounds = self._round_records(clear=True)  # (one copy per call; the journal keeps one per rank)
            for _, c in calls:
                c.rounds = rounds
        out: dict[int, dict[str, Any]] = {}
        for task, c in calls:
            if c.plain:
                rows = {k: partial_row(g) for k, g in c.finished.items()}
                rows.update({k: partial_row(taken[k]) for k in c.keys if k in taken})
                c.handed = rows
            # Only a call still generating is stopped: its cancellation lands in generate_requests' try, which
            # raises PreemptedError. One whose generation returned since it was listed (a SIGTERM lists the calls
            # from the main thread; the awaits above) is scoring its whole rows (compute_reward) or has returned
            # them: it finishes as it is, since a cancel there would reach the controller as a plain cancellation
            # it never asked for. (Checked and cancelled with no await in between, on the loop the call runs on.)
            if self._request_calls.get(task) is c:
                task.cancel()
            if c.seed is not None:
                out[int(c.seed)] = dict(c.handed)
        return out

    async def hand_over(self, seeds: list[int]) -> dict[int, dict[str, Any]]:
        """Hand the running ``generate_requests`` calls of `seeds` over (a resize past its drain deadline): their
        rows stop at the next decoding step and each call raises ``PreemptedError``; returns what the rows
        decoded, ``{seed: {request key: row}}`` (rows as :func:`partial_row`; only plain requests' rows), for
        ``generate_requests(..., resume=...)`` on another replica. A seed with no call running here is left out.
        As a group call, one dict per rank."""
        wanted = {int(s) for s in seeds}
        calls = [(t, c) for t, c in self._request_calls.items() if c.seed is not None and int(c.seed) in wanted
                 and not c.handing and not t.done()]
        return await self._hand_over_calls(calls) if calls else {}

    def round_log(self, clear: bool = False) -> list[dict[str, Any]]:
        """The request batcher's rounds so far as JSON-able dicts (``RolloutConfig.record_rounds``), then, with
        ``RolloutConfig.agent``, one ``{"session": key, "requests": [...]}`` per gateway session closed (what each
        agent asked and was answered, as digests: a replay checks its agents against them); `clear` forgets
        what was returned. As a group call, one list per rank."""
        if not self.config.record_rounds:
            raise RuntimeError("this rollout worker does not record its rounds; set RolloutConfig.record_rounds=True")
        return self._round_records(clear)

    def _round_records(self, clear: bool) -> list[dict[str, Any]]:
        """:meth:`round_log`'s records."""
        sessions = list(getattr(self._episode_fn, "sessions", None) or [])  # rollout.agent: the gateway's sessions
        if clear and sessions:
            self._episode_fn.sessions.clear()
        rounds = [r.to_dict() for r in self._batcher.round_log(clear)] if self._batcher is not None else []
        return rounds + sessions

    def replay_rounds(self, rounds: list[dict[str, Any]], hold_unknown: bool = False) -> int:
        """Replay `rounds` (a recorded :meth:`round_log`): the request-level engine runs exactly those rounds,
        so the same requests (same keys and seeds) and the same weight updates, in order, regenerate the
        recording's tokens bit for bit. Call before any request-level generation. Returns the rounds.
        `hold_unknown`: a request no recorded round ran is held (never decoded) instead of refused -- what
        the recording had in flight when it ended. While replaying, requests start without waiting for a
        weight update in progress (the update waits until the rounds need it)."""
        if self.config.engine != "hf":
            raise ValueError(f"replay_rounds needs the request-level HF engine; this worker runs {self.config.engine!r}")
        if self._batcher is not None:
            raise RuntimeError("replay_rounds must come before any request-level generation on this worker (its "
                               "request engine already runs); build a fresh worker for the replay")
        self._replay = [r for r in rounds if "session" not in r]
        self._replay_hold = bool(hold_unknown)
        sessions = [r for r in rounds if "session" in r]
        if sessions or hasattr(self._episode_fn, "replay"):  # rollout.agent: its agents must ask what they asked
            self._episode_fn.replay(sessions)
        return len(self._replay)

    def replay_rank_rounds(self, rounds: list[dict[str, Any]], hold_unknown: bool = False) -> int:
        """:meth:`replay_rounds` with each rank's own recorded rounds (a group call takes one list per rank,
        as :meth:`round_log` returned them, and `hold_unknown` once per rank)."""
        return self.replay_rounds(rounds, hold_unknown)

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
        out: dict[str, Any] = {"version": self.weights.version, "partial_rollout": self.config.partial_rollout,
                               "updates": [dict(u) for u in self.weights.updates], "trajectories": self._trajectories[0],
                               "spanning_trajectories": self._trajectories[1]}
        if stats is not None:
            out.update(asdict(stats) if not isinstance(stats, dict) else stats)
        return out


def left_pad_prompts(prompts: list[list[int]], pad_id: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_ids, prompt_mask)`` of `prompts`, left-padded to `width` or the longest (the batch layout)."""
    P = max(width, *(len(p) for p in prompts))
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for b, p in enumerate(prompts):
        if p:
            ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, P - len(p):] = 1
    return ids, mask


_EPISODE_FIELDS = ("episode_reward", "num_turns", "tool_errors", "stop_reason")
"""What :func:`~asyncrl.roles.agentic.episodes.pack_trajectories` adds for episodes, absent from a plain request's row."""


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first non-group exception of `group` (an anyio task group wraps its tasks' errors)."""
    e: BaseException = group
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e
