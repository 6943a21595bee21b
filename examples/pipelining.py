"""Futures pipelining, deadlines, cancellation and errors, read top to bottom.

    python examples/pipelining.py --rows 1000

Three groups: a "producer" of 2 workers, a "consumer" of 4 (different layouts), and
stages chained by passing futures. The controller only ever sees small summaries.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

import torch
from tensordict import TensorDict

import asyncrl
from asyncrl import Dispatch, RayWorkerGroup, Worker, register


@dataclass(kw_only=True)
class Args:
    rows: int = 1000
    """Rows in the batch (a multiple of 4, see `checksum`)."""
    width: int = 1024
    """Floats per row (the payload that should never reach the controller)."""


class Stage(Worker):
    @register(Dispatch.DP_COMPUTE)
    def make(self, ids: torch.Tensor, width: int) -> TensorDict:
        return TensorDict({"ids": ids, "x": ids[:, None].float().expand(-1, width).contiguous()},
                          batch_size=[len(ids)])

    @register(Dispatch.DP_COMPUTE)
    def scale(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"ids": batch["ids"], "x": batch["x"] * 2}, batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def checksum(self, batch: TensorDict) -> float:
        # A per-rank metric sees its shard as dispatched, padding rows included:
        # keep `rows` a multiple of the world size here (DP_COMPUTE results are unpadded).
        return float(batch["x"][:, 0].sum())

    @register(concurrent=True)
    async def slow(self) -> None:
        await asyncio.sleep(3600)

    @register()
    def fail(self) -> None:
        raise RuntimeError("something went wrong on the worker")


async def main(args: Args) -> dict:
    producer, consumer = RayWorkerGroup(Stage, world_size=2, name="producer"), RayWorkerGroup(Stage, world_size=4, name="consumer")
    async with producer, consumer:
        made = producer.make(torch.arange(args.rows), args.width)   # 2 shards
        scaled = consumer.scale(made)                                # re-split 2 -> 4 on the workers
        sums = await consumer.checksum(scaled)                       # 4 floats come back
        total = sum(sums)
        print(f"sum of 2*ids = {total:.0f} (expected {args.rows * (args.rows - 1):.0f});",
              f"payload bytes fetched by the controller: {producer.stats.bytes_fetched + consumer.stats.bytes_fetched}")

        try:
            await consumer.slow.options(timeout=0.5)()
        except asyncrl.CallTimeoutError as e:
            print("deadline:", e)

        task = asyncio.ensure_future(consumer.slow())
        await asyncio.sleep(0.2)
        task.cancel()  # cancels the remote coroutines too
        try:
            await task
        except asyncio.CancelledError:
            print("cancelled: the awaiting task and the remote calls")

        try:
            await producer.fail()
        except asyncrl.RemoteError as e:
            print(f"remote error from {e.group}.{e.method} rank {e.rank}: {e.exc_type}: {e.message}")
        return {"total": total, "bytes_fetched": producer.stats.bytes_fetched + consumer.stats.bytes_fetched}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=Args.rows)
    p.add_argument("--width", type=int, default=Args.width)
    a = p.parse_args()
    asyncio.run(main(Args(rows=a.rows, width=a.width)))
