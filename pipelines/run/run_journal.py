"""The run journal as an observer of the loops (the file format: :mod:`asyncrl.pipelines.journaling.journal`).

The loops report to it in one line each -- a batch generated, a step trained, a batch dropped
-- and the rollout loop asks it which weight version a batch must follow (resume, restart,
replay). It never changes what the loops do otherwise.

With each step it also asks the training pool what the step's rows say about their generation (replica, token
versions: :func:`~asyncrl.pipelines.journaling.ledger.row_facts`, one small call beside the step's) and appends the
answer to ``ledger.jsonl`` in a task and a thread, off the step and the loop (the per-sample ledger,
:mod:`asyncrl.pipelines.journaling.ledger`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import anyio.to_thread
import structlog

from asyncrl.pipelines.job.config import config_fingerprint, fingerprint_diff
from asyncrl.pipelines.datasets.datafiles import code_digests
from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.journaling.journal import JOURNAL, Journal, JournalData, JournalError, read_journal
from asyncrl.pipelines.journaling.ledger import LEDGER, LedgerFile
from asyncrl.pipelines.loop.loop_state import RolloutBatch, batch_seed
from asyncrl.pipelines.journaling.rounds import ROUNDS, RoundFile, records_rounds

if TYPE_CHECKING:
    from asyncrl.pipelines.job.config import JobConfig
    from asyncrl.pipelines.datasets.data import PromptLoader
    from asyncrl.pipelines.loop.loop_state import LoopState
    from asyncrl.pipelines.loop.stages import Groups

__all__ = ["RunJournal", "weights_digest", "FACTS_IN_REPLY"]

FACTS_IN_REPLY = True
"""Read a streaming step's ledger facts from its ``concat_shard`` reply (``GroupFuture.summary``: the rows' facts ride
in each rank's reply). False: ask every training rank with ``ledger_rows``, one call each, as before (the
benchmark's earlier variants)."""


log = structlog.get_logger("asyncrl.pipelines")


def weights_digest(checksums: Mapping[str, str]) -> str:
    """One sha256 over a ``{name: checksum}`` dict of weights (order-independent)."""
    return hashlib.sha256(json.dumps(dict(sorted(checksums.items()))).encode()).hexdigest()


