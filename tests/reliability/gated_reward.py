"""A reward function that holds a run at a chosen batch until the test opens a gate.

``reward.fn=<this file>:char_class_gated`` with ``reward.fn_kwargs={"gate": DIR, "hold_at": N}`` scores
exactly as the built-in ``char_class`` (so a gated run trains the same as an ungated one), but its N-th
call in a reward process creates ``DIR/reached`` and then waits for ``DIR/open``. A test that must act
on a running CLI run before it ends (send a signal, say) waits for ``reached``, acts, and creates
``open``: the run cannot finish first however fast its steps are. Loaded by file, so the CLI's Ray
workers need not import ``tests``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from asyncrl.roles.scoring.reward import RewardConfig, RewardInput, get_reward_fn

_calls = 0
HOLD_BOUND_S = 300.0
"""How long a held call waits for ``open`` before it fails the run (a test that never opens the gate)."""


def char_class_gated(x: RewardInput) -> list[float]:
    """``char_class``'s scores; the ``hold_at``-th call waits for ``<gate>/open`` (see the module)."""
    global _calls
    _calls += 1
    gate = Path(x.kwargs["gate"])
    if _calls == int(x.kwargs["hold_at"]):
        (gate / "reached").touch()
        deadline = time.monotonic() + HOLD_BOUND_S
        while not (gate / "open").exists():  # a worker thread's poll: nothing else runs in this call
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate}/open was not created within {HOLD_BOUND_S:g} s")
            time.sleep(0.02)
    rest = {k: v for k, v in x.kwargs.items() if k not in ("gate", "hold_at")}
    return list(get_reward_fn("char_class")(dataclasses.replace(x, kwargs=rest)))


def gated_reward(gate: Path, hold_at: int) -> RewardConfig:
    """The reward section of a run held at reward call `hold_at` until ``gate/open`` exists (`gate` is created)."""
    gate.mkdir(parents=True, exist_ok=True)
    return RewardConfig(fn=f"{Path(__file__)}:char_class_gated", fn_kwargs={"gate": str(gate), "hold_at": hold_at})
