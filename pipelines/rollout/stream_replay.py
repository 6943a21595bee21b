"""Exact replay of a streaming run (``trainer.rollout_mode=stream``): its engine rounds, recorded and re-run.

A streaming run's tokens depend on timing twice: which prompt groups a step trains (the first to
finish), and which requests shared each decoding round of the request-level HF engine, and under
which weight version each round (or, with partial rollout, each part of a round) decoded. The journal
(:mod:`asyncrl.pipelines.journaling.journal`) records the first -- each group's admission and each step's groups;
the second is the engines' round log (:class:`~asyncrl.roles.engines.round_log.RoundRecord`), which
the run fetches from its rollout workers after each step's groups are chosen and appends to
``rounds.jsonl`` next to the journal (one line per step: ``{"step", "epoch", "ranks": [[round, ...]
per rollout rank]}``; ``epoch`` numbers the rollout pools: it counts replacements and resizes)::

    record:  StreamRollout.take(step) ─► rollout.round_log(clear=True)  ─► rounds.jsonl   (a task, off the step)
    replay:  rollout.replay_rank_rounds(rounds of each rank)   each engine runs exactly its recorded rounds
             issue the journal's group calls and weight loads in its order (a group once its admission
             version is exported, a load once its version is; each load waits until the rounds need it)
             step t trains the journal's groups of step t, in its order

so the replay regenerates every token, behaviour log-prob and token version bit for bit, trains the
same batches and reaches the same weights (``asyncrl replay RUN``; :mod:`asyncrl.pipelines.commands.replay`).

What it refuses, before any worker starts (:class:`~asyncrl.pipelines.journaling.journal.JournalError`, naming
what is missing and the fix): a journal written before rounds were recorded, or by an engine that
schedules requests itself (vLLM); a run resumed or restarted part-way (a second journal segment: the
regenerated groups ran on fresh engines the replay cannot re-create in place); a run whose rollout pool
was replaced (the replaced engines' rounds died with them: a pool epoch that no ``resize`` record started);
a resized run whose retired pool's last rounds were not recorded (no ``retire`` record or no ``retired``
line: a journal written before they were), or were lost while it handed groups over (a SIGTERM to one rank
of several: the told-to-stop rank sends its last rounds with its notice, but its exit breaks the pool's
group, and the other ranks' last rounds cannot be fetched); a ``retire`` record whose kept rows do not fit
its rounds (a row of a group it did not hand over, more tokens than ``max_new_tokens``, tokens no recorded
round decoded: an edited journal); a rounds file that is missing, unreadable, or lacks the rounds of a trained group; a run with
``rollout.agent`` whose round log records no agent sessions.

Resized runs (``scale_rollout``, ``preempt_rollout``, the autoscaler) replay: each pool's rounds are its own
(``rounds.jsonl`` lines by pool ``epoch``; a retired pool's last rounds in a ``"retired": true`` line written
before it closed), and the journal's ``resize`` record stands where the new pool took over, among the
``group`` and ``load`` records: the replay starts that pool there with its rounds, issues its load of the
recorded version, sends the next records' calls to it, and closes the old pool once its groups finished.
A resize that handed groups over mid-generation (past its drain deadline, a preemption) is re-created from
its ``retire`` record, never from the replay's timing::

    retire {"handed_over": [g...], "rows": {g: {row key: tokens kept}}}
      old pool: hand_over(seeds of g...) at the resize record; each rank's ReplayBatcher takes the rows once
                its recorded rounds of them ran (where the run stopped them)
      keep the rows the record kept, each with exactly its tokens (else ReplayDivergedError, naming the row)
      new pool: the groups issued again with generate_requests(resume=rows); its rounds continue them

The groups are the ones whose calls ended and were issued again (a late group whose generation had finished
drained); rows the run's hand-over did not find start over from their seeds, as they did. A SIGTERM's notice
(a one-rank pool) is re-created the same way: the told-to-stop rank's last rounds came back with its
``PreemptedError`` (a ``"notice"`` line of ``rounds.jsonl``), so the fetches that failed after its process
exited lost none.

Agents (``rollout.agent``): the round log also carries each gateway session's requests and responses (as
digests). The replaying gateways hold their sessions to them: an agent whose calls are a deterministic
function of what it received asks the same again and gets the same answers, so the run replays; one that
asks anything else fails the replay with ``ReplayDivergedError`` naming the session and the request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from asyncrl.pipelines.rollout.admission import Admission, check_stream
from asyncrl.pipelines.journaling.journal import JOURNAL, JournalData, JournalError
from asyncrl.pipelines.loop.loop_state import RolloutBatch, batch_seed
from asyncrl.pipelines.journaling.rounds import ROUNDS, RoundFile, read_rounds, recording_rollout, records_rounds
from asyncrl.pipelines.job.modes import RolloutMode, register_rollout_mode
from asyncrl.pipelines.rollout.stream_rollout import StreamRollout, _Attempt
from asyncrl.pipelines.loop.deadlines import unwrap, with_deadlines
from asyncrl.pipelines.loop.stages import Groups
from asyncrl.roles.engines.round_log import ReplayDivergedError

if TYPE_CHECKING:
    from asyncrl.pipelines.rollout.rollout_loop import RolloutServices

__all__ = ["ROUNDS", "RoundFile", "StreamMode", "StreamReplay", "read_rounds", "recording_rollout", "records_rounds",
           "stream_rollout"]

def stream_rollout(services: RolloutServices) -> StreamRollout:
    """The run's streaming producer: a :class:`StreamReplay` when its journal replays a run, else a
    :class:`~asyncrl.pipelines.rollout.stream_rollout.StreamRollout`."""
    return StreamReplay(services) if services.journal.replaying else StreamRollout(services)


@register_rollout_mode("stream")
class StreamMode(RolloutMode):
    """``trainer.rollout_mode=stream``: prompt groups in flight, admission control, the newest weights
    (docs/streaming.md)."""

    weights = "latest"
    splits_batches = False  # each group is routed whole to one replica
    hands_over = True
    replaces_processes = True  # StreamRollout._lose_process

    def check(self, job: Any) -> None:
        """:func:`~asyncrl.pipelines.rollout.admission.check_stream`."""
        check_stream(job)

    def build(self, services: Any) -> StreamRollout:
        """:func:`stream_rollout`: the replay of a recorded stream run, or a new one."""
        return stream_rollout(services)

    def records_rounds(self, job: Any) -> bool:
        """On the HF engine (a twin's rollout runs the simulated engine, whatever ``rollout.engine`` says):
        the rounds are what an exact replay of its interleaved requests needs."""
        return job.rollout.engine == "hf" and not job.twin.enabled


class _ReplayAdmission(Admission):
    """Admission bookkeeping of a replay: the journal decided what is admitted and taken, not the bound."""

    def can_admit(self, version: int) -> bool:
        return True

    def take_recorded(self, chosen: list[int], dropped: list[int]) -> None:
        """Step ``next_step`` takes `chosen`; `dropped` were found too stale (``drop_stale``)."""
        self._discard([*chosen, *dropped])
        self._dropped += len(dropped)
        self._step_done(chosen)


class StreamReplay(StreamRollout):
    """A :class:`StreamRollout` that follows a recorded stream run (see the module docstring): the
    journal's admissions and step groups, the engines replaying their recorded rounds.

    Args:
        services: the replaying run's parts (``Trainer(config, replay=RUN)``'s); the journal and its rounds file
            are checked here, before any worker starts.
    """

    def __init__(self, services: RolloutServices) -> None:
        super().__init__(services)
        source = services.journal.replay_source
        data = services.journal.replayed
        assert source is not None and data is not None
        self._order, self._steps, self._drops, self._pools = _plan(services.config, source, data)
        self._handed = {e: ([int(g) for g in r["handed_over"]],  # pool epoch -> (groups handed over, their kept rows)
                            {int(g): {str(k): int(n) for k, n in rows.items()} for g, rows in r.get("rows", {}).items()})
                        for e, r in data.retires.items()}
        self._loads: set[anyio.CancelScope] = set()  # the weight loads in flight, each shielded (_held_load)

    async def run(self) -> None:
        """Give each engine its rounds, then follow the journal's ``group`` and ``load`` records in order: issue
        a group's calls once its admission version is exported, a load once its version is; each is issued
        before the next record is followed, so the rollout workers' ordered lane sees them in the recorded
        order (a score call waiting for its group's tokens holds the calls behind it there)."""
        sv = self._services
        run, cfg = sv.current(), sv.config
        s, groups = run.state, run.groups
        assert groups is not None
        adm = _ReplayAdmission(cfg.prompts_per_step, cfg.trainer.max_staleness, 1 << 30, next_step=s.start_step)
        a = self._attempt = _Attempt(s, adm, [], 0)
        await groups.rollout.replay_rank_rounds(self._pools[0], [True] * len(self._pools[0]))
        await self._notify()
        async with anyio.create_task_group() as tg:
            with self._unshield_on_error():
                for kind, n, v0 in self._order:
                    if kind == "resize":
                        await self._resize(a, tg, n, v0)
                        continue
                    if kind == "load":
                        await s.wait_for(lambda n=n: s.exports.get(n) is not None)
                        await tg.start(self._load, a, n, name=f"stream replay load {n}")
                        continue
                    await s.wait_for(lambda v0=v0: s.exported >= v0)  # as the original: v0 <= its rollout version
                    adm.admit(n, v0)
                    a.next_group = max(a.next_group, n + 1)
                    await tg.start(self._group, a, n, v0, name=f"stream replay group {n}")
                await anyio.sleep_forever()  # the train loop cancels it after the last step

    @contextlib.contextmanager
    def _held_load(self) -> Iterator[anyio.CancelScope]:
        """A weight load's scope: shielded, as the run's weight loop (when the replay ends -- the train loop
        cancels it after the last step -- with a load in flight, ``rollout_version`` must still name the
        weights the engines hold), until the replay fails (:meth:`_unshield_on_error`)."""
        with anyio.CancelScope(shield=True) as scope:
            self._loads.add(scope)
            try:
                yield scope
            finally:
                self._loads.discard(scope)

    @contextlib.contextmanager
    def _unshield_on_error(self) -> Iterator[None]:
        """Lift the shield of every load in flight when the code inside fails (a
        :class:`ReplayDivergedError` above all): an engine holds a load until its recorded rounds need it,
        and rounds that will never run (a hand-over refused, a group's calls failed) would hold it, and the
        cancelled replay waiting for it, for ever."""
        try:
            yield
        except Exception:
            for scope in list(self._loads):
                scope.shield = False
            raise

    async def _group(self, a: _Attempt, g: int, v0: int, *,
                     task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """As the run's, lifting the loads' shields if it fails (:meth:`_unshield_on_error`)."""
        with self._unshield_on_error():
            await super()._group(a, g, v0, task_status=task_status)

    async def _hand_over(self, a: _Attempt, old_rollout: Any, handed: list[int], epoch: int) -> None:
        """:meth:`_take_handed`, lifting the loads' shields if it fails (:meth:`_unshield_on_error`)."""
        with self._unshield_on_error():
            await self._take_handed(a, old_rollout, handed, epoch)

    async def _load(self, a: _Attempt, v: int, *,
                    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load version `v` (the engines hold it until their rounds need it, so the loads of later records
        may be issued meanwhile; they complete in order)."""
        sv = self._services
        s, groups = a.state, sv.current().groups
        assert groups is not None
        task_status.started()  # the update is issued below, in this same step, before the driver goes on
        # shielded, as the run's weight loop: when the replay ends (the train loop cancels this after the last step)
        # with a load in flight, rollout_version must still name the weights the engines hold (the evaluation at the
        # end evaluates them)
        with self._held_load(), sv.tracer.span("weight_sync", track=groups.rollout.name, version=v):
            await sv.weights.load(groups, s.exports[v])
            sv.weights.loaded(s, v)
        sv.weights.drop_older(s, v)  # a load issued later holds its own export already
        await self._notify()

    async def _resize(self, a: _Attempt, tg: anyio.abc.TaskGroup, epoch: int, version: int) -> None:
        """Re-create a recorded resize at its ``resize`` record: start pool `epoch` with its recorded rounds, issue
        its load of `version`, and make it the pool the next records' calls go to; the old pool is closed once
        its groups finished there (a drained resize: the journal's ``retire`` record)."""
        sv = self._services
        s, g = a.state, sv.current().groups
        assert g is not None
        rounds = self._pools[epoch]
        part, pool = await sv.workers.start_rollout_part(len(rounds))
        fresh = with_deadlines(Groups(rollout=part["rollout"], reward=part["reward"], policy=g.policy,
                                      advantage=g.advantage), sv.config.trainer)
        await fresh.rollout.replay_rank_rounds(rounds, [True] * len(rounds))
        await s.wait_for(lambda: s.exports.get(version) is not None)
        # the run's resizes are one at a time: the groups the last one handed over were issued again on the pool
        # retired now before this one started
        before, _ = self._handed.get(epoch - 2, ([], {}))
        await s.wait_for(lambda: not any(k in a.handing or k in a.reissuing or (k in a.running and a.running[k][0]
                                                                               is not g.rollout) for k in before))
        old_rollout = g.rollout
        old_part, old_pool = sv.workers.adopt_rollout_part(part, pool, len(rounds))
        # the load first on the new pool's ordered lane, then the group calls after the record (its rounds
        # hold the load until their first round needs it, as the original's did not need to)
        await tg.start(self._load_into, a, fresh, version, name=f"stream replay pool {epoch} load {version}")
        g.rollout, g.reward = fresh.rollout, fresh.reward
        a.epoch = epoch
        handed, _ = self._handed.get(epoch - 1, ([], {}))
        if handed:  # (issued now, before any later record's calls; each waits for its recorded rounds there)
            tg.start_soon(self._hand_over, a, old_rollout, handed, epoch - 1,
                          name=f"stream replay hand-over {epoch - 1}")
        tg.start_soon(self._retire, a, old_rollout, old_part, old_pool, name=f"stream replay retire pool {epoch - 1}")

    async def _take_handed(self, a: _Attempt, old_rollout: Any, handed: list[int], epoch: int) -> None:
        """Re-create the hand-over of the groups `handed` from pool `epoch` (its ``retire`` record): each rank
        takes their rows where its recorded rounds stopped them (``ReplayBatcher.hand_over``), the rows the
        record kept are kept -- exactly as many tokens each, else :class:`ReplayDivergedError` -- and the groups
        are issued again on the new pool, continuing them (``StreamRollout._group``'s retry)."""
        _, recorded = self._handed[epoch]
        by_seed = {batch_seed(self._services.config, g): g for g in handed}
        a.handing.update(handed)
        try:
            parts = await unwrap(old_rollout).hand_over(sorted(by_seed))
            rows: dict[int, dict[str, dict[str, Any]]] = {}
            for part in parts:
                for seed, mine in part.items():
                    rows.setdefault(by_seed[int(seed)], {}).update(mine)
            for g in handed:
                got = rows.get(g, {})
                if g not in rows and not (g in a.running and a.running[g][0] is old_rollout):
                    continue  # its call returned before the hand-over reached it: it finished, as recorded rows do
                for key, n in sorted(recorded.get(g, {}).items()):
                    have = len(got[key]["ids"]) if key in got else None
                    if have != n:
                        raise ReplayDivergedError(
                            f"the replayed hand-over of prompt group {g} from rollout pool {epoch} stopped row {key!r} "
                            f"after {'no' if have is None else have} tokens, but the journal's retire record kept {n}: "
                            "the journal or its rounds.jsonl were edited, or the pool's rounds did not run as "
                            "recorded; replay the files the run wrote")
                self.keep_rows(a, g, got, epoch)  # (the rows the record kept: keep_rows below)
        finally:
            a.handing.difference_update(handed)
            for g in handed:
                if g in a.running and a.running[g][0] is old_rollout:
                    a.running[g][1].cancel()  # (a rank that took no rows: issued again, from its seeds)
            await self._notify()

    def keep_rows(self, a: _Attempt, g: int, rows: dict[str, dict[str, Any]], epoch: int) -> None:
        """As the run's, of the rows its ``retire`` record of pool `epoch` kept for group `g` only (the replay
        hands over every row where it stands; the run kept those its hand-over found)."""
        kept = self._handed.get(epoch, ([], {}))[1].get(g, {})
        super().keep_rows(a, g, {k: r for k, r in rows.items() if k in kept}, epoch)

    async def _load_into(self, a: _Attempt, groups: Groups, v: int, *,
                         task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load version `v` into the new pool `groups` (issued before `task_status` returns)."""
        sv, s = self._services, a.state
        task_status.started()
        with self._held_load(), sv.tracer.span("weight_sync", track=groups.rollout.name, version=v):
            await sv.weights.load(groups, s.exports[v])  # (shielded as in _load)
            sv.weights.loaded(s, v)
        await self._notify()

    async def _retire(self, a: _Attempt, old_rollout: Any, part: Any, pool: Any) -> None:
        """Close the replaced pool once its groups finished there."""
        sv, s = self._services, a.state
        await s.wait_for(lambda: not any(site is old_rollout for site, _ in a.running.values()))
        self.rehome_flights(a)
        with anyio.CancelScope(shield=True):
            await sv.workers.close_rollout_part(part, pool)

    async def take(self, step: int) -> RolloutBatch:
        """Step `step`'s batch: the journal's groups of that step, in its order, once they finished."""
        sv = self._services
        s = sv.current().state
        await s.wait_for(lambda: self._attempt is not None and self._attempt.state is s)
        a = self._attempt
        assert a is not None
        chosen, dropped = self._steps[step], self._drops.get(step, [])
        await s.wait_for(lambda: all(g in a.flights for g in [*chosen, *dropped]))
        assert isinstance(a.admission, _ReplayAdmission)
        a.admission.take_recorded(chosen, dropped)
        return await self._assemble(a, step, chosen, dropped)


def _plan(cfg: Any, source: Path, data: JournalData) -> tuple[list[tuple[str, int, int]], dict[int, list[int]],
                                                                dict[int, list[int]],
                                                                dict[int, list[list[dict[str, Any]]]]]:
    """``(("group", index, v0), ("load", version, 0) and ("resize", pool epoch, version) records in order,
    step -> groups, step -> dropped groups, pool epoch -> rounds per rank)`` of the journal at `source`, checked
    as the module docstring lists."""
    journal = source / JOURNAL if source.is_dir() else source
    where = f"the journal {str(journal)!r}"
    if not records_rounds(cfg):
        raise JournalError(f"{where} is a stream run on rollout.engine={cfg.rollout.engine!r}, which schedules its "
                           "requests itself and records no rounds, so its tokens cannot be regenerated; only stream "
                           "runs on rollout.engine=hf replay")
    header = data.header or {}
    if header.get("rounds") != ROUNDS:
        raise JournalError(f"{where} records no engine rounds (it was written before stream runs recorded them), so "
                           "its tokens cannot be regenerated; run it again with this version to get a replayable journal")
    if len(data.runs) > 1:
        at = data.runs[1].get("start_step")
        raise JournalError(f"{where} has {len(data.runs)} segments: the run was resumed or restarted at step {at}, and "
                           "the groups it regenerated ran on fresh engines; replay covers a stream run of one segment "
                           "(an uninterrupted run). Its steps before the restart replay as a run of that many steps")
    path = journal.with_name(ROUNDS)
    if not path.is_file():
        raise JournalError(f"{where} needs its round log {str(path)!r}, which is missing; put the run's {ROUNDS} back "
                           "next to its journal")
    sizes = {0: cfg.trainer.rollout_start}  # pool epoch -> its workers
    chunks = read_rounds(path)  # (each pool's lines are in the order its rounds ran)
    for r in data.resizes:
        e = int(r["epoch"])
        sizes[e] = int(r["size_after"])
        what = (f"{where}: its rollout pool was resized ({r['reason']}: {r['size_before']} -> {r['size_after']} "
                f"workers after step {r['after_step']}), which cannot be replayed bit for bit: ")
        done = data.retires.get(e - 1)
        if done is None or not any(c.get("retired") and int(c.get("epoch", -1)) == e - 1 for c in chunks):
            raise JournalError(what + "the retired pool's rounds after its last step were not recorded (a journal "
                               "written before resized runs recorded them, or a run that ended before the pool was "
                               "closed); run it again with this version to get a replayable journal")
        lost = [c for c in chunks if c.get("lost") is not None and int(c.get("epoch", -1)) == e - 1]
        if done["handed_over"] and lost and not _all_noticed(chunks, e - 1, sizes[e - 1]):
            some = any("notice" in c and int(c.get("epoch", -1)) == e - 1 for c in chunks)
            raise JournalError(what + f"it handed prompt groups {done['handed_over']} over, and the retired pool's "
                               f"rounds after step {lost[0]['step']} were lost ({lost[0]['lost']})"
                               + (f": a SIGTERM to one of its {sizes[e - 1]} ranks broke the pool's group, so the "
                                  "other ranks' last rounds could not be fetched" if some else "")
                               + ", so the rows it handed over cannot be regenerated")
        _check_kept_rows(cfg, where, e - 1, done, chunks)
    covered = {e for e, n in sizes.items() if _all_noticed(chunks, e, n)}  # (every rank's rounds came with a notice)
    for c in chunks:
        if (c.get("lost") is not None and int(c.get("epoch", 0)) not in covered) or int(c.get("epoch", 0)) not in sizes:
            raise JournalError(f"{where}: the rollout pool was replaced (or its rounds lost: {c.get('lost')}) by step "
                               f"{c['step']}, and the replaced engines' rounds died with them, so this run cannot be "
                               "replayed bit for bit")
    pools: dict[int, list[list[dict[str, Any]]]] = {}
    for e, n in sizes.items():
        mine = [c for c in chunks if int(c.get("epoch", 0)) == e and c.get("ranks") is not None]
        if any(len(c["ranks"]) != n for c in mine):
            raise JournalError(f"{str(path)!r} holds rounds of {sorted({len(c['ranks']) for c in mine})} ranks for "
                               f"rollout pool {e}, which had {n} workers (trainer.rollout_workers="
                               f"{cfg.trainer.rollout_workers}); restore the file the run wrote")
        pools[e] = [[r for c in mine for r in c["ranks"][k]] for k in range(n)]
    ranks = [r for e in sorted(pools) for r in pools[e]]  # (every pool's rounds, for the checks below)
    steps_done = data.end["steps"] if data.end is not None else len(data.steps)
    steps = {}
    for t in range(int(steps_done)):
        rec = data.steps.get(t)
        if rec is None or "groups" not in rec:
            raise JournalError(f"{where} records no groups for step {t}; replay needs every step's groups")
        steps[t] = [int(g) for g in rec["groups"]]
    if cfg.rollout.agent is not None and not any("session" in r for rounds in ranks for r in rounds):
        raise JournalError(f"{str(path)!r} records no agent sessions (written before gateway runs recorded what each "
                           "agent asked), so a replay cannot check that the agents ask what they asked; run it again "
                           "with this version to get a replayable journal")
    keys = {k for rounds in ranks for r in rounds if "keys" in r for k in r["keys"]}
    for t, gs in steps.items():
        for g in gs:
            missing = [j for j in range(cfg.group_size) if f"{batch_seed(cfg, g)}:{j}" not in keys]
            if missing:
                raise JournalError(f"{str(path)!r} has no round for row {missing[0]} of prompt group {g} (trained at "
                                   f"step {t}): the round log is truncated or edited; restore the file the run wrote")
    drops: dict[int, list[int]] = {}
    for d in data.group_drops:
        drops.setdefault(int(d["at_version"]), []).append(int(d["index"]))
    order = [("load", int(r["version"]), 0) if r["kind"] == "load" else
             ("resize", int(r["epoch"]), int(r["version"])) if r["kind"] == "resize" else
             ("group", int(r["index"]), int(r["version"])) for r in data.stream_order]
    return order, steps, drops, pools


def _all_noticed(chunks: list[dict[str, Any]], epoch: int, size: int) -> bool:
    """Whether every rank of rollout pool `epoch` (`size` ranks) sent its last rounds with a SIGTERM's notice (its
    ``notice`` lines): its process exited then, and the pool's later fetches that failed lost no round."""
    return {int(c["notice"]) for c in chunks if "notice" in c and int(c.get("epoch", -1)) == epoch} >= set(range(size))


def _check_kept_rows(cfg: Any, where: str, epoch: int, retire: dict[str, Any], chunks: list[dict[str, Any]]) -> None:
    """The ``retire`` record of pool `epoch` against the round log, before any worker starts: each kept row is a row
    of a group it handed over, kept at most ``rollout.max_new_tokens`` tokens, and one that kept tokens was decoded
    in a recorded round of that pool or an earlier one (else :class:`JournalError`: an edited journal). Whether the
    counts are the rounds' own is checked as the replay hands them over (``ReplayDivergedError``)."""
    handed = {int(g) for g in retire["handed_over"]}
    decoded = {k for c in chunks if int(c.get("epoch", 0)) <= epoch and c.get("ranks")
               for rank in c["ranks"] for r in rank for k in r.get("keys", ())}
    for g, rows in sorted((int(g), rows) for g, rows in retire.get("rows", {}).items()):
        keys = {f"{batch_seed(cfg, g)}:{j}" for j in range(cfg.group_size)}
        for key, n in sorted(rows.items()):
            why = None
            if g not in handed:
                why = f"group {g} is not among the groups it handed over ({sorted(handed)})"
            elif key not in keys:
                why = f"{key!r} is not a row of group {g}"
            elif not isinstance(n, int) or not 0 <= n <= cfg.rollout.max_new_tokens:
                why = f"row {key!r} kept {n!r} tokens (0..rollout.max_new_tokens={cfg.rollout.max_new_tokens})"
            elif n > 0 and key not in decoded:
                why = f"row {key!r} kept {n} tokens but no recorded round of pool {epoch} or before decoded it"
            if why is not None:
                raise JournalError(f"{where}: the retire record of rollout pool {epoch} does not match its rounds: "
                                   f"{why}; the journal or its rounds.jsonl were edited, restore the files the run "
                                   "wrote")
