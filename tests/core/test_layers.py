"""The parts of ``asyncrl.pipelines`` and of ``asyncrl.roles`` form layers: a module imports its own layer and the
layers below it, never one above (docs/architecture.md, "Layers").

Every import counts: module level, under ``if TYPE_CHECKING:`` and inside a function alike. An import inside a
function is allowed only where it saves a real cost (an optional extra, the start-up time of the command line),
and each such import is listed in :data:`LAZY` with its reason; a new one needs a reason there too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from tests.core.test_import_cycles import PACKAGES, _modules  # (one reading of the project's modules)

LAYERS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "asyncrl.pipelines": [
        ("commands", ("commands",)),
        ("trainers", ("trainers",)),
        ("rollout modes", ("rollout",)),
        ("supervision", ("supervision",)),
        ("a run", ("run",)),
        ("checkpoints", ("checkpoints",)),
        ("the loops' vocabulary", ("loop",)),
        ("records", ("journaling", "observe")),
        ("the job's configuration", ("job",)),
        ("data and the twin's model", ("datasets", "twin")),
        ("config library", ("configlib",)),
    ],
    "asyncrl.roles": [
        ("rollout worker", ("generation",)),
        ("trained workers", ("training",)),
        ("weight transfer", ("weights",)),
        ("episodes and agents", ("agentic",)),
        ("engines and rewards", ("engines", "scoring")),
        ("worker helpers", ("_util",)),
        ("models", ("modeling",)),
        ("math and registries", ("functional", "registry")),
        ("errors and config fields", ("errors", "fields")),
    ],
}
"""Per package, its layers from the top down: a name and its parts, each a sub-package or a module at the
package's top. A module may import its own sub-package, and every layer below its own; never a layer above,
and never another part of its own layer (so no two sub-packages import each other, either way). The
package's ``__init__`` (its public face) may import every layer, and no part imports the face."""

LAZY: dict[tuple[str, str], str] = {}
"""``(importing module, imported module): reason`` for each project import made inside a function (none today:
the optional extras are imported lazily by the modules that use them, and ``asyncrl.pipelines`` loads the trainer
whatever the command line imports)."""


@dataclass(frozen=True)
class Import:
    """One import of a project module: who, what, where, and whether it runs at import time."""

    importer: str
    target: str
    line: int
    lazy: bool


def imports_of(name: str, source: str, *, is_package: bool, modules: set[str] | dict[str, object]) -> list[Import]:
    """The imports of project `modules` in module `name` (its text `source`): absolute and relative, at the top,
    under ``TYPE_CHECKING`` or in a function, each resolved to the module it loads."""

    def project_module(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    here = name.split(".") if is_package else name.split(".")[:-1]
    tree = ast.parse(source)
    in_function: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function |= {id(n) for n in ast.walk(fn)} - {id(fn)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*(here[: len(here) - node.level + 1] if node.level else []),
                             *([node.module] if node.module else [])])
            targets = [f"{base}.{a.name}" if project_module(f"{base}.{a.name}") != project_module(base) else base
                       for a in node.names]
        else:
            continue
        for t in dict.fromkeys(project_module(t) for t in targets):
            if t is not None and t != name:
                found.append(Import(name, t, node.lineno, id(node) in in_function))
    return found


def project_imports() -> list[Import]:
    """Every import of a project module by a project module."""
    modules = _modules()
    return [imp for name, path in modules.items()
            for imp in imports_of(name, path.read_text(), is_package=path.name == "__init__.py", modules=modules)]


def _layer(module: str) -> tuple[str, int, str] | None:
    """``(package, layer index, part)`` of `module`, or None for a package's face and the core."""
    for pkg, layers in LAYERS.items():
        if not module.startswith(pkg + "."):
            continue
        rel = module[len(pkg) + 1:]
        parts = [(part, i) for i, (_, names) in enumerate(layers) for part in names
                 if rel == part or rel.startswith(part + ".")]
        assert parts, f"{module} is in no layer of {pkg}: add its part to LAYERS"
        part, i = max(parts, key=lambda p: len(p[0]))
        return pkg, i, part
    return None


