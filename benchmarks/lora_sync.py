"""LoRA weight sync: the adapter's factors alone (``trainer.weight_sync=adapter``) against the whole merged weights.

A LoRA policy (``actor.lora``, every linear layer of the decoder) and an HF rollout in two Ray processes. Each
repetition bumps the policy's version (no training) and syncs it, timed from the controller as the trainer issues
its two stages (``stages.export_weights`` then ``stages.load_weights``):

* ``full (object_store)``: the merged weights under the base names (``W + scaling * B @ A`` per adapted layer,
  computed on the policy), ``ray.put`` by the policy, adopted by the rollout (what a LoRA run syncs by default);
* ``adapter``: ``export_adapter`` -> the factors (A, B in float32) through the object store -> the rollout merges
  them into its copy of the base (the same sum, computed on the rollout) and adopts the merged tensors.

Bytes: what crosses between the processes (the full sync's state dict, a tied weight once; the factors). The two
kinds alternate within each repetition, into two rollouts (so each rollout only ever receives one kind); the
table shows medians. The machine is shared: read the ratios.

    python benchmarks/lora_sync.py                         # tiny and smollm2, ranks 8 and 64, 5 reps
    python benchmarks/lora_sync.py --models smollm2 --ranks 16 --reps 9
    python benchmarks/lora_sync.py --quick                 # tiny model, rank 8, 2 reps (the smoke test)

Writes the table to ``benchmarks/results/lora_sync.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_note, run_header, write_result  # noqa: E402

import asyncrl  # noqa: E402
from asyncrl import Dispatch, Execute, register  # noqa: E402
from asyncrl.pipelines.loop import stages  # noqa: E402
from asyncrl.roles import ModelConfig, OptimConfig, PolicyWorker, RolloutConfig, RolloutWorker  # noqa: E402
from asyncrl.roles.training.lora import LoraConfig  # noqa: E402

FULL, ADAPTER = "full (object_store)", "adapter"


class LoraBenchPolicy(PolicyWorker):
    """A LoRA policy whose version can be bumped without training (each sync needs a newer version)."""

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def bump(self) -> int:
        """Next version, same weights."""
        self._version += 1
        return self._version

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def sizes(self) -> dict[str, int]:
        """Parameters of the model and of its adapters, and the bytes each sync kind moves."""
        merged = self._export_state()
        seen, full, params = set(), 0, 0
        for t in merged.values():
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key not in seen:  # a tied weight once, as the object-store sync packs it
                seen.add(key)
                full += t.numel() * t.element_size()
                params += t.numel()
        adapters = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {"params": params, "adapter_params": adapters, "full_bytes": full,
                "adapter_bytes": self.export_adapter().nbytes}


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this script


def model_config(name: str) -> ModelConfig:
    """float32 on the CPU, torch threads following the busy workers (as benchmarks/weight_sync.py)."""
    if name == "tiny":
        return ModelConfig(seed=0, device="cpu", dtype="float32", autocast="off", num_threads="follow")
    from asyncrl.roles.modeling.gguf import SMOLLM2_135M_INSTRUCT

    return ModelConfig(gguf=SMOLLM2_135M_INSTRUCT, device="cpu", dtype="float32", num_threads="follow")


async def measure(model: str, rank: int, reps: int) -> list[dict[str, Any]]:
    cfg = model_config(model)
    optim = OptimConfig(lora=LoraConfig(rank=rank, alpha=2 * rank))
    policy = asyncrl.RayWorkerGroup(LoraBenchPolicy, world_size=1, args=(cfg, optim), name=f"ls-policy-{rank}")
    rollouts = {kind: asyncrl.RayWorkerGroup(RolloutWorker, world_size=1, args=(cfg, RolloutConfig(max_new_tokens=4)),
                                             name=f"ls-rollout-{i}-{rank}") for i, kind in enumerate((FULL, ADAPTER))}
    times: dict[str, list[float]] = {FULL: [], ADAPTER: []}
    try:
        await asyncio.gather(policy.setup(), *(r.setup() for r in rollouts.values()))
        sizes = await policy.sizes()
        for _ in range(reps + 1):  # the first repetition warms up (first put, first merge) and is dropped
            for kind, rollout in rollouts.items():
                await policy.bump()
                g = SimpleNamespace(policy=policy, rollout=rollout)
                transport = "adapter" if kind == ADAPTER else "object_store"
                t0 = time.perf_counter()
                exported = stages.export_weights(g, transport=transport)  # type: ignore[arg-type]
                await stages.load_weights(g, exported, transport=transport)  # type: ignore[arg-type]
                times[kind].append(time.perf_counter() - t0)
        sums = [await r.weights_checksum() for r in rollouts.values()]
        # the full rollout holds the last version but one's merged weights, the adapter rollout the last one's;
        # with untrained adapters (B = 0) both are the base: the same checksums
        assert sums[0] == sums[1], "the two syncs left different weights"
    finally:
        for group in (*rollouts.values(), policy):
            try:
                await group.close()
            except Exception:  # noqa: BLE001 - a group that never started
                pass
    rows = []
    for kind in (FULL, ADAPTER):
        t = statistics.median(times[kind][1:])
        nbytes = sizes["full_bytes"] if kind == FULL else sizes["adapter_bytes"]
        rows.append({"model": model, "params": sizes["params"], "rank": rank, "adapter_params": sizes["adapter_params"],
                     "kind": kind, "bytes": nbytes, "seconds": t})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| model (params) | LoRA rank (adapter params) | sync | bytes moved | seconds (median) | vs full |",
           "|---|---|---|---:|---:|---:|"]
    full = {(r["model"], r["rank"]): r for r in rows if r["kind"] == FULL}
    for r in rows:
        f = full[(r["model"], r["rank"])]
        ratio = "" if r is f else f"{r['bytes'] / f['bytes']:.2%} of the bytes, {r['seconds'] / f['seconds']:.2f}x time"
        out.append(f"| {r['model']} ({r['params'] / 1e6:.1f} M) | {r['rank']} ({r['adapter_params'] / 1e6:.2f} M) | "
                   f"{r['kind']} | {r['bytes'] / 2**20:.2f} MiB | {r['seconds']:.4f} | {ratio} |")
    return "\n".join(out)


async def main_async(args: argparse.Namespace) -> str:
    start = os.getloadavg()[0]
    asyncrl.init(num_cpus=4)
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for rank in args.ranks:
            rows += await measure(model, rank, args.reps)
    asyncrl.shutdown()
    header = run_header("lora_sync.py", load_note(start, os.getloadavg()[0]))
    return (f"# LoRA weight sync: adapter vs full\n\n{header}\n\n{table(rows)}\n\n"
            "Both kinds leave the rollout with the same weights (bit for bit in float32: "
            "tests/roles/test_lora.py); the adapter sync trades the bytes of the whole model for a merge of "
            "`W + scaling * B @ A` per adapted layer on the rollout.\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    p.add_argument("--ranks", nargs="+", type=int, default=[8, 64])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny model, rank 8, 2 repetitions")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "lora_sync.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.ranks, args.reps = ["tiny"], [8], 2
    write_result(args.out, asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
