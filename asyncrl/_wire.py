"""What crosses between the controller and a worker host: the message types both sides share.

:class:`CallMsg` is one rank's call (the worker objects themselves are built from
:class:`asyncrl.worker.RoleSpec`); its arguments travel as a :class:`Payload` (for Ray,
:meth:`Payload.wire`: plain values as msgpack lists in :attr:`Payload.sent`, anything else
as the Payload, one nested pickle stream whose unpickling on the worker never raises:
unpickling-never-raises of ``docs/protocol.md``); the host rebuilds it with :func:`arrived`.
A pipelined input travels as one of the markers below (:class:`DeferredShard`,
:class:`DeferredValue`, :class:`TopShard`, :class:`TopValue`, :class:`LocalShard`: ``asyncrl._deferred`` says
how the worker takes each). :class:`CallCancelled` is how a threaded host reports a
cancelled call. The controller builds these (``asyncrl._call``), the worker reads them
(``asyncrl._host``); nothing here runs on one side only.
"""

from __future__ import annotations

import functools
import io
import pickle
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from asyncrl.errors import DispatchError

__all__ = ["CallMsg", "Payload", "arrived", "as_columns", "CallCancelled", "Source", "DeferredShard", "DeferredValue", "TopShard",
           "TopValue", "LocalShard", "has_deferred", "has_local", "select_fields"]


@dataclass(slots=True, eq=False)
class CallMsg:
    """One rank's call as it crosses to its worker host: everything the host needs to run it.

    The controller's :class:`~asyncrl._call.Sequencer` makes one per executing rank; the
    backend stamps `after` and sends it (Ray: as the plain list :meth:`wire`, which Ray
    encodes with msgpack, so a call with plain arguments crosses without pickling; the
    local backend: as it is); the host rebuilds it with :meth:`from_wire` and runs it.
    """

    role: str
    """The worker object (one per role in a process: colocated groups share the process)."""
    method: str
    """The registered method to run."""
    seq: int | None
    """Its number on the process's ordered lane; None for a concurrent call."""
    call_id: int
    """Unique per controller: what the one cancel message names."""
    payload: "Payload | list[Any]"
    """The arguments: a :class:`Payload`, or its plain lists (:meth:`Payload.wire`)."""
    in_pad: int | None
    """Padding rows of a data-parallel input the controller split (None: the host works it
    out from the pipelined inputs' producers, or the call is not data-parallel)."""
    want_meta: bool
    """Return ``(result, metadata)``: the rows and padding of a data-parallel result, and the times."""
    keep: bool
    """Return the result (False: a mesh rank whose result is not collected returns None)."""
    after: int = 0
    """How many control messages the controller had sent (or reserved) to this process
    before this call: the host runs it only after handling them (control-before-call)."""

    def wire(self) -> list[Any]:
        """The message as one plain list, in field order (one Ray argument, not nine); its
        payload as the plain lists the builder packed (:attr:`Payload.sent`), if it did."""
        payload = self.payload
        if type(payload) is Payload and payload.sent is not None:
            payload = payload.sent
        return [self.role, self.method, self.seq, self.call_id, payload, self.in_pad, self.want_meta, self.keep,
                self.after]

    @classmethod
    def from_wire(cls, packed: list[Any]) -> "CallMsg":
        """The message :meth:`wire` packed."""
        return cls(*packed)


class CallCancelled(Exception):
    """A threaded host's call was cancelled (an ``Exception``, not asyncio's
    ``CancelledError``, so that Ray reports it as the call's error; the controller reads it
    as a cancellation)."""


# ---- pipelined inputs: how each travels (asyncrl._deferred: how the worker takes it) ------------


@dataclass(frozen=True)
class Source:
    """What a worker needs to rebuild a producer future's value."""

    group: str
    method: str
    refs: tuple[Any, ...]
    """Payload refs of the collecting ranks, in DP (or rank) order."""
    metas: tuple[Any, ...] | None
    """Refs of ``(rows, pad)`` per payload, for data-parallel producers."""
    collect: Callable[..., Any] | None
    """The producer's collect function; None in a matched-layout shard (rank r reads rank r)."""
    world: Any
    data_parallel: bool
    select: tuple[str, ...] | None = None
    ranks: tuple[int, ...] | None = None
    """The producer rank of each of `refs` (and `metas`), for errors that name it."""


