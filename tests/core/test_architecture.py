"""The framework's modules form a one-way dependency graph (no module imports one that imports it back).

Every import counts: top level, ``if TYPE_CHECKING:`` blocks and imports inside
functions alike, since each is a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "asyncrl"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules and t != name and t != "asyncrl":
                    graph[name].add(t)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_of_the_framework_imports_one_that_imports_it_back():
    graph = _imports()
    assert "asyncrl.future" in graph["asyncrl.worker_group"]  # the graph is really read
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_call_path_layers():
    graph = _imports()
    # the future owns the call's state; it knows nothing of groups or hosts
    assert not graph["asyncrl.future"] & {"asyncrl.worker_group", "asyncrl.host_set"}
    # the call (its issuing: the sequencer; its state) knows nothing of groups or hosts
    assert not graph["asyncrl._call"] & {"asyncrl.worker_group", "asyncrl.host_set"}
    # only the backends import ray's worker host wrapper; no backend-independent module imports a backend
    for m in ("asyncrl.future", "asyncrl.host_set", "asyncrl._call", "asyncrl._host", "asyncrl.resources"):
        assert not {d for d in graph[m] if d.startswith("asyncrl.backends")}, m


ROOT = PKG.parent
LAYERS = {"asyncrl": PKG, "asyncrl.roles": ROOT / "roles", "asyncrl.pipelines": ROOT / "pipelines"}


def _imported(package: str) -> dict[str, set[str]]:
    """Every module name each file of ``package`` imports (absolute, relative and lazy imports
    alike, relative ones resolved against the installed name, e.g. ``roles/x.py`` is
    ``asyncrl.roles.x``), plus every string constant that names a module of the project (what
    ``importlib.import_module`` would load)."""
    where = LAYERS[package]
    out: dict[str, set[str]] = {}
    for path in where.rglob("*.py"):
        rel = path.relative_to(where).with_suffix("").parts
        is_pkg = rel[-1] == "__init__"
        name = ".".join([package, *(rel[:-1] if is_pkg else rel)])
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                mod = ".".join([*base, *([node.module] if node.module else [])])
                found |= {mod} | {f"{mod}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("asyncrl."):
                found.add(node.value)
        out[name] = found
    return out


def _reaching(imports: dict[str, set[str]], layers: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for module, targets in imports.items():
        hits = sorted(t for t in targets
                      if any(t == layer or t.startswith(layer + ".") for layer in layers)
                      or t.split(".")[0] in {layer.split(".")[-1] for layer in layers})
        if hits:
            bad[module] = hits
    return bad


def test_the_framework_imports_nothing_of_the_roles_or_the_pipelines():
    """``asyncrl/`` knows nothing of RL: no import of ``asyncrl.roles`` / ``asyncrl.pipelines``,
    at the top, under ``TYPE_CHECKING`` or inside a function."""
    imports = _imported("asyncrl")
    assert "asyncrl.future" in imports["asyncrl.worker_group"]  # the scan really reads the files
    assert _reaching(imports, ("asyncrl.roles", "asyncrl.pipelines")) == {}


def test_the_roles_import_nothing_of_the_pipelines():
    imports = _imported("asyncrl.roles")
    assert "asyncrl.roles.modeling.device" in imports["asyncrl.roles._util"]  # relative imports are resolved
    assert _reaching(imports, ("asyncrl.pipelines",)) == {}


def test_the_console_script_is_the_pipelines_cli():
    """``asyncrl`` (pyproject's ``[project.scripts]``) points at the pipelines' CLI directly,
    not at a shim in the framework that would import upwards."""
    import importlib
    import tomllib

    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["asyncrl"]
    assert target == "asyncrl.pipelines.commands.cli:main"
    module, attr = target.split(":")
    assert callable(getattr(importlib.import_module(module), attr))


SIDES = {
    "controller": {"asyncrl.worker_group", "asyncrl.host_set", "asyncrl._call", "asyncrl.future", "asyncrl.resources",
                   "asyncrl.backends", "asyncrl.backends.ray", "asyncrl.backends._ray_fetch", "asyncrl.backends.local"},
    "worker": {"asyncrl._host", "asyncrl._lanes", "asyncrl._deferred"},
    "shared": {"asyncrl._wire", "asyncrl.errors", "asyncrl.batch", "asyncrl.register", "asyncrl.worker",
               "asyncrl.dispatch", "asyncrl._backend", "asyncrl.backends._ray_errors", "asyncrl.runtime",
               "asyncrl._tensordict_import"},
}
"""Where each core module runs: on the controller, in a worker process, or on both (the
message types and the helpers both sides use)."""
STARTS_HOSTS = {"asyncrl.backends.ray", "asyncrl.backends.local"}
"""The controller's modules that name the hosts' classes, to start them (Ray actors, or in-process)."""


def test_each_core_module_is_controller_side_or_worker_side():
    """Every module of ``asyncrl/`` (not the roles or pipelines; the package itself is the
    public face, re-exporting both) is on one side, or shared; the worker side imports
    nothing of the controller's, the shared modules nothing of either side, and the
    controller imports the worker side only to start its hosts."""
    graph = _imports()
    core = {m for m in graph if not m.startswith(("asyncrl.roles", "asyncrl.pipelines")) and m != "asyncrl"}
    sides = {m: side for side, ms in SIDES.items() for m in ms}
    assert core == set(sides), f"classify: {sorted(core - set(sides))}; gone: {sorted(set(sides) - core)}"
    wrong = {}
    for m in sorted(core):
        bad = {d for d in graph[m] if d in sides and sides[d] != "shared" and sides[d] != sides[m]}
        if sides[m] == "shared":
            bad = {d for d in graph[m] if sides.get(d, "shared") != "shared"}
        elif m in STARTS_HOSTS:
            bad -= {"asyncrl._host"}
        if bad:
            wrong[m] = sorted(bad)
    assert wrong == {}


def test_the_trainer_enters_through_the_groups_async_resource_base():
    """``Trainer`` is an ``AsyncResource``, as the groups and pools are: ``async with`` runs the
    base's ``__aenter__`` (set up, or close on a failed set-up), not a copy of it."""
    from asyncrl.pipelines.trainers.trainer import Trainer
    from asyncrl.resources import AsyncResource

    assert issubclass(Trainer, AsyncResource)
    assert Trainer.__aenter__ is AsyncResource.__aenter__
