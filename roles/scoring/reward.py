"""`RewardWorker` and the reward-function registry.

A reward function takes a :class:`RewardInput` (decoded responses, prompts, answers,
token ids) and returns one float per row. Register your own::

    @register_reward_fn("my_task")
    def my_task(x: RewardInput) -> list[float]:
        return [float(r.strip() == a) for r, a in zip(x.responses, x.answers)]

Built-in toy tasks (see :func:`toy_dataset` for their prompts):

``char_class`` (the default, learnable by a tiny model with GRPO)
    The prompt is ``"write digits:"`` or ``"write vowels:"``; the answer names the class.
    The score is the fraction of the R response slots filled with tokens made only of
    that class's characters (``0-9`` or ``aeiou``; a leading space is allowed). A random
    tiny model scores ~0.03 (about 1 in 30 tokens qualifies); a policy that learned the
    task scores ~1.0. It is dense (every sample gets partial credit), so GRPO groups
    carry signal from the first step.
``echo_word``
    The prompt is ``"say <word>"``; score 1 when the response's first word is that word.
``exact_match``
    Score 1 when the stripped response equals the stripped answer.
``arith`` (arithmetic word problems, :mod:`asyncrl.roles.scoring.arithmetic`)
    1.0 when the number after ``Answer:`` equals the answer; ``fn_kwargs``:
    ``format_score`` (default 0.0: what a wrong answer in the asked format earns),
    ``method`` (``"strict"``, the default, or ``"flexible"``: the last number counts).

A reward function can also be named by path (:func:`load_reward_fn`): ``"path/to/file.py:fn"``
or ``"package.module:fn"``. Two signatures are accepted, told apart by their parameters:
verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``,
called once per row (it returns a float, or a dict with a ``"score"``), and asyncrl's batch
signature ``fn(x: RewardInput) -> list[float]``.

A reward model (a tiny sequence classifier, or a local directory) replaces the
function when ``RewardConfig.model`` is set.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from asyncrl import Dispatch, Worker, register

from asyncrl.roles._util import micro_batches, require, text_list
from asyncrl.roles.scoring.arithmetic import compute_score
from asyncrl.roles.errors import RewardFnError, UnknownNameError
from asyncrl.roles.fields import MAX_ROWS, Range, Section
from asyncrl.roles.registry import Registry
from asyncrl.roles.modeling.device import place_model, resolve_placement
from asyncrl.roles.modeling.models import ModelConfig, build_reward_model, load_tokenizer, position_ids_from_mask, set_torch_threads

__all__ = [
    "RewardConfig",
    "RewardInput",
    "RewardWorker",
    "scored",
    "register_reward_fn",
    "get_reward_fn",
    "reward_fn_names",
    "is_reward_path",
    "load_reward_fn",
    "RewardFnSpecError",
    "toy_dataset",
    "TOY_WORDS",
]


@dataclass
class RewardInput:
    """What a reward function sees for a batch of B rows."""

    responses: list[str]
    """Decoded responses (special tokens removed)."""
    prompts: list[str] | None
    """Prompt strings (the batch's ``prompt`` field), when present."""
    answers: list[str] | None
    """Ground truth (the batch's ``answer`` field), when present."""
    response_ids: list[list[int]]
    """Generated token ids per row (padding removed)."""
    response_tokens: list[list[str]]
    """Each generated token decoded on its own."""
    max_new_tokens: int
    """Width R of the response tensors."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """``RewardConfig.fn_kwargs``."""
    data_sources: list[str] | None = None
    """Each row's ``data_source`` (the batch's ``data_source`` field: prompts from data files)."""
    extra_infos: list[dict[str, Any]] | None = None
    """Each row's ``extra_info`` (the batch's ``extra_info`` field, JSON text decoded)."""


RewardFn = Callable[[RewardInput], Sequence[float] | torch.Tensor]
_REWARD_FNS: Registry[RewardFn] = Registry(
    "reward function", how_to_register="Register one with @asyncrl.roles.register_reward_fn(name) in a "
    "module the worker imports, or name a file: reward.fn=path/to/file.py:function")


def register_reward_fn(name: str, *, replace: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a reward function under `name` (``RewardConfig(fn=name)``)."""
    return _REWARD_FNS.decorator(name, replace=replace)


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as `name`."""
    return _REWARD_FNS.get(name)


def reward_fn_names() -> list[str]:
    """Registered reward function names."""
    return _REWARD_FNS.names()


# --------------------------------------------------------------------------- reward functions by path

_VERL_PARAMS = ("data_source", "solution_str", "ground_truth")


class RewardFnSpecError(ValueError):
    """A reward function named by path cannot be used: no such file or module, no such function, or a
    signature that is neither verl's row signature nor asyncrl's batch signature."""


def is_reward_path(spec: str) -> bool:
    """True when `spec` names a function by path (``file.py:fn`` or ``package.module:fn``), not a
    registered name."""
    return ":" in spec


def _load_module(target: str, spec: str) -> Any:
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise RewardFnSpecError(f"reward.fn={spec!r}: the file {path!r} does not exist; give an existing "
                                    "file, as reward.fn=path/to/file.py:function")
        st = os.stat(path)
        name = "asyncrl_reward_" + hashlib.sha256(f"{path}:{st.st_mtime_ns}:{st.st_size}".encode()).hexdigest()[:16]
        if name in sys.modules:
            return sys.modules[name]
        mspec = importlib.util.spec_from_file_location(name, path)
        if mspec is None or mspec.loader is None:
            raise RewardFnSpecError(f"reward.fn={spec!r}: cannot load {path!r} as a Python file")
        module = importlib.util.module_from_spec(mspec)
        sys.modules[name] = module
        try:
            mspec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise RewardFnSpecError(f"reward.fn={spec!r}: importing {path!r} raised {type(e).__name__}: {e}; "
                                    "fix the file") from e
        return module
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise RewardFnSpecError(f"reward.fn={spec!r}: cannot import module {target!r} ({e}); give an importable "
                                "module (package.module:function) or a file (path/to/file.py:function)") from None


def _kind(fn: Callable[..., Any], spec: str, fn_kwargs: dict[str, Any]) -> Literal["row", "batch"]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise RewardFnSpecError(f"reward.fn={spec!r} is not a function with a signature") from None
    params = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    shown = f"{getattr(fn, '__name__', spec)}{sig}"
    if all(n in named for n in _VERL_PARAMS):
        required = {n for n, p in params.items() if p.default is p.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = sorted(required - set(_VERL_PARAMS) - {"extra_info"} - set(fn_kwargs))
        if missing:
            raise RewardFnSpecError(f"reward.fn={spec!r}: {shown} also requires {missing}, which asyncrl does not "
                                    "pass; give them defaults or pass them with reward.fn_kwargs")
        unknown = sorted(k for k in fn_kwargs if k not in named) if not var_kw else []
        if unknown:
            raise RewardFnSpecError(f"reward.fn_kwargs {unknown} are not parameters of {shown}; drop them or add "
                                    "them to the function")
        return "row"
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    needed = [p for p in params.values() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                                    p.VAR_KEYWORD)]
    if positional and len(needed) <= 1 and (not needed or needed[0] is positional[0]):
        return "batch"
    raise RewardFnSpecError(
        f"reward.fn={spec!r} has the signature {shown}, which is neither verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info=None) (one row per call) nor asyncrl's "
        "fn(x: RewardInput) -> list[float] (one batch per call); change the function to one of them")


def load_reward_fn(spec: str, fn_kwargs: dict[str, Any] | None = None
                   ) -> tuple[Callable[..., Any], Literal["row", "batch"]]:
    """``(function, kind)`` of ``"path/to/file.py:fn"`` or ``"package.module:fn"``: ``kind`` is ``"row"``
    for verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` and
    ``"batch"`` for ``fn(x: RewardInput)``. Raises :class:`RewardFnSpecError` naming what is wrong."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise RewardFnSpecError(f"reward.fn={spec!r} is not PATH:FUNCTION; write reward.fn=path/to/file.py:"
                                "compute_score or reward.fn=package.module:function")
    module = _load_module(target, spec)
    fn = getattr(module, attr, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise RewardFnSpecError(f"reward.fn={spec!r}: {target!r} has no function {attr!r}; its functions are "
                                f"{found}")
    if not callable(fn):
        raise RewardFnSpecError(f"reward.fn={spec!r}: {attr!r} in {target!r} is a {type(fn).__name__}, not a "
                                "function")
    return fn, _kind(fn, spec, dict(fn_kwargs or {}))


def _row_score(value: Any) -> float:
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"returned a dict without a 'score' key (keys {sorted(value)})")
        value = value["score"]
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    raise TypeError(f"returned {type(value).__name__} {value!r}; return a float (or a dict with a 'score')")


def rowwise(fn: Callable[..., Any], name: str) -> RewardFn:
    """A batch reward function that calls verl-style ``fn(data_source=, solution_str=, ground_truth=,
    extra_info=, **fn_kwargs)`` once per row; a row that raises raises :class:`RewardFnError` naming the
    row's index in the batch, its ``data_source`` and its ``extra_info`` index."""
    params = inspect.signature(fn).parameters
    takes_extra = "extra_info" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def batch_fn(x: RewardInput) -> list[float]:
        answers = _answers(x, name)
        sources = x.data_sources or [""] * len(x.responses)
        extras = x.extra_infos or [{} for _ in x.responses]
        out = []
        for k, (r, a, ds, ex) in enumerate(zip(x.responses, answers, sources, extras)):
            kw = dict(x.kwargs)
            if takes_extra:
                kw["extra_info"] = ex
            try:
                out.append(_row_score(fn(data_source=ds, solution_str=r, ground_truth=a, **kw)))
            except Exception as e:
                where = f"row {k} of the batch (data_source {ds!r}"
                where += f", extra_info index {ex['index']!r})" if isinstance(ex, dict) and "index" in ex else ")"
                raise RewardFnError(f"reward function {name!r} raised {type(e).__name__} on {where}: {e}; fix the "
                                    "function") from e
        return out

    return batch_fn


# --------------------------------------------------------------------------- toy tasks

TOY_WORDS: tuple[str, ...] = ("cat", "dog", "sun", "sea", "red", "blue", "tree", "bird")
"""The words of the ``echo_word`` task (single tokens, with a leading space, in the tiny tokenizer)."""

_CLASSES = {"digits": set("0123456789"), "vowels": set("aeiou")}


def toy_dataset(task: str, n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` ``{"prompt", "answer"}`` rows of a built-in toy task (``char_class``, ``echo_word``, ``echo_number``).

    ``char_class`` and ``echo_word`` draw their few prompts with replacement (2 and 8 distinct); every
    ``echo_number`` prompt is distinct."""
    rng = random.Random(seed)
    if task == "char_class":
        names = sorted(_CLASSES)
        return [{"prompt": f"write {c}:", "answer": c} for c in (rng.choice(names) for _ in range(n))]
    if task == "echo_word":
        return [{"prompt": f"say {w}", "answer": w} for w in (rng.choice(TOY_WORDS) for _ in range(n))]
    if task == "echo_number":
        return [{"prompt": f"say {k}", "answer": str(k)} for k in rng.sample(range(max(10**6, 10 * n)), n)]
    raise UnknownNameError(f"no toy task {task!r}; known: char_class, echo_word, echo_number")


def _answers(x: RewardInput, name: str) -> list[str]:
    if x.answers is None:
        raise KeyError(f"reward function {name!r} needs the batch's 'answer' field")
    return x.answers


@register_reward_fn("char_class")
def char_class(x: RewardInput) -> list[float]:
    """Fraction of the R response slots holding tokens of the class named by the answer."""
    out = []
    for toks, cls in zip(x.response_tokens, _answers(x, "char_class")):
        allowed = _CLASSES.get(cls.strip())
        if allowed is None:
            raise ValueError(f"char_class answers must be one of {sorted(_CLASSES)}, got {cls!r}")
        good = sum(1 for t in toks if t.strip() and set(t.lstrip(" ")) <= allowed)
        out.append(good / max(1, x.max_new_tokens))
    return out


@register_reward_fn("echo_word")
def echo_word(x: RewardInput) -> list[float]:
    """1.0 when the response's first word is the answer."""
    return [float((r.split() or [""])[0] == a.strip()) for r, a in zip(x.responses, _answers(x, "echo_word"))]


