"""Held-out evaluation in stream mode (``trainer.rollout_mode=stream``): the versions it evaluates, and
that each evaluation equals batch mode's evaluation of the same weights on idle rollout workers."""

from __future__ import annotations

import pytest
from asyncrl.pipelines.job.config import EvalConfig
from asyncrl.pipelines.datasets.evaluation import Evaluator
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.trainers.trainer import GRPOTrainer

from tests.pipelines.test_stream import stream_config


def _metrics(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("eval/") and k != "eval/time"}


def test_stream_mode_accepts_evaluation(tmp_path):
    cfg = stream_config(tmp_path)
    cfg.evaluation = EvalConfig(every=5, at_start=True, at_end=True)
    assert cfg.validate().evaluation.enabled  # refused before streaming evaluated


@pytest.mark.slow
async def test_stream_evaluation_equals_batch_evaluation_of_the_same_weights(ray_cluster, tmp_path):
    """Stream run (k=1, 4 steps) evaluating at start, every 2 versions and at the end, while groups stream:
    versions 0, 2 (or 3, if the weight loop skipped 2) and 4; the rows at versions 0 and 4 equal what
    ``Evaluator.run`` (batch mode's evaluation) computes on the same rollout workers, idle, with the
    same weights; the rows reach metrics.jsonl like batch mode's."""
    cfg = stream_config(tmp_path / "run")
    cfg.evaluation = EvalConfig(every=2, at_start=True, at_end=True, num_prompts=6, num_samples=0)
    async with GRPOTrainer(cfg) as trainer:
        assert trainer.evaluator is not None and trainer.groups is not None
        batch_eval = Evaluator(cfg.evaluation, cfg.data, trainer.evaluator.tokenizer,
                               max_new_tokens=cfg.rollout.max_new_tokens, output_dir=tmp_path / "batch")
        before = await batch_eval.run(trainer.groups, 0)  # the initial weights, no groups in flight
        history = await trainer.fit()
        after = await batch_eval.run(trainer.groups, 4)  # at_end loaded the final weights
    assert [h["version"] for h in history] == [1, 2, 3, 4]
    records = trainer.evaluator.records
    versions = [r["eval/version"] for r in records]
    assert versions[0] == 0 and versions[1] in (2, 3) and versions[2:] == [4]
    assert _metrics(records[0]) == _metrics(before) and _metrics(records[-1]) == _metrics(after)
    for r in records:
        assert r["eval/num_prompts"] == 6 and 0.0 <= r["eval/reward_mean"] <= 1.0
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [(r["step"], r["eval/version"]) for r in rows] == [(v, v) for v in versions]
