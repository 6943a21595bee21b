"""Helpers shared by the role workers (private)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterable, Mapping, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from asyncrl.roles.functional import entropy_from_logits
from asyncrl.roles.modeling.device import Placement
from asyncrl.roles.modeling.models import position_ids_from_mask
from asyncrl.roles.modeling.parallel import DataParallel



def require(batch: TensorDictBase, fields: Iterable[str], who: str) -> None:
    """Raise a KeyError naming the missing fields and who writes them."""
    missing = [f for f in fields if f not in batch.keys()]
    if missing:
        raise KeyError(
            f"{who} needs batch field(s) {missing}; the batch has {sorted(map(str, batch.keys()))}. "
            "See docs/roles_api.md for which stage writes each field"
        )


def text_list(batch: TensorDictBase, key: str) -> list[str] | None:
    """A non-tensor per-row string field as a list (None when absent)."""
    if key not in batch.keys():
        return None
    v = batch.get(key)
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, str):  # a NonTensorData broadcast over the batch
        return [v] * batch.batch_size[0]
    return [str(x) for x in v]


def with_fields(batch: TensorDictBase, fields: Mapping[str, Any]) -> TensorDict:
    """A shallow copy of `batch` plus `fields` (the input tensors are never written)."""
    out = batch.clone(recurse=False)
    for k, v in fields.items():
        out.set(k, v)
    return out


def mini_batches(n: int, size: int | None) -> list[slice]:
    """Row selections of one optimizer step each, strided: with ``k = ceil(n / size)`` mini-batches,
    mini-batch ``j`` is rows ``j, j + k, j + 2k, ...``.

    Strided rather than contiguous so that R data-parallel ranks train like one: rank r holds the
    contiguous shard ``[r*n/R, (r+1)*n/R)`` of the batch and takes ``size / R`` rows per step, and
    when ``n / R`` is a multiple of ``k`` its mini-batch ``j`` is exactly the rows of the one-rank
    mini-batch ``j`` that fall in its shard (contiguous mini-batches would mix other rows). When
    ``size`` does not divide ``n`` the selections differ in size by at most one row."""
    if size is None or size <= 0 or size >= n:
        return [slice(0, n)]
    k = -(-n // size)
    return [slice(j, n, k) for j in range(k)]


def micro_batches(n: int, size: int | None) -> list[slice]:
    """Row slices of at most `size` rows covering ``range(n)`` in order."""
    if size is None or size <= 0:
        size = n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def token_budget_micro_batches(lengths: Sequence[int] | Sequence[tuple[int, int]], budget: int,
                               min_count: int = 1) -> list[list[int]]:
    """Rows grouped into micro-batches of at most `budget` padded tokens each (rows x the
    micro-batch's own width): ``max(min_count, the fewest the budget allows)`` lists of row indices.

    A length is a row's token count, or a pair ``(prompt, response)`` for a row laid out as the
    trained roles' batches are (left-padded prompt, right-padded response): a micro-batch cut to its
    own rows is then ``longest prompt + longest response`` wide.

    The rows are sorted longest first and cut into runs of neighbours, so rows of similar length
    share a micro-batch; of the cuts into that many runs, it takes the one with the fewest padded
    tokens in all, the most even of those (exact, by dynamic programming: O(count x rows^2) time,
    O(rows^2) memory).
    `min_count` is how data-parallel ranks agree: each computes its own fewest
    (``len(token_budget_micro_batches(lengths, budget))``), they take the max, and each partitions
    into exactly that many, since a sharded model's every forward is a collective. Lists are
    non-empty while rows last; with fewer rows than `min_count` the last ones are empty. Lists come
    longest first, rows ascending within a list. Raises ValueError when a row alone is longer than `budget`."""
    rows = [_pair(x) for x in lengths]
    n = len(rows)
    longest = max((a + b for a, b in rows), default=0)
    if longest > budget:
        raise ValueError(f"a micro-batch budget of {budget} tokens is smaller than the longest row "
                         f"({longest} tokens); raise it to at least {longest}")
    if n == 0:
        return [[] for _ in range(max(min_count, 1))]
    order = sorted(range(n), key=lambda i: (-(rows[i][0] + rows[i][1]), i))
    a = torch.tensor([rows[i][0] for i in order], dtype=torch.float64)
    b = torch.tensor([rows[i][1] for i in order], dtype=torch.float64)
    start = torch.arange(n).unsqueeze(1)
    later = torch.arange(n).unsqueeze(0) >= start  # [i, j]: row j is in a run that starts at row i
    width = (torch.where(later, a, 0.0).cummax(1).values + torch.where(later, b, 0.0).cummax(1).values)
    cost = torch.full((n + 1, n + 1), float("inf"), dtype=torch.float64)  # cost[i, j]: rows i..j-1 as one run
    run = width * (torch.arange(1, n + 1) - start)
    # + a tie-break below one token in all (sum of squares): of equally padded cuts, the most even
    cost[:n, 1:] = torch.where(later & (run <= budget), run + 0.5 / n * (run / budget) ** 2, float("inf"))
    best = torch.full((n + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0  # best[j]: fewest padded tokens of rows 0..j-1 in t runs
    cuts: list[torch.Tensor] = []
    while len(cuts) < min(min_count, n) or best[n] == float("inf"):
        best, arg = (best.unsqueeze(1) + cost).min(0)
        cuts.append(arg)
    groups, j = [], n
    for arg in reversed(cuts):
        i = int(arg[j])
        groups.append(sorted(order[i:j]))
        j = i
    groups.reverse()
    return groups + [[] for _ in range(min_count - len(groups))]


def _pair(length: Any) -> tuple[int, int]:
    try:
        a, b = length
    except TypeError:
        return int(length), 0
    return int(a), int(b)


def row_extents(attention_mask: torch.Tensor, response_width: int) -> list[tuple[int, int]]:
    """``(prompt, response)`` columns each row spans around the prompt/response boundary (the
    batch is a left-padded prompt then a right-padded response of `response_width` columns)."""
    P = attention_mask.shape[1] - response_width
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    on = attention_mask.bool()
    first = torch.where(on, cols, attention_mask.shape[1]).min(1).values.clamp(max=P)
    last = torch.where(on, cols, -1).max(1).values
    return list(zip((P - first).tolist(), (last + 1 - P).clamp(min=0).tolist()))


def cut_columns(b: TensorDictBase, prompt: int, response: int) -> TensorDict:
    """`b` cut to its last `prompt` prompt columns and first `response` response columns:
    ``input_ids``/``attention_mask`` on both sides, every other field as wide as the response
    (``response_ids``, its mask, log-probs, advantages, ...) on the right; ``prompt_*`` fields keep
    their width. Only padding goes when the widths cover every row's `row_extents`."""
    T, R = b["input_ids"].shape[1], b["response_ids"].shape[1]
    P = T - R
    out = b.clone(recurse=False)
    for k in b.keys():
        t = b.get(k)
        if not isinstance(t, torch.Tensor) or t.ndim < 2:
            continue
        if k in ("input_ids", "attention_mask"):
            out.set(k, t[:, P - prompt:P + response])
        elif t.shape[1] == R and not str(k).startswith("prompt_"):
            out.set(k, t[:, :response])
    return out


def require_token_budget(batch: TensorDictBase, max_tokens: int | None, dp: DataParallel | None, key: str) -> None:
    """Raise ValueError on every rank of `dp` when a row of any rank's `batch` is longer than
    `max_tokens` (one all-reduce; nothing when `max_tokens` is None), so that an update refuses the
    batch before its first optimizer step rather than at the mini-batch that holds the row."""
    if max_tokens is None:
        return
    extents = row_extents(batch["attention_mask"], batch["response_ids"].shape[1])
    longest = torch.tensor([max((a + b for a, b in extents), default=0)], dtype=torch.int64)
    _refuse_longer(int((dp.all_reduce(longest, op="max") if dp is not None else longest)[0]), max_tokens, key)


def _refuse_longer(longest: int, max_tokens: int, key: str) -> None:
    if longest > max_tokens:
        raise ValueError(f"{key}={max_tokens} is smaller than the longest row of this batch ({longest} tokens, "
                         f"prompt + response); set it to at least {longest}, or to null for micro-batches of "
                         "micro_batch_size rows")


def split_micro_batches(batch: TensorDictBase, size: int, max_tokens: int | None, dp: DataParallel | None,
                        key: str) -> list[tuple[slice | torch.Tensor, TensorDictBase]]:
    """``(rows, micro-batch)`` pairs covering `batch` (one mini-batch of this rank's shard).

    `max_tokens` None: slices of `size` rows, as wide as the batch. Else the rows grouped by
    :func:`token_budget_micro_batches`, each micro-batch cut to its own columns (:func:`cut_columns`),
    and as many micro-batches on every rank of `dp` (one all-reduce; None: this rank alone): a rank
    with fewer rows than that runs its first row with an all-zero ``response_mask`` for each missing
    one (no gradient, no metric; its `rows` are empty). `key` names the setting in errors
    (``actor.max_tokens_per_micro_batch``)."""
    n = batch.batch_size[0]
    if max_tokens is None:
        return [(s, batch[s]) for s in micro_batches(n, size)]
    extents = row_extents(batch["attention_mask"], batch["response_ids"].shape[1])
    longest = max((a + b for a, b in extents), default=0)
    groups = token_budget_micro_batches(extents, max_tokens) if longest <= max_tokens else []
    count = len(groups)
    if dp is not None:
        count, longest = (int(x) for x in dp.all_reduce(torch.tensor([count, longest], dtype=torch.int64), op="max"))
    _refuse_longer(longest, max_tokens, key)  # every rank raises together (the max is everyone's)
    if count > len(groups):
        groups = token_budget_micro_batches(extents, max_tokens, count)
    out: list[tuple[slice | torch.Tensor, TensorDictBase]] = []
    for group in groups:
        if not group and n:
            dummy = cut_columns(batch[:1], max(1, extents[0][0]), 1)
            dummy.set("response_mask", torch.zeros_like(dummy["response_mask"]))
            out.append((torch.zeros(0, dtype=torch.long), dummy))
        elif group:
            rows = torch.tensor(group, dtype=torch.long)
            out.append((rows, cut_columns(batch[rows], max(extents[i][0] for i in group),
                                          max(1, max(extents[i][1] for i in group)))))
    return out


_KEEP_KW: dict[type, str | None] = {}


def _keep_logits(model: torch.nn.Module, n: int) -> dict[str, int]:
    """``{logits_to_keep: n}`` where the model's forward takes it (transformers' causal LMs), else {}.

    The LM head then runs on the last `n` positions only, the ones whose logits are read: SmolLM2's
    49k-vocabulary head is ~1/5 of its FLOPs per token, so on 69-token prompts with 20-token
    responses the prompt's logits were ~1/6 of a forward/backward (TRL passes the same argument)."""
    cls = type(getattr(model, "module", model))  # DDP's wrapper forwards to its module
    if cls not in _KEEP_KW:
        params = inspect.signature(cls.forward).parameters
        _KEEP_KW[cls] = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    kw = _KEEP_KW[cls]
    return {kw: n} if kw else {}


def response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_ids: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    placement: Placement | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, R]`` of the response tokens (the last R columns of `input_ids`)
    under ``log_softmax(logits / temperature)``, and their entropy.

    With a `placement` the inputs move to its device and the forward runs under its
    autocast; the log-softmax and entropy are always computed in float32 (on the device)."""
    R = response_ids.shape[1]
    if placement is not None:
        dev = placement.device
        input_ids, attention_mask, response_ids = (t.to(dev, non_blocking=True)
                                                   for t in (input_ids, attention_mask, response_ids))
    with placement.autocast() if placement is not None else contextlib.nullcontext():
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                    **_keep_logits(model, R + 1))
    logits = out.logits[:, -R - 1:-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, response_ids.long().unsqueeze(-1)).squeeze(-1)
    ent = entropy_from_logits(logits) if with_entropy else None
    return lp, ent
