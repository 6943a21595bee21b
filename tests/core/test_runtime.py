"""Ray's lifetime: the embedded cluster lives as long as the process, whatever thread or
event loop started it (each case runs in its own process: it starts and owns a Ray)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Started from an executor thread inside asyncio.run, the old way. When asyncio.run ends,
# its executor threads exit; Ray's GCS and raylet carry PR_SET_PDEATHSIG for the thread
# that spawned them, so before the owner thread they died here and the next call blocked
# 60 s on the dead GCS.
_OUTLIVES_THE_LOOP = """
import asyncio, os, ray, asyncrl

async def start():
    await asyncio.to_thread(asyncrl.init, num_cpus=2, runtime_env={"env_vars": {"ASYNCRL_TEST_VAR": "kept"}})

asyncio.run(start())            # the loop and its executor thread are gone after this line

@ray.remote
def probe():
    return os.environ.get("ASYNCRL_TEST_VAR"), os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS")

print("probe", *ray.get(probe.remote(), timeout=60))

async def again():              # a second run in the same process reuses the live Ray
    return await asyncrl.ainit()

print("cpus", asyncio.run(again())["CPU"])
"""

# An error raised after Ray has started must reach the user as itself, at once.
_ERROR_AFTER_START = """
import asyncio, asyncrl

async def main():
    await asyncrl.ainit(num_cpus=2)
    raise ValueError("the user's own error")

asyncio.run(main())
"""


def _run(script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout)


def test_embedded_ray_outlives_the_loop_and_thread_that_started_it() -> None:
    proc = _run(_OUTLIVES_THE_LOOP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("probe", "cpus"))]
    # the user's runtime_env is merged with asyncrl's own (zero-copy stays on)
    assert lines == ["probe kept 1", "cpus 2.0"], proc.stdout + proc.stderr[-3000:]
    assert "Failed to connect to GCS" not in proc.stderr


def test_error_after_ray_start_surfaces_as_itself() -> None:
    # Before the fix the process sat 60 s on the dead GCS before exiting: the timeout is a
    # hang bound with a wide margin over Ray's start-up (TimeoutExpired fails the test).
    proc = _run(_ERROR_AFTER_START, timeout=50)
    assert proc.returncode == 1
    assert "ValueError: the user's own error" in proc.stderr
    assert "Failed to connect to GCS" not in proc.stderr


def test_free_port_picks_a_bindable_port_below_the_kernels_ephemeral_range() -> None:
    """Outgoing connections take their local ports from the ephemeral range: a rendezvous port picked there can
    be taken between the pick and the server's bind (an EADDRINUSE seen on a busy machine)."""
    import socket

    from asyncrl.runtime import PORTS_BELOW_EPHEMERAL, _ephemeral_low, free_port

    for _ in range(20):
        port = free_port()
        assert PORTS_BELOW_EPHEMERAL[0] <= port < min(PORTS_BELOW_EPHEMERAL[1], _ephemeral_low())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))  # free: it binds


def test_free_port_falls_back_to_the_kernels_pick_when_its_candidates_are_taken(monkeypatch) -> None:
    import random
    import socket

    from asyncrl.runtime import PORTS_BELOW_EPHEMERAL, free_port

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks: list[int] = []

        def randrange(lo: int, hi: int) -> int:
            assert lo == PORTS_BELOW_EPHEMERAL[0]
            picks.append(taken)
            return taken

        monkeypatch.setattr(random, "randrange", randrange)
        port = free_port(tries=3)
        assert picks == [taken] * 3 and port != taken
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))
