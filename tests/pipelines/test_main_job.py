"""The main job (``asyncrl train``): GRPO on the toy task learns, and the run leaves its
metrics, a Perfetto trace with overlapping rollout and training spans, a report and a checkpoint."""

from __future__ import annotations

import json

import pytest

from asyncrl.pipelines.commands.cli import main
from asyncrl.pipelines.observe.metrics import read_jsonl
from tests.pipelines.test_tensorboard import tensorboard_scalars


def test_main_job_reward_rises_and_artifacts_are_written(ray_cluster, tmp_path):
    out = tmp_path / "run"
    assert main(["train", f"trainer.output_dir={out}", "trainer.steps=60", "trainer.progress=false"]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(60))
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.3 and last > 0.8, (first, last)
    assert all(r["staleness/max"] <= 1 for r in rows)

    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    stages = {e["name"] for e in spans}
    assert {"generate", "score", "old_log_prob", "advantages", "actor_update", "export_weights",
            "weight_sync"} <= stages
    gen = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "generate"]
    upd = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "actor_update"]
    assert any(g0 < u1 and u0 < g1 for g0, g1 in gen for u0, u1 in upd), "rollout and training never overlapped"
    assert {"rollout.rollout", "train.policy"} <= set(names)

    tb = tensorboard_scalars(out)  # trainer.tensorboard is on by default: the same scalars, float32
    assert tb["reward/mean"] == [(r["step"], pytest.approx(r["reward/mean"], rel=1e-6)) for r in rows]
    assert {"actor/grad_norm", "actor/pg_loss", "staleness/max"} <= set(tb)

    assert (out / "report.png").stat().st_size > 0
    assert (out / "checkpoints" / "step_000060" / "state.json").is_file()
