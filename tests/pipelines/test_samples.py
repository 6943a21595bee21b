"""``samples.jsonl``: which rows are picked, what each line holds (against a hand-built batch), resume and
torn lines; and (``-m slow``) streaming and multi-turn episode runs whose lines match their batches' layout. A batch run's
samples are checked in test_viewer_browser.py, on the run the browser tests load."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from asyncrl.pipelines.job.presets import grpo_agents_toy, tiny_test
from asyncrl.pipelines.observe.samples import SamplesWriter, pick_rows, read_samples, trajectory_rows
from asyncrl.pipelines.trainers.trainer import GRPOTrainer


class CharTokenizer:
    """Decodes id i as chr(ord('a') + i) (enough to check what was decoded where)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def batch(episodes: bool = False) -> TensorDict:
    # 2 prompt groups x 2 rows; P=3 (left-padded), R=4 (right-padded)
    prompt_ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    response_ids = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 6], [1, 1, 1, 0], [2, 0, 0, 0]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [1, 0, 0, 0]])
    att = response_mask.clone()
    if episodes:
        att[2] = torch.tensor([1, 1, 1, 0])  # the middle token is the environment's
    td = TensorDict({
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
        "response_mask": response_mask, "attention_mask": torch.cat([prompt_mask, att], -1),
        "uid": torch.tensor([10, 10, 11, 11]), "version": torch.tensor([3, 3, 2, 3]),
        "rollout_log_probs": -torch.rand(4, 4) * response_mask, "old_log_probs": -torch.rand(4, 4) * response_mask,
        "advantages": torch.tensor([[0.5] * 4, [-0.5] * 4, [1.0] * 4, [-1.0] * 4]) * response_mask,
        "scores": torch.tensor([1.0, 0.0, 1.0, 0.0]),
    }, batch_size=[4])
    if episodes:
        td["token_versions"] = torch.tensor([[3, 3, -1, -1], [3, 3, 3, 3], [2, -1, 3, -1], [3, -1, -1, -1]])
        td["num_turns"] = torch.tensor([1, 1, 2, 1])
        td["tool_errors"] = torch.tensor([0, 0, 1, 0])
        td["episode_reward"] = torch.tensor([float("nan"), 0.0, 1.0, 0.0])
        td["stop_reason"] = NonTensorStack("stop", "max_length", "done", "stop")
    return td


def test_rows_are_whole_prompt_groups_drawn_with_the_seed():
    uid = [4, 4, 4, 9, 9, 9, 2, 2, 2]
    for seed in range(20):
        rows = pick_rows(uid, 6, seed)
        assert len(rows) == 6 and len({uid[r] for r in rows}) == 2  # two whole groups
        assert pick_rows(uid, 6, seed) == rows
    assert len({tuple(pick_rows(uid, 3, s)) for s in range(20)}) == 3
    assert pick_rows(uid, 2, 0) in ([0, 1], [3, 4], [6, 7])  # a group larger than n: its first n
    assert pick_rows(uid, 100, 0) == list(range(9))


def test_a_line_holds_each_tokens_id_text_mask_version_log_probs_and_advantage():
    td = batch()
    rows = trajectory_rows(td, [0, 1, 2], policy_version=3)
    lines = [json.loads(x) for x in SamplesWriter.lines(_writer_stub(), 7, rows)]
    a, b, c = lines
    assert (a["step"], a["uid"], a["index"], a["row"]) == (7, 10, 0, 0)
    assert (b["uid"], b["index"], c["uid"], c["index"]) == (10, 1, 11, 0)
    assert a["prompt"] == "fg" and c["prompt"] == "hij"  # padding dropped
    assert a["tokens"]["id"] == [1, 2] and a["response"] == "bc" and a["tokens"]["text"] == ["b", "c"]
    assert a["stop_reason"] == "stop" and b["stop_reason"] == "max_length"  # ended before R tokens, or at R
    assert c["tokens"]["mask"] == [1, 0, 1] and c["tokens"]["version"] == [2, -1, 2]
    assert c["staleness"] == 1 and a["staleness"] == 0 and a["version"] == 3
    assert a["reward"] == 1.0 and c["reward"] == 1.0 and b["reward"] == 0.0
    for line, r in zip(lines, [0, 1, 2]):
        n = line["length"]
        assert line["tokens"]["logp_rollout"] == pytest.approx(td["rollout_log_probs"][r, :n].tolist(), abs=1e-6)
        assert line["tokens"]["logp_old"] == pytest.approx(td["old_log_probs"][r, :n].tolist(), abs=1e-6)
        assert line["tokens"]["advantage"] == pytest.approx(td["advantages"][r, :n].tolist(), abs=1e-6)
    assert a["num_turns"] is None and a["tool_errors"] is None


def test_an_episode_keeps_its_environment_tokens_turns_tool_errors_and_stop_reason():
    rows = trajectory_rows(batch(episodes=True), [2, 0], policy_version=3)
    c, a = rows
    assert c["ids"] == [1, 1, 1] and c["mask"] == [1, 0, 1] and c["versions"] == [2, -1, 3]
    assert (c["num_turns"], c["tool_errors"], c["stop_reason"], c["episode_reward"]) == (2, 1, "done", 1.0)
    assert a["episode_reward"] is None and a["stop_reason"] == "stop"  # NaN: the reward function scored it