@register_reward_fn("exact_match")
def exact_match(x: RewardInput) -> list[float]:
    """1.0 when the stripped response equals the stripped answer."""
    return [float(r.strip() == a.strip()) for r, a in zip(x.responses, _answers(x, "exact_match"))]


@register_reward_fn("arith")
def arith(x: RewardInput) -> list[float]:
    """Exact-match reward of an arithmetic answer, with an optional format reward (``fn_kwargs``:
    ``format_score``, ``method``); see :func:`asyncrl.roles.scoring.arithmetic.compute_score`."""
    kw = x.kwargs
    unknown = sorted(set(kw) - {"format_score", "method", "score"})
    if unknown:
        raise ValueError(f"reward 'arith' takes fn_kwargs format_score, method, score; got unknown {unknown}")
    return [compute_score(r, a, method=kw.get("method", "strict"), format_score=float(kw.get("format_score", 0.0)),
                          score=float(kw.get("score", 1.0)))
            for r, a in zip(x.responses, _answers(x, "arith"))]


# --------------------------------------------------------------------------- worker


@dataclass(kw_only=True)
class RewardConfig(Section):
    """Where sequence rewards come from."""

    fn: str = "char_class"
    """Registered reward function name, or a function by path: ``path/to/file.py:compute_score`` or
    ``package.module:fn`` (verl's row signature or asyncrl's batch signature; :func:`load_reward_fn`).
    Ignored when `model` is set."""
    fn_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to the function: as ``RewardInput.kwargs`` (batch signature), or as keyword arguments of each
    call (verl's row signature)."""
    tokenizer: str | None = None
    """Tokenizer that decodes responses (``"tiny"``, ``"qwen2"``, a GGUF spec or a directory); it must be the
    policy's. None: the policy's (``JobConfig.validate`` fills in ``model.tokenizer``, else ``model.path`` or
    ``model.gguf``, else ``"tiny"``; a worker built on its own uses ``"tiny"``)."""
    model: ModelConfig | None = None
    """A reward model (sequence classifier, one label) scoring ``input_ids``; replaces `fn`."""
    micro_batch_size: Annotated[int, Range(ge=1, le=MAX_ROWS)] = 16
    """Rows per reward-model forward."""


def _validate_scores(name: str, scores: Any, n: int) -> torch.Tensor:
    if isinstance(scores, torch.Tensor):
        t = scores.detach().to(torch.float32).cpu()
    else:
        try:
            t = torch.tensor([float(s) for s in scores], dtype=torch.float32)
        except (TypeError, ValueError) as e:
            raise RewardFnError(
                f"reward function {name!r} must return a sequence of {n} floats (or a tensor of shape [{n}]), "
                f"got {type(scores).__name__}: {e}"
            ) from None
    if tuple(t.shape) != (n,):
        raise RewardFnError(
            f"reward function {name!r} returned shape {tuple(t.shape)} for a batch of {n} rows; return one "
            f"float per row (shape [{n}])"
        )
    if not torch.isfinite(t).all():
        raise RewardFnError(f"reward function {name!r} returned non-finite scores: {t.tolist()}")
    return t



def scored(batch: TensorDictBase, scores: torch.Tensor) -> TensorDict:
    """A reward's result for `batch`: ``TD{scores, response_length}`` (each row's response tokens, from its
    ``response_mask``, when the batch has one: what ``trainer.balance_batch`` partitions the training ranks by)."""
    out = {"scores": scores}
    if "response_mask" in batch.keys():
        out["response_length"] = batch["response_mask"].sum(-1).to(torch.int64)
    return TensorDict(out, batch_size=[batch.batch_size[0]])

class RewardWorker(Worker):
    """Scores responses with a registered reward function or a reward model.

    Args:
        reward: which function or model, and the tokenizer that decodes responses.
    """

    def __init__(self, reward: RewardConfig | None = None) -> None:
        self.config = reward or RewardConfig()
        self.rm: torch.nn.Module | None = None
        if self.config.model is not None:
            set_torch_threads(self.context.num_cpus, self.config.model.num_threads)
            self.placement = resolve_placement(self.config.model, self.context.num_gpus, trained=False,
                                               who="RewardWorker (reward model)")
            rm, self.tokenizer = build_reward_model(self.config.model)
            self.rm = place_model(rm, self.placement, trained=False, who="RewardWorker (reward model)")
            self.rm.eval().requires_grad_(False)
            self.fn_name = "reward_model"
        else:
            set_torch_threads(self.context.num_cpus)
            self.tokenizer = load_tokenizer(self.config.tokenizer or "tiny")
            self.fn_name = self.config.fn
            if is_reward_path(self.config.fn):  # loaded here by path (the controller checked it already)
                fn, kind = load_reward_fn(self.config.fn, self.config.fn_kwargs)
                self.fn = rowwise(fn, self.fn_name) if kind == "row" else fn
            else:
                self.fn = get_reward_fn(self.config.fn)  # fail at construction for an unknown name
        self._token_text: dict[int, str] = {}

    def _decode_token(self, i: int) -> str:
        s = self._token_text.get(i)
        if s is None:
            s = self._token_text[i] = self.tokenizer.decode([i])
        return s

    def reward_input(self, batch: TensorDictBase) -> RewardInput:
        """The :class:`RewardInput` of a batch (responses decoded)."""
        require(batch, ["response_ids", "response_mask"], "RewardWorker.compute_reward")
        ids, mask = batch["response_ids"], batch["response_mask"].bool()
        rows = [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]
        return RewardInput(
            responses=self.tokenizer.batch_decode(rows, skip_special_tokens=True),
            prompts=text_list(batch, "prompt"),
            answers=text_list(batch, "answer"),
            response_ids=rows,
            response_tokens=[[self._decode_token(i) for i in r] for r in rows],
            max_new_tokens=int(ids.shape[1]),
            kwargs=dict(self.config.fn_kwargs),
            data_sources=text_list(batch, "data_source"),
            extra_infos=[json.loads(e) for e in extras] if (extras := text_list(batch, "extra_info")) else None,
        )

    @register(Dispatch.DP_COMPUTE)
    def compute_reward(self, batch: TensorDictBase) -> TensorDict:
        """``TD{scores [B], response_length [B]}``: one float per row, and its response tokens (what the
        trainer balances the training ranks by: ``trainer.balance_batch``).

        A function that raises, or returns the wrong type or shape, raises
        :class:`RewardFnError` naming the function."""
        n = batch.batch_size[0]
        if "episode_reward" in batch.keys() and bool(torch.isfinite(batch["episode_reward"]).all()):
            return scored(batch, batch["episode_reward"].float())  # episodes scored themselves
        if self.rm is not None:
            scores = self._model_scores(batch)
        else:
            x = self.reward_input(batch)
            try:
                raw = self.fn(x)
            except RewardFnError:
                raise
            except Exception as e:
                raise RewardFnError(
                    f"reward function {self.fn_name!r} raised {type(e).__name__}: {e}; fix the function "
                    "(it gets a RewardInput and returns one float per row)"
                ) from e
            scores = _validate_scores(self.fn_name, raw, n)
        return scored(batch, scores)

    def _model_scores(self, batch: TensorDictBase) -> torch.Tensor:
        require(batch, ["input_ids", "attention_mask"], "RewardWorker.compute_reward (reward model)")
        out = []
        with torch.no_grad():
            for s in micro_batches(batch.batch_size[0], self.config.micro_batch_size):
                dev = self.placement.device
                ids, m = batch["input_ids"][s].to(dev), batch["attention_mask"][s].to(dev)
                base = getattr(self.rm, self.rm.base_model_prefix)  # type: ignore[union-attr]
                with self.placement.autocast():
                    h = base(input_ids=ids, attention_mask=m, position_ids=position_ids_from_mask(m)).last_hidden_state
                    logits = self.rm.score(h).squeeze(-1).float()  # type: ignore[union-attr]
                last = m.shape[1] - 1 - m.flip(-1).long().argmax(-1)  # the last attended position
                out.append(logits[torch.arange(ids.shape[0], device=dev), last].cpu())
        scores = torch.cat(out)
        if not math.isfinite(float(scores.abs().sum())):
            raise RewardFnError("the reward model returned non-finite scores")
        return scores
