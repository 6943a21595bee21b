"""TensorBoard output (README "Training"; ``trainer.tensorboard``, on by default): ``metrics.jsonl`` and
TensorBoard event files under ``<output_dir>/tensorboard`` carry the same numeric scalars per step
(tensorboard is in the ``test`` extra, so these tests run rather than skip). The main job's run
(tests/pipelines/test_main_job.py) checks the same on a real trainer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncrl.pipelines.observe.metrics import MetricsWriter, read_jsonl


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of the event files under ``run_dir/tensorboard``."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        pytest.fail("tensorboard is not installed, but it is in the test extra: bash scripts/setup.sh test "
                    "(or .venv/bin/python -m pip install tensorboard)")

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_gets_every_finite_numeric_metric_of_every_step(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=True)
    w.write(0, {"reward/mean": 0.25, "actor/grad_norm": 1.5, "version": 1, "note": "text", "bad": math.nan})
    w.write(1, {"reward/mean": 0.75, "actor/grad_norm": 0.5, "version": 2, "note": "text", "bad": math.inf})
    w.close()
    assert tensorboard_scalars(tmp_path) == {"reward/mean": [(0, 0.25), (1, 0.75)],
                                             "actor/grad_norm": [(0, 1.5), (1, 0.5)],
                                             "version": [(0, 1.0), (1, 2.0)]}
    assert [r["reward/mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0.25, 0.75]


def test_tensorboard_false_writes_no_event_files(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write(0, {"reward/mean": 0.25})
    w.close()
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "metrics.jsonl").is_file()
