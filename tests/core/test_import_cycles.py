"""No import cycle anywhere in the project: ``asyncrl/``, ``roles/`` (``asyncrl.roles``) and ``pipelines/``
(``asyncrl.pipelines``) together form a one-way graph of modules.

Every import counts: module level, inside functions (lazy), under ``if TYPE_CHECKING:``, and a string
constant naming a module of the project (what ``importlib.import_module`` loads). A module importing its
own package (``from asyncrl import GroupFuture`` inside ``asyncrl.pipelines.x``) is not an edge: the
package's ``__init__`` is what the import system runs first anyway.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = {"asyncrl": ROOT / "asyncrl", "asyncrl.roles": ROOT / "roles", "asyncrl.pipelines": ROOT / "pipelines"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg, where in PACKAGES.items():
        for path in where.rglob("*.py"):
            parts = list(path.relative_to(where).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: the project modules it imports}``."""
    modules = _modules()

    def project_module(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join([*(here[: len(here) - node.level + 1] if node.level else []),
                                 *([node.module] if node.module else [])])
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("asyncrl."):
                targets = [node.value]
            for t in targets:
                mod = project_module(t)
                if mod is not None and mod != name and not name.startswith(mod + "."):
                    graph[name].add(mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_scan_reads_every_kind_of_import():
    graph = import_graph()
    assert "asyncrl.future" in graph["asyncrl.worker_group"]  # a module-level import
    assert "asyncrl.roles.modeling.device" in graph["asyncrl.roles._util"]  # a relative import, resolved
    assert "asyncrl.roles.engines.hf" in graph["asyncrl.roles.engines"]  # a lazy entry named by a string
    assert "asyncrl.pipelines.observe.trace" in graph["asyncrl.pipelines.rollout.rollout_loop"]  # under TYPE_CHECKING


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_three_packages_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []
