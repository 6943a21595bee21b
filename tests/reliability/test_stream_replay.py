"""A streaming partial-rollout run replays bit for bit: ``asyncrl replay`` follows the
journal's admissions and step groups while the engines re-run their recorded rounds (pipelines/rollout/stream_replay.py).

* Real Ray, the tiny model on ``char_class``: stream mode, ``partial_rollout=recompute``, ``max_staleness=2``,
  a weight update landing mid-generation every time (tests/pipelines/mid_update.py: a group held between two
  rounds until version 2 reaches it); the replay (plain workers: other timing) trains on the same tokens,
  behaviour log-probs and token versions, and reaches the same per-step metrics and final weights, exactly.
  Slow: with evaluation or dynamic sampling, decoding and updates slowed by seeded random sleeps.
* What cannot be replayed is refused before any worker starts, naming what is missing and the fix: a
  journal written before rounds were recorded, a missing or truncated rounds file, a resumed or restarted
  run, a run whose rollout pool was replaced, a resize whose handed-over rows' rounds were lost, a ``retire``
  record that does not fit its rounds.
* Resized runs replay: drained, handed over past ``drain_s=0`` (grow, shrink, ``preempt_rollout``), and a
  one-worker pool's SIGTERM (its notice carries its last rounds); an edited kept-token count fails the
  replay at its hand-over (``ReplayDivergedError``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from asyncrl.pipelines.job.config import config_fingerprint
from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.journaling.journal import JournalError, read_journal
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.commands.replay import replay
from asyncrl.pipelines.journaling.rounds import read_rounds
from asyncrl.pipelines.loop.stages import AdvantageWorker
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles import RolloutWorker

import asyncrl
from asyncrl import Dispatch, Execute, register
from tests.pipelines.mid_update import mid_update_workers
from tests.reliability.faults import DelayedPolicy

STEPS = 6


def stream_cfg(out: Path, steps: int = STEPS):
    cfg = tiny_test()
    cfg.rollout.partial_rollout = "recompute"
    cfg.rollout.max_new_tokens, cfg.rollout.chunk_tokens = 8, 2
    t = cfg.trainer
    t.steps, t.max_staleness, t.rollout_weights, t.rollout_mode = steps, 2, "latest", "stream"
    t.output_dir = str(out)
    return cfg.validate()


class SlowDecodeRollout(RolloutWorker):
    """A rollout worker whose every forward pass sleeps a seeded random time (decoding outlasts a train
    step, so updates reach generations in flight): the timing changes, what is computed does not."""

    def __init__(self, *args: Any, delay_seed: int = 0, max_delay: float = 0.04, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rng = random.Random(delay_seed)
        self.model.register_forward_hook(lambda *_: time.sleep(rng.uniform(0, max_delay)))


class TokenRecorder(AdvantageWorker):
    """Writes what each step trains on (tokens, behaviour log-probs, token versions) to `path`."""

    def __init__(self, *args: Any, path: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._path = path

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def version_stats(self, batch: Any, step: int, max_staleness: int) -> dict[str, float]:
        rec = {"step": step, "ids": batch["response_ids"].tolist(), "logp": batch["rollout_log_probs"].tolist(),
               "versions": batch["token_versions"].tolist()}
        with open(self._path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return super().version_stats(batch, step, max_staleness)


def trained(path: Path) -> list[dict[str, Any]]:
    return sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda r: r["step"])


def test_a_stream_partial_rollout_run_replays_bit_for_bit(ray_cluster, tmp_path):
    run, steps = tmp_path / "run", 4
    cfg = stream_cfg(run, steps)
    overrides = {**mid_update_workers(cfg, tmp_path / "held"),
                 "advantage": (TokenRecorder, {"path": str(tmp_path / "original.jsonl")})}
    history = GRPOTrainer(cfg, worker_overrides=overrides).fit_sync()
    assert [r["step"] for r in history] == list(range(steps))
    assert max(r["staleness/max"] for r in history) <= 2
    original = trained(tmp_path / "original.jsonl")
    # the held group's rows decoded under versions 1 and 2: the replay has an update mid-generation to re-enact
    assert any(r["stream/multi_version_frac"] > 0 for r in history)
    assert any({1, 2} <= {v for v in row if v >= 0} for r in original for row in r["versions"])

    result = asyncrl.run(replay(run, worker_overrides={
        "advantage": (TokenRecorder, {"path": str(tmp_path / "replayed.jsonl")})}))
    assert result.metric_differences == [] and result.identical
    assert result.weights_sha256 == result.original_weights_sha256 is not None  # the final weights, bit for bit
    assert result.groups == result.original_groups == {t: read_journal(run).steps[t]["groups"] for t in range(steps)}
    assert trained(tmp_path / "replayed.jsonl") == original  # same tokens, log-probs (exact floats), versions


def write_journal(run: Path, cfg, *, rounds: bool = True, segments: int = 1, chunks: list[dict] | None = None,
                  rounds_file: bool = True, resize: bool = False, retire: dict | None = None) -> None:
    """A stream journal of one step that trained groups 0 and 1 (and its rounds file); with `resize`, a new
    rollout pool of one worker took over from two after step 0 (stream_scale.py), and `retire` is the old pool's
    ``retire`` record, when given."""
    header = {"kind": "run", "fingerprint": config_fingerprint(cfg), "config": to_dict(cfg), "start_step": 0,
              "next_gen": 0}
    if rounds:
        header["rounds"] = "rounds.jsonl"
    recs = [header, {"kind": "group", "index": 0, "seed": 0, "version": 0},
            {"kind": "group", "index": 1, "seed": 1, "version": 0}]
    recs += [{**header, "start_step": 1}] * (segments - 1)
    recs += [{"kind": "resize", "size_before": 2, "size_after": 1, "reason": "scale", "version": 0, "epoch": 1,
              "after_step": 0}] if resize else []
    recs += [{"kind": "retire", "epoch": 0, **retire}] if retire is not None else []
    recs += [{"kind": "step", "step": 0, "batch": 0, "version": 0, "groups": [0, 1]},
             {"kind": "end", "steps": 1, "weights_sha256": "x"}]
    run.mkdir(parents=True, exist_ok=True)
    (run / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    keys = [f"{g}:{j}" for g in (0, 1) for j in range(4)]  # tiny_test: seed 0, so group g's seed is g
    if chunks is None:
        chunks = [{"step": 0, "epoch": 0, "ranks": [[{"keys": keys, "segments": [[0, 2]]}]]}]
    if rounds_file:
        (run / "rounds.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chunks))


ALL_KEYS = [f"{g}:{j}" for g in (0, 1) for j in range(4)]
RESIZED = ("journal.jsonl': its rollout pool was resized \\(scale: 2 -> 1 workers after step 0\\), which cannot be "
           "replayed bit for bit: ")
"""The start of the refusal of a resized stream run (after the journal's path)."""
OLD_POOL = {"step": 0, "epoch": 0, "ranks": [[{"keys": ALL_KEYS[:4], "segments": [[0, 2]]}]]}
"""Pool 0's rounds (one rank: the config's): group 0's rows, fetched after step 0."""
NEW_POOL = {"step": 0, "epoch": 1, "ranks": [[{"keys": ALL_KEYS[4:], "segments": [[0, 2]]}]]}
"""Pool 1's rounds (one rank): group 1's rows."""


@pytest.mark.parametrize("case, match", [
    ({"rounds": False}, "records no engine rounds .* run it again with this version"),
    ({"rounds_file": False}, "needs its round log .* which is missing; put the run's rounds.jsonl back"),
    ({"chunks": [{"step": 0, "epoch": 0, "ranks": [[{"keys": ALL_KEYS[:7], "segments": [[0, 2]]}]]}]},
     "no round for row 3 of prompt group 1 .* truncated or edited; restore the file"),
    ({"segments": 2}, "resumed or restarted at step 1"),
    ({"chunks": [{"step": 0, "epoch": 1, "ranks": [[{"keys": ALL_KEYS, "segments": [[0, 2]]}]]}]},
     "rollout pool was replaced"),
    ({"chunks": [{"step": 0, "epoch": 0, "ranks": None, "lost": "ActorDiedError: gone"}]},
     "rounds lost: ActorDiedError"),
    ({"resize": True, "chunks": [OLD_POOL, NEW_POOL]},  # a journal written before retired pools' rounds were
     RESIZED + "the retired pool's rounds after its last step were not recorded \\(a journal written before "
     "resized runs recorded them, or a run that ended before the pool was closed\\); run it again with this "
     "version to get a replayable journal$"),
    ({"resize": True, "retire": {"drained": [0], "handed_over": []}, "chunks": [OLD_POOL, NEW_POOL]},
     RESIZED + "the retired pool's rounds after its last step were not recorded"),  # its retired line is missing
    ({"resize": True, "retire": {"drained": [], "handed_over": [0], "rows": {"0": {"0:0": 2}}},
      "chunks": [OLD_POOL, NEW_POOL, {**OLD_POOL, "ranks": None, "lost": "ActorDiedError: gone", "retired": True}]},
     RESIZED + "it handed prompt groups \\[0\\] over, and the retired pool's rounds after step 0 were lost "
     "\\(ActorDiedError: gone\\), so the rows it handed over cannot be regenerated$"),
    *[({"resize": True, "retire": {"drained": [], "handed_over": [0], "rows": rows},
        "chunks": [OLD_POOL, NEW_POOL, {**OLD_POOL, "retired": True}]},
       "the retire record of rollout pool 0 does not match its rounds: " + why + "; the journal or its "
       "rounds.jsonl were edited, restore the files the run wrote$") for rows, why in [
        ({"1": {"1:0": 2}}, "group 1 is not among the groups it handed over \\(\\[0\\]\\)"),
        ({"0": {"1:0": 2}}, "'1:0' is not a row of group 0"),
        ({"0": {"0:0": 9}}, "row '0:0' kept 9 tokens \\(0..rollout.max_new_tokens=8\\)"),
    ]],
    ({"resize": True, "retire": {"drained": [], "handed_over": [0], "rows": {"0": {"0:0": 2}}},
      "chunks": [{**OLD_POOL, "ranks": [[]]}, NEW_POOL, {**OLD_POOL, "ranks": [[]], "retired": True}]},
     "row '0:0' kept 2 tokens but no recorded round of pool 0 or before decoded it"),
    ({"resize": True, "retire": {"drained": [0], "handed_over": []},
      "chunks": [OLD_POOL, NEW_POOL, {**OLD_POOL, "ranks": [[], []], "retired": True}]},
     "holds rounds of \\[1, 2\\] ranks for rollout pool 0, which had 1 workers"),
    ({"resize": True, "retire": {"drained": [0], "handed_over": []},
      "chunks": [OLD_POOL, NEW_POOL, {**OLD_POOL, "retired": True}, {**NEW_POOL, "epoch": 2}]},
     "rollout pool was replaced"),  # a pool epoch no resize started: a fault replaced it
])
def test_a_stream_journal_that_cannot_be_replayed_is_refused_before_workers_start(tmp_path, case, match):
    cfg = stream_cfg(tmp_path / "out")
    write_journal(tmp_path / "run", cfg, **case)
    with pytest.raises(JournalError, match=match):
        GRPOTrainer(cfg, replay=tmp_path / "run")


def test_a_complete_stream_journal_is_accepted(tmp_path):
    cfg = stream_cfg(tmp_path / "out")
    write_journal(tmp_path / "run", cfg)
    trainer = GRPOTrainer(cfg, replay=tmp_path / "run")
    assert trainer.journal.replaying and type(trainer.rollout).__name__ == "StreamReplay"


def test_a_drained_resize_is_planned_as_a_new_pool_at_its_place_with_each_pools_own_rounds(tmp_path):
    cfg = stream_cfg(tmp_path / "out")
    retired = {**OLD_POOL, "ranks": [[{"keys": ["0:0"], "segments": [[0, 1]]}]], "retired": True}
    write_journal(tmp_path / "run", cfg, resize=True, retire={"drained": [0], "handed_over": []},
                  chunks=[OLD_POOL, NEW_POOL, retired])
    rollout = GRPOTrainer(cfg, replay=tmp_path / "run").rollout
    assert rollout._order == [("group", 0, 0), ("group", 1, 0), ("resize", 1, 0)]
    assert rollout._pools == {0: [OLD_POOL["ranks"][0] + retired["ranks"][0]], 1: NEW_POOL["ranks"]}


def test_a_resize_that_handed_groups_over_is_planned_with_the_rows_its_retire_record_kept(tmp_path):
    cfg = stream_cfg(tmp_path / "out")
    retired = {**OLD_POOL, "ranks": [[{"keys": ["0:0", "0:1"], "segments": [[0, 0]]}]], "retired": True}
    write_journal(tmp_path / "run", cfg, resize=True, chunks=[OLD_POOL, NEW_POOL, retired],
                  retire={"drained": [], "handed_over": [0], "rows": {"0": {"0:0": 2, "0:1": 0}}})
    rollout = GRPOTrainer(cfg, replay=tmp_path / "run").rollout
    assert rollout._order == [("group", 0, 0), ("group", 1, 0), ("resize", 1, 0)]
    assert rollout._handed == {0: ([0], {0: {"0:0": 2, "0:1": 0}})}
    # a SIGTERM: the told-to-stop rank's last rounds came with its notice; the fetch after found it gone
    notice = {**OLD_POOL, "ranks": [[{"keys": ["0:0"], "segments": [[0, 1]]}]], "notice": 0}
    lost = {**OLD_POOL, "ranks": None, "lost": "GroupBrokenError: worker rank 0 died", "retired": True}
    write_journal(tmp_path / "run", cfg, resize=True, chunks=[OLD_POOL, notice, NEW_POOL, lost],
                  retire={"drained": [], "handed_over": [0], "rows": {"0": {"0:0": 2}}})
    rollout = GRPOTrainer(cfg, replay=tmp_path / "run").rollout
    assert rollout._pools[0] == [OLD_POOL["ranks"][0] + notice["ranks"][0]]


@pytest.mark.slow
@pytest.mark.parametrize("evaluation, filter_groups", [(True, False), (False, True)])
def test_a_stream_run_with_evaluation_or_dynamic_sampling_replays_bit_for_bit(ray_cluster, tmp_path, evaluation,
                                                                             filter_groups):
    """Held-out evaluation (the weight loop evaluates due versions between loads) or dynamic sampling
    (finished groups rejected, others admitted in their room) in a streaming partial-rollout run: the
    replay reaches the same metrics and final weights."""
    from asyncrl.pipelines.job.config import EvalConfig

    run = tmp_path / "run"
    cfg = stream_cfg(run)
    if evaluation:
        cfg.evaluation = EvalConfig(every=2, at_start=True, at_end=True, num_prompts=4, num_samples=0)
    cfg.algorithm.filter_groups.enable = filter_groups
    cfg = cfg.validate()
    overrides = {"rollout": (SlowDecodeRollout, {"delay_seed": 7, "max_delay": 0.06}),
                 "policy": (DelayedPolicy, {"delay_seed": 8, "max_delay": 0.4})}
    history = GRPOTrainer(cfg, worker_overrides=overrides).fit_sync()
    assert [r["step"] for r in history] == list(range(STEPS))
    result = asyncrl.run(replay(run))
    assert result.metric_differences == [] and result.identical
    assert result.weights_sha256 == result.original_weights_sha256 is not None


AGENT = str(Path(__file__).resolve().parent.parent / "roles" / "gateway_agent.py")


def agent_cfg(out: Path, fn: str, steps: int = 3):
    """A stream partial-rollout run of an openai-client agent through the gateway (tests/roles/gateway_agent.py)."""
    cfg = stream_cfg(out)
    cfg.model.tokenizer = "qwen2"
    cfg.rollout.agent, cfg.rollout.max_new_tokens = f"{AGENT}:{fn}", 24
    cfg.trainer.steps = steps
    return cfg.validate()


def test_a_gateway_stream_journal_without_agent_sessions_is_refused(tmp_path):
    cfg = agent_cfg(tmp_path / "out", "two_turns")
    write_journal(tmp_path / "run", cfg)  # rounds, but no session records
    with pytest.raises(JournalError, match="records no agent sessions .* run it again with this version"):
        GRPOTrainer(cfg, replay=tmp_path / "run")


@pytest.mark.slow  # a gateway run and its replay: about 2 minutes on 2 loaded cores per case
@pytest.mark.parametrize("agent", ["two_turns", "two_turns_random"])
def test_a_gateway_stream_run_replays_when_its_agent_is_deterministic_and_fails_naming_why_otherwise(
        ray_cluster, tmp_path, agent):
    """`two_turns` asks only what follows from the answers it got: the replay's gateways get the recorded
    requests, the engines regenerate the same tokens, and the run replays bit for bit. `two_turns_random`
    puts a random number in its second message: the replayed request differs from the recorded one, and the
    replay fails saying so (the session, the request, the reason)."""
    run = tmp_path / "run"
    cfg = agent_cfg(run, agent)
    history = GRPOTrainer(cfg, worker_overrides={
        "advantage": (TokenRecorder, {"path": str(tmp_path / "original.jsonl")})}).fit_sync()
    assert [r["step"] for r in history] == [0, 1, 2]
    sessions = [e for c in read_rounds(run / "rounds.jsonl") for rank in c["ranks"] for e in rank if "session" in e]
    trained_groups = [g for t in range(3) for g in read_journal(run).steps[t]["groups"]]
    keys = {e["session"] for e in sessions}
    from asyncrl.pipelines.loop.loop_state import batch_seed

    assert {f"{batch_seed(cfg, g)}:{j}" for g in trained_groups for j in range(cfg.group_size)} <= keys
    assert all(len(e["requests"]) == 2 for e in sessions)  # the agent's two requests, each with its answer
    if agent == "two_turns":
        result = asyncrl.run(replay(run, worker_overrides={
            "advantage": (TokenRecorder, {"path": str(tmp_path / "replayed.jsonl")})}))
        assert result.metric_differences == [] and result.identical
        assert result.weights_sha256 == result.original_weights_sha256 is not None
        assert trained(tmp_path / "replayed.jsonl") == trained(tmp_path / "original.jsonl")
    else:
        with pytest.raises(Exception, match=r"request 1 of session '\d+:\d+' differs from the recorded one .* not a "
                                            r"deterministic function of the responses it received"):
            asyncrl.run(replay(run))


class GatedRollout(SlowDecodeRollout):
    """A :class:`SlowDecodeRollout` whose group calls wait before they start while its process is listed in the
    `gate` file (what the calls compute does not change: their requests have not started)."""

    def __init__(self, *args: Any, gate: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gate_file = gate

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.DP_COMPUTE, concurrent=True, summary=("scores", "response_length"))
    async def generate_requests(self, batch, max_new_tokens=None, temperature=None, seed=None, resume=None,
                                compute_reward=False):
        while os.path.exists(self._gate_file) and str(os.getpid()) in Path(self._gate_file).read_text().split():
            await asyncio.sleep(0.02)
        return await super().generate_requests(batch, max_new_tokens, temperature, seed, resume, compute_reward)


async def _resize_while_gated(tr, gate: Path, n: int) -> None:
    """Resize the rollout pool to `n` while the old pool's calls wait at their gate (so the run cannot end before
    the new pool takes over), and open the gate once it took over (the old pool's groups then drain)."""
    gate.write_text(" ".join(map(str, await tr.groups.rollout.pid())))
    old = tr.workers.parts[0]
    scale = asyncio.ensure_future(tr.scale_rollout(n))
    async with asyncio.timeout(120):
        while tr.workers.parts[0] is old and not scale.done():
            await asyncio.sleep(0.02)
    gate.write_text("")
    await scale


@pytest.mark.slow  # a streaming run with three rollout pools and its replay: about 90 s on 2 loaded cores
async def test_a_stream_run_resized_1_2_1_with_drains_replays_bit_for_bit(ray_cluster, tmp_path):
    """``scale_rollout(2)`` then ``scale_rollout(1)`` mid-run, each draining the old pool's groups (no hand-over):
    the retired pools' last rounds are in the round log and the journal places each new pool among the group
    calls and loads, so the replay starts the pools where the run did and regenerates every token, behaviour
    log-prob and version, with the same final weights."""
    run = tmp_path / "run"
    cfg = stream_cfg(run)
    cfg.trainer.rollout_workers, cfg.trainer.rollout_placement = "1..2", [1]
    cfg.trainer.rollout_drain_s = 120.0  # each resize drains: nothing is handed over
    cfg.trainer.steps = steps = 10
    cfg = cfg.validate()
    gate = tmp_path / "gate"
    overrides = {"rollout": (GatedRollout, {"delay_seed": 9, "max_delay": 0.06, "gate": str(gate)}),
                 "policy": (DelayedPolicy, {"delay_seed": 10, "max_delay": 0.4}),
                 "advantage": (TokenRecorder, {"path": str(tmp_path / "original.jsonl")})}
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> None:
            while len(tr.history) < 1:
                await asyncio.sleep(0.02)
            await _resize_while_gated(tr, gate, 2)
            while len(tr.history) < 4:
                await asyncio.sleep(0.02)
            await _resize_while_gated(tr, gate, 1)

        async with asyncio.TaskGroup() as tg:
            fit, task = tg.create_task(tr.fit()), tg.create_task(drive())
        history, resizes = fit.result(), tr.rollout.scaler.resizes
    assert [r["step"] for r in history] == list(range(steps))
    assert [(r.size_before, r.size_after, r.handed_over) for r in resizes] == [(1, 2, []), (2, 1, [])]
    data = read_journal(run)
    assert [(r["epoch"], r["drained"], r["handed_over"]) for r in data.retires.values()] == [
        (0, resizes[0].drained, []), (1, resizes[1].drained, [])]
    lines = read_rounds(run / "rounds.jsonl")
    assert [(c["epoch"], len(c["ranks"])) for c in lines if c.get("retired")] == [(0, 1), (1, 2)]
    assert {c["epoch"] for c in lines} == {0, 1, 2}

    result = await replay(run, worker_overrides={
        "advantage": (TokenRecorder, {"path": str(tmp_path / "replayed.jsonl")})})
    assert result.metric_differences == [] and result.identical
    assert result.weights_sha256 == result.original_weights_sha256 is not None  # the final weights, bit for bit
    assert trained(tmp_path / "replayed.jsonl") == trained(tmp_path / "original.jsonl")  # tokens, log-probs, versions


@pytest.mark.slow  # a run with four rollout pools, its replay and one that diverges: 75-135 s on 2 loaded cores
async def test_a_stream_run_whose_resizes_handed_groups_over_replays_bit_for_bit(ray_cluster, tmp_path):
    """``scale_rollout(2)``, ``scale_rollout(1)`` and ``preempt_rollout(0)`` mid-run with ``drain_s=0``, each
    while the old pool holds its rows after 3 tokens (tests/pipelines/test_stream_hand_over.py): every group in
    flight is handed over, its rows continued on the new pool from the tokens they had. The replay hands the same
    rows over where the journal says they stopped, and regenerates every token, behaviour log-prob and version,
    with the same metrics and final weights. A retire record edited to keep another token count fails the
    replay at that hand-over, naming the row."""
    from asyncrl.roles.engines.round_log import ReplayDivergedError
    from tests.pipelines.test_stream_hand_over import HELD, _stall_pool, _stalling_run
    from tests.pipelines.test_stream_scale import _history_reaches

    calls, _, stall, cfg, overrides = _stalling_run(tmp_path, rollout_drain_s=0.0)
    run = tmp_path / "run"
    overrides["advantage"] = (TokenRecorder, {"path": str(tmp_path / "original.jsonl")})
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> None:
            await _history_reaches(tr, 1)
            await _stall_pool(tr, stall, calls)  # (so the run cannot end before the resizes)
            await tr.scale_rollout(2)  # grow 1 -> 2: every group in flight handed over at once
            await _stall_pool(tr, stall, calls)
            await tr.scale_rollout(1)  # shrink 2 -> 1, from both ranks
            await _stall_pool(tr, stall, calls)
            await tr.preempt_rollout(0)  # the API's notice: 1 -> 1 (the range's minimum)
            stall.write_text("")

        async with asyncio.TaskGroup() as tg:
            fit, _ = tg.create_task(tr.fit()), tg.create_task(drive())
        history, resizes = fit.result(), tr.rollout.scaler.resizes
        kept = {k: len(r["ids"]) for _, rows in tr.rollout.handovers for k, r in rows.items()}
    assert [r["step"] for r in history] == list(range(cfg.trainer.steps))
    assert [(r.size_before, r.size_after, r.reason) for r in resizes] == [(1, 2, "scale"), (2, 1, "scale"),
                                                                          (1, 1, "preempt")]
    assert all(r.handed_over and r.kept_tokens >= HELD for r in resizes)  # each kept decoded tokens
    retires = read_journal(run).retires
    assert [(e, r["handed_over"]) for e, r in retires.items()] == [(e, r.handed_over) for e, r in enumerate(resizes)]
    assert {k: n for r in retires.values() for rows in r["rows"].values() for k, n in rows.items()} == kept

    result = await replay(run, worker_overrides={
        "advantage": (TokenRecorder, {"path": str(tmp_path / "replayed.jsonl")})})
    assert result.metric_differences == [] and result.identical
    assert result.weights_sha256 == result.original_weights_sha256 is not None  # the final weights, bit for bit
    assert trained(tmp_path / "replayed.jsonl") == trained(tmp_path / "original.jsonl")  # tokens, log-probs, versions

    # the journal edited: the first resize kept one token fewer of a held row than its rounds decoded
    lines = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]
    retire = next(r for r in lines if r["kind"] == "retire")
    g, key = next((g, k) for g, rows in retire["rows"].items() for k, n in rows.items() if n == HELD)
    retire["rows"][g][key] = HELD - 1
    (run / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(ReplayDivergedError, match=f"the replayed hand-over of prompt group {g} from rollout pool 0 "
                                                  f"stopped row '{key}' after {HELD} tokens, but the journal's retire "
                                                  f"record kept {HELD - 1}"):
        await replay(run, output_dir=tmp_path / "replay2")


@pytest.mark.slow  # a streaming run with two 2-worker rollout pools and its replay: about 90 s
async def test_a_stream_run_whose_rollout_rank_got_a_sigterm_replays_bit_for_bit(ray_cluster, tmp_path):
    """A SIGTERM to the rollout worker while it holds its rows after 3 tokens: its rows and its last rounds come
    back with its notice (its process then exits), and the run goes on on a new pool. The replay regenerates
    every token, behaviour log-prob and version, with the same metrics and final weights. (In a pool of several
    ranks the others' last rounds die with the broken group: refused, tests/pipelines/test_stream_hand_over.py.)"""
    import signal

    from tests.pipelines.test_stream_hand_over import HELD, _stall_pool, _stalling_run
    from tests.pipelines.test_stream_scale import _history_reaches

    calls, _, stall, cfg, overrides = _stalling_run(tmp_path)
    run = tmp_path / "run"
    overrides["advantage"] = (TokenRecorder, {"path": str(tmp_path / "original.jsonl")})
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:

        async def drive() -> None:
            await _history_reaches(tr, 1)
            [pid] = await _stall_pool(tr, stall, calls)
            os.kill(pid, signal.SIGTERM)
            async with asyncio.timeout(120):
                while len(tr.rollout.scaler.resizes) < 1:
                    await asyncio.sleep(0.02)
            stall.write_text("")

        async with asyncio.TaskGroup() as tg:
            fit, _ = tg.create_task(tr.fit()), tg.create_task(drive())
        history, [rec] = fit.result(), tr.rollout.scaler.resizes
        assert tr.restarts == []
    assert [r["step"] for r in history] == list(range(cfg.trainer.steps))
    assert (rec.size_before, rec.size_after, rec.reason) == (1, 1, "preempt") and rec.kept_tokens >= HELD
    [notice] = [c for c in read_rounds(run / "rounds.jsonl") if "notice" in c]  # the told-to-stop rank's rounds
    assert notice["epoch"] == 0 and notice["ranks"][notice["notice"]]

    result = await replay(run, worker_overrides={
        "advantage": (TokenRecorder, {"path": str(tmp_path / "replayed.jsonl")})})
    assert result.metric_differences == [] and result.identical
    assert result.weights_sha256 == result.original_weights_sha256 is not None  # the final weights, bit for bit
    assert trained(tmp_path / "replayed.jsonl") == trained(tmp_path / "original.jsonl")  # tokens, log-probs, versions
