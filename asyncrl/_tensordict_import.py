"""Import tensordict without importing ``torch._dynamo`` (unless something else needs it).

tensordict 0.15 marks seven functions for ``torch.compile`` while it is imported
(``torch.compiler.allow_in_graph`` on six functorch builtins, ``assume_constant_result`` on
one helper), and each of those calls imports ``torch._dynamo`` first: 2.5 s of CPU on the
2-core development machine, 40 % of the start of a worker process that never compiles
anything (every process of every group pays it, and the controller).

`import_tensordict` imports tensordict with both functions standing in for themselves:
``assume_constant_result`` does at once what dynamo's does (it sets one attribute);
``allow_in_graph`` records its function, and the records are handed to dynamo's own
``allow_in_graph`` as soon as ``torch._dynamo`` has been imported, by whoever imports it (a
``torch.compile``, an optimizer step), inside that import, so no code can see dynamo without
the marks. A process that has imported dynamo already defers nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any, Sequence

DYNAMO = "torch._dynamo"
_pending: list[Any] = []  # functions tensordict asked dynamo to allow in graphs, until dynamo is imported


def _mark_constant(fn: Any) -> Any:
    """What ``torch._dynamo.assume_constant_result`` does (torch 2.11-2.14): set one attribute."""
    fn._dynamo_marked_constant = True
    return fn


def _defer_allow(fn: Any) -> Any:
    _pending.append(fn)
    return fn


def _apply_pending(dynamo: ModuleType) -> None:
    fns, _pending[:] = list(_pending), []
    for fn in fns:
        dynamo.allow_in_graph(fn)


class _Loader(importlib.abc.Loader):
    """torch._dynamo's own loader, then the deferred marks, before the import returns."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _apply_pending(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the spec the other finders give torch._dynamo."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != DYNAMO:
            return None
        sys.meta_path.remove(self)  # once; the other finders answer
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def import_tensordict() -> ModuleType:
    """Import tensordict (once) with its compile marks deferred as the module docstring says."""
    if "tensordict" in sys.modules:
        return sys.modules["tensordict"]
    import torch.compiler

    if DYNAMO in sys.modules:  # nothing to save
        import tensordict

        return tensordict
    allow, constant = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
    torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = _defer_allow, _mark_constant
    try:
        import tensordict
    finally:
        torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = allow, constant
    if DYNAMO in sys.modules:  # imported meanwhile (not by tensordict 0.15): mark now
        _apply_pending(sys.modules[DYNAMO])
    elif _pending:
        sys.meta_path.insert(0, _Finder())
    return tensordict