@dataclass(frozen=True)
class DeferredValue:
    """Resolves to the producer's whole collected value (every rank fetches all shards)."""

    source: Source


@dataclass(frozen=True)
class TopShard:
    """A matched-layout shard passed as top-level Ray arguments (see ``asyncrl._deferred``).

    `value` and `meta` are indices into the call's top-level arguments: the producer
    rank's output and its ``(rows, pad)``; the host takes them without awaiting.
    """

    group: str
    method: str
    select: tuple[str, ...] | None
    value: int
    meta: int


@dataclass(frozen=True)
class TopValue:
    """The whole value of a one-rank data-parallel producer (a call to one rank: ``options(rank=r)``) passed as
    top-level Ray arguments (see ``asyncrl._deferred``): what a :class:`DeferredValue` of it resolves to (the
    output less its padding rows, through the producer's `collect`, the field selection), without a nested ref.

    `value` and `meta` are indices into the call's top-level arguments: the producer rank's output and its
    ``(rows, pad)``; the host takes them without awaiting. Reports no input padding (a whole value)."""

    group: str
    method: str
    select: tuple[str, ...] | None
    collect: Callable[..., Any]
    world: Any
    value: int
    meta: int


@dataclass(frozen=True)
class LocalShard:
    """A matched-layout shard handed over inside the worker process (see
    ``asyncrl._deferred``): the producer's name, the field selection, and the producer's call id and
    ordered number on this process's lane. Resolved by the host at the consumer's turn."""

    group: str
    method: str
    select: tuple[str, ...] | None
    call_id: int
    seq: int


@dataclass(frozen=True)
class DeferredShard:
    """Resolves to shard `index` of `count` of a data-parallel producer's batch.

    When the producer had `count` shards too, shard i is the producer's rank-i output
    as it is (padding included); otherwise the worker fetches the metadata of every
    producer shard (a few bytes each), then only the shards that overlap its rows.
    """

    source: Source
    index: int
    count: int


_DEFERRED = (DeferredShard, DeferredValue)


def _contains(args: Any, kwargs: dict[str, Any], kinds: type | tuple[type, ...]) -> bool:
    """Whether an argument, or an item of a list or dict argument (the levels where
    pipelined inputs are placed), is an instance of `kinds`."""
    for x in (*args, *kwargs.values()):
        if isinstance(x, kinds):
            return True
        if isinstance(x, list) and any(isinstance(i, kinds) for i in x):
            return True
        if isinstance(x, dict) and any(isinstance(i, kinds) for i in x.values()):
            return True
    return False


