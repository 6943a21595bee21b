"""`@register`: the contract of a worker method.

A registered method declares how a group call's arguments are split across ranks
(*dispatch*), how per-rank results are merged (*collect*), which ranks run
(*execute*), and how the worker runs it (*mode*: ordered or concurrent).

The decorator returns a :class:`RegisteredMethod` descriptor. On a worker instance it
behaves like the plain method (call it locally, step through it in a debugger); on a
:class:`~asyncrl.WorkerGroup` it becomes a group call that returns a
:class:`~asyncrl.GroupFuture`.
"""

from __future__ import annotations

import enum
import functools
import inspect
import threading
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Concatenate, Generic, Literal, Mapping, ParamSpec, TypeAlias,
                    TypeVar, overload)

from asyncrl import dispatch as _d
from asyncrl.errors import RegistrationError

if TYPE_CHECKING:
    from asyncrl.dispatch import CollectFn, DispatchFn

__all__ = [
    "Dispatch",
    "Execute",
    "Mode",
    "DispatchMode",
    "ConcatMode",
    "ListMode",
    "MethodSpec",
    "RegisteredMethod",
    "register",
    "register_dispatch_mode",
    "get_dispatch_mode",
]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
C_co = TypeVar("C_co", covariant=True)


@dataclass(frozen=True)
class DispatchMode:
    """A named (dispatch, collect) pair.

    `dispatch(world, args, kwargs)` returns one `(args, kwargs)` per rank (see
    :mod:`asyncrl.dispatch` for the `world` it receives) and `collect(world, results)`
    merges the results of the collecting ranks, in rank order.
    """

    name: str
    dispatch: "DispatchFn" = field(repr=False)
    collect: "CollectFn" = field(repr=False)
    mesh: str | None = None
    """The named mesh this mode splits along, if any."""
    data_parallel: bool = False
    """True when results are shards of one batch (padding is stripped on collect and
    a future can feed another data-parallel call shard by shard)."""

    def __post_init__(self) -> None:
        if not callable(self.dispatch) or not callable(self.collect):
            raise RegistrationError(
                f"dispatch mode {self.name!r}: dispatch and collect must both be callables"
            )


class ConcatMode(DispatchMode):
    """A mode whose collected result is the merged batch (static typing: the method's own return type)."""


class ListMode(DispatchMode):
    """A mode whose collected result is the list of per-rank results (static typing: ``list[R]``)."""


class Dispatch:
    """The built-in dispatch modes (attributes are :class:`DispatchMode` values).

    ============================  ==================================================
    ``ONE_TO_ALL``                same arguments to every rank; list of results
    ``ALL_TO_ALL``                each argument is a per-rank list; list of results
    ``DP_COMPUTE``                split batches across ranks (auto-padded); results
                                  concatenated, unpadded, in input order
    ``DP_COMPUTE_METRIC``         split like ``DP_COMPUTE``; list of per-rank results
    ``mesh(name)``                split along a named mesh's data-parallel ranks
    ``custom(name, d, c)``        any (dispatch, collect) pair of functions
    ============================  ==================================================
    """

    ONE_TO_ALL: ListMode
    ALL_TO_ALL: ListMode
    DP_COMPUTE: ConcatMode
    DP_COMPUTE_METRIC: ListMode

    @staticmethod
    def mesh(name: str, *, collect: str = "concat") -> DispatchMode:
        """Split along the data-parallel dimension of the mesh `name`.

        Each DP rank's shard is replicated to its TP/PP peers; results are taken only
        from ranks that registered the mesh with ``collect=True``, in DP order, and
        concatenated (``collect="concat"``) or returned as a list (``collect="list"``).
        """
        if collect not in ("concat", "list"):
            raise ValueError(f"Dispatch.mesh(collect=...) must be 'concat' or 'list', got {collect!r}")
        return DispatchMode(
            name=f"mesh:{name}:{collect}",
            dispatch=functools.partial(_d.dispatch_mesh, mesh=name),
            collect=_d.collect_dp if collect == "concat" else _d.collect_list,
            mesh=name,
            data_parallel=collect == "concat",
        )

    @staticmethod
    def custom(name: str, dispatch: "DispatchFn", collect: "CollectFn") -> DispatchMode:
        """A mode from any pair of functions; see :class:`DispatchMode` for their signatures."""
        return DispatchMode(name=name, dispatch=dispatch, collect=collect)


Dispatch.ONE_TO_ALL = ListMode("ONE_TO_ALL", _d.dispatch_one_to_all, _d.collect_list)
Dispatch.ALL_TO_ALL = ListMode("ALL_TO_ALL", _d.dispatch_all_to_all, _d.collect_list)
Dispatch.DP_COMPUTE = ConcatMode("DP_COMPUTE", _d.dispatch_dp, _d.collect_dp, data_parallel=True)
Dispatch.DP_COMPUTE_METRIC = ListMode("DP_COMPUTE_METRIC", _d.dispatch_dp, _d.collect_list)


