"""The advantage stage's math against hand-computed values, and the trace format."""

from __future__ import annotations

import json

import torch
from tensordict import TensorDict

from asyncrl.pipelines.datasets.data import PromptLoader
from asyncrl.pipelines.loop.stages import compute_advantages, terminal_rewards
from asyncrl.pipelines.observe.trace import Span, Tracer

GRPO = {"name": "grpo", "norm_adv_by_std": True}
PPO = {"name": "ppo", "kl_in_reward_coef": 0.0, "kl_penalty": "k1", "gamma": 1.0, "lam": 1.0, "whiten_advantages": False}


def test_terminal_rewards_put_the_score_on_the_last_generated_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    r = terminal_rewards(torch.tensor([2.0, 3.0, 5.0]), mask)
    assert r.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]


def test_grpo_advantages_are_group_relative():
    batch = TensorDict({"scores": torch.tensor([1.0, 0.0, 1.0, 1.0]), "uid": torch.tensor([7, 7, 9, 9]),
                        "response_mask": torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])}, batch_size=[4])
    adv, ret = compute_advantages(batch, GRPO)
    s = 0.5 / (2 ** 0.5 / 2 + 1e-6)  # (1 - 0.5) / std([1, 0]) with the unbiased std sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([[s, s], [-s, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    assert torch.equal(adv, ret)


def test_ppo_advantages_with_gamma_and_lambda_one_are_return_minus_value():
    batch = TensorDict({"scores": torch.tensor([1.0]), "values": torch.tensor([[0.25, 0.5, 0.0]]),
                        "response_mask": torch.tensor([[1, 1, 0]])}, batch_size=[1])
    adv, ret = compute_advantages(batch, PPO)
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0]]))


def test_ppo_in_reward_kl_lowers_the_token_rewards():
    batch = TensorDict({"scores": torch.tensor([1.0]), "values": torch.zeros(1, 2),
                        "old_log_probs": torch.tensor([[-1.0, -1.0]]), "ref_log_probs": torch.tensor([[-1.5, -1.0]]),
                        "response_mask": torch.tensor([[1, 1]])}, batch_size=[1])
    adv, _ = compute_advantages(batch, {**PPO, "kl_in_reward_coef": 0.1})
    torch.testing.assert_close(adv, torch.tensor([[1.0 - 0.05, 1.0]]))


def test_loader_repeats_each_prompt_in_consecutive_rows_and_is_a_function_of_the_step():
    class Tok:
        pad_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    pairs = [(f"p{i}", "digits") for i in range(5)]
    a = PromptLoader(Tok(), pairs, prompts_per_step=2, group_size=3, seed=1)
    b = PromptLoader(Tok(), pairs, prompts_per_step=2, group_size=3, seed=1)
    batch = a.batch(4)
    assert batch["uid"].tolist() == [8, 8, 8, 9, 9, 9]
    assert batch["prompt"].tolist()[:3] == [batch["prompt"].tolist()[0]] * 3
    assert [b.indices(s) for s in (4, 0, 2)] == [a.indices(s) for s in (4, 0, 2)]
    assert sorted(a.indices(0) + a.indices(1) + a.indices(2)[:1]) == list(range(5))  # one epoch = a permutation


def test_trace_puts_overlapping_spans_of_a_group_in_separate_lanes(tmp_path):
    t = Tracer()
    t.spans = [Span("generate", "rollout", 0.0, 2.0), Span("score", "rollout", 1.0, 3.0),
               Span("generate", "rollout", 2.0, 4.0), Span("step", "controller", 0.0, 1.0)]
    events = json.loads(t.write(tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"]
    assert spans == [("generate", 2, 0, 0.0, 2e6), ("step", 1, 0, 0.0, 1e6), ("score", 2, 1, 1e6, 2e6),
                     ("generate", 2, 0, 2e6, 2e6)]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "controller", 2: "rollout"}
