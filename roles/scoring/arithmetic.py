"""Arithmetic word problems: a procedurally generated task with checkable answers.

Pure functions only (no workers, no config objects): problem generation, the prompt
text, answer extraction and the rewards. The trainer's task ``arith``
(:mod:`asyncrl.pipelines.datasets.data`) and the registered reward function ``arith``
are built on them.

Problems
    ``Tom has 17 apples. He buys 25 more apples. How many apples does Tom have now?``
    -- addition, subtraction (never negative) and multiplication, each from a few
    sentence templates, with operands drawn by difficulty level:

    ======  ==================  ==================  =====================
    level   add                 sub (a >= b)        mul
    ======  ==================  ==================  =====================
    1       1-20 + 1-20         2-20 - 1-20         2-12 x 2-12
    2       10-99 + 10-99       20-99 - 10-99       10-20 x 2-9
    3       100-999 + 10-999    100-999 - 10-999    10-99 x 10-99
    ======  ==================  ==================  =====================

Train / held-out split
    Every problem (operation and operands) falls into the held-out bucket or the training
    bucket by a hash of the problem itself, not by a seed: :func:`make_problems` with
    ``split="eval"`` draws only held-out problems and ``split="train"`` never draws one, so
    no held-out problem is ever trained on, whatever the seeds or sizes.

Answers and rewards (verl's ``gsm8k`` conventions)
    :func:`extract_answer` with ``method="strict"`` reads the number after the last
    ``Answer:`` (the format the prompt asks for); ``"flexible"`` reads the last number in
    the response. :func:`compute_score` returns `score` (1.0) for a correct answer,
    `format_score` (default 0.0) for a wrong one given in the asked format, and 0.0
    when no answer can be extracted.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal, Sequence

__all__ = [
    "OPS",
    "LEVELS",
    "INSTRUCTION",
    "Problem",
    "make_problem",
    "make_problems",
    "is_held_out",
    "prompt_text",
    "extract_answer",
    "compute_score",
    "is_correct",
]

OPS: tuple[str, ...] = ("add", "sub", "mul")
"""The operations."""

LEVELS: tuple[int, ...] = (1, 2, 3)
"""The difficulty levels (operand ranges: see the module docstring)."""

INSTRUCTION = 'End your reply with "Answer: " followed by the number.'
"""Appended to every question: the answer format that ``method="strict"`` extraction reads. It holds no
example number on purpose: with "like this: Answer: 7" SmolLM2 learned under GRPO with a format reward to
append "The answer is: 7" to every reply (format credit for any wrong answer, and the flexible extraction then
read 7)."""

Split = Literal["train", "eval", "all"]

_RANGES: dict[int, dict[str, tuple[tuple[int, int], tuple[int, int]]]] = {
    1: {"add": ((1, 20), (1, 20)), "sub": ((2, 20), (1, 20)), "mul": ((2, 12), (2, 12))},
    2: {"add": ((10, 99), (10, 99)), "sub": ((20, 99), (10, 99)), "mul": ((10, 20), (2, 9))},
    3: {"add": ((100, 999), (10, 999)), "sub": ((100, 999), (10, 999)), "mul": ((10, 99), (10, 99))},
}

_NAMES = ("Tom", "Anna", "Ben", "Maria", "Sam", "Lena", "Omar", "Julia", "Ravi", "Emma")
_ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells")
_CONTAINERS = ("boxes", "bags", "baskets", "shelves", "jars")

_TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "{name} has {a} {item}. {pron} gets {b} more {item}. How many {item} does {name} have now?",
        "There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in total?",
        "What is {a} plus {b}?",
    ),
    "sub": (
        "{name} has {a} {item}. {pron} gives away {b} {item}. How many {item} does {name} have left?",
        "A shop had {a} {item} and sold {b} of them. How many {item} are left?",
        "What is {a} minus {b}?",
    ),
    "mul": (
        "There are {a} {container} with {b} {item} in each. How many {item} are there in total?",
        "{name} buys {a} packs of {item}. Each pack has {b} {item}. How many {item} does {name} buy?",
        "What is {a} times {b}?",
    ),
}
_PRONOUNS = {"Tom": "He", "Ben": "He", "Sam": "He", "Omar": "He", "Ravi": "He"}


@dataclass(frozen=True)
class Problem:
    """One word problem."""

    op: str
    """``"add"``, ``"sub"`` or ``"mul"``."""
    a: int
    """First operand."""
    b: int
    """Second operand."""
    question: str
    """The word problem (without the answer-format instruction)."""
    level: int
    """Difficulty level it was drawn at."""

    @property
    def answer(self) -> int:
        """The correct answer."""
        return _apply(self.op, self.a, self.b)

    @property
    def prompt(self) -> str:
        """The user message: the question and the answer-format instruction (:func:`prompt_text`)."""
        return prompt_text(self.question)


def _apply(op: str, a: int, b: int) -> int:
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    raise ValueError(f"unknown operation {op!r}; use one of {OPS}")


def is_held_out(op: str, a: int, b: int, eval_fraction: float = 0.2) -> bool:
    """True when the problem ``(op, a, b)`` belongs to the held-out set (a fixed hash bucket)."""
    h = int.from_bytes(hashlib.sha256(f"{op}|{a}|{b}".encode()).digest()[:8], "little")
    return (h % 10_000) < int(round(eval_fraction * 10_000))


def prompt_text(question: str) -> str:
    """The user message for `question`: the question, then :data:`INSTRUCTION`."""
    return f"{question}\n{INSTRUCTION}"


def make_problem(rng: random.Random, op: str, level: int) -> Problem:
    """One problem of operation `op` at `level`, drawn with `rng` (ignores the split)."""
    if level not in _RANGES:
        raise ValueError(f"difficulty level must be one of {LEVELS}, got {level!r}")
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r}; use one of {OPS}")
    (lo_a, hi_a), (lo_b, hi_b) = _RANGES[level][op]
    a = rng.randint(lo_a, hi_a)
    b = rng.randint(lo_b, min(hi_b, a) if op == "sub" else hi_b)
    name = rng.choice(_NAMES)
    template = rng.choice(_TEMPLATES[op])
    question = template.format(a=a, b=b, name=name, pron=_PRONOUNS.get(name, "She"), item=rng.choice(_ITEMS),
                               container=rng.choice(_CONTAINERS))
    return Problem(op=op, a=a, b=b, question=question, level=level)


def make_problems(n: int, seed: int, *, levels: Sequence[int] = (1,), ops: Sequence[str] = OPS,
                  split: Split = "train", eval_fraction: float = 0.2) -> list[Problem]:
    """`n` problems, deterministic in every argument.

    Operations and levels cycle in turn (balanced); operands, names and templates come from
    ``random.Random(seed)``. ``split="eval"`` keeps only held-out problems
    (:func:`is_held_out`), ``"train"`` only the others, ``"all"`` both. Distinct problems are
    preferred; duplicates appear only when the split has fewer distinct problems than `n`.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not ops or any(o not in OPS for o in ops):
        raise ValueError(f"ops must be a non-empty subset of {OPS}, got {list(ops)}")
    if not levels or any(lv not in LEVELS for lv in levels):
        raise ValueError(f"levels must be a non-empty subset of {LEVELS}, got {list(levels)}")
    if split not in ("train", "eval", "all"):
        raise ValueError(f"split must be 'train', 'eval' or 'all', got {split!r}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    rng = random.Random(seed)
    out: list[Problem] = []
    seen: set[tuple[str, int, int]] = set()
    while len(out) < n:
        op, level = ops[len(out) % len(ops)], levels[(len(out) // len(ops)) % len(levels)]
        for attempt in range(10_000):
            p = make_problem(rng, op, level)
            if split != "all" and is_held_out(p.op, p.a, p.b, eval_fraction) != (split == "eval"):
                continue
            if (p.op, p.a, p.b) not in seen or attempt >= 50:  # the split ran out of new problems
                break
        else:
            raise RuntimeError(f"no {split} problem of {op!r} at level {level} in 10,000 draws; raise eval_fraction")
        seen.add((p.op, p.a, p.b))
        out.append(p)
    return out


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\**\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY = re.compile(_NUMBER)
_CLIP = 300  # as verl's gsm8k: the answer is at the end; regexes over long strings are slow


def _normalize(num: str) -> str:
    num = num.replace(",", "")
    if "." in num:
        whole, frac = num.split(".", 1)
        if frac.strip("0") == "":
            num = whole  # "42.0" is 42
    return num


def extract_answer(response: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer a response gives, as a normalised number string (``"1,234"`` -> ``"1234"``,
    ``"42.0"`` -> ``"42"``), or None.

    ``strict``: the number after the last ``Answer:`` (also ``answer is``, ``Answer =``,
    ``**Answer:** 7``). ``flexible``: the last number anywhere in the response.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = response[-_CLIP:]
    found = (_STRICT if method == "strict" else _ANY).findall(text)
    if not found:
        return None
    return _normalize(found[-1])


def is_correct(response: str, answer: str | int, method: Literal["strict", "flexible"] = "strict") -> bool:
    """True when the answer extracted from `response` equals `answer`."""
    got = extract_answer(response, method)
    return got is not None and got == _normalize(str(answer).strip())


def compute_score(response: str, answer: str | int, *, method: Literal["strict", "flexible"] = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` for a correct answer, `format_score` for a wrong answer in the asked format
    (strict extraction finds one), 0.0 otherwise (verl's ``gsm8k.compute_score`` shape)."""
    if is_correct(response, answer, method):
        return score
    return format_score if extract_answer(response, "strict") is not None else 0.0
