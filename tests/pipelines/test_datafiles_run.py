"""A real run (local Ray) on a verl-format Parquet file, a verl ``compute_score`` file named by path
and a model directory with its own tokenizer and chat template: the prompts of each batch reach the
reward with their answers, data sources and extra info; a run resumed from its step-2 checkpoint
continues at the same data position (the same prompts, the same responses, the same metrics)."""

from __future__ import annotations

import json

import pytest

from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.journaling.journal import read_journal
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from tests.pipelines.datafiles_util import ROWS, write, write_model_dir, write_reward_file

STEPS = 4


def _cfg(tmp_path, out):
    cfg = tiny_test()
    cfg.model.path = str(tmp_path / "model")
    cfg.data.train_files = str(tmp_path / "train.parquet")
    cfg.reward.fn = f"{tmp_path / 'my_reward.py'}:compute_score"
    cfg.reward.fn_kwargs = {"log": str(tmp_path / "calls.jsonl")}
    t = cfg.trainer
    t.steps, t.max_staleness, t.checkpoint_every, t.keep_checkpoints = STEPS, 0, 2, 3
    t.colocated, t.output_dir = True, str(out)
    return cfg.validate()


def _metrics(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "buffer/"))} for r in rows]


@pytest.mark.slow  # ~45 s on a loaded 2-core machine; tests/pipelines/test_datafiles.py covers each part fast
async def test_a_verl_parquet_file_and_reward_file_train_and_resume_at_the_same_data_position(ray_cluster, tmp_path):
    write_model_dir(tmp_path / "model")
    write("parquet", tmp_path)
    write_reward_file(tmp_path / "my_reward.py")
    async with GRPOTrainer(_cfg(tmp_path, tmp_path / "full")) as t:
        full = await t.fit()
    assert [r["step"] for r in full] == list(range(STEPS))
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    journal = read_journal(tmp_path / "full")
    rows = [i for b in range(STEPS) for i in journal.batches[b]["prompts"] for _ in range(4)]  # 4 per group
    assert len(calls) == len(rows) == STEPS * 8
    for call, i in zip(calls, rows):
        assert (call["data_source"], call["ground_truth"], call["extra_info"]) == (
            ROWS[i]["data_source"], ROWS[i]["reward_model"]["ground_truth"], ROWS[i]["extra_info"])
        assert isinstance(call["solution_str"], str)
    for b in range(STEPS):  # the reward of a row is ground_truth / 8: each step's mean follows from its prompts
        prompts = journal.batches[b]["prompts"]
        assert full[b]["reward/mean"] == sum(int(ROWS[i]["reward_model"]["ground_truth"]) / 8 for i in prompts) / 2

    resume = ckpt.checkpoint_dir(tmp_path / "full", 2)
    async with GRPOTrainer(_cfg(tmp_path, tmp_path / "resumed"), resume=resume) as t:
        resumed = await t.fit()
    again = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()][len(calls):]
    assert again == calls[3 * 8:]  # batch 3, the first one generated after the restore: same prompts and responses
    assert read_journal(tmp_path / "resumed").batches[3]["prompts"] == journal.batches[3]["prompts"]
    assert _metrics(resumed) == _metrics(full)
