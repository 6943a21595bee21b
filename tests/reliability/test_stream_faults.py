"""Streaming rollout's failure protocol on a real local Ray: a rollout worker killed inside a partial-rollout weight
update is replaced and the groups it had in flight are generated again, once each, with their seeds; a stop
requested while a new version loads ends with a checkpoint that lists the untrained groups, and the resumed run
admits exactly those again first, with the same seeds. Each ends in completion (never a hang), with every prompt
group trained exactly once and every trajectory within the staleness bound.

What each case needs is made to happen, not waited for (tests/pipelines/mid_update.py): the first group admitted
at version 1 holds its rows mid-generation until version 2 reaches them, and the update that publishes version 2
waits for that hold; so a group is in flight whenever version 2 loads. The stop case also holds the load of
version 2 until the stop's checkpoint is written."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.roles import RolloutWorker

from asyncrl import Dispatch, register

from tests.pipelines.mid_update import hold_group, mid_update_workers
from tests.reliability.conftest import live_actors, settled, until, wait_for_file
from tests.reliability.faults import Fault, FaultyPolicy

STEPS = 4


def stream_cfg(out: Path, *, restarts: int = 0, partial: str = "off"):
    cfg = tiny_test()
    cfg.rollout.partial_rollout = partial
    cfg.rollout.chunk_tokens = 2  # two rounds a response: a row can be held between them
    t = cfg.trainer
    t.steps, t.max_staleness, t.rollout_weights, t.rollout_mode = STEPS, 1, "latest", "stream"
    t.output_dir = str(out)
    t.restart.max_restarts = restarts
    return cfg.validate()


async def fit_until_the_fault_fires(trainer: GRPOTrainer, fault_dir: Path) -> tuple[asyncio.Task, int]:
    """Start ``trainer.fit()`` in a task and wait until the injected fault has fired: (the task, the pid the
    fault wrote). Fails if the run ends first."""

    async def run():
        async with trainer:
            return await trainer.fit()

    task = asyncio.create_task(run())
    fired = asyncio.create_task(wait_for_file(fault_dir / "pid", 120))
    await asyncio.wait({task, fired}, return_when=asyncio.FIRST_COMPLETED)
    assert fired.done(), f"the run ended before the fault fired: {task.exception()!r}"
    return task, int((fault_dir / "pid").read_text())


def groups_trained(out: Path) -> tuple[dict[int, int], list[dict]]:
    recs = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    admitted = {r["index"]: r["version"] for r in recs if r["kind"] == "group"}
    return admitted, [r for r in recs if r["kind"] == "step"]


def assert_every_group_once_within_the_bound(out: Path, B: int) -> None:
    admitted, steps = groups_trained(out)
    assert [s["step"] for s in steps] == list(range(STEPS))
    trained = [g for s in steps for g in s["groups"]]
    assert sorted(trained) == list(range(STEPS * B))
    for s in steps:
        assert all(0 <= s["step"] - admitted[g] <= 1 for g in s["groups"])
    ledger = check_ledger(out)
    assert ledger.ok, ledger.render()


async def test_a_rollout_worker_killed_during_an_update_is_replaced_and_every_group_is_trained_once(
        ray_cluster, tmp_path):
    before = await asyncio.to_thread(live_actors)
    (tmp_path / "fault").mkdir()
    fault = Fault(dir=str(tmp_path / "fault"), point="load_weights", call=2)  # loading version 2
    cfg = stream_cfg(tmp_path / "run", restarts=1, partial="recompute")  # the update reaches groups in flight
    calls = tmp_path / "calls.jsonl"
    trainer = GRPOTrainer(cfg, worker_overrides=mid_update_workers(cfg, tmp_path / "held", fault=fault,
                                                                   calls=str(calls)))
    task, pid = await fit_until_the_fault_fires(trainer, tmp_path / "fault")
    os.kill(pid, signal.SIGKILL)
    history = await asyncio.wait_for(task, 180)  # completion, not a hang
    [r] = trainer.restarts
    assert r["kind"] == "replace" and r["from_checkpoint"] is None
    # the rollout pool's process died inside the update (its fault fired in the load of version 2): whichever call
    # the trainer saw fail first names it (the reward worker shares the process)
    assert r["origin"] in {"rollout.rollout", "rollout.reward"} and "died while running" in r["error"]
    assert len(history) == STEPS and all(h["staleness/max"] <= 1 for h in history)
    assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    assert await settled(before) == before
    killed = int((tmp_path / "fault" / "pid").read_text())
    issued = [json.loads(x) for x in calls.read_text().splitlines()]
    seeds = {r["index"]: r["seed"] for r in journal(tmp_path / "run") if r["kind"] == "group"}
    assert [c["seed"] for c in issued] == [seeds[c["group"]] for c in issued]  # first or again: the group's seed
    held = {c["group"] for c in issued if c["pid"] == killed}  # issued to the worker that died
    again = [c["group"] for c in issued if c["pid"] != killed and c["group"] in held]
    # the held group was in flight when the worker died: it and any other unfinished group were issued again, once
    # each, to the replacement, with the same seeds
    assert hold_group(cfg) in again and len(again) == len(set(again)) == trainer.rollout.regenerated


async def test_a_stop_during_an_update_checkpoints_the_untrained_groups_and_a_resume_trains_exactly_them(
        ray_cluster, tmp_path):
    out, gate = tmp_path / "run", tmp_path / "gate"
    gate.mkdir()
    cfg = stream_cfg(out, partial="recompute")
    B = cfg.prompts_per_step
    at_stop: dict[str, int] = {}
    overrides = mid_update_workers(cfg, tmp_path / "held", gate=str(gate), gate_load=2)  # version 2 loads on "go"

    def stop(trainer, step, metrics):
        if step == 1:  # version 2 was just published: its load is issued, and held until the checkpoint is written
            trainer.request_stop("test")

    async with GRPOTrainer(cfg, on_step=stop, worker_overrides=overrides) as trainer:

        async def go() -> None:
            await until(lambda: (gate / "loading").exists() and trainer.interrupted is not None,
                        "the stop during the gated load", 120)
            loads = [r["version"] for r in journal(out) if r["kind"] == "load"]
            at_stop.update(loading=loads[-1], loaded=trainer.state.rollout_version)
            (gate / "go").write_text("")  # the load ends; the run returns

        async with asyncio.TaskGroup() as tg:
            tg.create_task(trainer.fit())
            tg.create_task(go())
    assert trainer.interrupted is not None and trainer.interrupted.steps_done == 2
    assert at_stop == {"loading": 2, "loaded": 1}  # the stop's checkpoint was written while version 2 loaded
    state = json.loads((trainer.interrupted.checkpoint / "state.json").read_text())
    _, steps = groups_trained(out)
    trained = {g for s in steps for g in s["groups"]}
    pending = state["stream"]["pending"]
    assert len(trained) == 2 * B and not trained & set(pending)
    assert sorted(trained | set(pending)) == list(range(state["stream"]["next_group"]))  # none lost
    assert hold_group(cfg) in pending  # (held mid-generation until version 2: owed at the stop)
    first = {r["index"]: r for r in journal(out) if r["kind"] == "group"}
    async with GRPOTrainer(cfg, resume=out) as resumed:
        history = await resumed.fit()
    assert [h["step"] for h in history if h["step"] >= 2] == [2, 3]
    runs = segments(journal(out))
    assert len(runs) == 2
    again = [r for r in runs[1] if r["kind"] == "group"]
    # the owed groups are admitted again first, in index order, each with the seed it had before the stop
    assert [r["index"] for r in again[:len(pending)]] == pending
    assert [r["seed"] for r in again[:len(pending)]] == [first[g]["seed"] for g in pending]
    assert all(r["seed"] == cfg.trainer.seed * 1_000_003 + r["index"] for r in again)
    assert_every_group_once_within_the_bound(out, B)


def journal(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]


def segments(recs: list[dict]) -> list[list[dict]]:
    """The journal's records per run segment (each starts with a ``run`` header: the run, then each resume)."""
    out: list[list[dict]] = []
    for r in recs:
        if r["kind"] == "run":
            out.append([])
        out[-1].append(r)
    return out


