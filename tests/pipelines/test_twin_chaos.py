"""Chaos in the cluster twin (pipelines/commands/chaos.py), the default suite's fast versions of the chaos table
(benchmarks/chaos.py): seeded schedules, and real runs at 4 simulated replicas, 2 per process -- a replica that dies
is replaced alone (simulated death, the real controller's recovery), a rollout process SIGKILLed while it holds a
group is replaced alone (a real fault: the other process keeps its pid), a rollout process SIGKILLed while the
weight loop's load is in flight leaves no error unretrieved (the ranks that live refuse the version they hold once,
the new process loads each version once), a replacement that fails to start falls back to replacing the pool, a
training rank's process SIGKILLed restarts the run from its checkpoint (a real fault);
each completes with its ledger holding (nothing lost, nothing trained twice, every token within the bound) and no
call past twice its deadline. Slow: a lost node (a process of replicas
SIGKILLed), a preemption wave (SIGTERMs), a replica 10x slower, and the pool replaced whole when per-replica
replacement is off."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from asyncrl import Dispatch, register
from asyncrl.pipelines.job.presets import twin
from asyncrl.pipelines.commands.chaos import KINDS, ChaosPolicy, ChaosRollout, plan, run_chaos
from asyncrl.roles import StaleWeightsError
from tests.reliability.conftest import wait_for_file

HOLD_S = 120.0
"""Longest a held generation waits (only its process's SIGKILL is meant to end it)."""


class HoldingRollout(ChaosRollout):
    """The twin's rollout worker whose rank `hold_rank` holds its third prompt group, once a run (marker file
    ``held`` in `gate`, holding its pid): its process is SIGKILLed while the run needs it (every admitted group is
    trained), whatever the machine's timing. A process started after the hold (a replacement) writes ``started``,
    and rank `wait_rank` holds its next group until then: the run goes on while the replacement starts, and cannot
    end before. With `refuse`, the first process started after the hold fails its start (marker ``refused``)."""

    def __init__(self, *args: Any, gate: str, hold_rank: int, wait_rank: int, refuse: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hold_dir, self._hold_rank, self._wait_rank = Path(gate), hold_rank, wait_rank
        self._groups_seen, self._waited = 0, False
        if not (self._hold_dir / "held").exists():
            return
        if refuse:
            try:
                os.close(os.open(self._hold_dir / "refused", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass  # refused once already: this start succeeds
            else:
                raise RuntimeError("the replacement's start refused by the test")
        (self._hold_dir / "started").touch()

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate_requests(self, batch: Any, max_new_tokens: int | None = None, temperature: float | None = None,
                                seed: int | None = None, resume: dict[str, dict[str, Any]] | None = None) -> Any:
        """``ChaosRollout.generate_requests``, held as the class says."""
        self._groups_seen += 1
        if self.rank == self._hold_rank and self._groups_seen == 3 and not (self._hold_dir / "held").exists():
            # (held once already: a new process generates freely)
            (self._hold_dir / "held.tmp").write_text(str(os.getpid()))
            os.rename(self._hold_dir / "held.tmp", self._hold_dir / "held")  # (whole, once it exists)
            await asyncio.sleep(HOLD_S)
        elif self.rank == self._wait_rank and not self._waited and (self._hold_dir / "held").exists():
            self._waited = True
            deadline = time.monotonic() + HOLD_S
            while not (self._hold_dir / "started").exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # (a file another process writes: nothing to await)
        return await super().generate_requests(batch, max_new_tokens, temperature, seed, resume)


class LoadHoldingRollout(ChaosRollout):
    """The twin's rollout worker that records every weight load of its process (``loads_<rank>_<pid>`` in `gate`, a
    line per load: ``loaded <version>`` or ``refused <version>``), and whose rank `hold_rank` holds the group load of
    version `hold_version` once it has loaded it and its process's other ranks `peers` recorded that they loaded it
    too, once a run (marker ``held`` with its pid): its process is SIGKILLed while the weight loop's group load is in
    flight, after every rank of the process loaded that version (the ranks of a process load concurrently, each on
    its own lane: without the wait a peer could still be loading when the kill comes).
    A rank that refuses a version writes ``retried``; a process started after the hold (the replacement) waits for
    it before it starts (its catch-up load comes after the weight loop's retry) and writes ``caught_up`` once it
    loaded weights."""

    def __init__(self, *args: Any, gate: str, hold_rank: int, hold_version: int, peers: tuple[int, ...] = (),
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hold_dir, self._hold_rank, self._hold_version = Path(gate), hold_rank, hold_version
        self._peers = tuple(peers)
        self._new = (self._hold_dir / "held").exists()  # started after the hold: the replacement
        if self._new:
            deadline = time.monotonic() + HOLD_S
            while not (self._hold_dir / "retried").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # (a file another process writes: nothing to await)

    def _record(self, outcome: str, version: int) -> None:
        with open(self._hold_dir / f"loads_{self.rank}_{os.getpid()}", "a") as f:
            f.write(f"{outcome} {version}\n")

    @register(Dispatch.ONE_TO_ALL)
    async def update_weights(self, weights: Any, version: int | None = None, *,
                             expected_checksums: dict[str, str] | None = None) -> dict[str, Any]:
        """``RolloutWorker.update_weights``, recorded and held as the class says."""
        try:
            got = await super().update_weights(weights, version, expected_checksums=expected_checksums)
        except StaleWeightsError as e:
            self._record("refused", int(str(e).split("refusing weights of version ")[1].split(":")[0]))
            (self._hold_dir / "retried").touch()
            raise
        self._record("loaded", got["version"])
        if self._new:
            (self._hold_dir / "caught_up").touch()
        elif (self.rank == self._hold_rank and got["version"] == self._hold_version
              and not (self._hold_dir / "held").exists()):
            pid, loaded = os.getpid(), ("loaded", got["version"])
            async with asyncio.timeout(HOLD_S):  # the process's other ranks loaded it too (files they write)
                while not all(loaded in _loads(self._hold_dir, r, pid) for r in self._peers):
                    await asyncio.sleep(0.05)
            (self._hold_dir / "held.tmp").write_text(str(os.getpid()))
            os.rename(self._hold_dir / "held.tmp", self._hold_dir / "held")  # (whole, once it exists)
            await asyncio.sleep(HOLD_S)
        return got


class SaveHoldingPolicy(ChaosPolicy):
    """The twin's training rank whose checkpoint of version `hold_version` waits until the replacement process
    loaded weights (``caught_up`` in `gate`): no newer version is published meanwhile (the next step waits for the
    checkpoint), so the weight loop's loads stay at `hold_version` until then."""

    def __init__(self, *args: Any, gate: str, hold_version: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hold_dir, self._hold_version = Path(gate), hold_version

    @register(Dispatch.ONE_TO_ALL)
    async def save(self, path: str) -> str:
        """``TwinPolicy.save``, held as the class says."""
        if self.version == self._hold_version:
            await wait_for_file(self._hold_dir / "caught_up", HOLD_S)  # (a file another process writes)
        return super().save(path)


def _loads(gate: Path, rank: int, pid: int) -> list[tuple[str, int]]:
    """What `rank` of process `pid` recorded of its weight loads (LoadHoldingRollout), in order."""
    path = gate / f"loads_{rank}_{pid}"
    return [(o, int(v)) for o, v in (line.split() for line in path.read_text().splitlines())] if path.exists() else []


async def _kill_held(gate: Path) -> int:
    """SIGKILL the process whose group is held (once the hold began); returns its pid."""
    await wait_for_file(gate / "held", HOLD_S)
    pid = int((gate / "held").read_text())
    os.kill(pid, signal.SIGKILL)
    return pid


def test_schedules_are_seeded_and_land_inside_the_run():
    kw = dict(replicas=64, replicas_per_process=8, train_ranks=4, steps=8)
    assert plan("kill", 3, **kw) == plan("kill", 3, **kw) != plan("kill", 4, **kw)
    kill = plan("kill", 3, **kw)
    assert len(kill.events) == 6 and len({e.target for e in kill.events}) == 6  # 10 % of 64, distinct replicas
    assert all(1 <= e.step <= 5 and 0 <= e.delay < 1 for e in kill.events) and not kill.real
    wave = plan("preempt", 0, **kw)
    assert len(wave.events) == 2 and len({e.step for e in wave.events}) == 1 and wave.real  # 8 processes / 4
    assert [e.kind for e in plan("train", 0, **kw).events] == ["train"] and plan("node", 0, **kw).real
    assert plan("slow", 0, **kw).events[0].step == 0  # slow from the start
    with pytest.raises(ValueError, match="needs twin.replicas_per_process=8"):
        plan("node", 0, **{**kw, "replicas_per_process": 16})
    with pytest.raises(ValueError, match="unknown chaos kind 'flood'"):
        plan("flood", 0, **kw)
    assert set(KINDS) == {"kill", "slow", "node", "preempt", "train"}


def chaos_config(out, steps: int = 8):
    cfg = twin()
    t = cfg.trainer
    t.steps, t.rollout_workers, t.train_workers, t.output_dir = steps, 4, 2, str(out)
    t.rollout_placement = [4]  # a pool of its own: a preemption resizes it
    t.batch_size, t.rollout_timeout_s, t.checkpoint_every, t.num_cpus = 64, 60.0, 2, 32
    cfg.twin.replicas_per_process = 2
    return cfg.validate()


def assert_holds(res, steps: int = 8) -> None:
    assert res.completed, res.error
    assert res.ledger.ok, res.ledger.render()
    assert res.ledger.trained == steps * 64 and res.ledger.lost == 0 and res.ledger.trained_twice == 0
    assert res.overruns == [] and res.max_wait_ratio <= 2.0
    assert all("error" not in f for f in res.fired), res.fired


async def test_a_replica_that_dies_is_replaced_alone_and_the_ledger_holds(ray_cluster, tmp_path):
    chaos = plan("kill", 0, replicas=4, replicas_per_process=2, train_ranks=2, steps=8)
    [ev] = chaos.events
    res = await run_chaos(chaos_config(tmp_path / "run"), chaos)
    assert_holds(res)
    assert [f["died"] for f in res.fired] == [1]
    # the replica alone: a new engine in its process, no pool replacement, no restart
    assert [r["kind"] for r in res.restarts] == ["replace_replica"] and res.restarts[0]["rank"] == ev.target
    assert res.ledger.replicas == 4  # every replica returned trained rows, the replaced one too


async def test_a_training_rank_killed_restarts_from_its_checkpoint_and_the_ledger_holds(ray_cluster, tmp_path):
    chaos = plan("train", 1, replicas=4, replicas_per_process=2, train_ranks=2, steps=8)
    res = await run_chaos(chaos_config(tmp_path / "run"), chaos)
    assert_holds(res)
    assert [r["kind"] for r in res.restarts] == ["restart"]  # a real SIGKILL: the run went back to a checkpoint
    assert res.ledger.rewinds == 1


async def test_a_lost_rollout_process_is_replaced_alone_and_the_ledger_holds(ray_cluster, tmp_path):
    """A real SIGKILL of the process of ranks 2 and 3 while it holds a group: that process alone is replaced (the
    other process's pids unchanged), the run never stops, and every step completes with the ledger holding."""
    gate = tmp_path / "gate"
    gate.mkdir()
    cfg = chaos_config(tmp_path / "run")
    chaos = plan("none", 0, replicas=4, replicas_per_process=2, train_ranks=2, steps=8)
    hooks = {"gate": str(gate), "hold_rank": 2, "wait_rank": 0}
    run = asyncio.ensure_future(run_chaos(cfg, chaos, rollout=(HoldingRollout, hooks)))
    killed = await _kill_held(gate)
    res = await run
    assert_holds(res)
    before, after = res.pids
    assert before[2] == before[3] == killed and before[0] == before[1] != killed
    assert after[:2] == before[:2] and after[2] == after[3] and killed not in after  # that process alone
    [rec] = res.restarts  # no pool replacement, no restart: the run went on
    assert (rec["kind"], rec["ranks"]) == ("replace_process", [2, 3])
    assert rec["origin"] in ("rollout.rollout", "rollout.reward")  # (whichever of its roles' calls saw it first)
    assert "failed" not in rec and (gate / "started").exists()


async def test_a_replacement_that_fails_to_start_falls_back_to_the_pool(ray_cluster, tmp_path):
    """The new process's start fails (its constructor raises): the whole pool is replaced instead, and the run
    still completes with the ledger holding."""
    gate = tmp_path / "gate"
    gate.mkdir()
    cfg = chaos_config(tmp_path / "run")
    chaos = plan("none", 0, replicas=4, replicas_per_process=2, train_ranks=2, steps=8)
    hooks = {"gate": str(gate), "hold_rank": 0, "wait_rank": 2, "refuse": True}
    run = asyncio.ensure_future(run_chaos(cfg, chaos, rollout=(HoldingRollout, hooks)))
    killed = await _kill_held(gate)
    res = await run
    assert_holds(res)
    assert [r["kind"] for r in res.restarts] == ["replace_process", "replace"]
    assert "the replacement's start refused by the test" in res.restarts[0]["failed"]
    assert res.restarts[0]["ranks"] == [0, 1] and (gate / "refused").exists()
    assert killed not in res.pids[1] and not set(res.pids[1]) & set(res.pids[0])  # every process new


async def test_a_process_lost_during_a_weight_load_leaves_no_error_unretrieved(ray_cluster, tmp_path, monkeypatch):
    """The process of ranks 2 and 3 is SIGKILLed while the weight loop's group load of version 4 is in flight, after
    every rank loaded it: the weight loop loads version 4 again on the ranks that live, which refuse it (they hold
    it: counted as loaded, nothing changes), once each; the new process is brought to version 4 and then loads what
    the others load, each version once; no rank's error is left unretrieved (Ray logs none as unhandled), and the
    run completes with its ledger holding."""
    import ray._private.worker as ray_worker

    unhandled: list[str] = []
    monkeypatch.setattr(ray_worker, "_unhandled_error_handler", lambda e: unhandled.append(str(e)[:300]))
    gate = tmp_path / "gate"
    gate.mkdir()
    cfg = chaos_config(tmp_path / "run")
    chaos = plan("none", 0, replicas=4, replicas_per_process=2, train_ranks=2, steps=8)
    hooks = {"gate": str(gate), "hold_rank": 2, "hold_version": 4, "peers": (3,)}
    run = asyncio.ensure_future(run_chaos(cfg, chaos, rollout=(LoadHoldingRollout, hooks),
                                          policy=(SaveHoldingPolicy, {"gate": str(gate), "hold_version": 4})))
    killed = await _kill_held(gate)
    res = await run
    gc.collect()
    assert_holds(res)
    [rec] = res.restarts
    assert (rec["kind"], rec["ranks"]) == ("replace_process", [2, 3])
    before, after = res.pids
    assert before[2] == before[3] == killed and after[:2] == before[:2] and killed not in after
    # the lost process: the versions the weight loop loaded up to 4, each once (it loads the newest exported
    # version, so a busy machine may skip one), the same on both ranks
    first = _loads(gate, 2, killed)
    upto = [v for _, v in first]
    assert all(o == "loaded" for o, _ in first) and upto == sorted(set(upto)) and upto[-1] == 4
    assert _loads(gate, 3, killed) == first
    live = [_loads(gate, r, before[r]) for r in (0, 1)]
    new = [_loads(gate, r, after[r]) for r in (2, 3)]
    later = live[0][len(first) + 1:]  # what the weight loop loaded once the new process caught up
    assert live[0] == live[1] == [*first, ("refused", 4), *later]  # the weight loop's one retry of version 4
    assert new[0] == new[1] == [("loaded", 4), *later]  # the catch-up, then what the others load
    versions = [v for _, v in later]
    assert later and all(o == "loaded" for o, _ in later) and versions == sorted(set(versions)) and versions[0] > 4
    assert unhandled == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["node", "preempt", "slow"])
async def test_a_lost_node_a_preemption_wave_and_a_slow_replica_are_survived(ray_cluster, tmp_path, kind):
    cfg = chaos_config(tmp_path / "run")
    chaos = plan(kind, 0, replicas=4, replicas_per_process=2, train_ranks=2, steps=8, node=2)
    res = await run_chaos(cfg, chaos)
    assert_holds(res)
    if kind == "slow":
        assert res.restarts == [] and [f["slowed"] for f in res.fired] == [1]
    else:
        assert res.restarts or res.resizes  # the lost processes' replicas were replaced or resized away


@pytest.mark.slow
async def test_without_per_replica_replacement_the_whole_pool_is_replaced(ray_cluster, tmp_path, monkeypatch):
    from asyncrl.pipelines.rollout import stream_rollout

    monkeypatch.setattr(stream_rollout, "REPLACE_REPLICAS", False)
    chaos = plan("kill", 0, replicas=4, replicas_per_process=2, train_ranks=2, steps=8)
    res = await run_chaos(chaos_config(tmp_path / "run"), chaos)
    assert_holds(res)
    assert [r["kind"] for r in res.restarts] == ["replace"]

