"""A removed or preempted rollout replica hands its rows over with the tokens they decoded, on a real local Ray.

The rows of a stalled pool decode ``HELD`` tokens each and then wait (decoding nothing) until a hand-over takes
them (a row that a weight update's pause cut mid-round may have decoded more when the stall began: it waits at its
count, and the log notes each held row with its count). A shrink 2 -> 1 past ``trainer.rollout_drain_s``, a real SIGTERM and ``preempt_rollout`` each hand
them over: every handed-over row's final tokens begin with exactly the tokens decoded before (ids, behaviour
log-probs and versions), the new pool decodes only the rest, and the run completes every step, trains every
group once, within the staleness bound. In a pool of two, a SIGTERM to one rank brings its rows back with its
notice and the other rank's through ``hand_over``: both ranks' rows keep their tokens. Failure paths: the new
pool's process dies while it continues them (its replacement continues them again from the same tokens); a rank
that cannot answer its hand-over (its rows start over from their seeds, the other rank's keep their tokens); a
hand-over that fails on every rank.

The default suite runs the autoscaler both ways (a grow that hands held rows over, a shrink) and a SIGTERM; the rest
is slow (several rollout pools each)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from asyncrl import Dispatch, register
from asyncrl.pipelines.journaling.journal import JournalError, read_journal
from asyncrl.pipelines.commands.replay import replay_config
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.pipelines.rollout.rollout_loop import batch_seed
from asyncrl.roles import PolicyWorker
from asyncrl.roles.engines.batcher import RequestBatcher

from tests.pipelines.test_stream_scale import (STEPS, LoggedRollout, _assert_every_group_once_within_the_bound,
                                               _calls, _cfg, _history_reaches)
from tests.reliability.conftest import live_actors, settled, until
from tests.reliability.faults import BeforeStepEngine

HELD = 3
"""Tokens a stalled pool's rows decode before they wait for a hand-over."""
NEW_TOKENS = 6
GENERATE_S = 0.3
"""A group call's extra time (the run lasts long enough for the test to stall its pools mid-run)."""


class StallingBatcher(RequestBatcher):
    """A request batcher that, while its process is listed in the `stall` file (or it lists ``*``), lets each
    request decode ``HELD`` tokens and then holds it (decoding nothing) until a hand-over, a weight update's
    pause or the close; it notes each held request's key and token count in `calls` once (a request that had more
    than ``HELD`` tokens when the stall began, from a round a weight update's pause cut short, is held at its
    count). Held requests sit out the other
    requests' rounds, and a round of held requests only decodes no step, so its round log replays as it ran."""

    def __init__(self, engine, *, stall: str, calls: str, **kwargs) -> None:
        super().__init__(engine, **kwargs)
        self._stall, self._log = stall, calls
        self._noted: set[str] = set()

    def _stalling(self) -> bool:
        listed = Path(self._stall).read_text().split() if os.path.exists(self._stall) else []
        return "*" in listed or str(os.getpid()) in listed

    def _held(self, batch) -> list:
        """The requests of `batch` held now (noted in `calls` once)."""
        if not self._stalling():
            return []
        held = [r for r in batch if len(r.tokens) >= HELD]
        new = [r.key for r in held if r.key not in self._noted]
        if new:
            self._noted.update(new)
            with open(self._log, "a") as f:
                f.write(json.dumps({"held": new, "pid": os.getpid(),
                                    "tokens": {r.key: len(r.tokens) for r in held if r.key in new}}) + "\n")
        return held

    def _segment(self, batch, rnd, version, steps=None):
        if rnd is None:
            held = self._held(batch)
            if held and len(held) == len(batch):  # a round of held requests: no decode step
                rnd = self._begin(batch)
                rnd.done[:] = [True] * len(batch)  # (their finish stays None)
                while not (self._halt.is_set() or self._interrupt.is_set() or self._abort.is_set()):
                    time.sleep(0.01)  # (the worker thread: a hand-over, an update's pause or the close ends it)
                return rnd, True
            batch = [r for r in batch if r not in held]  # the others decode without them
        return super()._segment(batch, rnd, version, steps)