def against_the_order(imports: list[Import]) -> list[str]:
    """A line per import that reaches a layer above the importer's, another part of its own layer, or the
    package's face from inside."""
    bad = []
    for imp in imports:
        src = _layer(imp.importer)
        if src is None:
            continue
        pkg, i, part = src
        if imp.target == pkg:
            bad.append(f"{imp.importer}:{imp.line} imports {imp.target}: a part never imports its package's face")
            continue
        dst = _layer(imp.target)
        if dst is None or dst[0] != pkg or dst[1] > i or (dst[1] == i and dst[2] == part):
            continue
        layers = LAYERS[pkg]
        bad.append(f"{imp.importer}:{imp.line} imports {imp.target} ({dst[2]}, layer {layers[dst[1]][0]!r}): "
                   f"in {pkg}, {part} (layer {layers[i][0]!r}) may import only itself and the layers below")
    return bad


def test_the_scan_reads_every_kind_of_import():
    imports = {(i.importer, i.target): i for i in project_imports()}
    assert ("asyncrl.worker_group", "asyncrl.future") in imports  # module level
    assert ("asyncrl.roles._util", "asyncrl.roles.modeling.device") in imports  # relative, resolved
    assert ("asyncrl.pipelines.rollout.rollout_loop", "asyncrl.pipelines.observe.trace") in imports  # TYPE_CHECKING
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\ndef f():\n    from .c import x\n"
    found = imports_of("p.q.a", source, is_package=False, modules={"p.q.a", "p.q.b", "p.q.c"})
    assert found == [Import("p.q.a", "p.q.b", 3, lazy=False), Import("p.q.a", "p.q.c", 5, lazy=True)]


def test_every_module_is_in_a_layer():
    for module in _modules():
        _layer(module)


def test_the_order_refuses_an_upward_import():
    up = Import("asyncrl.pipelines.job.config", "asyncrl.pipelines.trainers.trainer", 1, lazy=True)
    down = Import("asyncrl.pipelines.trainers.trainer", "asyncrl.pipelines.job.config", 1, lazy=False)
    face = Import("asyncrl.roles.fields", "asyncrl.roles", 1, lazy=False)
    assert against_the_order([down]) == []
    [msg] = against_the_order([up])
    assert "asyncrl.pipelines.job.config:1 imports asyncrl.pipelines.trainers.trainer" in msg
    assert "job (layer \"the job's configuration\") may import only itself and the layers below" in msg
    assert against_the_order([face])


def test_the_order_refuses_an_import_between_two_parts_of_one_layer():
    sideways = Import("asyncrl.pipelines.journaling.ledger", "asyncrl.pipelines.observe.metrics", 1, lazy=False)
    within = Import("asyncrl.pipelines.journaling.ledger", "asyncrl.pipelines.journaling.journal", 1, lazy=False)
    assert against_the_order([within]) == []
    [msg] = against_the_order([sideways])
    assert "journaling (layer 'records') may import only itself and the layers below" in msg


def test_each_part_is_a_whole_sub_package_or_a_top_module():
    """A layer holds sub-packages whole: no sub-package is split between two layers, so the sub-packages
    themselves have an order, not only their modules."""
    for pkg, layers in LAYERS.items():
        parts = [part for _, names in layers for part in names]
        assert all("." not in part for part in parts), f"{pkg}: a part names a module inside a sub-package"
        assert len(parts) == len(set(parts))
        tops = {m[len(pkg) + 1:].split(".")[0] for m in _modules() if m.startswith(pkg + ".")}
        assert tops == set(parts), f"{pkg}: sub-packages and top modules not in LAYERS: {tops ^ set(parts)}"


def test_no_import_goes_against_the_layers():
    bad = against_the_order(project_imports())
    assert not bad, "imports against the layers (tests/core/test_layers.py LAYERS):\n" + "\n".join(bad)


def test_every_import_inside_a_function_has_a_listed_reason():
    lazy = {(i.importer, i.target): i for i in project_imports() if i.lazy}
    unlisted = [f"{i.importer}:{i.line} imports {i.target} inside a function" for k, i in sorted(lazy.items())
                if k not in LAZY]
    assert not unlisted, ("import these at the top, or list the cost the delay saves in LAZY:\n"
                          + "\n".join(unlisted))
    assert not set(LAZY) - set(lazy), f"listed but no longer lazy: {sorted(set(LAZY) - set(lazy))}"
