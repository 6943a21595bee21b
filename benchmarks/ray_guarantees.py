"""What Ray itself guarantees to one caller of one actor: order, threads, cancellation.

Not a speed benchmark: each line is an observed fact about the installed Ray (the rows of
``docs/architecture.md``, "What Ray guarantees"), measured on a local Ray with small actors:

- order: do calls from one caller start in the order they were submitted? (sync actor
  with ``max_concurrency=1``; its one-thread concurrency group; a threaded actor; an async
  actor) — also when an earlier call waits for a top-level argument still being produced;
- threads: does every call of a one-thread group (and of a plain sync actor) run on one OS thread?
- cancellation: ``ray.cancel`` of a queued call of a sync actor (does it ever run?), of a
  running one (is it interrupted?), and of a running ``async def`` call (``CancelledError``?).

    python benchmarks/ray_guarantees.py [--calls 200]
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
def slow(x: int) -> int:
    time.sleep(0.3)
    return x


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        rows = order_rows(args.calls) + cancel_rows()
    finally:
        ray.shutdown()
    print(f"Ray {ray.__version__}\n\n| what | observed |\n|---|---|")
    for what, seen in rows:
        print(f"| {what} | {seen} |")


if __name__ == "__main__":
    main()
