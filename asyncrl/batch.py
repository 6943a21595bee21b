"""Batch helpers: what TensorDict lacks for data-parallel dispatch.

A *batch* is anything with a leading batch dimension: a ``TensorDict``, a tensor
(``ndim >= 1``), a list or a tuple (one entry per row), or a numpy array. asyncrl adds
only padding to a divisor, the row bookkeeping of shards, and a concat that accepts
every batch kind; splitting and indexing are TensorDict's own.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from tensordict import TensorDictBase

from asyncrl.errors import DispatchError

try:  # numpy is a declared dependency, but keep batch.py importable without it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = [
    "is_batch",
    "batch_len",
    "take_rows",
    "concat",
    "shard_plan",
    "payload_nbytes",
]


def is_batch(x: Any) -> bool:
    """True when `x` has a leading batch dimension asyncrl can split."""
    if isinstance(x, TensorDictBase):
        return len(x.batch_size) >= 1
    if isinstance(x, torch.Tensor):
        return x.ndim >= 1
    if np is not None and isinstance(x, np.ndarray):
        return x.ndim >= 1
    return isinstance(x, (list, tuple))


def batch_len(x: Any) -> int:
    """Number of rows of a batch."""
    if isinstance(x, TensorDictBase):
        return int(x.batch_size[0])
    if isinstance(x, torch.Tensor) or (np is not None and isinstance(x, np.ndarray)):
        return int(x.shape[0])
    if isinstance(x, (list, tuple)):
        return len(x)
    raise DispatchError(f"{type(x).__name__} has no batch dimension")


def take_rows(x: Any, rows: Sequence[int] | slice) -> Any:
    """Rows `rows` of batch `x`, as the same kind of batch."""
    if isinstance(rows, slice):
        return x[rows]
    if isinstance(x, (list, tuple)):
        out = [x[i] for i in rows]
        return out if isinstance(x, list) else tuple(out)
    if isinstance(x, (TensorDictBase, torch.Tensor)):
        return x[torch.as_tensor(list(rows), dtype=torch.long)]
    return x[list(rows)]


def concat(parts: Sequence[Any]) -> Any:
    """Concatenate batches of one kind along the batch dimension.

    Tuples and dicts of batches are concatenated field by field (a method may return
    ``(batch, extras)``); ``None`` parts merge to ``None``.
    """
    if not parts:
        raise DispatchError("nothing to concatenate: no rank returned a result")
    first = parts[0]
    if first is None:
        if any(p is not None for p in parts):
            raise DispatchError("some ranks returned None and others a value; a DP method must be consistent")
        return None
    if isinstance(first, TensorDictBase):
        return torch.cat(list(parts), dim=0)
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts), dim=0)
    if np is not None and isinstance(first, np.ndarray):
        return np.concatenate(list(parts), axis=0)
    if isinstance(first, list):
        return [row for p in parts for row in p]
    if isinstance(first, tuple):
        return tuple(concat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: concat([p[k] for p in parts]) for k in first}
    raise DispatchError(
        f"cannot concatenate results of type {type(first).__name__} across ranks; return a "
        "TensorDict, tensor or list from DP methods, or use Dispatch.DP_COMPUTE_METRIC to get the per-rank list"
    )


def result_len(x: Any) -> int | None:
    """Rows of a method's result (None when it has no batch dimension)."""
    if x is None:
        return None
    if is_batch(x) and not isinstance(x, tuple):
        return batch_len(x)
    if isinstance(x, tuple):
        for item in x:
            n = result_len(item)
            if n is not None:
                return n
        return None
    if isinstance(x, dict):
        for item in x.values():
            n = result_len(item)
            if n is not None:
                return n
    return None


def strip_tail(x: Any, n: int) -> Any:
    """`x` without its last `n` rows (recursing into tuples and dicts)."""
    if n == 0 or x is None:
        return x
    if isinstance(x, tuple):
        return tuple(strip_tail(i, n) for i in x)
    if isinstance(x, dict):
        return {k: strip_tail(v, n) for k, v in x.items()}
    return x[: batch_len(x) - n]


def shard_plan(n_rows: int, world: int) -> tuple[int, list[list[int]], list[int]]:
    """Rows of each of `world` equal shards of a batch of `n_rows`, padded to a divisor.

    Returns ``(shard_size, rows_per_shard, pad_per_shard)``. Padding rows repeat the
    batch from its start, so they are valid inputs; they sit at the end of the padded
    batch and each shard reports how many trailing rows of it are padding.
    """
    if n_rows <= 0:
        raise DispatchError(
            "empty batch: a data-parallel call needs at least one row; skip the call for an empty batch"
        )
    size = math.ceil(n_rows / world)
    rows, pads = [], []
    for r in range(world):
        idx = list(range(r * size, (r + 1) * size))
        rows.append([g if g < n_rows else (g - n_rows) % n_rows for g in idx])
        pads.append(sum(1 for g in idx if g >= n_rows))
    return size, rows, pads


_SCALARS = frozenset({int, float, bool, str, type(None)})


def payload_nbytes(x: Any) -> int:
    """Bytes of tensor payload in `x` (TensorDicts, tensors, arrays, nested containers)."""
    if type(x) in _SCALARS:  # the common small result: no isinstance checks against ABCs
        return 0
    if isinstance(x, TensorDictBase):
        return int(sum(t.numel() * t.element_size() for t in x.values(True, True) if isinstance(t, torch.Tensor)))
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if np is not None and isinstance(x, np.ndarray):
        return int(x.nbytes)
    if isinstance(x, (bytes, bytearray, memoryview)):
        return len(x)
    if isinstance(x, (list, tuple)):
        return sum(payload_nbytes(i) for i in x)
    if isinstance(x, dict):
        return sum(payload_nbytes(v) for v in x.values())
    return 0
