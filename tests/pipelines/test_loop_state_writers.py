"""Each field of the loop state has one writing module (``pipelines/loop/loop_state.py``'s docstring names them).

The project's source is read with ``ast``: an assignment, augmented assignment or ``del`` of ``<x>.<field>`` or of
``<x>.<field>[...]`` outside the owner's module, or a ``setattr`` naming a field, fails the test -- so the rule holds
for the next change too, not only today. Writes through ``self`` count only inside :class:`LoopState` (another
class's ``self.device`` is not the loop state's).
"""

from __future__ import annotations

import ast
import dataclasses

from asyncrl.pipelines.loop.loop_state import LoopState
from tests.core.test_import_cycles import _modules  # (one reading of the project's modules)

STATE = "asyncrl.pipelines.loop.loop_state"
WEIGHTS = "asyncrl.pipelines.loop.weights"

OWNERS: dict[str, str | None] = {
    # built with the state, never assigned
    "buffer": None, "cond": None, "device": None,
    # weight sync: publish (policy side), loaded/drop_older (rollout side), prepare (new engines), restore
    "exports": WEIGHTS, "exported": WEIGHTS, "rollout_version": WEIGHTS,
    # the counters the loops wait on and a checkpoint's resume point: LoopState's named transitions
    "policy_version": STATE, "start_step": STATE, "next_gen": STATE, "rollout_done": STATE, "restored": STATE,
    "taken": "asyncrl.pipelines.trainers.trainer",  # the train loop, after each take
    "generating": "asyncrl.pipelines.rollout.rollout_loop",  # the batch rollout's batch in flight
    "precomputed": "asyncrl.pipelines.loop.precompute",
    "rollout_state": "asyncrl.pipelines.rollout.stream_rollout",  # the mode's Rollout.restore (streaming's)
}


def _written_field(target: ast.expr, fields: set[str], in_state: bool) -> str | None:
    """The loop-state field `target` writes (``x.f`` or ``x.f[...]``), if any."""
    if isinstance(target, ast.Subscript):
        target = target.value
    if not (isinstance(target, ast.Attribute) and target.attr in fields):
        return None
    if isinstance(target.value, ast.Name) and target.value.id == "self" and not in_state:
        return None
    return target.attr


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, ast.Tuple) else [t])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def writers() -> dict[str, dict[str, list[int]]]:
    """``{field: {module: [line, ...]}}`` of every write of a loop-state field in the project's source."""
    fields = {f.name for f in dataclasses.fields(LoopState)}
    out: dict[str, dict[str, list[int]]] = {f: {} for f in fields}
    for module, path in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        state_nodes = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "LoopState"
                       for n in ast.walk(c)} if module == STATE else set()
        for node in ast.walk(tree):
            hits = [_written_field(t, fields, id(node) in state_nodes) for t in _targets(node)]
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and len(node.args) >= 2):
                name = node.args[1]
                hits.append(name.value if isinstance(name, ast.Constant) and name.value in fields else None)
            for field in filter(None, hits):
                out[field].setdefault(module, []).append(node.lineno)
    return out


def test_every_loop_state_field_has_a_named_owner() -> None:
    assert set(OWNERS) == {f.name for f in dataclasses.fields(LoopState)}, \
        "a new LoopState field needs its one writing module in OWNERS (and in loop_state.py's docstring)"


def test_each_loop_state_field_is_written_by_its_owner_module_only() -> None:
    found = writers()
    wrong = {field: sorted(mods) for field, mods in found.items()
             if set(mods) != ({OWNERS[field]} if OWNERS[field] else set())}
    assert not wrong, (f"loop-state fields written outside their owner module: {wrong}; owners: "
                       f"{ {f: OWNERS[f] for f in wrong} } -- call the owner's method instead")


def test_the_loop_state_sets_no_field_by_name() -> None:
    source = _modules()[STATE].read_text()
    assert "setattr(" not in source, "a generic setter hides which module writes a field: name the transition"