def has_deferred(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether an argument (or an item of a list or dict argument, the levels
    :func:`~asyncrl._deferred.resolve_args` looks at) is resolved on the worker."""
    return _contains(args, kwargs, _DEFERRED)


def has_local(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether an argument (or an item of a list or dict argument) is a :class:`LocalShard`."""
    return _contains(args, kwargs, LocalShard)


# ---- the arguments ---------------------------------------------------------------------------


class Payload:
    """A call's arguments on their way to a worker.

    Pickled as a nested pickle stream (with Ray's reducers and out-of-band buffers, so
    tensors still cross without copies) whose unpickling on the worker never raises: a
    failure (a class that is not importable there, a ``__setstate__`` that raises)
    arrives as `error` and the host reports it as the call's ``RemoteError``, releasing
    the call's number (unpickling-never-raises of docs/protocol.md).
    """

    __slots__ = ("args", "kwargs", "error", "top", "nested", "sent")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 error: tuple[str, str, str] | None = None, top: list[Any] | None = None,
                 nested: bool = False) -> None:
        self.sent: list[Any] | None = None
        """Its plain arguments packed as lists (:meth:`wire`), when every one is plain: set by
        :class:`Builder` for a backend that ``sends_plain_lists`` (Ray), which then sends
        this instead of the Payload. Not part of the pickled payload (and never the Payload
        itself: a reference cycle would keep its arguments alive until the collector runs)."""
        self.args = args
        self.kwargs = kwargs
        self.error = error
        self.top = top
        """Refs sent as top-level arguments of the host's call (the :class:`TopShard`
        placeholders in `args`/`kwargs` index them); not part of the pickled payload."""
        self.nested = nested
        """Set by the controller: some argument is resolved on the worker (:func:`has_deferred`);
        not part of the pickled payload."""

    def __reduce__(self) -> tuple[Any, ...]:
        data, buffers = _inner_pickler().dumps((self.args, self.kwargs))
        return (_UNPACK, (data, *buffers))

    def wire(self) -> "Payload | list[Any]":
        """What the Ray backend sends: when every argument is plain (a scalar — an int of
        64 bits, a float, a string, a bool, None — or a small list or string-keyed dict
        of plain values, such as a config dict: :func:`_plain`), a :class:`TopShard` (a
        pipelined input sent top-level) or a :class:`LocalShard` (one handed over in the
        worker's process): ints and strings, the list ``[args, kwargs]`` (plus, with
        TopShards, their places and fields), which Ray encodes with msgpack (no pickling on
        either side, and nothing that can fail to unpickle on the worker); otherwise the
        Payload itself. :func:`arrived` undoes it."""
        tops: list[Any] | None = None
        for i, x in enumerate(self.args):
            if not _plain(x):
                if type(x) not in _MARKERS:
                    return self
                tops = tops or []
                tops.append(_top_wire(i, x))
        for k, x in self.kwargs.items():
            if not _plain(x):
                if type(x) not in _MARKERS:
                    return self
                tops = tops or []
                tops.append(_top_wire(k, x))
        if tops is None:
            return [list(self.args), self.kwargs]
        return [[None if type(x) in _MARKERS else x for x in self.args],
                {k: (None if type(x) in _MARKERS else x) for k, x in self.kwargs.items()}, tops]

    def local_copy(self) -> "Payload":
        """What a worker process would receive, made in this process (the local backend):
        pickled and unpickled, deferred values passed through as they are."""
        from ray import cloudpickle

        kept: list[Any] = []

        class _Pickler(cloudpickle.CloudPickler):
            def persistent_id(self, obj: Any) -> Any:
                if isinstance(obj, (DeferredShard, DeferredValue)):
                    kept.append(obj)
                    return len(kept) - 1
                return None

        class _Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                return kept[pid]

        buf = io.BytesIO()
        _Pickler(buf, protocol=5).dump((self.args, self.kwargs))  # raises at submission, as Ray's would
        try:
            args, kwargs = _Unpickler(io.BytesIO(buf.getvalue())).load()
        except Exception as e:
            return Payload((), {}, _unpickling_error(e))
        return Payload(args, kwargs)


_PLAIN_ITEMS = 64  # list items and dict values, over all levels, that still count as plain
_PLAIN_DEPTH = 4  # levels of nested lists and dicts that still count as plain


def _scalar(x: Any) -> bool:
    t = type(x)
    return t is str or t is float or t is bool or x is None or (t is int and -(1 << 63) <= x < (1 << 63))


def _plain(x: Any) -> bool:
    """A value Ray encodes with msgpack and the worker decodes without unpickling anything
    (so it cannot fail there: unpickling-never-raises of docs/protocol.md): a scalar (an int of 64 bits,
    a float, a string, a bool, None), or lists and string-keyed dicts of such — a config
    dict — with at most ``_PLAIN_ITEMS`` items in all, nested at most ``_PLAIN_DEPTH``
    levels. Tuples, other key types, subclasses and anything larger take the pickled Payload."""
    if _scalar(x):
        return True
    t = type(x)
    if t is not dict and t is not list:
        return False
    budget = _PLAIN_ITEMS
    todo: list[tuple[Any, int]] = [(x, 1)]
    while todo:
        y, depth = todo.pop()
        if depth > _PLAIN_DEPTH:
            return False
        budget -= len(y)
        if budget < 0:
            return False
        if type(y) is dict:
            if any(type(k) is not str for k in y):
                return False
            items: Any = y.values()
        else:
            items = y
        for v in items:
            if not _scalar(v):
                if type(v) is not dict and type(v) is not list:
                    return False
                todo.append((v, depth + 1))
    return True


_MARKERS = (TopShard, LocalShard)


def _top_wire(place: int | str, x: "TopShard | LocalShard") -> list[Any]:
    select = list(x.select) if x.select is not None else None
    if type(x) is LocalShard:
        return [place, x.group, x.method, select, x.call_id, x.seq, True]
    return [place, x.group, x.method, select, x.value, x.meta]  # type: ignore[union-attr]