def test_a_resumed_run_rewrites_the_steps_after_its_checkpoint_and_torn_lines_are_counted(tmp_path):
    rows = trajectory_rows(batch(), [0, 1], policy_version=3)
    w = SamplesWriter(tmp_path, CharTokenizer())
    for step in range(4):
        w.write(step, rows)
    w.close()
    w = SamplesWriter(tmp_path, CharTokenizer(), start_step=2)
    w.write(2, rows[:1])
    w.close()
    got, bad = read_samples(tmp_path / "samples.jsonl")
    assert [r["step"] for r in got] == [0, 0, 1, 1, 2] and bad == 0
    with (tmp_path / "samples.jsonl").open("a") as f:
        f.write('{"step": 3, "uid": 1, "tok')  # a process killed mid-write
    got, bad = read_samples(tmp_path / "samples.jsonl")
    assert len(got) == 5 and bad == 1


def _writer_stub():
    w = SamplesWriter.__new__(SamplesWriter)
    w._tok = CharTokenizer()
    return w


def check_run(out, steps: int, per_step: int) -> list[dict]:
    """The trajectories of run `out`, after checking their layout (``samples_per_step`` per step, columns of
    one length, versions only on model tokens, staleness = step - version, GRPO advantages per sequence)."""
    rows, bad = read_samples(out / "samples.jsonl")
    assert bad == 0
    assert sorted({r["step"] for r in rows}) == list(range(steps))
    for step in range(steps):
        assert len([r for r in rows if r["step"] == step]) == per_step
    for r in rows:
        t = r["tokens"]
        n = len(t["id"])
        assert n == r["length"] > 0
        assert all(len(t[k]) == n for k in ("text", "mask", "version", "logp_rollout", "logp_old", "advantage"))
        assert all(v == -1 for v, m in zip(t["version"], t["mask"]) if not m)
        assert r["staleness"] == r["step"] - r["version"] >= 0
        assert all(a == t["advantage"][0] for a, m in zip(t["advantage"], t["mask"]) if m)  # GRPO: per sequence
    return rows


@pytest.mark.slow
def test_streaming_and_episode_runs_write_their_samples_and_0_writes_none(ray_cluster, tmp_path):
    cfg = tiny_test()
    cfg.trainer.steps = 3
    cfg.trainer.max_staleness = 1
    cfg.trainer.rollout_mode = "stream"
    cfg.trainer.output_dir = str(tmp_path / "stream")
    GRPOTrainer(cfg.validate()).fit_sync()
    check_run(tmp_path / "stream", 3, 4)

    cfg = tiny_test()
    cfg.trainer.steps = 1
    cfg.trainer.samples_per_step = 0
    cfg.trainer.output_dir = str(tmp_path / "off")
    GRPOTrainer(cfg).fit_sync()
    assert not (tmp_path / "off" / "samples.jsonl").exists()

    cfg = grpo_agents_toy()
    cfg.model = tiny_test().model
    cfg.trainer.steps, cfg.trainer.batch_size, cfg.trainer.progress, cfg.trainer.plot = 2, 8, False, False
    cfg.trainer.samples_per_step = 8
    cfg.trainer.output_dir = str(tmp_path / "agents")
    GRPOTrainer(cfg.validate()).fit_sync()
    rows = check_run(tmp_path / "agents", 2, 8)
    assert all(r["num_turns"] >= 1 and r["tool_errors"] is not None for r in rows)
    assert any(0 in r["tokens"]["mask"] for r in rows)  # the environment's feedback tokens
    assert {r["stop_reason"] for r in rows} <= {"done", "max_turns", "max_length", "stop"}


class TextTokenizer:
    """Decodes every id to the same text (a response that holds line separators of its own)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def decode(self, ids):
        return self.text


LINE_BREAKING = "a\u2028b\u2029c\x85d"
"""Characters ``str.splitlines`` breaks a line at, which JSON keeps raw with ``ensure_ascii=False``."""


def test_a_trajectory_holding_unicode_line_separators_survives_a_resume_and_reaches_the_viewer(tmp_path):
    from asyncrl.pipelines.observe import viewer

    rows = trajectory_rows(batch(), [0, 1], policy_version=3)
    w = SamplesWriter(tmp_path, TextTokenizer(LINE_BREAKING))
    for step in range(3):
        w.write(step, rows)
    w.close()
    w = SamplesWriter(tmp_path, TextTokenizer(LINE_BREAKING), start_step=2)  # a resume at step 2
    w.close()
    got, bad = read_samples(tmp_path / "samples.jsonl")
    assert ([r["step"] for r in got], bad) == ([0, 0, 1, 1], 0)
    assert all(r["prompt"] == LINE_BREAKING and r["tokens"]["text"][0] == LINE_BREAKING for r in got)
    run = viewer.load_run(tmp_path)
    assert [s["step"] for s in run["samples"]] == [0, 0, 1, 1] and run["status"]["skipped_samples"] == 0
    assert run["samples"][0]["response"] == LINE_BREAKING
