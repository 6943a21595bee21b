"""What Ray itself guarantees to one caller of one actor: order, threads, cancellation.

Not a speed benchmark: each line is an observed fact about the installed Ray (the rows of
``docs/architecture.md``, "What Ray guarantees"), measured on a local Ray with small actors:

- order: do calls from one caller start in the order they were submitted? (sync actor
  with ``max_concurrency=1``; its one-thread concurrency group; a threaded actor; an async
  actor) — also when an earlier call waits for a top-level argument still being produced;
- threads: does every call of a one-thread group (and of a plain sync actor) run on one OS thread?
- cancellation: ``ray.cancel`` of a queued call of a sync actor (does it ever run?), of a
  running one (is it interrupted?), and of a running ``async def`` call (``CancelledError``?);
- the threaded host's actor shape (a one-thread group ``ordered``, an 8-thread group, a
  one-thread ``control`` group): its one-thread group's order with 1 MiB arguments mixed in,
  and whether the other groups run while the one-thread group is blocked (the two behaviours
  the threaded host relies on);
- Ray holding a call back itself (a top-level argument still being produced): what it does
  to the caller's later calls to that actor, in the other groups too, and to them after
  ``ray.cancel`` of the held call or when the argument fails (why asyncrl never passes an
  unfinished input top-level; ``--no-stall`` leaves out the row that waits Ray's 30 s).

    python benchmarks/ray_guarantees.py [--calls 200] [--no-stall]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any

import ray


@ray.remote(concurrency_groups={"control": 1})
class SyncActor:
    """A plain sync actor (``max_concurrency`` set by the caller) with a one-thread group."""

    def __init__(self) -> None:
        self.log: list[int] = []
        self.threads: set[int] = set()
        self.ran: list[str] = []
        self.gate = threading.Event()

    def record(self, i: int, *_dep: Any) -> None:
        self.log.append(i)
        self.threads.add(threading.get_ident())

    def block(self, name: str) -> str:
        self.ran.append(name)
        self.gate.wait(30)
        return name

    def mark(self, name: str) -> str:
        self.ran.append(name)
        return name

    @ray.method(concurrency_group="control")
    def release(self) -> None:
        self.gate.set()

    @ray.method(concurrency_group="control")
    def state(self) -> tuple[list[int], int, list[str]]:
        return self.log, len(self.threads), self.ran


@ray.remote(concurrency_groups={"ordered": 1, "calls": 8})
class PinnedActor:
    """A sync actor whose ``ordered`` group has one thread."""

    def __init__(self) -> None:
        self.log: list[int] = []
        self.threads: set[int] = set()

    @ray.method(concurrency_group="ordered")
    def record(self, i: int, *_dep: Any) -> None:
        self.log.append(i)
        self.threads.add(threading.get_ident())

    @ray.method(concurrency_group="calls")
    def other(self, i: int) -> None:
        time.sleep(0.0005)

    def state(self) -> tuple[list[int], int]:
        return self.log, len(self.threads)


@ray.remote(concurrency_groups={"ordered": 1, "calls": 8, "control": 1})
class HostShaped:
    """The threaded host's actor shape: a sync actor whose ``ordered`` group has one thread,
    beside a ``calls`` group of 8 and a one-thread ``control`` group."""

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.threads: set[int] = set()
        self.gate = threading.Event()

    @ray.method(concurrency_group="ordered")
    def record(self, i: Any, *_args: Any) -> None:
        self.log.append(i)
        self.threads.add(threading.get_ident())

    @ray.method(concurrency_group="ordered")
    def block(self) -> None:
        self.gate.wait(60)

    @ray.method(concurrency_group="calls")
    def other(self, i: Any) -> Any:
        self.log.append(i)
        return i

    @ray.method(concurrency_group="control")
    def control(self, i: Any) -> Any:
        self.log.append(i)
        return i

    @ray.method(concurrency_group="control")
    def release(self) -> None:
        self.gate.set()

    @ray.method(concurrency_group="control")
    def state(self) -> tuple[list[Any], int]:
        return list(self.log), len(self.threads)


@ray.remote
class AsyncActor:
    def __init__(self) -> None:
        self.log: list[int] = []
        self.cancelled = 0

    async def record(self, i: int, *_dep: Any) -> None:
        self.log.append(i)

    async def long(self) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def state(self) -> tuple[list[int], int]:
        return self.log, self.cancelled


@ray.remote
def slow(x: int, seconds: float = 0.3) -> int:
    time.sleep(seconds)
    return x


@ray.remote
def fails(seconds: float) -> None:
    time.sleep(seconds)
    raise ValueError("the producer failed")


def _inversions(log: list[int]) -> int:
    return sum(1 for a, b in zip(log, log[1:]) if b < a)


def order_rows(n: int) -> list[tuple[str, str]]:
    rows = []
    kinds = [
        ("sync actor, max_concurrency=1", SyncActor.options()),
        ("sync actor, max_concurrency=8", SyncActor.options(max_concurrency=8)),
        ("async actor", AsyncActor.options()),
    ]
    for name, cls in kinds:
        a = cls.remote()
        refs = [a.record.remote(i) for i in range(n)]
        ray.get(refs)
        log = ray.get(a.state.remote())[0]
        rows.append((f"order, {name}: {n} calls", f"{_inversions(log)} out of order"))
        # an earlier call waits for a top-level argument still being produced
        a2 = cls.remote()
        dep = slow.remote(0)
        refs = [a2.record.remote(0, dep)] + [a2.record.remote(i) for i in range(1, 20)]
        ray.get(refs)
        log = ray.get(a2.state.remote())[0]
        rows.append((f"order, {name}: call 0 waits for an argument", f"first ran: {log[0]}"))
    p = PinnedActor.remote()
    refs = []
    for i in range(n):
        refs.append(p.record.remote(i))
        refs.append(p.other.remote(i))
    ray.get(refs)
    log, threads = ray.get(p.state.remote())
    rows.append((f"order, one-thread group beside an 8-thread group: {n} calls", f"{_inversions(log)} out of order"))
    rows.append(("threads, one-thread group", f"{threads} OS thread(s) for {n} calls"))
    s = SyncActor.options().remote()
    ray.get([s.record.remote(i) for i in range(n)])
    rows.append(("threads, plain sync actor (max_concurrency=1)", f"{ray.get(s.state.remote())[1]} OS thread(s)"))
    return rows


def cancel_rows() -> list[tuple[str, str]]:
    rows = []
    s = SyncActor.options().remote()
    running = s.block.remote("running")
    queued = s.mark.remote("queued")
    after = s.mark.remote("after")
    while "running" not in ray.get(s.state.remote())[2]:  # (a measurement script: poll until it runs)
        time.sleep(0.01)
    ray.cancel(queued)
    ray.cancel(running)
    ray.get(s.release.remote())
    try:
        ray.get(queued)
        q = "returned"
    except ray.exceptions.TaskCancelledError:
        q = "TaskCancelledError"
    try:
        r = f"returned {ray.get(running)!r}"
    except ray.exceptions.TaskCancelledError:
        r = "TaskCancelledError"
    ray.get(after)
    ran = ray.get(s.state.remote())[2]
    rows.append(("cancel, queued call of a sync actor", f"{q}; ran: {'queued' in ran}"))
    rows.append(("cancel, running call of a sync actor", f"{r}; ran to its end: {'running' in ran}"))
    rows.append(("cancel, later call after a cancelled queued one", f"ran: {'after' in ran}"))
    a = AsyncActor.remote()
    ref = a.long.remote()
    ray.get(a.state.remote())  # (the async actor has started `long` once it answers this)
    time.sleep(0.2)
    ray.cancel(ref)
    try:
        ray.get(ref)
        out = "returned"
    except ray.exceptions.TaskCancelledError:
        out = "TaskCancelledError"
    rows.append(("cancel, running async def call", f"{out}; CancelledError seen: {ray.get(a.state.remote())[1]}"))
    return rows


def host_rows(n: int) -> list[tuple[str, str]]:
    """The two behaviours the threaded host relies on, on its actor shape."""
    import numpy as np

    rows = []
    h = HostShaped.remote()
    big = np.zeros(1 << 20, dtype=np.uint8)  # 1 MiB: Ray puts it in the object store, fetched before the call runs
    refs = []
    for i in range(n):
        refs.append(h.record.remote(i, big) if i % 7 == 0 else h.record.remote(i))
        if i % 3 == 0:
            refs.append(h.other.remote(-1))
    ray.get(refs)
    log, threads = ray.get(h.state.remote())
    ordered = [i for i in log if i != -1]
    rows.append((f"order, the host's one-thread group beside an 8-thread and a control group, 1 MiB arguments "
                 f"mixed in: {n} calls", f"{_inversions(ordered)} out of order; {threads} OS thread(s)"))
    h2 = HostShaped.remote()
    ray.get(h2.state.remote())
    blocker = h2.block.remote()
    queued = h2.record.remote("queued")
    t0 = time.perf_counter()
    ctl, oth = ray.get([h2.control.remote("control"), h2.other.remote("calls")])
    beside = time.perf_counter() - t0
    ran_before = "queued" not in ray.get(h2.state.remote())[0]
    ray.get(h2.release.remote())
    ray.get([blocker, queued])
    rows.append(("while a call blocks the one-thread group: a control-group and a calls-group call",
                 f"both ran in {beside * 1e3:.0f} ms, before the call queued behind the blocker: {ran_before}"))
    return rows


def held_rows(stall: bool) -> list[tuple[str, str]]:
    """Ray holding a call back itself, until a top-level argument is produced."""
    rows = []
    h = HostShaped.remote()
    ray.get(h.state.remote())
    t0 = time.perf_counter()
    dep = slow.remote(0, 1.5)
    waiting = h.record.remote("waits", dep)
    ctl = h.control.remote("control")
    ray.get(ctl)
    took = time.perf_counter() - t0
    ray.get(waiting)
    log = ray.get(h.state.remote())[0]
    rows.append(("a call waits for a top-level argument (1.5 s): a later control-group call of the same caller",
                 f"returned after {took:.1f} s; ran {'after' if log.index('control') > log.index('waits') else 'before'}"
                 " the waiting call"))
    h = HostShaped.remote()
    ray.get(h.state.remote())
    t0 = time.perf_counter()
    waiting = h.record.remote("waits", fails.remote(1.0))
    after = h.record.remote("after")
    try:
        ray.get(waiting)
        out = "ran"
    except ray.exceptions.RayTaskError as e:
        out = f"{type(e).__name__} (cause {type(e.cause).__name__}), never ran"
    ray.get(after)
    rows.append(("the argument fails: the waiting call / the call behind it",
                 f"{out} / ran after {time.perf_counter() - t0:.1f} s"))
    if stall:
        h = HostShaped.remote()
        ray.get(h.state.remote())
        waiting = h.record.remote("waits", slow.remote(0, 3.0))
        behind = h.record.remote("behind")
        time.sleep(0.3)
        ray.cancel(waiting)
        t0 = time.perf_counter()
        try:
            ray.get(behind, timeout=90)
            out = f"ran after {time.perf_counter() - t0:.1f} s"
        except Exception as e:  # noqa: BLE001 - the observation
            out = f"{type(e).__name__} after {time.perf_counter() - t0:.0f} s"
        rows.append(("`ray.cancel` of the call waiting for its argument: the call behind it", out))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--no-stall", action="store_true", help="leave out the row that waits for Ray's 30 s timeout")
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        rows = order_rows(args.calls) + cancel_rows() + host_rows(args.calls) + held_rows(not args.no_stall)
    finally:
        ray.shutdown()
    print(f"Ray {ray.__version__}\n\n| what | observed |\n|---|---|")
    for what, seen in rows:
        print(f"| {what} | {seen} |")


if __name__ == "__main__":
    main()