def arrived(payload: "Payload | list[Any]") -> Payload:
    """The Payload of a call as it arrived on the worker (see :meth:`Payload.wire`)."""
    if type(payload) is list:
        if len(payload) == 2:
            return Payload(tuple(payload[0]), payload[1])
        args, kwargs, tops = payload
        for place, group, method, select, a, b, *local in tops:
            sel = tuple(select) if select is not None else None
            shard = LocalShard(group, method, sel, a, b) if local else TopShard(group, method, sel, a, b)
            if type(place) is int:
                args[place] = shard
            else:
                kwargs[place] = shard
        return Payload(tuple(args), kwargs)
    return payload  # type: ignore[return-value]


TEXT_TENSORDICTS = True
"""Pickle a call argument that is a plain TensorDict of tensors and text columns (a prompt group's rows) as its
columns (:func:`_reduce_text_td`); False: tensordict's own reduction, every text cell a pickled ``NonTensorData``
(what the code did before; ``benchmarks/cluster_twin.py`` measures both)."""


SMALL_TENSOR_BYTES = 1 << 16
"""A tensor column of such a TensorDict (:data:`TEXT_TENSORDICTS`) of at most this many bytes crosses in-band, as its
bytes (:func:`_rebuild_text_td` makes a writable tensor of them): Ray's zero-copy reducer costs the controller more
than the copy for a prompt group's few kilobytes. 0: every tensor by that reducer (what the code did before;
``benchmarks/cluster_twin.py`` measures both)."""


def _reduce_text_td(td: Any) -> tuple[Any, ...] | None:
    """`td` as ``(_rebuild_text_td, (rows, keys, columns))`` when it is a plain ``TensorDict`` (one batch
    dimension, no device, names, lock or consolidated storage) whose every value is a tensor or a
    ``NonTensorStack`` of strings (one per row, stacked on dimension 0); else None (tensordict's reduction). The
    tensors are pickled as before (Ray's zero-copy reducer), or, up to :data:`SMALL_TENSOR_BYTES`, as a tuple of their
    bytes, dtype and shape; a text column crosses as one list of strings, not as a pickled ``NonTensorData`` per cell
    (about ten times the CPU, on the controller, per routed prompt group)."""
    if (td.batch_dims != 1 or td.device is not None or td.is_locked or td._has_names()
            or getattr(td, "_consolidated", None)):
        return None
    n = td.batch_size[0]
    if not n:
        return None  # (a text column of no rows has no cells to rebuild it from)
    keys: list[str] = []
    columns: list[Any] = []
    for k, v in td._tensordict.items():
        t = type(v)
        if t is torch.Tensor:
            small = (0 < SMALL_TENSOR_BYTES and v.nbytes <= SMALL_TENSOR_BYTES and not v.requires_grad
                     and v.device.type == "cpu")
            columns.append((v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), v.dtype, tuple(v.shape))
                           if small else v)
        elif t is NonTensorStack:
            cells: Any = v.tensordicts  # NonTensorData cells: their text is `_non_tensordict["data"]`
            if v.stack_dim != 0 or len(cells) != n or v.batch_dims != 1 or v.device is not None:
                return None  # (n cells stacked on dimension 0 into one batch dimension: each cell has none)
            if any(type(c) is not NonTensorData for c in cells):
                return None
            texts = [c._non_tensordict.get("data") for c in cells]
            if any(type(x) is not str for x in texts):
                return None
            columns.append(texts)
        else:
            return None
        keys.append(k)
    return _rebuild_text_td, (n, keys, columns)


class _Columns:
    """A call's result on its way to Ray's object store as its columns (:func:`_reduce_text_td`); it unpickles as
    the TensorDict itself, wherever it is read (the controller, another worker)."""

    __slots__ = ("reduced",)

    def __init__(self, reduced: tuple[Any, ...]) -> None:
        self.reduced = reduced

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduced


def _text_reduction(obj: Any) -> tuple[Any, ...] | None:
    """How a call argument or a result crosses when it is a plain TensorDict that :func:`_reduce_text_td` can take
    apart (and :data:`TEXT_TENSORDICTS` is on); None: as pickle would send it."""
    return _reduce_text_td(obj) if TEXT_TENSORDICTS and type(obj) is TensorDict else None


def as_columns(value: Any) -> Any:
    """`value` as a Ray host returns it: a plain TensorDict of tensors and text columns (a generated group's rows,
    with their text) as its columns, as such an argument crosses (:func:`_text_reduction`); anything else as it is.
    Pickled by tensordict, every text cell is a ``NonTensorData`` of its own: a simulated rollout of 32 replicas per
    process spent a fifth of its CPU pickling its results so."""
    reduced = _text_reduction(value)
    return value if reduced is None else _Columns(reduced)


