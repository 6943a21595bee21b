"""The examples run end to end with tiny sizes."""

from __future__ import annotations

import importlib


def test_custom_pipeline_trains_with_its_own_reward_worker(ray_cluster, tmp_path):
    ex = importlib.import_module("examples.custom_pipeline")
    history = ex.main(["--steps", "3", "--batch-size", "16", "--output-dir", str(tmp_path), "--progress", "false"])
    assert [r["step"] for r in history] == [0, 1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in history)


def test_fit_in_app_serves_status_while_training(ray_cluster, tmp_path):
    ex = importlib.import_module("examples.fit_in_app")
    out = ex.main(["--steps", "4", "--batch-size", "16", "--output-dir", str(tmp_path), "--probe-every", "0.01"])
    assert [r["step"] for r in out["history"]] == [0, 1, 2, 3]
    steps_seen = {s["step"] for s in out["during_training"]}
    assert steps_seen and steps_seen <= {0, 1, 2, 3}  # answered while steps were completing
    assert all(s["buffer"]["capacity"] == 2 for _, s in out["requests"])
    lag = out["loop_lag"]  # the heartbeat ran through fit(); its worst delay is a no-freeze bound only
    assert lag["samples"] > 0 and lag["max_s"] < 5.0, lag
