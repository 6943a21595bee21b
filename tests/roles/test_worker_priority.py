"""The workers yield the CPU to the controller: the threads that compute in a Ray worker process (the
thread that runs the calls and torch's intra-op threads) run at a lower CPU priority (a higher
niceness) than the controller's process, so busy workers on shared cores cannot keep the
controller's event loop from being scheduled. Ray starts its worker processes at
``RAY_worker_niceness`` (15 by default), applied after its own C++ I/O threads started (those stay at
the controller's priority: they only move messages). Nothing in asyncrl sets it: this pins that the
embedded Ray asyncrl starts keeps it."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import ray
import torch

import asyncrl
from asyncrl import Dispatch, ResourcePool, Worker, register

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test-only worker


def thread_nice_values() -> dict[int, tuple[str, int]]:
    """``{thread id: (name, niceness)}`` of this process (Linux ``/proc``; field 19 of stat(5))."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                nice = int(f.read().rsplit(")", 1)[1].split()[16])
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = (f.read().strip(), nice)
        except OSError:  # the thread ended meanwhile
            pass
    return out


class Compute(Worker):
    """Runs torch on its CPU share and reports the niceness of its threads."""

    @register(Dispatch.ONE_TO_ALL)
    def nice_values(self) -> tuple[int, int, dict[int, tuple[str, int]]]:
        torch.set_num_threads(2)
        torch.ones(512, 512) @ torch.ones(512, 512)  # starts torch's intra-op thread
        return os.getpid(), threading.get_native_id(), thread_nice_values()


@pytest.mark.slow  # a worker process start: ~8 s on the loaded 2-core machine
async def test_worker_compute_threads_run_below_the_controllers_priority(ray_cluster):
    own = os.getpriority(os.PRIO_PROCESS, 0)
    wg = asyncrl.RayWorkerGroup(Compute, ResourcePool([1], cpus_per_bundle=2), name="nice")
    async with wg:
        (pid, call_thread, threads), = await wg.nice_values()
    assert pid != os.getpid()
    assert threads[call_thread][1] == min(19, own + 15)  # the thread that runs the calls
    python_threads = {tid: nice for tid, (name, nice) in threads.items() if name.startswith("ray::")}
    assert len(python_threads) >= 3  # main, the call thread, torch's intra-op thread at least
    assert set(python_threads.values()) == {min(19, own + 15)}
    assert {nice for _, nice in thread_nice_values().values()} == {own}  # the controller keeps its priority