def _rebuild_text_td(n: int, keys: list[str], columns: list[Any]) -> Any:
    """The TensorDict :func:`_reduce_text_td` took apart: its tensors (a small one from its bytes), and its text
    columns as ``NonTensorStack`` s of strings, in its key order."""
    return TensorDict({k: NonTensorStack(*c) if type(c) is list else _from_bytes(*c) if type(c) is tuple else c
                       for k, c in zip(keys, columns)}, batch_size=[n])


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A writable tensor of `shape` and `dtype` holding a copy of `data` (its bytes, :func:`_reduce_text_td`)."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


@functools.cache
def _pickler_class() -> type:
    from ray import cloudpickle

    class _Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj: Any) -> Any:
            reduced = _text_reduction(obj)
            return super().reducer_override(obj) if reduced is None else reduced

    return _Pickler


class _InnerPickler:
    """One cloudpickle pickler per thread, reused for every Payload (building a pickler
    costs several times more than pickling a few small arguments). It is Ray's
    cloudpickle, so Ray's reducers apply (zero-copy tensors, ObjectRef accounting); a plain
    TensorDict of tensors and text crosses as its columns (:data:`TEXT_TENSORDICTS`)."""

    def __init__(self) -> None:
        self._file = io.BytesIO()
        self._buffers: list[pickle.PickleBuffer] = []
        self._pickler = _pickler_class()(self._file, protocol=5, buffer_callback=self._buffer)
        self._busy = False

    def _buffer(self, b: pickle.PickleBuffer) -> None:
        self._buffers.append(b)

    def dumps(self, obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
        if self._busy:  # a Payload inside a Payload's arguments: a one-off pickler
            buffers: list[pickle.PickleBuffer] = []
            f = io.BytesIO()
            _pickler_class()(f, protocol=5, buffer_callback=buffers.append).dump(obj)
            return f.getvalue(), buffers
        self._busy = True
        f, self._buffers = self._file, []
        try:
            f.seek(0)
            f.truncate()
            self._pickler.clear_memo()
            self._pickler.globals_ref = {}  # cloudpickle's per-dump state: never shared between calls
            self._pickler.dump(obj)
            return f.getvalue(), self._buffers
        finally:
            self._busy = False


_INNER = threading.local()


def _inner_pickler() -> _InnerPickler:
    p = getattr(_INNER, "pickler", None)
    if p is None:
        p = _INNER.pickler = _InnerPickler()
    return p


class _Unpacker:
    """Rebuilds a Payload on the worker; unpickling failures become its `error`.

    An object, not a function: pickled as a plain global name (``__reduce__`` returns
    one), so Ray's cloudpickle does not inspect it on every call as it does functions.
    """

    def __call__(self, data: bytes, *buffers: Any) -> Payload:
        try:
            args, kwargs = pickle.loads(data, buffers=buffers)
        except Exception as e:
            return Payload((), {}, _unpickling_error(e))
        return Payload(args, kwargs)

    def __reduce__(self) -> str:
        return "_UNPACK"


_UNPACK = _Unpacker()


def _unpickling_error(e: BaseException) -> tuple[str, str, str]:
    return (f"{type(e).__module__}.{type(e).__qualname__}",
            f"the worker could not unpickle the call's arguments ({e}); an argument's class must be importable "
            "on the workers (put its module on their PYTHONPATH, or in runtime_env py_modules/working_dir)",
            traceback.format_exc())


def select_fields(value: Any, fields: tuple[str, ...] | None,
                  source: "Source | TopShard | TopValue | LocalShard") -> Any:
    """`value`'s field selection `fields` (None: all of it), as a consumer and an awaiter
    see it; an error names `source`'s producer."""
    if fields is None:
        return value
    if not isinstance(value, TensorDictBase):
        raise DispatchError(
            f"a field selection of {source.group}.{source.method} needs it to return a TensorDict, "
            f"it returned {type(value).__name__}"
        )
    missing = [f for f in fields if f not in value.keys(include_nested=True)]
    if missing:
        raise DispatchError(
            f"{source.group}.{source.method} has no field(s) {missing}; "
            f"it returned fields {sorted(map(str, value.keys()))}"
        )
    return value.select(*fields)