@pytest.mark.slow
async def test_a_training_worker_killed_mid_update_restarts_from_its_checkpoint_and_regenerates_the_untrained_groups(
        ray_cluster, tmp_path):
    """Recovery with finished and in-flight groups in the buffer: the restart replaces the loop state
    whole; the step-2 checkpoint's untrained groups are admitted again (same indices and seeds), the
    finished ones regenerated, and every group is trained exactly once."""
    before = await asyncio.to_thread(live_actors)
    (tmp_path / "fault").mkdir()
    fault = Fault(dir=str(tmp_path / "fault"), point="update", call=3)  # step 2, after backward
    cfg = stream_cfg(tmp_path / "run", restarts=1)
    cfg.trainer.checkpoint_every, cfg.trainer.keep_checkpoints = 1, 10
    trainer = GRPOTrainer(cfg, worker_overrides={"policy": (FaultyPolicy, {"fault": fault})})

    async def run():
        async with trainer:
            return await trainer.fit()

    task = asyncio.create_task(run())
    await wait_for_file(tmp_path / "fault" / "pid", 120)
    os.kill(int((tmp_path / "fault" / "pid").read_text()), signal.SIGKILL)
    history = await asyncio.wait_for(task, 240)
    [r] = trainer.restarts
    assert r["kind"] == "restart" and r["from_checkpoint"].endswith("step_000002") and r["from_step"] == 2
    assert [h["step"] for h in history] == list(range(STEPS))
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "state.json").read_text())
    admitted, steps = groups_trained(tmp_path / "run")
    assert set(state["stream"]["pending"]) <= {g for s in steps if s["step"] >= 2 for g in s["groups"]}
    assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    assert await settled(before) == before