class Execute(enum.Enum):
    """Which ranks run a call."""

    ALL = "all"
    """Every rank runs; results are collected by the dispatch mode."""
    RANK_ZERO = "rank_zero"
    """Only rank 0 runs; the call resolves to its single result (not a list)."""


class Mode(enum.Enum):
    """How the worker runs the method."""

    ORDERED = "ordered"
    """One at a time, in the order the controller issued the calls (the default)."""
    CONCURRENT = "concurrent"
    """`async def` methods that may interleave with each other and with ordered calls."""


_MODES: dict[str, DispatchMode] = {}
_MODES_LOCK = threading.Lock()


def register_dispatch_mode(mode: DispatchMode, *, replace: bool = False) -> DispatchMode:
    """Make `mode` usable by name: ``@register(dispatch_mode="my_mode")``.

    Registering a second mode under a taken name raises :class:`RegistrationError`
    unless ``replace=True``.
    """
    if not isinstance(mode, DispatchMode):
        raise RegistrationError(f"register_dispatch_mode expects a DispatchMode, got {type(mode).__name__}")
    with _MODES_LOCK:
        if mode.name in _MODES and not replace and _MODES[mode.name] is not mode:
            raise RegistrationError(
                f"a dispatch mode named {mode.name!r} is already registered; "
                "pick another name or pass replace=True"
            )
        _MODES[mode.name] = mode
    return mode


for _m in (Dispatch.ONE_TO_ALL, Dispatch.ALL_TO_ALL, Dispatch.DP_COMPUTE, Dispatch.DP_COMPUTE_METRIC):
    _MODES[_m.name] = _m


def get_dispatch_mode(mode: DispatchMode | str) -> DispatchMode:
    """Resolve a mode object or a registered mode name."""
    if isinstance(mode, DispatchMode):
        return mode
    if isinstance(mode, str):
        try:
            return _MODES[mode]
        except KeyError:
            known = ", ".join(sorted(_MODES))
            raise RegistrationError(
                f"unknown dispatch mode {mode!r}; known modes: {known}. "
                "Register your own with asyncrl.register_dispatch_mode(Dispatch.custom(...))"
            ) from None
    raise RegistrationError(
        f"dispatch_mode must be a DispatchMode or a registered name, got {type(mode).__name__}"
    )


Summary: TypeAlias = "tuple[str, ...] | Callable[[Any], Mapping[str, Any]]"
"""What ``register(summary=...)`` takes: field names of the result, or a function of the result giving per-row
fields."""


@dataclass(frozen=True)
class MethodSpec:
    """The frozen contract of one registered method."""

    name: str
    dispatch_mode: DispatchMode
    execute_mode: Execute
    mode: Mode
    is_async: bool
    signature: inspect.Signature
    summary: "Summary" = ()
    """Fields of the method's TensorDict result that also ride in the call's reply (its metadata), read by
    :meth:`~asyncrl.GroupFuture.summary` without fetching the result; or a function of the result giving such
    per-row fields (computed in the worker)."""


class RegisteredMethod(Generic[P, R_co, C_co]):
    """Descriptor made by :func:`register`.

    On a worker instance it returns the bound method, so local calls run the
    function directly. The group side reads :attr:`spec`. Type parameters: the
    method's parameters `P`, its return type `R` and the collected type `C` of a
    group call (``list[R]`` for list modes, ``R`` for DP_COMPUTE and RANK_ZERO).
    """

    def __init__(self, fn: Callable[..., Any], spec: MethodSpec) -> None:
        self.fn = fn
        self.spec = spec
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        if name != self.spec.name:
            object.__setattr__(self.spec, "name", name)

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> "RegisteredMethod[P, R_co, C_co]": ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> Callable[P, R_co]: ...
    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return self.fn.__get__(obj, objtype)

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"<registered {s.name} dispatch={s.dispatch_mode.name} "
            f"execute={s.execute_mode.value} mode={s.mode.value}>"
        )


_Method = Callable[Concatenate[Any, P], R]


