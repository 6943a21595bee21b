"""``asyncrl.init(address="auto")`` connects to an existing cluster (README "Resources"): the test starts
one with ``ray start --head`` on a free port, in a Ray temp directory of its own (``RAY_TMPDIR``, so
``"auto"`` finds this cluster and no other Ray on a shared machine), runs a group on it from a fresh
process, and stops it by killing the process group it started (``ray stop`` would stop every Ray on the
machine)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CLIENT = textwrap.dedent("""
    import asyncio
    import ray
    import asyncrl
    from asyncrl import Dispatch, RayWorkerGroup, Worker, register

    class Where(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    async def main() -> None:
        resources = await asyncrl.ainit(address="auto")
        print("cpus", int(resources["CPU"]))
        print("gcs", ray.get_runtime_context().gcs_address.rsplit(":", 1)[1])
        async with RayWorkerGroup(Where, world_size=2, name="where") as g:
            nodes = await g.node()
        print("ranks", len(nodes), "nodes", len(set(nodes)))

    asyncio.run(main())
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ours(tmp: str) -> list[str]:
    """Processes whose command line names our Ray temp directory (pgrep: only what this test started)."""
    out = subprocess.run(["pgrep", "-f", tmp], capture_output=True, text=True)
    return out.stdout.split()


@pytest.mark.slow  # starting a Ray cluster and a fresh driver: 30-60 s on the loaded 2-core machine
async def test_init_auto_connects_to_a_cluster_started_with_ray_start(tmp_path):
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_TMPDIR": tmp}
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]  # `ray`, run by this interpreter
    head = subprocess.Popen([*ray_cli, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", "--disable-usage-stats"], env=env, cwd=ROOT,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        async with asyncio.timeout(120):  # `ray start` writes the address file once the head is up
            while not (Path(tmp) / "ray" / "ray_current_cluster").exists():
                assert head.poll() is None, head.stdout.read()[-3000:]
                await asyncio.sleep(0.2)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, cwd=ROOT, env=env,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=240)
        assert proc.returncode == 0, err.decode()[-3000:]
        # The cluster's 2 CPUs (an embedded Ray would advertise >= 16), its GCS port, both ranks on its node.
        assert out.decode().split("\n")[-4:] == ["cpus 2", f"gcs {port}", "ranks 2 nodes 1", ""]
    finally:
        with_group = head.pid
        os.killpg(with_group, signal.SIGTERM)
        try:
            await asyncio.to_thread(head.wait, 10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(with_group, signal.SIGKILL)  # whatever of the cluster outlived `ray start`
        except ProcessLookupError:
            pass
        head.wait()
    async with asyncio.timeout(30):
        while _ours(tmp):
            await asyncio.sleep(0.2)
    shutil.rmtree(tmp, ignore_errors=True)
