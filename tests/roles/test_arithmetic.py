"""The arithmetic task's pure functions, against hand-checked values: problems, the held-out
split, answer extraction, scores and the registered reward functions."""

from __future__ import annotations

import random

import pytest

from asyncrl.roles import RewardConfig, RewardFnError, RewardWorker
from asyncrl.roles.scoring.arithmetic import (
    INSTRUCTION,
    OPS,
    Problem,
    compute_score,
    extract_answer,
    is_correct,
    is_held_out,
    make_problem,
    make_problems,
    prompt_text,
)
from asyncrl.roles.scoring.reward import RewardInput, get_reward_fn


def test_answers_are_the_arithmetic_of_the_operands():
    assert Problem(op="add", a=17, b=25, question="", level=1).answer == 42
    assert Problem(op="sub", a=20, b=7, question="", level=1).answer == 13
    assert Problem(op="mul", a=12, b=11, question="", level=1).answer == 132


def test_problems_are_pinned_for_a_seed():
    """The generator is deterministic; these are the first problems of seed 0 (checked by hand)."""
    ps = make_problems(3, 0)
    assert [(p.op, p.a, p.b, p.answer) for p in ps] == [("add", 13, 14, 27), ("sub", 11, 8, 3), ("mul", 11, 4, 44)]
    assert ps[0].question == "There are 13 shells in a box and 14 shells on the table. How many shells are there in total?"
    assert ps[1].question == "What is 11 minus 8?"
    assert ps[2].prompt == ("There are 11 baskets with 4 marbles in each. How many marbles are there in total?\n"
                            'End your reply with "Answer: " followed by the number.')
    assert make_problems(3, 0) == ps and make_problems(3, 1) != ps


def test_operations_cycle_and_operands_follow_the_level():
    ranges = {1: {"add": (1, 20, 1, 20), "sub": (2, 20, 1, 20), "mul": (2, 12, 2, 12)},
              2: {"add": (10, 99, 10, 99), "sub": (20, 99, 10, 99), "mul": (10, 20, 2, 9)},
              3: {"add": (100, 999, 10, 999), "sub": (100, 999, 10, 999), "mul": (10, 99, 10, 99)}}
    for level, by_op in ranges.items():
        ps = make_problems(300, 7, levels=(level,), split="all")
        assert [p.op for p in ps[:6]] == ["add", "sub", "mul", "add", "sub", "mul"]
        for p in ps:
            lo_a, hi_a, lo_b, hi_b = by_op[p.op]
            assert lo_a <= p.a <= hi_a and lo_b <= p.b <= hi_b and p.level == level
            if p.op == "sub":
                assert p.b <= p.a and p.answer >= 0  # never a negative answer
            assert str(p.a) in p.question and str(p.b) in p.question
    mixed = make_problems(12, 0, levels=(1, 2), ops=("mul",), split="all")
    assert [p.level for p in mixed[:4]] == [1, 2, 1, 2] and {p.op for p in mixed} == {"mul"}


def test_held_out_problems_never_appear_in_training():
    train = {(p.op, p.a, p.b) for seed in range(5) for p in make_problems(400, seed)}
    held = {(p.op, p.a, p.b) for seed in range(5) for p in make_problems(48, seed, split="eval")}
    assert not train & held
    assert all(is_held_out(*k, 0.2) for k in held) and not any(is_held_out(*k, 0.2) for k in train)
    # a fixed bucket: about 20 % of all level-1 problems, the same for every seed
    space = [(op, a, b) for op in OPS for a in range(1, 21) for b in range(1, 21)]
    frac = sum(is_held_out(*k, 0.2) for k in space) / len(space)
    assert 0.15 < frac < 0.25
    assert is_held_out("add", 3, 4, 0.2) and not is_held_out("add", 17, 25, 0.2)  # pinned bucket members


def test_evaluation_set_is_fixed_by_seed_and_distinct():
    a = make_problems(48, 0, split="eval")
    assert a == make_problems(48, 0, split="eval")
    assert len({(p.op, p.a, p.b) for p in a}) == 48  # no duplicate problems in the held-out set


def test_bad_generator_arguments_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"levels must be a non-empty subset of \(1, 2, 3\)"):
        make_problems(4, 0, levels=(4,))
    with pytest.raises(ValueError, match="ops must be a non-empty subset"):
        make_problems(4, 0, ops=("div",))
    with pytest.raises(ValueError, match="split must be"):
        make_problems(4, 0, split="test")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="difficulty level"):
        make_problem(random.Random(0), "add", 0)


@pytest.mark.parametrize("text, strict, flexible", [
    ("Answer: 42", "42", "42"),
    ("17 + 25 = 42", None, "42"),
    ("The answer is 42.", "42", "42"),
    ("answer: 7\nAnswer: 9", "9", "9"),                 # the last one counts
    ("Answer: 1,234", "1234", "1234"),
    ("**Answer:** 15", "15", "15"),
    ("Answer = 12.0", "12", "12"),
    ("Answer: -5", "-5", "-5"),
    ("Answer: 3 apples, 4 left", "3", "4"),
    ("I do not know.", None, None),
    ("", None, None),
])
def test_answer_extraction(text, strict, flexible):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_scores_follow_verl_gsm8k_shape():
    assert compute_score("Answer: 42", "42") == 1.0
    assert compute_score("Answer: 41", "42") == 0.0
    assert compute_score("Answer: 41", "42", format_score=0.1) == 0.1    # asked format, wrong number
    assert compute_score("it is 42", "42", format_score=0.1) == 0.0      # strict: no format, no credit
    assert compute_score("it is 42", "42", method="flexible") == 1.0
    assert compute_score("it is 41", "42", method="flexible", format_score=0.1) == 0.0
    assert is_correct("Answer: 42", 42) and not is_correct("Answer: 4", 42)
    assert prompt_text("What is 2 plus 2?") == f"What is 2 plus 2?\n{INSTRUCTION}"


def _input(responses: list[str], answers: list[str], **kwargs) -> RewardInput:
    return RewardInput(responses=responses, prompts=None, answers=answers, response_ids=[[] for _ in responses],
                       response_tokens=[[] for _ in responses], max_new_tokens=8, kwargs=kwargs)


def test_registered_reward_functions():
    x = ["Answer: 27", "Answer: 26", "27", "no idea"]
    ans = ["27"] * 4
    assert get_reward_fn("arith")(_input(x, ans)) == [1.0, 0.0, 0.0, 0.0]
    assert get_reward_fn("arith")(_input(x, ans, format_score=0.1)) == [1.0, 0.1, 0.0, 0.0]
    assert get_reward_fn("arith")(_input(x, ans, method="flexible")) == [1.0, 0.0, 1.0, 0.0]
    assert get_reward_fn("arith")(_input(x, ans, method="flexible", format_score=0.1)) == [1.0, 0.1, 1.0, 0.0]
    with pytest.raises(ValueError, match="unknown"):
        get_reward_fn("arith")(_input(x, ans, fromat_score=0.1))


def test_reward_worker_names_the_function_on_bad_kwargs(prompt_batch):
    import torch

    worker = RewardWorker(RewardConfig(fn="arith", fn_kwargs={"fromat_score": 0.1}))
    batch = prompt_batch("char_class", n=2)
    batch.set("response_ids", torch.ones((2, 3), dtype=torch.long))
    batch.set("response_mask", torch.ones((2, 3), dtype=torch.long))
    with pytest.raises(RewardFnError, match="'arith' raised ValueError.*fromat_score"):
        worker.compute_reward(batch)
