"""Multi-turn episodes and gateway agents in streaming mode (``trainer.rollout_mode=stream``) on real Ray:
the streaming trainer's ``generate_requests`` runs the configured episode or agent per row through the
request-level engine (roles/generation/rollout_requests.py, the one seam), under admission control.

Each run records what the rollout engine sampled (every request: its ids, tokens, log-probs and versions)
and what each step trained, and asserts, for every trained row: each model-token segment is one request's
sampled tokens exactly, on exactly the row's ids before it (no token re-encoded); its per-token versions
are within ``max_staleness`` of the step; environment / new-message tokens are masked 0 with no version and
no log-prob; the attention mask covers exactly the trajectory; every admitted group is trained once. The gateway
agent's one-step run checks the same in batch mode too."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.loop.stages import AdvantageWorker
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles import RolloutWorker

from asyncrl import Dispatch, Execute, register

AGENT = os.path.join(os.path.dirname(__file__), "..", "roles", "gateway_agent.py")


class SampledRecorder(RolloutWorker):
    """Appends every request its engine answered to `path` (one JSON line each)."""

    def __init__(self, *args: Any, path: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._path = path

    def _request_engine(self) -> Any:
        submit = super()._request_engine()

        async def recorded(ids: list[int], params: Any, key: str | None = None) -> Any:
            gen = await submit(ids, params, key=key)
            with open(self._path, "a") as f:
                f.write(json.dumps({"key": key, "ids": list(ids), "tokens": list(gen.response_ids),
                                    "logp": list(gen.log_probs), "versions": list(gen.versions)}) + "\n")
            return gen

        return recorded


class TrainedRecorder(AdvantageWorker):
    """Appends each step's trained rows to `path`."""

    def __init__(self, *args: Any, path: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._path = path

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def version_stats(self, batch: Any, step: int, max_staleness: int) -> dict[str, float]:
        self._record(batch, step)
        return super().version_stats(batch, step, max_staleness)

    def _record(self, batch: Any, step: int) -> None:
        rec = {"step": step, "prompt_ids": batch["prompt_ids"].tolist(), "prompt_mask": batch["prompt_mask"].tolist(),
               "ids": batch["response_ids"].tolist(), "mask": batch["response_mask"].tolist(),
               "attn": batch["attention_mask"].tolist(), "logp": batch["rollout_log_probs"].tolist(),
               "versions": batch["token_versions"].tolist(), "turns": batch["num_turns"].tolist()}
        with open(self._path, "a") as f:
            f.write(json.dumps(rec) + "\n")


class BatchTrainedRecorder(TrainedRecorder):
    """A :class:`TrainedRecorder` for batch mode (no version statistics there): appends each step's rows as its
    advantages are computed (one call a step)."""

    _steps = 0

    @register(Dispatch.DP_COMPUTE)
    def compute_advantages(self, batch: Any, scores: Any, log_probs: Any = None, ref: Any = None, values: Any = None,
                           *, algo: Any) -> Any:
        out = super().compute_advantages(batch, scores, log_probs, ref, values, algo=algo)
        self._record(batch, self._steps)
        self._steps += 1
        return out


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def segments(mask: list[int]) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the runs of 1 in `mask`."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def check_trained_rows(trained: list[dict[str, Any]], sampled: list[dict[str, Any]], k: int) -> list[list[int]]:
    """Assert the module docstring's row invariants; returns each row's environment-token runs."""
    by_ids: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for s in sampled:
        by_ids.setdefault(tuple(s["ids"]), []).append(s)
    env_runs = []
    for rec in trained:
        step = rec["step"]
        for b, mask in enumerate(rec["mask"]):
            prompt = [t for t, m in zip(rec["prompt_ids"][b], rec["prompt_mask"][b]) if m]
            ids, versions, logp = rec["ids"][b], rec["versions"][b], rec["logp"][b]
            n = sum(rec["attn"][b][len(rec["prompt_ids"][b]):])
            assert rec["attn"][b][-len(mask):] == [1] * n + [0] * (len(mask) - n)  # exactly the trajectory
            segs = segments(mask)
            assert len(segs) == rec["turns"][b] >= 1 and segs[-1][1] <= n
            for a, e in segs:  # one request's sampled tokens, on exactly the row's ids before them
                turn = [s for s in by_ids.get(tuple(prompt + ids[:a]), []) if s["tokens"] == ids[a:e]]
                assert turn, f"step {step} row {b}: tokens {a}:{e} were not sampled on the row's ids"
                assert turn[0]["logp"] == logp[a:e] and turn[0]["versions"] == versions[a:e]
                assert all(0 <= step - v <= k for v in versions[a:e]), (step, versions[a:e])
            off = [i for i in range(len(mask)) if not mask[i]]
            assert all(versions[i] == -1 and logp[i] == 0.0 for i in off)
            env_runs += [ids[e:a2] for (_, e), (a2, _) in zip(segs, segs[1:])]
    return env_runs


def stream_cfg(out: Path, steps: int):
    cfg = tiny_test()
    cfg.rollout.partial_rollout = "recompute"
    cfg.rollout.chunk_tokens = 2  # short rounds: updates land between them, mid-turn
    t = cfg.trainer
    t.steps, t.max_staleness, t.rollout_mode, t.output_dir = steps, 1, "stream", str(out)
    return cfg


def run(cfg, tmp_path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    overrides = {"rollout": (SampledRecorder, {"path": str(tmp_path / "sampled.jsonl")}),
                 "advantage": (TrainedRecorder, {"path": str(tmp_path / "trained.jsonl")})}
    history = GRPOTrainer(cfg.validate(), worker_overrides=overrides).fit_sync()
    journal = lines(Path(cfg.trainer.output_dir) / "journal.jsonl")
    admitted = sorted(r["index"] for r in journal if r["kind"] == "group")
    trained_groups = sorted(g for r in journal if r["kind"] == "step" for g in r["groups"])
    assert trained_groups == admitted == list(range(cfg.trainer.steps * cfg.prompts_per_step))
    return history, lines(tmp_path / "trained.jsonl"), lines(tmp_path / "sampled.jsonl")


def test_stream_mode_trains_multi_turn_episodes_within_the_staleness_bound(ray_cluster, tmp_path):
    cfg = stream_cfg(tmp_path / "run", steps=3)
    cfg.rollout.episode, cfg.rollout.max_new_tokens = "char_class_retry", 19
    cfg.rollout.episode_kwargs = {"max_turns": 2, "tokens_per_turn": 4}
    history, trained, sampled = run(cfg, tmp_path)
    assert [r["step"] for r in history] == [0, 1, 2] and all(r["staleness/max"] <= 1 for r in history)
    assert sorted(r["step"] for r in trained) == [0, 1, 2] and all(len(r["mask"]) == 8 for r in trained)
    env = check_trained_rows(trained, sampled, k=1)
    from asyncrl.roles import tiny_tokenizer

    tok = tiny_tokenizer()
    assert env, "no episode took a second turn"  # the feedback between turns, as the environment wrote it
    for run_ids in env:
        text = tok.decode(run_ids)
        assert re.fullmatch(r" [0-3]/4, again:", text) and run_ids == tok.encode(text, add_special_tokens=False)
    for rec in trained:  # each turn is 4 tokens (tokens_per_turn) unless it ended on EOS
        for mask, ids in zip(rec["mask"], rec["ids"]):
            assert all(e - a == 4 or ids[e - 1] == tok.eos_token_id for a, e in segments(mask))
    assert any(r["actor/episode/turns_mean"] > 1 for r in history)
    keys = {s["key"] for s in sampled}  # turn 2 of a row is named after its first request in the round log
    assert any(k.endswith("/1") and k[:-2] in keys for k in keys)


@pytest.mark.slow  # four agents' HTTP sessions per group on 2 cores: about 30 s
def test_stream_mode_trains_an_openai_client_agent_through_the_gateway(ray_cluster, tmp_path):
    cfg = stream_cfg(tmp_path / "run", steps=2)
    cfg.model.tokenizer = "qwen2"
    cfg.rollout.agent, cfg.rollout.max_new_tokens = f"{AGENT}:two_turns", 24
    history, trained, sampled = run(cfg, tmp_path)
    assert [r["step"] for r in history] == [0, 1] and all(r["reward/mean"] == 1.0 for r in history)
    assert all(r["staleness/max"] <= 1 and r["actor/episode/turns_mean"] == 2.0 for r in history)
    env = check_trained_rows(trained, sampled, k=1)
    from asyncrl.roles.modeling.models import load_tokenizer

    tok = load_tokenizer("qwen2")
    assert len(env) == 16  # one new user message per row, rendered by the chat template and encoded alone
    for run_ids in env:  # (the first turn's end tag too when max_tokens=4 cut it before the model wrote it)
        text = tok.decode(run_ids)
        assert re.fullmatch(r"(<\|im_end\|>)?\n<\|im_start\|>user\nsure\?<\|im_end\|>\n<\|im_start\|>assistant\n",
                            text), text
        assert run_ids == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("mode", ["batch", "stream"])
def test_one_step_of_an_openai_client_agent_trains_through_the_gateway(ray_cluster, tmp_path, mode):
    """The default suite's gateway run, in each mode (``rollout.agent``; the slow tests below and in
    ``test_agents_toy.py`` train more steps): one step of 4 two-turn sessions of an ``openai``-client agent
    (2 prompts x 2), every trained model segment one request's sampled tokens on the row's exact ids, the new
    user message masked 0."""
    out = tmp_path / "run"
    cfg = stream_cfg(out, steps=1)
    cfg.trainer.rollout_mode = mode
    cfg.trainer.batch_size, cfg.algorithm.group_size = 4, 2
    cfg.model.tokenizer = "qwen2"
    cfg.rollout.agent, cfg.rollout.max_new_tokens = f"{AGENT}:two_turns", 24
    recorder = TrainedRecorder if mode == "stream" else BatchTrainedRecorder
    overrides = {"rollout": (SampledRecorder, {"path": str(tmp_path / "sampled.jsonl")}),
                 "advantage": (recorder, {"path": str(tmp_path / "trained.jsonl")})}
    [row] = GRPOTrainer(cfg.validate(), worker_overrides=overrides).fit_sync()
    assert (row["step"], row["reward/mean"], row["actor/episode/turns_mean"]) == (0, 1.0, 2.0)
    [trained] = lines(tmp_path / "trained.jsonl")
    sampled = lines(tmp_path / "sampled.jsonl")
    assert len(trained["ids"]) == 4 and len(sampled) == 8  # 4 sessions of two requests, each trained once
    env = check_trained_rows([trained], sampled, k=1)
    from asyncrl.roles.modeling.models import load_tokenizer

    tok = load_tokenizer("qwen2")
    assert len(env) == 4 and all(tok.decode(e).endswith("<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n")
                                 for e in env)


@pytest.mark.parametrize("overrides", [["rollout.episode=char_class_retry"],
                                       [f"rollout.agent={AGENT}:two_turns", "model.tokenizer=qwen2"]])
def test_stream_mode_accepts_episodes_and_agents(overrides):
    from asyncrl.pipelines.job.presets import load_config

    cfg = load_config(None, ["trainer.rollout_mode=stream", *overrides])
    assert cfg.trainer.rollout_mode == "stream" and (cfg.rollout.episode or cfg.rollout.agent)