@overload
def register(
    dispatch_mode: ConcatMode, execute_mode: Literal[Execute.ALL] = ..., *,
    mode: Mode | None = ..., concurrent: bool | None = ..., summary: "Summary" = ...,
) -> Callable[[_Method[P, R]], RegisteredMethod[P, R, R]]: ...
@overload
def register(
    dispatch_mode: ListMode | None = ..., execute_mode: Literal[Execute.ALL] = ..., *,
    mode: Mode | None = ..., concurrent: bool | None = ..., summary: "Summary" = ...,
) -> Callable[[_Method[P, R]], RegisteredMethod[P, R, list[R]]]: ...
@overload
def register(
    dispatch_mode: DispatchMode | str | None = ..., execute_mode: Literal[Execute.RANK_ZERO] = ..., *,
    mode: Mode | None = ..., concurrent: bool | None = ..., summary: "Summary" = ...,
) -> Callable[[_Method[P, R]], RegisteredMethod[P, R, R]]: ...
@overload
def register(
    dispatch_mode: DispatchMode | str | None = ..., execute_mode: Execute = ..., *,
    mode: Mode | None = ..., concurrent: bool | None = ..., summary: "Summary" = ...,
) -> Callable[[_Method[P, R]], RegisteredMethod[P, R, Any]]: ...
def register(
    dispatch_mode: DispatchMode | str | None = None,
    execute_mode: Execute = Execute.ALL,
    *,
    mode: Mode | None = None,
    concurrent: bool | None = None,
    summary: "Summary" = (),
) -> Callable[[Callable[..., Any]], RegisteredMethod[..., Any, Any]]:
    """Declare a worker method's group contract.

    Args:
        dispatch_mode: how arguments are split and results merged
            (default :attr:`Dispatch.ONE_TO_ALL`); a :class:`DispatchMode` or the name
            of one registered with :func:`register_dispatch_mode`.
        execute_mode: which ranks run (:attr:`Execute.ALL` or :attr:`Execute.RANK_ZERO`).
        mode: :attr:`Mode.ORDERED` (default) or :attr:`Mode.CONCURRENT`.
        concurrent: shorthand for ``mode=Mode.CONCURRENT``.
        summary: fields of a data-parallel method's TensorDict result (a few values per row) that also travel
            in the call's reply, so the controller reads them with :meth:`~asyncrl.GroupFuture.summary`
            without fetching the result (which stays in the object store for the calls it feeds). A field the
            result lacks is left out. Or a function of the result (a module-level function, run in the worker
            after the method) that gives such fields, a mapping of name to per-row values (tensors of the
            result's rows): small facts the controller needs of a result that is not among its fields.

    Keyword names follow verl's ``@register(dispatch_mode=..., execute_mode=...)``.
    """
    if isinstance(dispatch_mode, Callable) and not isinstance(dispatch_mode, DispatchMode):  # type: ignore[arg-type]
        raise RegistrationError(
            "@register needs parentheses: write @register() or @register(dispatch_mode=...)"
        )
    dm = get_dispatch_mode(dispatch_mode if dispatch_mode is not None else Dispatch.ONE_TO_ALL)
    if not isinstance(execute_mode, Execute):
        raise RegistrationError(f"execute_mode must be an asyncrl.Execute, got {execute_mode!r}")
    if mode is not None and concurrent is not None:
        raise RegistrationError("pass either mode= or concurrent=, not both")
    resolved_mode = mode if mode is not None else (Mode.CONCURRENT if concurrent else Mode.ORDERED)
    if not isinstance(resolved_mode, Mode):
        raise RegistrationError(f"mode must be an asyncrl.Mode, got {resolved_mode!r}")
    if callable(summary):
        pass
    elif isinstance(summary, str) or not all(isinstance(f, str) and f for f in summary):
        raise RegistrationError(f"summary must be a tuple of field names or a function, got {summary!r}")
    if summary and not dm.data_parallel:
        raise RegistrationError(
            f"summary needs a data-parallel dispatch mode (its rows are the result's), got {dm.name}")

    def decorate(fn: Callable[..., Any]) -> RegisteredMethod[..., Any, Any]:
        if isinstance(fn, RegisteredMethod):
            raise RegistrationError(f"{fn.spec.name} is registered twice")
        if not callable(fn):
            raise RegistrationError(f"@register decorates methods, got {type(fn).__name__}")
        is_async = inspect.iscoroutinefunction(fn)
        if resolved_mode is Mode.CONCURRENT and not is_async:
            raise RegistrationError(
                f"{fn.__qualname__}: concurrent mode needs an `async def` method "
                "(a plain def would block the worker's event loop); make it async or drop concurrent"
            )
        spec = MethodSpec(
            name=fn.__name__,
            dispatch_mode=dm,
            execute_mode=execute_mode,
            mode=resolved_mode,
            is_async=is_async,
            signature=inspect.signature(fn),
            summary=summary if callable(summary) else tuple(summary),
        )
        return RegisteredMethod(fn, spec)

    return decorate


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every registered method of `cls` (including inherited ones), by name."""
    out: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, RegisteredMethod):
                out[name] = value.spec
            elif name in out:
                del out[name]  # overridden without @register
    return out
