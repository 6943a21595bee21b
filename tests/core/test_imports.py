"""`import asyncrl` imports tensordict without torch._dynamo (asyncrl/_tensordict_import.py):
worker processes and the controller start without it, and once something imports dynamo,
tensordict's compile marks are exactly what a plain `import tensordict` makes them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from asyncrl import Dispatch, RayWorkerGroup, Worker, register

# The state of every compile mark tensordict makes: dynamo's allow-list verdict for each
# functorch builtin, and the constant mark on its lock-warning helper.
_MARKS = """
import torch
import torch._C._functorch as F
from torch._dynamo import trace_rules
import tensordict.utils as U
marks = {name: bool(trace_rules.is_callable_allowed(getattr(F, name)))
         for name in sorted(dir(F)) if callable(getattr(F, name)) and not name.startswith("__")}
marks["torch._foreach_copy_"] = bool(trace_rules.is_callable_allowed(torch._foreach_copy_))
marks["_lock_warn constant"] = getattr(U._lock_warn, "_dynamo_marked_constant", False)
"""

_DEFERRED = """
import json, sys
import asyncrl
from asyncrl import _tensordict_import as T
before = {"dynamo imported": "torch._dynamo" in sys.modules, "deferred": sorted(f.__name__ for f in T._pending)}
import torch._dynamo
""" + _MARKS + """
print(json.dumps({**before, "left": len(T._pending), "marks": marks}))
"""

_PLAIN = """
import json
import torch._dynamo, tensordict
""" + _MARKS + """
print(json.dumps({"marks": marks}))
"""


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_defers_dynamo_and_its_later_import_marks_tensordict_as_a_plain_import_does() -> None:
    deferred, plain = _run(_DEFERRED), _run(_PLAIN)
    assert deferred["dynamo imported"] is False
    assert deferred["deferred"] == ["_add_batch_dim"] * 3 + ["_foreach_copy_"] + ["_remove_batch_dim"] * 2
    assert deferred["left"] == 0
    assert deferred["marks"] == plain["marks"]
    assert deferred["marks"]["_lock_warn constant"] is True
    assert {k for k, v in plain["marks"].items() if v} == {"_add_batch_dim", "_remove_batch_dim",
                                                            "torch._foreach_copy_", "_lock_warn constant"}


class _Modules(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def dynamo_imported(self) -> bool:
        return "torch._dynamo" in sys.modules


async def test_a_worker_process_starts_without_dynamo(ray_cluster) -> None:
    async with RayWorkerGroup(_Modules, world_size=1, name="modules") as wg:
        assert await wg.dynamo_imported() == [False]
