"""Dynamic sampling (``algorithm.filter_groups``): which groups carry signal, which extra prompts a
step draws, and how groups of batches with different prompt widths are joined into one batch."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from asyncrl.pipelines.config import ConfigError
from asyncrl.pipelines.presets import load_config
from asyncrl.pipelines.sampling import extra_indices, group_stds, informative_groups, select_groups


def test_groups_whose_rewards_are_all_equal_carry_no_signal():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    assert informative_groups(scores, 4) == [0]
    assert group_stds(scores, 4).tolist() == [pytest.approx(0.4330127), 0.0, 0.0]


def test_extra_prompts_are_a_pure_function_of_seed_step_and_call():
    a = extra_indices(10, 3, seed=0, step=5, call=1)
    assert a == extra_indices(10, 3, seed=0, step=5, call=1) and len(set(a)) == 3
    assert a != extra_indices(10, 3, seed=0, step=5, call=2) and a != extra_indices(10, 3, seed=1, step=5, call=1)
    assert len(extra_indices(2, 3, seed=0, step=0, call=1)) == 3  # a dataset smaller than a batch repeats rows


def _batch(prompt_width: int, tag: str, groups: int = 2, g: int = 2) -> TensorDict:
    n = groups * g
    ids = torch.arange(n * prompt_width).reshape(n, prompt_width) + 10
    resp = torch.full((n, 3), 7)
    return TensorDict({
        "prompt_ids": ids, "prompt_mask": torch.ones(n, prompt_width, dtype=torch.long),
        "response_ids": resp, "input_ids": torch.cat([ids, resp], 1),
        "attention_mask": torch.ones(n, prompt_width + 3, dtype=torch.long),
        "uid": torch.arange(groups).repeat_interleave(g), "scores": torch.arange(n, dtype=torch.float32),
        "prompt": NonTensorStack(*[f"{tag}{r}" for r in range(n)]),
    }, batch_size=[n])


def test_groups_of_batches_with_different_prompt_widths_join_left_padded_and_renumbered():
    a, b = _batch(2, "a"), _batch(4, "b")
    out = select_groups([a, b], [(0, 1), (1, 0)], 2, pad_id=0, uid_base=6)
    assert out.batch_size == torch.Size([4])
    assert out["prompt_ids"].tolist() == [[0, 0, 14, 15], [0, 0, 16, 17], [10, 11, 12, 13], [14, 15, 16, 17]]
    assert out["prompt_mask"].tolist() == [[0, 0, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2
    assert out["input_ids"][:, -3:].tolist() == [[7, 7, 7]] * 4 and out["input_ids"].shape == (4, 7)
    assert out["attention_mask"].sum(1).tolist() == [5, 5, 7, 7]
    assert out["uid"].tolist() == [6, 6, 7, 7]
    assert out["scores"].tolist() == [2.0, 3.0, 0.0, 1.0]
    assert list(out["prompt"]) == ["a2", "a3", "b0", "b1"]


def test_filter_groups_is_checked():
    with pytest.raises(ConfigError, match="needs algorithm.name=grpo"):
        load_config(None, ["algorithm.name=ppo", "algorithm.group_size=1", "algorithm.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match="max_num_gen_batches must be >= 1, got 0"):
        load_config(None, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0"])