class RunJournal:
    """Writes ``<output_dir>/journal.jsonl`` as the loops run and holds the versions to follow.

    Args:
        config: the run's configuration (its fingerprint heads the journal; a replay must be the same config's).
        groups: the run's current groups (a restart or a rollout replacement swaps them): the rows a step trains
            and the rounds the engines ran are asked of them.
        replay: a run journal (or a run directory holding ``journal.jsonl``) whose batches this run
            generates with exactly the recorded weight versions; it must be the same config's.
    """

    def __init__(self, config: JobConfig, groups: Callable[[], Groups | None],
                 replay: str | Path | None = None) -> None:
        self._config, self._groups = config, groups
        self._out = Path(config.trainer.output_dir)
        self._loader: PromptLoader | None = None  # the run's prompts (given by open)
        self._file: Journal | None = None
        self._schedule: dict[int, int] = {}  # batch index -> weight version to follow
        self._replay: JournalData | None = None
        self._rounds: RoundFile | None = None  # streaming on HF: the engines' round log (rounds.jsonl)
        self._fetch: asyncio.Task[None] | None = None  # the newest round-log fetch (each awaits the one before)
        self._notices: set[tuple[int, int]] = set()  # (pool epoch, rank) whose notice's rounds are written
        self._ledger: LedgerFile | None = None  # the measured rows of each step (ledger.jsonl)
        self._measure: asyncio.Task[None] | None = None  # the newest step's measurement (each awaits the one before)
        self.replay_source = Path(replay) if replay is not None else None
        """The journal (or run directory) this run replays."""
        if replay is not None:
            self._replay = read_journal(replay)
            header = self._replay.header or {}
            if header.get("fingerprint") != config_fingerprint(config):
                diff = fingerprint_diff(header.get("config") or {}, to_dict(config))
                if not diff:
                    raise JournalError(f"the journal {str(replay)!r} was edited: its config does not hash to the "
                                       "fingerprint it records, so it is refused")
                raise JournalError(f"the journal {str(replay)!r} was written by a different config (differs in: "
                                   f"{', '.join(diff)}); replay with the run's own config")

    def open(self, resume: Path | None, s: LoopState, loader: PromptLoader | None) -> None:
        """Open the journal (blocking file I/O: call it in a thread) at the loop state `s`'s position: continue
        the resumed run's (rewound to its checkpoint `resume`, following the versions it recorded after it), or
        follow a replayed run's, or start a new one. `loader`: the run's prompts (a batch's are journaled)."""
        self._loader = loader
        config = to_dict(self._config)
        header = {"fingerprint": config_fingerprint(self._config), "config": config,
                  "code_digests": code_digests(config)}
        previous = None
        source = resume.parent.parent / JOURNAL if resume is not None else None
        if source is not None and source.is_file():
            previous = read_journal(source)
        if records_rounds(self._config) and self._replay is None:
            header["rounds"] = ROUNDS
            self._rounds = RoundFile(self._out / ROUNDS)
            self._rounds.start(source.with_name(ROUNDS) if source is not None else None, s.start_step)
        self._ledger = LedgerFile(self._out / LEDGER)
        self._ledger.start(source.with_name(LEDGER) if source is not None else None, s.start_step)
        self._file = Journal(self._out / JOURNAL)
        schedule = self._file.start(header, previous=previous, next_gen=s.next_gen,
                                    start_step=s.start_step, **_settled(s))
        if self._replay is not None:
            schedule = self._replay.schedule()
            self._check_replay(self._replay)
        self._schedule = schedule

    def _check_replay(self, data: JournalData) -> None:
        loader = self._loader
        assert loader is not None
        for i, b in sorted(data.batches.items()):
            if list(b["prompts"]) != loader.indices(i) or int(b["seed"]) != batch_seed(self._config, i):
                raise JournalError(f"batch {i} of the journal has other prompts or another seed than this run "
                                   "would use; replay with the journal's config and data")

    async def rewind(self, s: LoopState) -> None:
        """Back to the restored loop state `s`'s position (a restart): drop what was recorded after it and
        follow the versions recorded for the batches after it (a replay keeps following its own)."""
        if self._file is None or self._replay is not None:
            return
        journal, rounds, ledger = self._file, self._rounds, self._ledger
        await self._fetched()
        await self._measured()
        self._schedule = await anyio.to_thread.run_sync(
            lambda: journal.rewind(next_gen=s.next_gen, start_step=s.start_step, **_settled(s)))
        if rounds is not None:
            await anyio.to_thread.run_sync(lambda: rounds.start(rounds.path, s.start_step))
        if ledger is not None:
            await anyio.to_thread.run_sync(lambda: ledger.start(ledger.path, s.start_step))

    @property
    def replaying(self) -> bool:
        """True when this run follows a replayed journal's versions."""
        return self._replay is not None

    @property
    def replayed(self) -> JournalData | None:
        """The journal this run replays (None: not a replay)."""
        return self._replay

    def rounds(self, step: int, epoch: int) -> None:
        """Streaming: step `step` chose its groups; fetch the engines' rounds since the last fetch (every round
        of those groups) and append them to ``rounds.jsonl`` -- in a task, so the step does not wait for the
        rollout workers' ordered lane (a weight update may hold it). `epoch`: rollout-pool replacements so far."""
        groups = self._groups()
        if self._rounds is not None and groups is not None:
            self._fetch_rounds(groups.rollout, step, epoch)

    async def retired(self, rollout: Any, *, epoch: int, drained: list[int], handed_over: list[int],
                      after_step: int, rows: dict[int, dict[str, int]] | None = None) -> None:
        """Streaming: rollout pool `epoch` (`rollout`) is about to be closed by a resize, its groups drained
        (`drained`) or handed over (`handed_over`; `rows`: the decoding step, i.e. tokens kept, at which each
        handed-over row stopped, by group and request key): journal a ``retire`` record and append the rounds its engines
        ran since their last fetch to ``rounds.jsonl`` (as a line of `after_step`, the last step taken) (they would die with it), before it is closed (at most
        ``trainer.rollout_timeout_s``; a replay refuses a run whose retired pool's rounds are missing)."""
        if self._file is not None:
            self._file.retire(epoch=epoch, drained=drained, handed_over=handed_over, rows=rows or {})
        if self._rounds is not None:
            self._fetch_rounds(rollout, after_step, epoch, retired=True)
            await self._fetched()

    def noticed(self, epoch: int, rank: int, size: int, rounds: list[dict[str, Any]], *, after_step: int) -> None:
        """Streaming: rank `rank` of rollout pool `epoch` (`size` ranks) was told to stop by a SIGTERM and sent its
        rounds since its last fetch with its notice (``PreemptedError.rounds``): append them as its line of
        `after_step` (the last step taken), after
        the fetches issued before (once per rank: each of its calls' errors carries the same rounds). Its process
        exits and the pool's later fetches fail (``lost``); a replay accepts that of a pool whose every rank sent
        its notice's rounds (none is left to decode)."""
        if self._rounds is None or (epoch, rank) in self._notices:
            return
        self._notices.add((epoch, rank))
        ranks: list[list[dict[str, Any]]] = [[] for _ in range(size)]
        ranks[rank] = list(rounds)
        self._append_after(after_step, epoch, None, ranks=ranks, notice=rank)

    def _fetch_rounds(self, rollout: Any, step: int, epoch: int, retired: bool = False) -> None:
        """Fetch `rollout`'s rounds since its last fetch (the call issued now) and append them as pool `epoch`'s
        line of step `step`, after the fetches issued before (in a task: :attr:`_fetch`)."""
        try:
            call = rollout.round_log(True)
        except AttributeError:  # a custom rollout worker without a round log
            call = RuntimeError("the rollout worker has no round_log")
        except Exception as e:  # noqa: BLE001 - a pool that takes no call (a dead rank): its rounds are gone
            call = e
        self._append_after(step, epoch, call, retired=retired)

    def _append_after(self, step: int, epoch: int, call: Any, *, retired: bool = False,
                      ranks: list[list[dict[str, Any]]] | None = None, notice: int | None = None) -> None:
        """Append the line of the round-log `call` (or of `ranks`, a notice's) after the lines issued before."""
        file = self._rounds
        assert file is not None
        before = self._fetch

        async def fetch() -> None:
            if before is not None:
                await asyncio.wait([before])
            got, lost = ranks, None
            try:
                if got is None:
                    if isinstance(call, Exception):
                        raise call
                    got = list(await call)
            except Exception as e:  # noqa: BLE001 - a dead rollout worker's rounds are gone: say so (replay refuses)
                got, lost = None, f"{type(e).__name__}: {e}"
            await anyio.to_thread.run_sync(lambda: file.append(step, epoch, got, lost, retired, notice))

        self._fetch = asyncio.get_running_loop().create_task(fetch(), name=f"round log of step {step}")

    async def _fetched(self) -> None:
        """Until the round-log fetches issued so far are written -- at most ``trainer.rollout_timeout_s`` (the
        fetch waits its turn behind the score calls of groups still generating; a hung rollout worker must not
        hang the run's end: the fetch is then cancelled, and a replay refuses the run for its missing rounds)."""
        fetch = self._fetch
        if fetch is None or fetch.done():
            return
        limit = self._config.trainer.rollout_timeout_s
        done, _ = await asyncio.wait([fetch], timeout=limit)
        if not done:
            fetch.cancel()
            log.warning("journal.round_log_timeout", timeout_s=limit,
                        detail="the last round-log fetch did not return; this run cannot be replayed")

    def planned(self, index: int) -> int | None:
        """The weight version batch `index` must be generated with, when the journal says."""
        return self._schedule.get(index)

    def batch(self, index: int, version: int) -> None:
        """Batch `index` was generated and scored with weights `version`."""
        loader = self._loader
        if self._file is not None and loader is not None:
            self._file.batch(index, prompts=loader.indices(index), seed=batch_seed(self._config, index),
                             version=version, rows=self._config.trainer.batch_size)

    def step(self, step: int, item: RolloutBatch) -> None:
        """Step `step` trains on `item`: journal it, and measure its rows' generation (:meth:`_measure_rows`)."""
        if self._file is not None:
            self._file.step(step, batch=item.step, version=item.version, groups=item.groups, rows=item.row_groups)
            self._measure_rows(step, item.batch)

    def _measure_rows(self, step: int, batch: Any) -> None:
        """Ask the training pool for the rows of `batch` (``AdvantageWorker.ledger_rows``; the call issued now, so
        it runs before the step's own calls there) and append them to ``ledger.jsonl`` in a task, after the
        measurements issued before (a failed fetch is written as lost: the check reports the step unmeasured)."""
        groups, file = self._groups(), self._ledger
        if file is None or groups is None:
            return
        try:
            if FACTS_IN_REPLY and getattr(batch, "method", None) == "concat_shard":
                call = batch.summary()  # a streaming step's shards: their rows' facts rode in its reply
            else:
                call = groups.advantage.ledger_rows(batch)
        except AttributeError:  # a custom advantage worker without the method
            call = RuntimeError("the advantage worker has no ledger_rows")
        except Exception as e:  # noqa: BLE001 - a group that takes no call (closed): the step goes unmeasured
            call = e
        before = self._measure

        async def measure() -> None:
            if before is not None:
                await asyncio.wait([before])
            facts, lost = None, None
            try:
                if isinstance(call, Exception):
                    raise call
                facts = await call
            except Exception as e:  # noqa: BLE001 - the rows' facts are gone with a dead worker: say so
                lost = f"{type(e).__name__}: {e}"[:300]
            await anyio.to_thread.run_sync(lambda: file.append(step, facts, lost))

        self._measure = asyncio.get_running_loop().create_task(measure(), name=f"ledger rows of step {step}")

    async def _measured(self) -> None:
        """Until the measurements issued so far are written -- at most ``trainer.rollout_timeout_s`` (then the
        last is cancelled, and its step goes unmeasured)."""
        task = self._measure
        if task is None or task.done():
            return
        done, _ = await asyncio.wait([task], timeout=self._config.trainer.rollout_timeout_s)
        if not done:
            task.cancel()
            log.warning("journal.ledger_timeout", detail="the last step's rows were not measured in time")

    def filtered(self, index: int, *, seeds: list[int], picks: list[tuple[int, int]]) -> None:
        """Batch mode with ``algorithm.filter_groups``: batch `index` made generate calls with `seeds` and
        trains the groups `picks` (``(call, slot)``); the other groups of those calls were rejected."""
        if self._file is not None:
            self._file.filter(index, seeds=seeds, picks=picks)

    def group(self, index: int, *, seed: int, version: int) -> None:
        """Streaming: prompt group `index` was admitted at `version` (sampling with `seed`)."""
        if self._file is not None:
            self._file.group(index, seed=seed, version=version)

    def load(self, version: int) -> None:
        """Streaming: the rollout starts loading weights `version`."""
        if self._file is not None:
            self._file.load(version)

    def resized(self, *, size_before: int, size_after: int, reason: str, version: int, epoch: int,
                after_step: int) -> None:
        """Streaming: a new rollout pool took over (its size, why, the version it loaded, its pool epoch and the
        last step taken before); written as it takes over, so its place among the ``group`` and ``load`` records
        is where a replay starts it and issues the next calls to it (stream_replay)."""
        if self._file is not None:
            self._file.resize(size_before=size_before, size_after=size_after, reason=reason, version=version,
                              epoch=epoch, after_step=after_step)

    def group_dropped(self, index: int, *, version: int, at_version: int) -> None:
        """Streaming with ``drop_stale``: group `index` was dropped as too stale at `at_version`."""
        if self._file is not None:
            self._file.group_drop(index, version=version, at_version=at_version)

    def group_filtered(self, index: int, *, version: int) -> None:
        """Streaming with ``algorithm.filter_groups``: group `index` had equal rewards and was rejected."""
        if self._file is not None:
            self._file.group_filter(index, version=version)

    def drop(self, item: RolloutBatch, current: int) -> None:
        """`item` was dropped as too stale at policy version `current` (the buffer's ``on_drop``)."""
        if self._file is not None:
            self._file.drop(item.step, version=item.version, at_version=current)

    async def end(self, s: LoopState, rollout: Any) -> None:
        """The run finished (or stopped cleanly) at the loop state `s`: record the steps done, what `rollout`
        (the producer) leaves untrained (its ``untrained()``), and the weights' digest."""
        g = self._groups()
        if self._file is None or g is None:
            return
        await self._fetched()
        await self._measured()
        untrained = getattr(rollout, "untrained", None)  # a rollout producer of one's own may not say
        if untrained is not None:
            batches, groups = untrained()
            self._file.left(batches=batches, groups=groups)
        try:
            sums = await g.policy.weights_checksum()
        except AttributeError:  # a custom policy without checksums
            digest = None
        else:
            digest = weights_digest(sums)
        self._file.end(s.policy_version, digest)

    def close(self) -> None:
        """Close the file (idempotent); a round-log fetch still running is cancelled."""
        for task in (self._fetch, self._measure):
            if task is not None and not task.done():
                task.cancel()
        if self._file is not None:
            self._file.close()


def _settled(s: LoopState) -> dict[str, Any]:
    """What a journal rewind needs of a restored state of a mode that journals prompt groups (its checkpoint state
    lists them, as streaming's does): its untrained ``pending`` groups (admitted again) and ``next_group`` (the
    groups below it that are not pending were settled before the checkpoint)."""
    stream = s.rollout_state
    if not stream or "next_group" not in stream:
        return {}
    return {"pending": [int(g) for g in stream.get("pending", [])], "next_group": int(stream["next_group"])}
