"""`Registry`: the one name -> entry table behind every ``register_*`` of the roles and the pipelines.

Generation engines, episodes, environments, tools, reward functions and tasks are each one
``Registry``: the same duplicate rule (a second, different entry under a taken name is an error
unless ``replace=True``; registering the same object again is a no-op, so re-importing a module is
harmless), the same unknown-name error (it lists what is registered and says how to register), and
optional lazy entries (a module imported on first use, which registers itself).
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterator, Mapping, TypeVar

from asyncrl.roles.errors import UnknownNameError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> entry table.

    Args:
        kind: what an entry is, in messages (``"reward function"``).
        how_to_register: the sentence an unknown-name error ends with (``"Register one with ..."``).
        error: the exception type of an unknown name (a :class:`KeyError` subclass reads badly; the
            default :class:`UnknownNameError` prints its message as is).
        lazy: ``{name: module}`` imported on first lookup of `name`; the module registers the entry.
    """

    def __init__(self, kind: str, *, how_to_register: str, error: type[Exception] = UnknownNameError,
                 lazy: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self._how = how_to_register
        self._error = error
        self._lazy = dict(lazy or {})
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T, *, replace: bool = False) -> T:
        """Register `entry` as `name`; returns `entry` (so a decorator can return it)."""
        old = self._entries.get(name)
        if old is not None and old is not entry and not replace:
            article = "an" if self.kind[0] in "aeiou" else "a"
            raise ValueError(f"{article} {self.kind} named {name!r} is already registered; pick another name or "
                             "pass replace=True")
        self._entries[name] = entry
        return entry

    def decorator(self, name: str, *, replace: bool = False,
                  check: Callable[[T], None] | None = None) -> Callable[[T], T]:
        """``@registry.decorator(name)``: `check(entry)` (raise to refuse it) then :meth:`add`."""

        def deco(entry: T) -> T:
            if check is not None:
                check(entry)
            return self.add(name, entry, replace=replace)

        return deco

    def add_lazy(self, name: str, module: str) -> None:
        """Name `module` as the one that registers `name` when it is imported (on first lookup)."""
        self._lazy[name] = module

    def find(self, name: str) -> T | None:
        """The entry registered as `name` (importing its lazy module first), or None."""
        if name not in self._entries and name in self._lazy:
            importlib.import_module(self._lazy[name])
        return self._entries.get(name)

    def get(self, name: str) -> T:
        """The entry registered as `name`; the registry's error, listing the names, when there is none."""
        entry = self.find(name)
        if entry is None:
            raise self._error(f"no {self.kind} named {name!r}; known: {self.names()}. {self._how}")
        return entry

    def names(self) -> list[str]:
        """Every registered name (lazy ones included), sorted."""
        return sorted(set(self._entries) | set(self._lazy))

    def entries(self) -> dict[str, T]:
        """A copy of the registered (already imported) entries."""
        return dict(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