class StallingRollout(LoggedRollout):
    """:class:`LoggedRollout` over a :class:`StallingBatcher`, noting each call's returned rows in `calls`."""

    def __init__(self, *args, stall: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stall_file = stall

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def pid(self) -> int:
        """This rank's process id (not queued behind the weight loads of the ordered lane)."""
        return os.getpid()

    def _request_engine(self):
        if self.requests._batcher is None:
            self.requests._batcher = StallingBatcher(self.engine, stall=self._stall_file, calls=self._calls,
                                            max_batch_size=64, chunk_tokens=self.config.chunk_tokens,
                                            version_fn=lambda: self.weights.version,
                                            partial_rollout=self.config.partial_rollout,
                                            record_rounds=self.config.record_rounds)
        return super()._request_engine()

    @register(Dispatch.DP_COMPUTE, concurrent=True, summary=("scores", "response_length"))
    async def generate_requests(self, batch, max_new_tokens=None, temperature=None, seed=None, resume=None,
                                compute_reward=False):
        out = await super().generate_requests(batch, max_new_tokens, temperature, seed, resume, compute_reward)
        rows = {}
        for i in range(out.batch_size[0]):
            m = out["response_mask"][i].bool()
            rows[f"{seed}:{self.rank * out.batch_size[0] + i}"] = {
                "ids": out["response_ids"][i][m].tolist(), "versions": out["token_versions"][i][m].tolist(),
                "log_probs": out["rollout_log_probs"][i][m].tolist()}
        with open(self._calls, "a") as f:
            f.write(json.dumps({"seed": seed, "pid": os.getpid(), "rows": rows,
                                "resumed": sorted(resume or {})}) + "\n")
        return out


def _config(out: Path, **trainer):
    cfg = _cfg(out, **trainer)
    cfg.rollout.max_new_tokens, cfg.rollout.partial_rollout = NEW_TOKENS, "recompute"  # updates reach held rows
    cfg.rollout.chunk_tokens = HELD  # a round ends after HELD tokens: the next one holds its rows
    return cfg.validate()


async def _stall_pool(tr, stall: Path, calls: Path) -> set[int]:
    """Stall the rollout pool's rows from now on; returns its pids once one of its rows is held."""
    pids = set(await tr.groups.rollout.pid())
    stall.write_text(" ".join(map(str, pids)))
    # the run still has groups to generate (GENERATE_S each): one is held soon
    await until(lambda: any(c.get("held") and c["pid"] in pids for c in _calls(calls)), "a group held", 60)
    return pids


def _check_continued(tr, cfg, calls: Path, new: set[int], most: int | None = HELD) -> int:
    """Every handed-over row that was unfinished ended, in a call of a pool in `new`, with exactly the tokens
    (ids, log-probs, versions) it had decoded before, then its own; returns how many held rows (``HELD`` tokens
    decoded before the hand-over) were so continued. `most`: the most tokens a handed-over row had decoded
    (``HELD`` where every hand-over was from a stalled pool; ``None`` where a pool that is not stalled hands
    rows over wherever it stands)."""
    log = _calls(calls)
    seeds = {batch_seed(cfg, g): g for g, _ in tr.rollout.handovers}
    noted = _held_tokens(log)
    n = 0
    for g, rows in tr.rollout.handovers:
        returned = [c for c in log if c.get("seed") == batch_seed(cfg, g) and "rows" in c]  # one line per rank
        # (a group split over two ranks whose one rank's part returned before the hand-over took the other's rows:
        # that part is issued again with the group, from its seeds; its earlier return is not the group's result)
        final = [c for c in returned if c["resumed"]]
        assert final and all(c["pid"] in new for c in final), (g, returned)  # on a new pool, resumed
        got_rows = {k: r for c in final for k, r in c["rows"].items()}
        assert len(got_rows) == sum(len(c["rows"]) for c in final) == cfg.group_size  # the group finished once
        for key, row in rows.items():
            got = got_rows[key]
            if row["finish"]:
                assert got["ids"] == row["ids"]  # finished before the hand-over: kept as it was
                continue
            k = len(row["ids"])  # a held row's noted count (HELD, or more); fewer for one stopped in its first round
            assert most is None or k <= max([most, *(n for (_, key2), n in noted.items() if key2 == key)])
            assert got["ids"][:k] == row["ids"] and got["versions"][:k] == row["versions"]
            assert got["log_probs"][:k] == pytest.approx(row["log_probs"], abs=1e-6)
            assert len(got["ids"]) > k and min(got["versions"][k:]) >= max(row["versions"], default=0)
            n += k >= HELD
    assert seeds  # something was handed over
    ledger = check_ledger(Path(tr.config.trainer.output_dir))  # the continued rows trained once, in the bound
    assert ledger.ok, ledger.render()
    return n


def _held_tokens(log: list[dict[str, Any]]) -> dict[tuple[int, str], int]:
    """``(pid, row key) -> tokens`` of each row a stalled pool held, as its batcher noted it."""
    return {(c["pid"], k): n for c in log for k, n in c.get("tokens", {}).items()}


def _stalling_run(tmp_path: Path, cls: type | None = None, **trainer: Any) -> tuple[Path, Path, Path, Any, dict[str, Any]]:
    """The files a `StallingRollout` (or subclass `cls`) reads and writes, the run's config (with `trainer`
    overrides) and its worker overrides."""
    calls, hang, stall = tmp_path / "calls.jsonl", tmp_path / "hang", tmp_path / "stall"
    overrides = {"rollout": (cls or StallingRollout, {"calls": str(calls), "hang": str(hang), "stall": str(stall),
                                                      "delay": GENERATE_S})}
    return calls, hang, stall, _config(tmp_path / "run", **trainer), overrides


def _seconds(path: str) -> float:
    """The seconds written in the file `path` (0 while it is missing or empty)."""
    return float(Path(path).read_text() or 0) if os.path.exists(path) else 0.0


class PacedStallingRollout(StallingRollout):
    """A :class:`StallingRollout` whose group calls each take the seconds written in the file `pace` longer
    (simulated generation time; none while the file is missing or empty)."""

    def __init__(self, *args, pace: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pace = pace

    @register(Dispatch.DP_COMPUTE, concurrent=True, summary=("scores", "response_length"))
    async def generate_requests(self, batch, max_new_tokens=None, temperature=None, seed=None, resume=None,
                                compute_reward=False):
        self._delay = _seconds(self._pace)
        return await super().generate_requests(batch, max_new_tokens, temperature, seed, resume, compute_reward)


class PacedPolicy(PolicyWorker):
    """A policy worker whose updates each take the seconds written in the file `pace` longer."""

    def __init__(self, *args, pace: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.engine = BeforeStepEngine(self.engine, lambda: time.sleep(_seconds(pace)))  # simulated training time


async def test_the_autoscaler_grows_a_pool_that_generation_holds_up_and_shrinks_one_that_waits_for_training(
        ray_cluster, tmp_path):
    """``trainer.rollout_autoscale`` both ways in one streaming run, each a real resize beside the groups in flight:
    while each group call takes 1 s (steps wait for generation) it grows the pool 1 -> 2, and the rows then held
    on the old pool after ``HELD`` tokens are handed over at once (``rollout_drain_s=0``) and continued on the new
    pool from exactly those tokens; once calls take no time and each update 0.5 s (the engines wait for training)
    it shrinks the pool 2 -> 1. The run stops once both are done: every step until then trained every group once,
    within the bound. (The default suite's proof of resizing, hand-over and autoscaling; the slow tests below
    resize by ``scale_rollout``, from two ranks, and through failures.)"""
    calls, _, stall, cfg, overrides = _stalling_run(tmp_path, rollout_autoscale=True, rollout_drain_s=0.0,
                                                    steps=200)  # stopped below
    gen_pace, train_pace = tmp_path / "gen_pace", tmp_path / "train_pace"
    overrides["rollout"][1]["pace"] = str(gen_pace)
    overrides = {"rollout": (PacedStallingRollout, overrides["rollout"][1]),
                 "policy": (PacedPolicy, {"pace": str(train_pace)})}
    gen_pace.write_text("1.0")  # generation-bound
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:
        scaler = tr.rollout.scaler

        async def drive() -> list[set[int]]:
            async with asyncio.timeout(240):
                await until(lambda: scaler.requests == [(1, 2)], "the autoscaler asking to grow", 240)
                one = await _stall_pool(tr, stall, calls)  # its rows wait for the hand-over after HELD tokens
                gen_pace.write_text("0")  # then training-bound: the new pool's calls take no time
                train_pace.write_text("0.5")
                await until(lambda: len(scaler.resizes) >= 1, "the grow", 240)
                two = set(await tr.groups.rollout.pid())
                await until(lambda: len(scaler.resizes) >= 2, "the shrink", 240)
                tr.request_stop("both resizes done")
                return [one, two, set(await tr.groups.rollout.pid())]

        async with asyncio.TaskGroup() as tg:
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, (one, two, last) = fit.result(), task.result()
        assert tr.restarts == []
    assert scaler.requests == [(1, 2), (2, 1)]  # one grow, one shrink, each when its rule said so
    grow, shrink = scaler.resizes
    assert [(r.size_before, r.size_after, r.reason) for r in (grow, shrink)] == [(1, 2, "autoscale"),
                                                                                  (2, 1, "autoscale")]
    assert len(two) == 2 and len(last) == 1 and one.isdisjoint(two) and two.isdisjoint(last)
    done = tr.interrupted.steps_done
    assert len(history) == done and max(m["staleness/max"] for m in history) <= 1
    _assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step, done)
    # the rows held on the old pool were handed over with their HELD tokens, and continued from them on the new one
    assert grow.handed_over and grow.kept_tokens >= HELD
    # (the shrink hands over pool two's rows, which are not stalled: they stop wherever the shrink finds them, a
    # round or an update's pause in, so with any number of tokens: 4 in 2 of 6 runs on a busy machine)
    assert _check_continued(tr, cfg, calls, two | last, most=None) >= 1


async def test_a_sigterm_to_the_rollout_worker_hands_its_rows_over_with_their_tokens(ray_cluster, tmp_path):
    """The default suite's preemption notice: a real SIGTERM to the one rollout worker while its rows are held after
    ``HELD`` tokens; its rows come back with its notice, a new pool continues each from exactly its tokens, and the
    run completes every step, every group once within the bound, with no recovery counted. (Slow, below: the
    ``preempt_rollout`` call too, two ranks, failures.)"""
    steps = 4
    calls, _, stall, cfg, overrides = _stalling_run(tmp_path, steps=steps)
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> tuple[set[int], set[int]]:
            await _history_reaches(tr, 1)
            old = await _stall_pool(tr, stall, calls)
            os.kill(next(iter(old)), signal.SIGTERM)
            await until(lambda: len(tr.rollout.scaler.resizes) >= 1, "the SIGTERM's resize", 120)
            return old, set(await tr.groups.rollout.pid())

        async with asyncio.TaskGroup() as tg:
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, (old, new) = fit.result(), task.result()
        [rec] = tr.rollout.scaler.resizes
        assert tr.restarts == []  # a preemption is no fault
    assert (rec.size_before, rec.size_after, rec.reason) == (1, 1, "preempt")  # the range's minimum
    assert len(history) == steps and max(m["staleness/max"] for m in history) <= 1
    _assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step, steps)
    assert new.isdisjoint(old) and rec.kept_tokens >= HELD
    assert _check_continued(tr, cfg, calls, new) >= 1
    with pytest.raises(ProcessLookupError):
        os.kill(next(iter(old)), 0)  # the SIGTERMed process is gone


@pytest.mark.slow  # one streaming run with three rollout pools: 80-105 s on the loaded 2-core machine
async def test_a_shrink_hands_rows_over_with_their_tokens_and_the_new_pool_continues_them(ray_cluster, tmp_path):
    calls, hang, stall, cfg, overrides = _stalling_run(tmp_path, rollout_drain_s=1.0)
    before = live_actors()
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> list[set[int]]:
            await _history_reaches(tr, 1)
            await _stall_pool(tr, stall, calls)  # (so the run cannot end before the shrink)
            await tr.scale_rollout(2)  # grow: the held groups are handed over after the drain
            two = await _stall_pool(tr, stall, calls)
            await tr.scale_rollout(1)  # shrink: likewise, from two workers
            return [two, set(await tr.groups.rollout.pid())]

        async with asyncio.TaskGroup() as tg:
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, (two, one) = fit.result(), task.result()
        resizes = tr.rollout.scaler.resizes
        assert tr.restarts == []
    assert await settled(before) == before
    assert [(r.size_before, r.size_after) for r in resizes] == [(1, 2), (2, 1)]
    assert len(two) == 2 and two.isdisjoint(one)
    assert len(history) == STEPS and max(m["staleness/max"] for m in history) <= 1
    _assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    continued = _check_continued(tr, cfg, calls, two | one)
    handed = {g for g, _ in tr.rollout.handovers}
    assert handed == set(resizes[0].handed_over) | set(resizes[1].handed_over) and continued >= 2
    assert resizes[0].kept_tokens >= HELD and resizes[1].kept_tokens >= HELD
    assert resizes[0].kept_tokens + resizes[1].kept_tokens == tr.rollout.kept_tokens
    # both ranks' rows came back: a group's rows were split between the two workers of the old pool
    assert all(len(rows) == cfg.group_size for _, rows in tr.rollout.handovers)
    # the journal records both resizes, each with the rows it handed over (a replay re-creates them:
    # tests/reliability/test_stream_replay.py)
    run = tmp_path / "run"
    assert [(r["size_before"], r["size_after"], r["reason"], r["epoch"]) for r in read_journal(run).resizes] == [
        (1, 2, "scale", 1), (2, 1, "scale", 2)]
    data = read_journal(run)
    assert [(r["epoch"], r["handed_over"]) for r in data.retires.values()] == [
        (0, resizes[0].handed_over), (1, resizes[1].handed_over)]
    # each handed-over row's decoding step (tokens kept) is journaled with the pool that stopped it
    kept = {k: len(r["ids"]) for _, rows in tr.rollout.handovers for k, r in rows.items()}
    assert {k: n for r in data.retires.values() for rows in r["rows"].values() for k, n in rows.items()} == kept
    replaying = GRPOTrainer(replay_config(run)[0], replay=run).rollout
    assert {e: groups for e, (groups, _) in replaying._handed.items()} == {0: resizes[0].handed_over,
                                                                            1: resizes[1].handed_over}


@pytest.mark.slow  # one streaming run with three rollout pools: 35-50 s on the loaded 2-core machine
async def test_a_sigterm_or_a_preempt_call_returns_the_rows_tokens_and_they_are_continued(ray_cluster, tmp_path):
    calls, hang, stall, cfg, overrides = _stalling_run(tmp_path)
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> list[set[int]]:
            await _history_reaches(tr, 1)
            first = await _stall_pool(tr, stall, calls)
            os.kill(next(iter(first)), signal.SIGTERM)  # the rows come back in the PreemptedError, through Ray
            await until(lambda: len(tr.rollout.scaler.resizes) >= 1, "the SIGTERM's resize", 120)  # the SIGTERM's resize, or a clear failure
            after_sigterm = len(tr.rollout.handovers)
            second = await _stall_pool(tr, stall, calls)
            await tr.preempt_rollout(0)  # the API's notice: the rows come back from hand_over
            return [first, second, set(await tr.groups.rollout.pid()), after_sigterm]

        async with asyncio.TaskGroup() as tg:
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, (first, second, third, after_sigterm) = fit.result(), task.result()
        resizes = tr.rollout.scaler.resizes
        assert tr.restarts == []  # a preemption is no fault
    assert [(r.size_before, r.size_after, r.reason) for r in resizes] == [(1, 1, "preempt"), (1, 1, "preempt")]
    assert len(history) == STEPS and max(m["staleness/max"] for m in history) <= 1
    _assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    assert after_sigterm >= 1 and len(tr.rollout.handovers) > after_sigterm  # each notice kept tokens
    assert _check_continued(tr, cfg, calls, second | third) >= 2
    assert all(r.kept_tokens >= HELD for r in resizes)


async def _held_on_every_rank(calls: Path, pids: set[int]) -> None:
    """Until some group has rows held on each process of `pids` (so a notice finds tokens on every rank)."""
    def held_everywhere() -> bool:
        held: dict[str, set[int]] = {}
        for c in _calls(calls):
            for k in c.get("held", ()):
                held.setdefault(k.split(":")[0], set()).add(c["pid"])
        return any(pids <= p for p in held.values())  # (a group may have been held on an earlier pool too)

    await until(held_everywhere, "rows held on every rank", 60)


@pytest.mark.slow  # one streaming run with two 2-worker rollout pools: 50-70 s on the loaded 2-core machine
async def test_a_sigterm_to_one_rank_of_two_hands_over_every_ranks_rows_with_their_tokens(ray_cluster, tmp_path):
    calls, hang, stall, cfg, overrides = _stalling_run(tmp_path, rollout_workers="2..3", rollout_placement=[2])
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> tuple[int, set[int], set[int]]:
            await _history_reaches(tr, 1)
            old = await _stall_pool(tr, stall, calls)
            await _held_on_every_rank(calls, old)
            told = min(old)
            os.kill(told, signal.SIGTERM)  # one rank of two: its rows come back in its PreemptedError, the
            await until(lambda: len(tr.rollout.scaler.resizes) >= 1, "the SIGTERM's resize", 120)  # other rank's from its hand_over
            return told, old, set(await tr.groups.rollout.pid())

        async with asyncio.TaskGroup() as tg:
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, (told, old, new) = fit.result(), task.result()
        [rec] = tr.rollout.scaler.resizes
        assert tr.restarts == []  # a preemption is no fault
    assert (rec.size_before, rec.size_after, rec.reason) == (2, 2, "preempt")  # the range's minimum: as large
    assert len(history) == STEPS and max(m["staleness/max"] for m in history) <= 1
    _assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    # every row held on either rank of the old pool was handed over with exactly its HELD tokens
    kept: dict[str, dict[str, Any]] = {}
    for _, rows in tr.rollout.handovers:
        kept.update(rows)
    held = {pid: {k for c in _calls(calls) if c.get("pid") == pid for k in c.get("held", ())} for pid in old}
    assert all(held.values()) and set(held) == old
    noted = _held_tokens(_calls(calls))
    for pid, keys in held.items():
        assert {k: len(kept[k]["ids"]) for k in keys} == {k: noted[pid, k] for k in keys}, \
            (pid == told, keys - set(kept))
        assert min(noted[pid, k] for k in keys) >= HELD
    # and each continued, on the new pool, from exactly those tokens (ids, log-probs, versions) on both of its ranks
    assert _check_continued(tr, cfg, calls, new) >= sum(len(k) for k in held.values())
    assert len(new) == 2 and new.isdisjoint(old) and rec.kept_tokens == tr.rollout.kept_tokens
    # the journal records each row's decoding step at the hand-over; a replay refuses the run (one line): the
    # told-to-stop rank's last rounds came with its notice, but the other rank's died with the broken group
    [retire] = read_journal(tmp_path / "run").retires.values()
    assert {k: n for rows in retire["rows"].values() for k, n in rows.items()} == {
        k: len(r["ids"]) for k, r in kept.items()}
    with pytest.raises(JournalError, match=r"resized \(preempt: 2 -> 2 workers after step \d\), which cannot be "
                                           r"replayed bit for bit: it handed prompt groups \[[\d, ]+\] over, and "
                                           r"the retired pool's rounds after step \d+ were lost \(.*\): a SIGTERM to "
                                           r"one of its 2 ranks broke the pool's group, so the other ranks' last "
                                           r"rounds could not be fetched, so the rows it handed over cannot be "
                                           r"regenerated$"):
        GRPOTrainer(replay_config(tmp_path / "run")[0], replay=tmp_path / "run")


class RankOneFailsHandOverRollout(StallingRollout):
    """A rollout worker whose rank 1 cannot answer ``hand_over`` (its rank 0 can)."""

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def hand_over(self, seeds):
        if self.rank == 1:
            raise RuntimeError("rank 1 cannot hand its rows over")
        return await super().hand_over(seeds)


@pytest.mark.slow  # one streaming run with three 2-worker rollout pools: 40-80 s on the loaded 2-core machine
async def test_a_rank_that_cannot_hand_over_leaves_its_rows_to_start_over_and_the_others_keep_their_tokens(
        ray_cluster, tmp_path):
    calls, hang, stall, cfg, overrides = _stalling_run(tmp_path, RankOneFailsHandOverRollout,
                                                       rollout_workers="2..3", rollout_placement=[2])
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> list[list[int]]:
            await _history_reaches(tr, 1)
            first = list(await tr.groups.rollout.pid())  # in rank order
            await _stall_pool(tr, stall, calls)
            await _held_on_every_rank(calls, set(first))
            stall.write_text("*")  # the next pool holds its rows from its first round (on both of its ranks)
            os.kill(first[0], signal.SIGTERM)  # rank 0's rows come back with its notice; rank 1's hand-over fails
            await until(lambda: len(tr.rollout.scaler.resizes) >= 1, "the SIGTERM's resize", 120)
            second = list(await tr.groups.rollout.pid())
            await _stall_pool(tr, stall, calls)  # (only this pool from now on: the next one decodes freely)
            await _held_on_every_rank(calls, set(second))
            await tr.preempt_rollout(0)  # the API's notice: rank 0 answers its hand-over, rank 1 fails to
            return [first, second, list(await tr.groups.rollout.pid())]

        async with asyncio.TaskGroup() as tg:
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, pools = fit.result(), task.result()
        resizes = tr.rollout.scaler.resizes
        assert tr.restarts == []
    assert [(r.size_before, r.size_after, r.reason) for r in resizes] == [(2, 2, "preempt"), (2, 2, "preempt")]
    assert len(history) == STEPS and max(m["staleness/max"] for m in history) <= 1
    _assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    log = _calls(calls)
    for old in pools[:2]:  # for each notice: rank 0's held rows kept exactly their tokens, rank 1's started over
        held = [{k for c in log if c.get("pid") == pid for k in c.get("held", ())} for pid in old]
        kept = {k: r for _, rows in tr.rollout.handovers for k, r in rows.items() if k in held[0] | held[1]}
        noted = _held_tokens(log)
        assert held[0] and held[1] and set(kept) == held[0]
        assert {k: len(r["ids"]) for k, r in kept.items()} == {k: noted[old[0], k] for k in kept}
        assert min(noted[old[0], k] for k in kept) >= HELD
    assert _check_continued(tr, cfg, calls, set(pools[1]) | set(pools[2])) >= 2


@pytest.mark.slow  # one streaming run, a preemption and a replaced pool: 40-50 s on the loaded 2-core machine
async def test_a_new_pool_that_dies_while_continuing_is_replaced_and_continues_from_the_same_tokens(
        ray_cluster, tmp_path):
    calls, hang, stall, cfg, overrides = _stalling_run(tmp_path)
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> list[set[int]]:
            await _history_reaches(tr, 1)
            first = await _stall_pool(tr, stall, calls)
            kept = len(tr.rollout.handovers)
            stall.write_text("*")  # the new pool holds the continued rows too (they start at HELD tokens)
            await tr.preempt_rollout(0)  # (its drain ends although nothing else happens meanwhile: all held)
            second = set(await tr.groups.rollout.pid())
            assert len(tr.rollout.handovers) > kept
            resumed = {k for _, rows in tr.rollout.handovers[kept:] for k in rows}
            await until(lambda: resumed & {k for c in _calls(calls) if c.get("held") and c["pid"] in second
                                           for k in c["held"]}, "the handed-over rows continued", 60)
            os.kill(next(iter(second)), signal.SIGKILL)  # it dies while it continues them
            stall.write_text("")  # its replacement (seconds away) decodes freely
            return [first, second]

        async with asyncio.TaskGroup() as tg:
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, (first, second) = fit.result(), task.result()
        restarts = list(tr.restarts)
    third = {c["pid"] for c in _calls(calls) if "pid" in c} - first - second  # the replacement's
    assert len(restarts) == 1  # the dead new pool was replaced (a fault), the preemption was not
    assert len(history) == STEPS and max(m["staleness/max"] for m in history) <= 1
    _assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    # the rows handed over by the preemption finished on the replacement, beginning with the same tokens
    assert _check_continued(tr, cfg, calls, third) >= 1


class FailingHandOverRollout(StallingRollout):
    """A rollout worker whose ``hand_over`` fails (as a rank that cannot answer it would)."""

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def hand_over(self, seeds):
        raise RuntimeError("this rank cannot hand its rows over")


@pytest.mark.slow  # one streaming run with two rollout pools: 45-80 s on the loaded 2-core machine
async def test_a_hand_over_that_fails_cancels_the_groups_and_they_start_over_from_their_seeds(ray_cluster, tmp_path):
    calls, hang, stall, cfg, overrides = _stalling_run(tmp_path, FailingHandOverRollout, rollout_drain_s=1.0)
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> list[set[int]]:
            await _history_reaches(tr, 1)
            one = await _stall_pool(tr, stall, calls)
            await tr.scale_rollout(2)  # past the drain the hand-over call fails: the held groups are cancelled
            return [one, set(await tr.groups.rollout.pid())]

        async with asyncio.TaskGroup() as tg:
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, (one, two) = fit.result(), task.result()
        [rec] = tr.rollout.scaler.resizes
        assert tr.restarts == []
    assert len(history) == STEPS and max(m["staleness/max"] for m in history) <= 1
    _assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    assert rec.handed_over and rec.kept_tokens == 0 and tr.rollout.handovers == []
    log = _calls(calls)
    for g in rec.handed_over:  # each generated again on the new pool, from its seed: nothing resumed
        final = [c for c in log if c.get("seed") == batch_seed(cfg, g) and "rows" in c]
        assert final and all(c["pid"] in two and c["resumed"] == [] for c in final), (g, final)