class MidSessionFaultRollout(RolloutWorker):
    """A rollout worker whose gateway hangs the first time any session sends its second request (an agent
    mid-session) and publishes its pid in `fault`'s dir; every request it serves is appended to `requests`
    (its round-log key, its sampling seed and this process)."""

    def __init__(self, *args, fault: Fault, requests: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fault_at, self._requests = fault, requests

    def _request_engine(self):
        submit = super()._request_engine()

        async def hang_mid_session(ids, params, key=None):
            with open(self._requests, "a") as f:
                f.write(json.dumps({"key": key, "seed": params.seed, "pid": os.getpid()}) + "\n")
            if key is not None and key.endswith("/1") and self._fault_at.fire():
                await asyncio.Event().wait()  # until the process is killed
            return await submit(ids, params, key=key)

        return hang_mid_session


@pytest.mark.slow
async def test_a_rollout_worker_killed_mid_session_in_a_gateway_run_is_replaced_and_its_sessions_rerun_with_their_seeds(
        ray_cluster, tmp_path):
    """rollout.agent in stream mode: the rollout worker (and with it the gateway and the agents it runs) dies
    while an agent's session is between its two requests; the pool is replaced, the groups it held are issued
    again and their sessions re-run from the start with the same round-log keys and sampling seeds; the run
    completes every step, each group trained once within the bound."""
    before = await asyncio.to_thread(live_actors)
    (tmp_path / "fault").mkdir()
    cfg = stream_cfg(tmp_path / "run", restarts=1, partial="recompute")
    cfg.model.tokenizer = "qwen2"
    cfg.rollout.agent = os.path.join(os.path.dirname(__file__), "..", "roles", "gateway_agent.py") + ":two_turns"
    cfg.rollout.max_new_tokens = 24
    cfg.validate()
    requests = tmp_path / "requests.jsonl"
    fault = Fault(dir=str(tmp_path / "fault"), point="generate")
    trainer = GRPOTrainer(cfg, worker_overrides={"rollout": (MidSessionFaultRollout, {"fault": fault,
                                                                                      "requests": str(requests)})})
    task, killed = await fit_until_the_fault_fires(trainer, tmp_path / "fault")
    os.kill(killed, signal.SIGKILL)
    history = await asyncio.wait_for(task, 180)  # completion, not a hang
    [r] = trainer.restarts
    assert r["kind"] == "replace" and r["from_checkpoint"] is None
    assert len(history) == STEPS and all(h["staleness/max"] <= 1 for h in history)
    assert all(h["actor/episode/turns_mean"] == 2.0 for h in history)
    assert_every_group_once_within_the_bound(tmp_path / "run", cfg.prompts_per_step)
    assert await settled(before) == before
    served = [json.loads(x) for x in requests.read_text().splitlines()]
    dead = [(s["key"], s["seed"]) for s in served if s["pid"] == killed]
    later = {(s["key"], s["seed"]) for s in served if s["pid"] != killed}
    assert trainer.rollout.regenerated >= 1  # the hung session's group was in flight: issued again
    hung = next(k for k in dead if k[0].endswith("/1"))  # the first second request: the one that hung
    group = hung[0].split(":")[0]  # keys are f"{group seed}:{row}" (then "/turn")
    # every session of the hung group ran again from its first request, with the same key and seed, and the
    # hung one reached its second request again on the replacement
    first_turns = {(k, s) for k, s in dead if k.startswith(group + ":") and "/" not in k}
    assert len(first_turns) == cfg.algorithm.group_size and first_turns | {hung} <= later
