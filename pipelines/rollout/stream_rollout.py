"""Streaming rollout (``trainer.rollout_mode=stream``): prompt groups in flight, a step trains the
first finished groups that fill it, within ``max_staleness`` per trajectory, nothing dropped.

::

    sampler ──► admit group g at the rollout's version v0   (waits: admission control, pipelines/rollout/admission.py)
       │          generate_requests(prompts of g, compute_reward)   (one call per group to one replica, the one
       │                                                       with the fewest groups in flight; its request-level
       │                                                       engine batches the rounds of the groups it holds;
       │                                                       the reward worker of its process scores the rows)
       │          await the scores (the call's reply, GroupFuture.summary: the rows stay on the replica)
       │            ─► finished: the group may be taken
    weights ──► load export[newest] as soon as it is published (never waits for groups in flight: the
                update lands at a decoding-round boundary; tokens carry their version)
    take(step) ◄── the first finished groups that keep the bound (Admission.take)
                   ─► AdvantageWorker.concat_shard(group futures)  (worker to worker, each training rank
                      builds its own shard of the batch; the controller holds futures only)
                      ─► RolloutBatch(step, min v0, batch future, scores future)

With ``algorithm.filter_groups`` a finished group whose rewards are all equal is rejected
(:meth:`Admission.reject`) and the next group admitted in its room. Held-out evaluation runs in the weight
loop: a due version is evaluated before the next one is loaded (docs/streaming.md).

It stands in for :class:`~asyncrl.pipelines.rollout.rollout_loop.BatchRollout` behind the same four calls
(``run``, ``take``, ``upcoming``, ``finish``). Group ``g`` holds the prompts of slot ``g % B`` of step
``g // B``'s prompt batch (``B`` groups per step) and samples with seed ``batch_seed(config, g)``.

Recovery: a rollout-pool fault (dead or hung rollout/reward worker) replaces that pool
(:meth:`~asyncrl.pipelines.supervision.supervisor.Supervisor.replace_rollout`); finished groups' futures are first
re-homed on the training pool, groups in flight are issued again with the same prompts and seed once
the new engines hold at least their admission version. A resize or a preemption notice hands groups over
with what their rows decoded (:meth:`StreamRollout.keep_rows`): the retry continues each row from its tokens
(docs/nodes.md). One replica whose engine died (``ReplicaLostError``) is replaced alone: taken out of routing and
weight loads, its groups issued again on the others, a new engine started in its process and loaded with the
version the others hold, then routed to again (:meth:`StreamRollout._lose_replica`). A lost *process* of the
rollout pool (its worker group has the ``"process"`` restart policy) is replaced the same way, alone: its replicas
leave routing and weight loads, their groups are issued again on the other processes' replicas, a new process is
started in its bundle and loaded with the version the others hold (:meth:`StreamRollout._lose_process`). A restart
(training worker fault) or a resume replaces the loop state whole: the groups a checkpoint recorded as admitted and
not yet trained are admitted again first, in index order, with the same seeds (finished ones are regenerated, not
kept).

Routing: each group is one call to one replica (``options(rank=r)``), scored there by the reward worker that
shares its process (:data:`SCORE_IN_GENERATE`: one Ray call per group, and the controller reads the scores from
the call's reply, not the rows), so a group's G rows decode together, one engine's batch, whatever the number of
replicas. A run that records its engines' rounds (the HF engine, for
an exact replay) sends each group to the whole rollout group instead, its rows split across the ranks, as a
replay re-issues them (:data:`ROUTE_GROUPS`).

Replay: after each take the engines' round log goes to the journal's side file, and ``asyncrl replay``
follows it with :class:`~asyncrl.pipelines.rollout.stream_replay.StreamReplay` (a subclass of this one).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import structlog
from asyncrl import Broadcast
from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.journaling.rounds import records_rounds
from asyncrl.pipelines.rollout.admission import Admission, groups_in_flight
from asyncrl.pipelines.loop.loop_state import LoopState, ModeCheckpoint, RolloutBatch, batch_seed
from asyncrl.pipelines.supervision.recovery import is_preemption
from asyncrl.pipelines.rollout.rollout_loop import RolloutServices, evaluate, evaluate_rest
from asyncrl.pipelines.rollout.sampling import group_stds
from asyncrl.pipelines.rollout.stream_scale import StreamScaler
from asyncrl import GroupBrokenError, RemoteError, WorkerDiedError
from asyncrl.pipelines.loop.deadlines import unwrap
from asyncrl.pipelines.supervision.recovery import describe, root_cause

__all__ = ["StreamRollout", "ROUTE_GROUPS", "SHARD_STEP_BATCH", "SCORE_IN_GENERATE", "REPLACE_REPLICAS",
           "REPLACE_PROCESSES", "PROCESS_START_S", "balanced_order", "load_every_rank", "load_ranks"]

log = structlog.get_logger("asyncrl.pipelines")

ROUTE_GROUPS = True
"""Send each prompt group to one replica, the least loaded (module docstring). False: one call to the whole
rollout group, its rows split across every replica (what a run that records rounds does; the twin's benchmark
measures both)."""

SHARD_STEP_BATCH = True
"""Build a step's batch in shards, one per training rank (``stages.concat_sharded``). False: on one rank, which
every training rank then reads whole (what the code did before; ``benchmarks/cluster_twin.py`` measures both)."""

SPLIT_STEP_PROMPTS = True
"""Cut a step's prompt rows into its groups' by one ``split`` in the thread that builds them. False: each group slices
its rows from the step's batch on the loop (about 3.5 times the CPU; what the code did before;
``benchmarks/cluster_twin.py`` measures both)."""


class _Slices:
    """A step's groups' prompt rows as slices of its batch, cut when asked (:data:`SPLIT_STEP_PROMPTS` off)."""

    def __init__(self, whole: Any, group: int) -> None:
        self._whole, self._group = whole, group

    def __getitem__(self, slot: int) -> Any:
        return self._whole[slot * self._group:(slot + 1) * self._group]


SCORE_IN_GENERATE = True
"""Score each prompt group in its generate call (``generate_requests(compute_reward=True)``: the reward worker of
the replica's process scores the rows there) and read the scores from the call's reply (``GroupFuture.summary``):
one call per group. False: a generate and a score call per group, the controller fetching the scores (what the
code did before; ``benchmarks/cluster_twin.py`` measures both)."""

REPLACE_REPLICAS = True
"""Replace a lost replica's engine alone (:meth:`StreamRollout._lose_replica`), its groups issued again on the other
replicas meanwhile. False: the whole rollout pool is replaced for it (what the code did before; the chaos
benchmark measures both)."""

REPLACE_PROCESSES = True
"""Replace a lost rollout process alone (:meth:`StreamRollout._lose_process`), its replicas' groups issued again on
the other processes meanwhile. False: the whole rollout pool is replaced for it (what the code did before; the chaos
benchmark measures both)."""

PROCESS_START_S = 300.0
"""How long a lost rollout process's replacement may take to start (placement, process, constructors) before the
whole pool is replaced instead (no capacity for its bundle)."""


@dataclass
class _Flight:
    """A finished group, waiting for a step."""

    gen: Any
    scores: Any
    """Its score call's future; None when the generate call scored it (:data:`SCORE_IN_GENERATE`)."""
    v0: int
    reward_mean: float
    reward_std: float
    gen_time: float
    tokens: int | None = None
    """Its rows' response tokens (the reward's ``response_length``; None when the reward returns none)."""


class _Attempt:
    """The streaming state of one loop-state attempt (a restart starts a new one)."""

    def __init__(self, state: LoopState, admission: Admission, queue: list[int], next_group: int) -> None:
        self.state = state
        self.admission = admission
        self.queue = queue  # groups to admit before next_group (a resume's untrained groups)
        self.next_group = next_group
        self.flights: dict[int, _Flight] = {}
        self.issued: dict[int, bool] = {}  # groups whose first calls were issued (and journaled)
        self.finishes = 0
        self.epoch = 0  # rollout-pool replacements so far
        self.replacing = anyio.Lock()
        self.waits = 0
        self.wait_s = 0.0
        self.filtered = 0  # groups rejected by dynamic sampling since the last take
        self.running: dict[int, tuple[Any, Any]] = {}  # group -> (rollout group it runs on, generate future)
        self.handed: dict[int, dict[str, dict[str, Any]]] = {}  # group -> its rows handed over (request key -> row)
        self.handing: set[int] = set()  # groups whose hand-over call is in flight (their retry waits for it)
        self.carried: dict[int, int] = {}  # pool epoch -> tokens its hand-overs carried (Resize.kept_tokens)
        self.stopped: dict[int, dict[int, dict[str, int]]] = {}  # pool epoch -> group -> row key -> tokens kept
        self.reissued: dict[int, set[int]] = {}  # pool epoch -> groups whose call there ended and was issued again
        self.reissuing: set[int] = set()  # groups whose call ended, not issued again yet
        self.load: list[int] = []  # groups in flight per rollout rank (of the pool `load_epoch`)
        self.load_epoch = -1
        self.dead: set[int] = set()  # ranks of pool `epoch` whose engine died and is being replaced (not routed to)
        self.lost: set[int] = set()  # those of `dead` whose process died and is being replaced
        self.loading = anyio.Lock()  # a weight load, or a replaced replica catching up with the loaded version
        self.tg: anyio.abc.TaskGroup | None = None  # the producer's task group (replicas' replacements run in it)


class StreamRollout:
    """Keeps prompt groups in flight and hands each step its first finished groups (see the module)."""

    def __init__(self, services: RolloutServices) -> None:
        self._services = services
        self._attempt: _Attempt | None = None
        self.regenerated = 0
        """Group calls issued again after a rollout-pool fault or a hand-over (over the whole run)."""
        self.scaler = StreamScaler(services, self)
        """Resizes of the rollout pool beside the groups in flight (``scale_rollout``, preemption, autoscaling)."""
        self._prompt_batches: dict[int, Any] = {}  # step -> its prompt rows, one TensorDict per group (_step_prompts)
        self._prompt_widths: dict[int, int] = {}  # step -> its prompt rows' width (_prompt_width)
        self._prompts_lock = anyio.Lock()
        self.handovers: list[tuple[int, dict[str, dict[str, Any]]]] = []
        """``(group, rows)`` of every hand-over that kept decoded tokens: each row (by request key) as the old
        replica returned it (``ids``, ``log_probs``, ``versions``, ``finish``); the group's retry continued them."""

    # ---- the producer --------------------------------------------------------------------------

    async def run(self) -> None:
        """Admit groups and load new weights until the train loop ends (it cancels this)."""
        sv = self._services
        s, cfg = sv.current().state, sv.config
        B, t = cfg.prompts_per_step, cfg.trainer
        resume = s.rollout_state or {}
        adm = Admission(B, t.max_staleness, groups_in_flight(cfg), t.stream.drop_stale, next_step=s.start_step,
                        bound=t.stream.bound)
        a = self._attempt = _Attempt(s, adm, sorted(resume.get("pending", [])),
                                     int(resume.get("next_group", s.start_step * B)))
        await self._notify()
        async with anyio.create_task_group() as tg:
            a.tg = tg
            tg.start_soon(self._weights_loop, a)
            tg.start_soon(self.scaler.run, a)
            while True:
                t0 = time.perf_counter()
                if not self._admissible(a):
                    a.waits += 1
                await s.wait_for(lambda: self._admissible(a))
                a.wait_s += time.perf_counter() - t0
                g = a.queue.pop(0) if a.queue else a.next_group
                if g == a.next_group:
                    a.next_group += 1
                v0 = s.rollout_version
                adm.admit(g, v0)
                tg.start_soon(self._group, a, g, v0, name=f"stream group {g}")

    def _admissible(self, a: _Attempt) -> bool:
        s, adm, t = a.state, a.admission, self._services.config.trainer
        st = adm.statistics()
        needed = (t.steps - s.start_step) * self._services.config.prompts_per_step
        return st.admitted - st.dropped - st.rejected < needed and adm.can_admit(s.rollout_version)

    async def _group(self, a: _Attempt, g: int, v0: int, *,
                     task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Generate and score group `g` (admitted at `v0`); then it may be taken. Its journal record is
        written as its calls are issued (then `task_status` is started): the journal orders them with the
        weight loads as the rollout workers' ordered lane does, and a replay issues them in that order."""
        sv = self._services
        s, cfg, loader = a.state, sv.config, sv.loader()
        assert loader is not None
        B, G = cfg.prompts_per_step, cfg.group_size
        slot = g % B
        prompts = (await self._step_prompts(g // B))[slot]
        elastic = cfg.trainer.rollout_range.elastic
        while True:
            epoch = a.epoch
            groups = sv.current().groups
            assert groups is not None
            t0 = time.perf_counter()
            resume = a.handed.get(g)  # rows a removed replica handed over: continued from their tokens
            rank = held = self._route(a, groups.rollout, epoch)  # held: counted in flight on `rank` until it ends
            try:
                more: dict[str, Any] = {"resume": Broadcast(resume)} if resume else {}
                generate = groups.rollout.generate_requests
                # scored in the call only when routed to one replica: a call split across the ranks must raise at
                # the first rank's preemption notice (select, below), while its reply's summary waits for every rank
                fused = rank is not None and scores_in_generate(generate)
                if fused:
                    more["compute_reward"] = True
                if rank is not None:
                    generate = generate.options(rank=rank)
                gen = sv.tracer.watch(generate(prompts, seed=batch_seed(cfg, g), **more),
                                      "generate", step=g // B, group=g, version=v0, rank=rank)
                a.running[g] = (groups.rollout, gen)  # a resize drains it, or hands it over (stream_scale.py)
                if not a.issued.get(g):
                    a.issued[g] = True
                    sv.journal.group(g, seed=batch_seed(cfg, g), version=v0)
                    task_status.started()
                elif g in a.reissuing:  # issued again: a replay's next resize waits for that (stream_replay)
                    a.reissuing.discard(g)
                    await self._notify()
                if fused:  # scored in the call: its reply carries the scores, the rows stay put
                    scored_td = await gen.summary()  # (a preemption notice raises here, at its rank's error)
                    self._unload(a, held, epoch)
                    held = None
                    sc = None
                else:
                    # The score call is ordered on the rollout workers' lane, like a weight update: issued
                    # now, it would hold its place there until the group's tokens exist, and an update
                    # issued meanwhile would wait for this group to finish generating. Issued once the
                    # generation finished (nothing is fetched), it never holds an update back.
                    if elastic:  # a preemption notice raises here, at the told-to-stop rank's error (the other
                        await gen.select("version")  # ranks' rows are then handed over), not in a score call
                    else:
                        await _finished(gen)
                    self._unload(a, held, epoch)
                    held = None
                    sc = stages.score(groups, gen, rank=rank)
                    scored_td = await sc
                scores = scored_td["scores"]
                if a.epoch != epoch or a.replacing.locked():
                    # finished on a pool that is being (or was) replaced after a fault: re-home its results on the
                    # training pool now, before that pool closes (rehome_flights has run already); a pool closed
                    # meanwhile refuses them (GroupClosedError) and the group is generated again
                    now = sv.current().groups
                    advantage = stages_unwrap(now.advantage if now is not None else groups.advantage)
                    gen, sc = advantage.echo(gen), (advantage.echo(sc) if sc is not None else None)
                break
            except Exception as e:
                self._unload(a, held, epoch)
                a.reissued.setdefault(epoch, set()).add(g)  # (a resize's journal: handed over, not drained)
                a.reissuing.add(g)
                handing = g in a.handing
                if handing:  # a hand-over of g is under way: its answer keeps the rows first (the same rows its
                    await s.wait_for(lambda: g not in a.handing)  # ranks' errors carry, whole)
                # a preemption notice's rows arrive with its error (less those this pool's hand-over kept)
                done = a.stopped.get(epoch, {}).get(g, {})
                self.keep_rows(a, g, {k: r for k, r in handed_rows(e).items() if k not in done}, epoch)
                site = a.running.get(g)
                noticed = notice_rounds(e)  # a SIGTERM's: the rank's last rounds, which exit with its process
                if noticed is not None and site is not None:
                    sv.journal.noticed(epoch, noticed[0], len(getattr(site[1], "ranks", ())) or 1, noticed[1],
                                       after_step=s.taken)
                if (not handing and site is not None and len(getattr(site[1], "ranks", ())) > 1
                        and self._preempted(e, epoch)):
                    # the told-to-stop rank returned its rows; the other ranks still decode theirs: hand those
                    # over too (issued before any await, while the pool still takes calls)
                    await self.scaler.hand_over(a, site[0], [g], epoch)
                a.running.pop(g, None)
                await self._notify()  # a drain waiting for the old pool to hold no group (nothing else may wake it)
                await self._recover(a, e, epoch, g, rank=rank)
                self.regenerated += 1
                # the new engines' weights: at least v0; and the old pool's hand-over of g has returned
                await s.wait_for(lambda: s.rollout_version >= v0 and g not in a.handing)
        a.running.pop(g, None)
        a.handed.pop(g, None)
        await self._notify()  # a drain may be waiting for it
        std = float(group_stds(scores, G)[0])
        if self._rejects(a, std):
            a.admission.reject(g)
            a.filtered += 1
            sv.journal.group_filtered(g, version=v0)
            await self._notify()  # its room may be admitted again
            return
        tokens = int(scored_td["response_length"].sum()) if "response_length" in scored_td.keys() else None
        a.flights[g] = _Flight(gen, sc, v0, float(scores.float().mean()), std, time.perf_counter() - t0, tokens)
        a.admission.finish(g)
        a.finishes += 1
        await self._notify()

    async def _prompt_width(self, step: int) -> int:
        """The prompt width (left-padded) of step `step`'s prompt rows: every group of the step has it (a step whose
        groups this attempt never issued, a restored one, has its rows built as any other's)."""
        if step not in self._prompt_widths:
            await self._step_prompts(step)
        return self._prompt_widths[step]

    async def _step_prompts(self, step: int) -> Any:
        """The prompt rows of step `step`'s batch, one TensorDict per group (slot), built and split once for its
        groups and in a thread (a step's batch grows with its rows: built per group, that was quadratic in the groups
        per step; built on the loop, it stalled every call in flight; one split is a fraction of the CPU of a slice
        per group). The last few steps' are kept: groups are admitted in index order, at most
        ``max_staleness + 1`` steps apart."""
        got = self._prompt_batches.get(step)
        if got is None:
            async with self._prompts_lock:  # one build per step, however many of its groups ask at once
                got = self._prompt_batches.get(step)
                if got is None:
                    loader = self._services.loader()
                    assert loader is not None
                    def build() -> tuple[Any, int]:
                        whole = loader.batch(step)
                        G = loader.group_size
                        rows = list(whole.split(G)) if SPLIT_STEP_PROMPTS else _Slices(whole, G)
                        return rows, int(whole["prompt_ids"].shape[1])

                    got, self._prompt_widths[step] = await anyio.to_thread.run_sync(build)
                    self._prompt_batches[step] = got
                    keep = self._services.config.trainer.max_staleness + 2
                    for old in [s for s in self._prompt_batches if s < step - keep]:
                        del self._prompt_batches[old]
        return got

    def _route(self, a: _Attempt, rollout: Any, epoch: int) -> int | None:
        """The rollout rank a group's calls go to: the one with the fewest groups in flight (the lowest rank of
        those), counted as in flight from now; None: the whole group (:data:`ROUTE_GROUPS`, a run that records
        its engines' rounds)."""
        if not ROUTE_GROUPS or records_rounds(self._services.config):
            return None
        n = rollout.world_size
        if a.load_epoch != epoch or len(a.load) != n:  # a new pool: nothing of it in flight yet
            a.load, a.load_epoch = [0] * n, epoch
        load = a.load
        if a.dead:
            live = [r for r in range(n) if r not in a.dead] or list(range(n))  # (none live: it fails, the pool goes)
            rank = min(live, key=lambda r: (load[r], r))
        else:  # the same rank, found in C: this runs per group, over hundreds of replicas
            rank = load.index(min(load))
        load[rank] += 1
        return rank

    def _unload(self, a: _Attempt, rank: int | None, epoch: int) -> None:
        """A group's generation on `rank` of pool `epoch` ended (done or failed): no longer in flight there."""
        if rank is not None and a.load_epoch == epoch and rank < len(a.load):
            a.load[rank] -= 1

    def _rejects(self, a: _Attempt, std: float) -> bool:
        """Dynamic sampling (``algorithm.filter_groups``): reject a group whose rewards are all equal, at
        most ``(max_num_gen_batches - 1) * B`` since the last step took its groups (batch mode's budget of
        extra groups per step); past that, such groups are trained (``sampling/padded_groups``)."""
        cfg = self._services.config
        fg = cfg.algorithm.filter_groups
        return fg.enable and std == 0.0 and a.filtered < (fg.max_num_gen_batches - 1) * cfg.prompts_per_step

    async def _weights_loop(self, a: _Attempt) -> None:
        """Load the newest exported version as soon as it is published; evaluate it first when it is due
        (the next load waits for the evaluation, groups in flight decode on with the evaluated weights)."""
        sv = self._services
        s, ev = a.state, sv.evaluator()
        while True:
            epoch = a.epoch
            try:
                if ev is not None and ev.due(s.rollout_version):
                    await evaluate(sv, s.rollout_version)
                    continue
                await s.wait_for(lambda: s.exported > s.rollout_version and s.exports.get(s.exported) is not None)
                v, epoch = s.exported, a.epoch
                groups = sv.current().groups
                assert groups is not None
                sv.journal.load(v)  # (the update is issued below, before any other task runs)
                # shielded: when the run ends, rollout_version must name the weights the engines hold
                with anyio.CancelScope(shield=True), sv.tracer.span("weight_sync", track=groups.rollout.name,
                                                                     version=v):
                    async with a.loading:
                        if a.dead:  # a replica's engine is being replaced: the others load, it catches up after
                            live = [r for r in range(groups.rollout.world_size) if r not in a.dead]
                            await load_ranks(groups.rollout, s.exports[v], live)
                        else:
                            await load_every_rank(sv.weights, groups, s.exports[v])
                    if a.epoch == epoch:  # else loaded into engines that were replaced meanwhile
                        sv.weights.loaded(s, v)
                        sv.weights.drop_older(s, v)
            except Exception as e:
                await self._recover(a, e, epoch)
                continue
            await self._notify()

    async def _recover(self, a: _Attempt, error: Exception, epoch: int, group: int | None = None,
                       rank: int | None = None) -> None:
        """Replace the rollout pool after `error` (once per fault: the other groups that saw it only
        wait for the replacement), or raise `error` when it is not a rollout-pool fault. A lost replica's engine
        (``ReplicaLostError`` of `rank`, the call's rank when it went to one) is replaced alone
        (:meth:`_lose_replica`), as is a lost process of the pool (:meth:`_lose_process`): its groups are issued
        again on the other replicas meanwhile."""
        if not self.scaler.preempting(epoch) and self._lose_process(a, error, epoch, rank):
            return
        if self._preempted(error, epoch) and await self.scaler.preempted(a, epoch, group):
            return  # the pool was resized away from the preempted worker; the caller issues its group again
        if self._lose_replica(a, error, epoch, rank):
            return
        await self._replace_pool(a, error, epoch)

    async def _replace_pool(self, a: _Attempt, error: Exception, epoch: int) -> None:
        """Replace the whole rollout pool after `error` of pool `epoch` (once: the other groups that saw it only wait
        for the replacement), or raise `error` when it is not a rollout-pool fault."""
        sv = self._services
        async with a.replacing:
            if a.epoch != epoch:
                return  # another group (or the weight loop) already replaced the pool
            if not sv.supervisor.can_replace(error):
                raise error
            self.rehome_flights(a)
            await sv.supervisor.replace_rollout(error, a.state.policy_version)
            a.epoch += 1
            a.dead.clear()  # a new pool: every engine new
            a.lost.clear()
        await self._notify()

    def _lose_replica(self, a: _Attempt, error: Exception, epoch: int, rank: int | None) -> bool:
        """Whether `error` is the death of one replica's engine that is replaced alone: a ``ReplicaLostError``
        of a rank (groups routed one per replica; weights sent by the object store; another replica alive; the
        restart policy allows replacements). Then the rank is taken out of routing and weight loads and its
        replacement runs beside the groups in flight (:meth:`_replace_replica`)."""
        sv = self._services
        e = root_cause(error)
        if not (isinstance(e, RemoteError) and e.exc_type.rpartition(".")[2] == "ReplicaLostError"):
            return False
        groups = sv.current().groups
        if (not REPLACE_REPLICAS or a.epoch != epoch or groups is None or a.tg is None or not ROUTE_GROUPS
                or records_rounds(sv.config) or sv.weights.transport == "collective"
                or not sv.supervisor.can_replace(error)):
            return False
        if rank is None:
            rank = getattr(e, "rank", None)
        n = groups.rollout.world_size
        if not isinstance(rank, int) or not 0 <= rank < n:
            return False
        if rank in a.dead:
            return True  # already being replaced
        if len(a.dead) + 1 >= n:
            return False  # no replica left to route to: replace the pool
        a.dead.add(rank)
        record = sv.supervisor.replica_lost(error, rank)
        a.tg.start_soon(self._replace_replica, a, rank, epoch, record, name=f"replace rollout replica {rank}")
        return True

    async def _replace_replica(self, a: _Attempt, rank: int, epoch: int, record: dict[str, Any]) -> None:
        """A new engine for replica `rank` (``RolloutWorker.restart_engine``), loaded with the version the other
        replicas hold (under the weight loop's lock, so none is loaded past it meanwhile); then it is routed to
        again. When that fails, the pool is replaced (:meth:`_recover`)."""
        sv = self._services
        s, groups = a.state, sv.current().groups
        assert groups is not None
        t0 = time.perf_counter()
        try:
            await unwrap(groups.rollout).restart_engine.options(rank=rank)()
            async with a.loading:
                v = s.rollout_version
                if v > 0:
                    await load_ranks(groups.rollout, s.exports[v], [rank])
        except Exception as e:  # noqa: BLE001 - the new engine failed too: the whole pool is replaced
            if a.epoch == epoch:
                if rank not in a.lost:  # (else its process is being replaced: that replacement routes it again)
                    a.dead.discard(rank)
                await self._recover(a, e, epoch)
            return
        if a.epoch == epoch:
            a.dead.discard(rank)
            if a.load_epoch == epoch and rank < len(a.load):
                a.load[rank] = 0
        record["time_s"] = time.perf_counter() - t0
        log.warning("trainer.replica_replaced", rank=rank, version=s.rollout_version,
                    seconds=round(record["time_s"], 2))
        await self._notify()

    def _lose_process(self, a: _Attempt, error: Exception, epoch: int, rank: int | None) -> bool:
        """Whether `error` is the death of a rollout-pool process (a ``WorkerDiedError`` of the rollout or reward
        group, or a call refused at a rank of a lost process) that is replaced alone: the pool's worker group has
        the ``"process"`` restart policy, groups are routed one per replica, weights go by the object store, a
        replica of another process is alive and the restart policy allows replacements. Then the process's ranks
        are taken out of routing and weight loads and its replacement runs beside the groups in flight
        (:meth:`_replace_process`). A preemption *notice* (``PreemptedError``: the process still answers) is not a
        death: the scaler hands its groups over (:meth:`StreamScaler.preempted`)."""
        sv = self._services
        e = root_cause(error)
        groups = sv.current().groups
        if groups is None or a.epoch != epoch:
            return False
        rollout = unwrap(groups.rollout)
        if getattr(rollout, "restart", "none") != "process":
            return False
        ours = (groups.rollout.name, groups.reward.name)
        if isinstance(e, GroupBrokenError):
            r = e.ranks[0] if e.ranks and str(e).startswith(tuple(f"group {x!r}" for x in ours)) else None
        else:
            r = getattr(e, "rank", None) if getattr(e, "group", None) in ours else None
        n = rollout.world_size
        if not isinstance(r, int) or not 0 <= r < n:
            return False
        if r in a.lost:
            return True  # already being replaced (also a notice its process sent before it exited)
        if not isinstance(e, (WorkerDiedError, GroupBrokenError)):
            return False
        if r not in rollout.lost_ranks:
            return True  # a call to its former process, replaced since: the group is simply issued again
        if (not REPLACE_PROCESSES or a.tg is None or not ROUTE_GROUPS or records_rounds(sv.config)
                or sv.weights.transport == "collective" or not sv.supervisor.can_replace(error)):
            return False
        ranks = rollout.process_ranks(r)
        if len(a.dead | set(ranks)) >= n:
            return False  # no replica left to route to: replace the pool
        a.dead.update(ranks)
        a.lost.update(ranks)
        record = sv.supervisor.process_lost(error, ranks)
        a.tg.start_soon(self._replace_process, a, ranks, epoch, error, record,
                        name=f"replace rollout process of ranks {ranks}")
        return True

    async def _replace_process(self, a: _Attempt, ranks: list[int], epoch: int, error: Exception,
                               record: dict[str, Any]) -> None:
        """A new process for the lost rollout ranks `ranks` (``WorkerGroup.replace_process``: in its bundle, the
        other processes left alone), loaded with the version the other replicas hold (under the weight loop's lock,
        so none is loaded past it meanwhile); then its ranks are routed to again. When its start fails (or takes
        longer than :data:`PROCESS_START_S`: no capacity), the whole pool is replaced for `error`."""
        sv = self._services
        s, groups = a.state, sv.current().groups
        assert groups is not None
        t0 = time.perf_counter()
        try:
            await unwrap(groups.rollout).replace_process(ranks[0], timeout_s=PROCESS_START_S)
            async with a.loading:
                v = s.rollout_version
                if v > 0:
                    await load_ranks(groups.rollout, s.exports[v], ranks)
        except Exception as e:  # noqa: BLE001 - the new process failed: the whole pool is replaced
            record["failed"] = describe(e)
            log.warning("trainer.process_replacement_failed", ranks=ranks, error=describe(e))
            if a.epoch == epoch:
                await self._replace_pool(a, error, epoch)
            return
        if a.epoch == epoch:
            a.dead.difference_update(ranks)
            a.lost.difference_update(ranks)
            if a.load_epoch == epoch:
                for r in ranks:
                    if r < len(a.load):
                        a.load[r] = 0
        record["time_s"] = time.perf_counter() - t0
        log.warning("trainer.process_replaced", ranks=ranks, version=s.rollout_version,
                    seconds=round(record["time_s"], 2))
        await self._notify()

    def _preempted(self, error: Exception, epoch: int) -> bool:
        """Whether `error` of pool `epoch` is a preemption notice's (or the told-to-stop process's exit)."""
        return is_preemption(error) or self.scaler.preempting(epoch)

    @property
    def kept_tokens(self) -> int:
        """Decoded tokens the hand-overs carried to a new pool, continued there instead of generated again (a
        token handed over twice counts twice)."""
        return sum(len(r["ids"]) for _, rows in self.handovers for r in rows.values())

    def keep_rows(self, a: _Attempt, g: int, rows: dict[str, dict[str, Any]], epoch: int) -> None:
        """Keep what group `g`'s rows decoded on pool `epoch` before a hand-over (by request key); its retry
        continues them. A row already kept with more tokens keeps those (a later hand-over that came before
        the row restarted)."""
        if not rows:
            return
        kept = a.handed.setdefault(g, {})
        new = {k: r for k, r in rows.items() if len(r["ids"]) >= len(kept.get(k, {}).get("ids", ()))}
        if not new:
            return
        kept.update(new)
        a.stopped.setdefault(epoch, {}).setdefault(g, {}).update({k: len(r["ids"]) for k, r in new.items()})
        carried = sum(len(r["ids"]) for r in new.values())
        a.carried[epoch] = a.carried.get(epoch, 0) + carried
        self.handovers.append((g, {k: dict(r) for k, r in new.items()}))

    def rehome_flights(self, a: _Attempt) -> None:
        """Re-home the finished groups' futures on the training pool: their data must outlive the rollout
        pool's groups, which are about to close."""
        g = self._services.current().groups
        assert g is not None
        old = (g.rollout.name, g.reward.name)
        advantage = stages_unwrap(g.advantage)
        for f in a.flights.values():
            if getattr(f.gen, "group", None) in old:
                f.gen = advantage.echo(f.gen)
            if getattr(f.scores, "group", None) in old:
                f.scores = advantage.echo(f.scores)

    async def notify(self) -> None:
        """Wake every task waiting on the loop state (admission, takes, drains)."""
        await self._notify()

    async def _notify(self) -> None:
        s = self._services.current().state
        async with s.cond:
            s.cond.notify_all()

    # ---- the consumer's side -------------------------------------------------------------------

    async def take(self, step: int) -> RolloutBatch:
        """Step `step`'s batch: its first finished groups within the bound, assembled on the training
        pool (waits for groups to finish)."""
        sv = self._services
        s = sv.current().state
        await s.wait_for(lambda: self._attempt is not None and self._attempt.state is s)
        a = self._attempt
        assert a is not None and a.admission.next_step == step, (step, a and a.admission.next_step)
        t0 = time.perf_counter()
        while (got := a.admission.take()) is None:
            if a.admission.dropped_groups:
                await self._notify()  # drop_stale: the dropped groups' room may be admitted again
            seen = a.finishes
            await s.wait_for(lambda seen=seen: a.finishes != seen)
        chosen, dropped = got
        self.scaler.after_take(time.perf_counter() - t0)  # the autoscaler's view of this step
        await self._notify()  # admission may go on
        sv.journal.rounds(step, a.epoch)  # the engines' rounds so far: they ran every chosen group (replay)
        return await self._assemble(a, step, chosen, dropped)

    async def _assemble(self, a: _Attempt, step: int, chosen: list[int], dropped: list[int]) -> RolloutBatch:
        """Step `step`'s batch of the finished groups `chosen` (in order), assembled on the training pool;
        `dropped` (too stale, ``drop_stale``) are journaled and forgotten."""
        sv = self._services
        s, cfg = sv.current().state, sv.config
        for g in dropped:
            f = a.flights.pop(g)
            sv.journal.group_dropped(g, version=f.v0, at_version=step)
        flights = [a.flights.pop(g) for g in chosen]
        groups, loader = sv.current().groups, sv.loader()
        assert groups is not None and loader is not None
        gens, scores = [f.gen for f in flights], [f.scores for f in flights]
        row_groups: list[int] | None = None
        if SHARD_STEP_BATCH and len(flights) >= groups.advantage.world_size:  # a shard per training rank, built there
            tokens = [f.tokens for f in flights]
            if cfg.trainer.balance_batch and None not in tokens:  # each rank about the same tokens
                order = balanced_order(tokens, groups.advantage.world_size)  # type: ignore[arg-type]
                gens, scores = [gens[i] for i in order], [scores[i] for i in order]
                row_groups = [chosen[i] for i in order] if order != list(range(len(order))) else None
            width = max([await self._prompt_width(step) for step in {g // cfg.prompts_per_step for g in chosen}])
            batch = stages.concat_sharded(groups, gens, scores, pad_id=loader.pad_id,
                                          uid_base=step * cfg.prompts_per_step, width=width)
        else:
            batch = groups.advantage.concat_groups(gens, scores, pad_id=loader.pad_id,
                                                   uid_base=step * cfg.prompts_per_step)
        metrics: dict[str, float] = dict(await groups.advantage.version_stats(batch, step, cfg.trainer.max_staleness))
        st = a.admission.statistics()
        metrics.update({
            "stream/in_flight": float(st.in_flight), "stream/buffered": float(st.buffered),
            "stream/peak_in_flight": float(st.peak_in_flight), "stream/dropped_groups": float(st.dropped),
            "stream/admission_waits": float(a.waits), "stream/admission_wait_s": a.wait_s,
            "stream/admitted_version_min": float(min(f.v0 for f in flights)),
        })
        if cfg.algorithm.filter_groups.enable:  # batch mode's names (pipelines/rollout/sampling.py)
            metrics.update({"sampling/filtered_groups": float(a.filtered),
                            "sampling/padded_groups": float(sum(f.reward_std == 0.0 for f in flights)),
                            "sampling/min_group_std": min(f.reward_std for f in flights),
                            "stream/rejected_groups": float(st.rejected)})
        a.waits, a.wait_s, a.filtered = 0, 0.0, 0
        return RolloutBatch(step=step, version=min(f.v0 for f in flights), batch=batch,
                            scores=batch.select("scores"),
                            reward_mean=sum(f.reward_mean for f in flights) / len(flights),
                            gen_time=max(f.gen_time for f in flights), metrics=metrics, groups=chosen,
                            row_groups=row_groups)

    def upcoming(self, step: int) -> tuple[int, Any] | None:
        """Never decided ahead (``trainer.precompute_log_probs`` is refused with streaming)."""
        return None

    async def finish(self) -> None:
        """After the last step: the evaluations still due, the loaded version's first when the end of the
        run cut its evaluation short."""
        sv = self._services
        ev, run = sv.evaluator(), sv.current()
        if ev is not None and run.groups is not None and ev.due(run.state.rollout_version):
            await evaluate(sv, run.state.rollout_version)
        await evaluate_rest(sv)

    def untrained(self) -> tuple[list[int], list[int]]:
        """``(batches, groups)`` admitted and not trained (at the run's end: generating, or finished and waiting
        for a step); no batches (streaming has none)."""
        a = self._attempt
        return [], sorted(a.admission.pending()) if a is not None else []

    async def settle_for_checkpoint(self, step: int) -> None:
        """Nothing to wait for: streaming keeps no batches, its untrained groups are listed instead."""

    def restore(self, saved: ModeCheckpoint | None, state: LoopState) -> None:
        """The run goes on from `saved`'s groups: its ``pending`` ones admitted again first, then ``next_group``."""
        state.rollout_state = saved

    def checkpoint_state(self) -> ModeCheckpoint:
        """What a checkpoint keeps of streaming: the admitted, untrained groups (regenerated on resume,
        first, with the same seeds) and the next new group's index."""
        a = self._attempt
        if a is None:
            sv = self._services
            return {"pending": [], "next_group": sv.current().state.start_step * sv.config.prompts_per_step}
        return {"pending": sorted([*a.admission.pending(), *a.queue]), "next_group": a.next_group}


def scores_in_generate(generate: Any) -> bool:
    """Whether a group's scores come from its `generate` call (a ``generate_requests`` group method):
    :data:`SCORE_IN_GENERATE`, and the rollout class's method takes ``compute_reward`` and carries ``scores`` in
    its reply (``@register(..., summary=("scores", ...))``: ``RolloutWorker``'s does; a subclass that registers
    its own must keep both), for a call routed to one replica. Else (and for a call split across the ranks: a run
    that records its engines' rounds) a score call follows it."""
    spec = getattr(generate, "spec", None)
    return (SCORE_IN_GENERATE and spec is not None and "compute_reward" in spec.signature.parameters
            and not callable(spec.summary) and "scores" in spec.summary)


def handed_rows(error: BaseException) -> dict[str, dict[str, Any]]:
    """The rows a ``PreemptedError`` carried (what the told-to-stop replica's rows decoded), else nothing."""
    e = root_cause(error)
    cause = getattr(e, "cause", None)
    partial = getattr(cause, "partial", None)
    return dict(partial) if isinstance(partial, dict) else {}


def notice_rounds(error: BaseException) -> tuple[int, list[dict[str, Any]]] | None:
    """``(rank, rounds)`` a SIGTERM's ``PreemptedError`` carried (the told-to-stop rank's round log since its last
    fetch), else None."""
    e = root_cause(error)
    rounds = getattr(getattr(e, "cause", None), "rounds", None)
    rank = getattr(e, "rank", None)
    return (int(rank), list(rounds)) if isinstance(rounds, list) and rank is not None else None


def stages_unwrap(group: Any) -> Any:
    """The group under a deadline wrapper (calls issued on it carry no stage deadline)."""
    return unwrap(group)


async def _finished(fut: Any) -> None:
    """Wait until every rank of the call `fut` (a ``GroupFuture``) finished, successfully or not, without
    fetching its result (a failure is raised by whoever consumes it)."""
    done = anyio.Event()
    fut.add_done_callback(lambda _: done.set())
    await done.wait()


def _held_already(error: BaseException) -> bool:
    """Whether `error` is a rollout rank refusing a version as one it holds (or a newer one's):
    ``StaleWeightsError``, raised before the rank changes anything."""
    cause = root_cause(error)
    return isinstance(cause, RemoteError) and cause.exc_type.rpartition(".")[2] == "StaleWeightsError"


async def load_ranks(rollout: Any, exported: Any, ranks: list[int]) -> None:
    """Load `exported` into the rollout ranks `ranks` of the group `rollout`, one call each. A rank that holds it
    already (a group load that failed on another rank reached it) counts as loaded; any other error is raised (the
    calls not awaited then still have their errors retrieved: the core fetches every call's result)."""
    calls = [rollout.update_weights.options(rank=r)(exported) for r in ranks]
    for call in calls:
        try:
            await call
        except Exception as e:
            if not _held_already(e):
                raise


async def load_every_rank(weights: Any, groups: Any, exported: Any) -> None:
    """The weight loop's load of `exported` into every rollout rank (one group call, ``WeightSync.load``). When some
    ranks refuse it as a version they hold, the ranks are loaded one by one (:func:`load_ranks`): a group load that
    failed part-way (a process lost during it) reached them, and a replica or process replaced since was brought to
    the version before it. Not with the ``collective`` transport, whose ranks receive together."""
    try:
        await weights.load(groups, exported)
    except Exception as e:
        if weights.transport == "collective" or not _held_already(e):
            raise
        await load_ranks(groups.rollout, exported, list(range(groups.rollout.world_size)))


def balanced_order(tokens: list[int], ranks: int) -> list[int]:
    """An order of the groups (`tokens`: each group's response tokens) whose contiguous chunks, as
    ``stages.concat_sharded`` cuts them (sizes as equal as can be, the larger first), give each of the `ranks`
    training ranks about the same tokens: verl's ``balance_batch``, over whole groups. The longest-processing-time
    rule: the groups, longest first, each to the least-loaded rank with room left (within 4/3 of the best
    makespan); each rank's groups keep their order."""
    n = len(tokens)
    k, extra = divmod(n, ranks)
    room = [k + (r < extra) for r in range(ranks)]
    parts: list[list[int]] = [[] for _ in range(ranks)]
    heap = [(0, r) for r in range(ranks) if room[r]]  # (load, rank) of the ranks with room: O(n log ranks)
    for i in sorted(range(n), key=lambda i: (-tokens[i], i)):
        load, r = heapq.heappop(heap)
        parts[r].append(i)
        room[r] -= 1
        if room[r]:
            heapq.heappush(heap, (load + tokens[i], r))
    return [i for part in parts for i in sorted(part)]
