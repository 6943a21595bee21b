"""Toy tasks and the prompt loader.

A task is a deterministic list of ``(prompt, answer)`` pairs plus the name of the
reward function that scores a response against the answer. The loader turns step
``t`` into a batch of ``prompts_per_step`` prompts, each repeated ``group_size``
times in consecutive rows (a GRPO group never straddles a shard). Which prompts step
``t`` gets is a pure function of ``(seed, t)``, so the data position of a checkpoint
is just the step index.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tensordict import NonTensorStack, TensorDict

__all__ = ["Task", "register_task", "task_names", "get_task", "PromptLoader"]


@dataclass(frozen=True)
class Task:
    """A toy task: prompts with answers and the reward function that scores them."""

    name: str
    make: Callable[[int, int], list[tuple[str, str]]]
    """``make(num_prompts, seed) -> [(prompt, answer)]``."""
    reward_fn: str
    """Name of the reward function (registered with the roles' reward registry)."""


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Make `task` available as ``data.task=<name>``."""
    _TASKS[task.name] = task
    return task


def task_names() -> list[str]:
    """Names of the registered tasks."""
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    """The task registered as `name`."""
    try:
        return _TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known tasks: {task_names()}") from None


# ---- tasks -------------------------------------------------------------------------------------


def _roles_task(name: str) -> Callable[[int, int], list[tuple[str, str]]]:
    def make(n: int, seed: int) -> list[tuple[str, str]]:
        from asyncrl.roles import toy_dataset

        return [(r["prompt"], r["answer"]) for r in toy_dataset(name, n, seed)]

    return make


register_task(Task("char_class", _roles_task("char_class"), reward_fn="char_class"))
"""``write digits:`` / ``write vowels:``; the reward is the fraction of the response slots
holding tokens of that class (a random tiny model scores ~0.05)."""
register_task(Task("echo_word", _roles_task("echo_word"), reward_fn="echo_word"))
"""``say cat`` -> ``cat``; reward 1 when the first word of the response is the word."""


# ---- loader --------------------------------------------------------------------------------


class PromptLoader:
    """Step ``t``'s prompt batch, deterministic in ``(seed, t)``.

    Args:
        tokenizer: a tokenizer with ``pad_token_id`` (prompts are left-padded).
        pairs: the dataset's ``(prompt, answer)`` pairs.
        prompts_per_step: distinct prompts per batch.
        group_size: rows per prompt (consecutive).
        seed: seed of the epoch permutations.
        shuffle: permute the prompts every epoch.
    """

    def __init__(self, tokenizer: Any, pairs: list[tuple[str, str]], *, prompts_per_step: int, group_size: int,
                 seed: int, shuffle: bool = True) -> None:
        if not pairs:
            raise ValueError("the dataset is empty")
        self.pairs = pairs
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.seed = seed
        self.shuffle = shuffle
        self.pad_id = int(tokenizer.pad_token_id)
        self._ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in pairs]
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            idx = list(range(len(self.pairs)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
            self._orders = {epoch: idx}  # keep one epoch: batches are requested in order
        return self._orders[epoch]

    def indices(self, step: int) -> list[int]:
        """Dataset indices of step `step`'s prompts."""
        n = len(self.pairs)
        out = []
        for k in range(step * self.prompts_per_step, (step + 1) * self.prompts_per_step):
            out.append(self._order(k // n)[k % n])
        return out

    def batch(self, step: int) -> TensorDict:
        """Prompt rows of step `step`: ``prompt_ids``/``prompt_mask`` (left-padded), ``uid``,
        ``prompt`` and ``answer`` (one row per response)."""
        idx = [i for i in self.indices(step) for _ in range(self.group_size)]
        P = max(len(self._ids[i]) for i in idx)
        ids = torch.full((len(idx), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), P), dtype=torch.long)
        for r, i in enumerate(idx):
            t = self._ids[i]
            ids[r, P - len(t):] = torch.tensor(t, dtype=torch.long)
            mask[r, P - len(t):] = 1
        # uid: position of the prompt in this step (unique per group even if a prompt repeats)
        uid = torch.arange(self.prompts_per_step, dtype=torch.long).repeat_interleave(self.group_size)
        return TensorDict(
            {
                "prompt_ids": ids,
                "prompt_mask": mask,
                "uid": uid + step * self.prompts_per_step,
                "prompt": NonTensorStack(*[self.pairs[i][0] for i in idx]),
                "answer": NonTensorStack(*[self.pairs[i][1] for i in idx]),
            },
            batch_size=[len(idx)],
        )
