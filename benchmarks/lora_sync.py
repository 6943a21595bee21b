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

``--layouts`` spreads the policy over training ranks: ``one`` (1 rank, the default), ``ddp2`` (2 replicas: rank 0
exports, the other rank idles) and ``fsdp2`` (2 ranks holding shards: every rank gathers one decoder layer at a time,
rank 0 merges and packs it; an adapter sync gathers each unit's factors in one all-gather, without the frozen base),
``fsdp2:per-tensor`` (the same, with the adapter's factors gathered one tensor at a time, as before; its adapter
sync only). Several layouts live side by side and alternate within each repetition, each with its own two rollouts.
Each training rank samples its resident memory every 2 ms during a sync; the table shows the median peak above its
level before the sync, rank 0 and the largest of the others.

    python benchmarks/lora_sync.py                         # tiny and smollm2, ranks 8 and 64, 5 reps
    python benchmarks/lora_sync.py --models smollm2 --ranks 16 --reps 9
    python benchmarks/lora_sync.py --models smollm2 --ranks 16 --layouts ddp2 fsdp2 --reps 3   # from fsdp2 shards
    python benchmarks/lora_sync.py --models smollm2 --ranks 16 --layouts ddp2 fsdp2:per-tensor fsdp2 --reps 3
    python benchmarks/lora_sync.py --quick                 # tiny model, rank 8, 2 reps (the smoke test)

Writes the table to ``benchmarks/results/lora_sync.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_note, run_header, write_result  # noqa: E402

import asyncrl  # noqa: E402
from asyncrl import Dispatch, register  # noqa: E402
from asyncrl.pipelines.loop import stages  # noqa: E402
from asyncrl.roles import ModelConfig, OptimConfig, PolicyWorker, RolloutConfig, RolloutWorker  # noqa: E402
from asyncrl.roles.modeling.lora import LoraConfig  # noqa: E402
from asyncrl.roles.modeling.strategy import EVERY_RANK_GIVES_RANK_ZEROS  # noqa: E402

FULL, ADAPTER = "full (object_store)", "adapter"
LAYOUTS = {"one": ("ddp", 1), "ddp2": ("ddp", 2), "fsdp2": ("fsdp2", 2), "fsdp2:per-tensor": ("fsdp2", 2)}
"""``--layouts``: the policy's ``(actor.strategy, training ranks)``; ``fsdp2:per-tensor`` gathers an adapter's factors
one tensor at a time (the path before the per-unit gather), for a side-by-side."""
LAYOUT_NAMES = {"one": "1 rank", "ddp2": "ddp x2", "fsdp2": "fsdp2 x2", "fsdp2:per-tensor": "fsdp2 x2, per tensor"}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """This process's resident memory sampled every 2 ms in a thread, from ``start`` to ``stop``."""

    def __init__(self) -> None:
        self.base = self.top = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.top = max(self.top, _rss())
            self._stop.wait(0.002)

    def stop(self) -> int:
        """The peak above the level at the start, in bytes."""
        self._stop.set()
        self._t.join()
        return max(self.top, _rss()) - self.base


class LoraBenchPolicy(PolicyWorker):
    """A LoRA policy whose version can be bumped without training (each sync needs a newer version)."""

    _peak: _Peak | None = None

    @register(EVERY_RANK_GIVES_RANK_ZEROS)
    def bump(self) -> int:
        """Next version, same weights (on every rank)."""
        self._version += 1
        return self._version

    @register(EVERY_RANK_GIVES_RANK_ZEROS)
    def sizes(self) -> dict[str, int]:
        """Parameters of the model and of its adapters, and the bytes each sync kind moves (every rank runs it:
        the adapter's factors are gathered under fsdp2)."""
        from torch.distributed.tensor import DTensor

        seen, full, params = set(), 0, 0
        for t in self.weights.export_layout().values():  # the merged weights' names, shapes and ties (shards: whole shapes)
            local = t.to_local() if isinstance(t, DTensor) else t
            key = (local.untyped_storage().data_ptr(), local.storage_offset())
            if key not in seen:  # a tied weight once, as the object-store sync packs it
                seen.add(key)
                full += t.numel() * t.element_size()
                params += t.numel()
        adapters = sum(p.numel() for p in self.model.parameters() if p.requires_grad)  # (shards: whole counts)
        return {"params": params, "adapter_params": adapters, "full_bytes": full,
                "adapter_bytes": self.export_adapter().nbytes}

    @register(Dispatch.ONE_TO_ALL)
    def watch(self) -> None:
        """Start sampling this rank's resident memory (ordered before the sync's export on this worker)."""
        self._peak = _Peak()

    @register(Dispatch.ONE_TO_ALL)
    def peak(self) -> int:
        """Bytes of resident memory above the level at :meth:`watch`, at the highest since."""
        assert self._peak is not None
        peak, self._peak = self._peak.stop(), None
        return peak


class PerTensorAdapterPolicy(LoraBenchPolicy):
    """An adapter sync that gathers each factor of an FSDP2 policy alone (one all-gather per tensor)."""

    @register(EVERY_RANK_GIVES_RANK_ZEROS)
    def export_adapter(self, dtype: str | None = None) -> Any:
        from asyncrl.roles.modeling.lora import adapter_delta

        return adapter_delta(self.model, self._version, self._base_digest(dtype))


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this script


def model_config(name: str) -> ModelConfig:
    """float32 on the CPU, torch threads following the busy workers (as benchmarks/weight_sync.py)."""
    if name == "tiny":
        return ModelConfig(seed=0, device="cpu", dtype="float32", autocast="off", num_threads="follow")
    from asyncrl.roles.modeling.gguf import SMOLLM2_135M_INSTRUCT

    return ModelConfig(gguf=SMOLLM2_135M_INSTRUCT, device="cpu", dtype="float32", num_threads="follow")


async def measure(model: str, rank: int, reps: int, layouts: list[str]) -> list[dict[str, Any]]:
    cfg = model_config(model)
    policies, rollouts = {}, {}
    for layout in layouts:
        strategy, ranks = LAYOUTS[layout]
        optim = OptimConfig(lora=LoraConfig(rank=rank, alpha=2 * rank), strategy=strategy)  # type: ignore[arg-type]
        cls = PerTensorAdapterPolicy if layout.endswith(":per-tensor") else LoraBenchPolicy
        policies[layout] = asyncrl.RayWorkerGroup(cls, world_size=ranks, args=(cfg, optim),
                                                  name=f"ls-policy-{layout.replace(':', '-')}-{rank}")
        for i, kind in enumerate((FULL, ADAPTER)):
            if kind == FULL and layout.endswith(":per-tensor"):
                continue  # the same merged-weights sync as fsdp2's
            rollouts[layout, kind] = asyncrl.RayWorkerGroup(RolloutWorker, world_size=1,
                                                            args=(cfg, RolloutConfig(max_new_tokens=4)),
                                                            name=f"ls-rollout-{layout.replace(':', '-')}-{i}-{rank}")
    times: dict[tuple[str, str], list[float]] = {k: [] for k in rollouts}
    peaks: dict[tuple[str, str], list[list[int]]] = {k: [] for k in rollouts}
    try:
        await asyncio.gather(*(p.setup() for p in policies.values()), *(r.setup() for r in rollouts.values()))
        sizes = {layout: await p.sizes() for layout, p in policies.items()}
        for _ in range(reps + 1):  # the first repetition warms up (first put, first merge) and is dropped
            for (layout, kind), rollout in rollouts.items():  # layouts and kinds alternate within a repetition
                policy = policies[layout]
                await policy.bump()
                await policy.watch()
                g = SimpleNamespace(policy=policy, rollout=rollout)
                transport = "adapter" if kind == ADAPTER else "object_store"
                t0 = time.perf_counter()
                exported = stages.export_weights(g, transport=transport)  # type: ignore[arg-type]
                await stages.load_weights(g, exported, transport=transport)  # type: ignore[arg-type]
                times[layout, kind].append(time.perf_counter() - t0)
                peaks[layout, kind].append(await policy.peak())
        sums = [await r.weights_checksum() for r in rollouts.values()]
        # the full rollouts hold the last version but one's merged weights, the adapter rollouts the last one's;
        # with untrained adapters (B = 0) all are the base: the same checksums, whatever the layout
        assert all(s == sums[0] for s in sums), "the syncs left different weights"
    finally:
        for group in (*rollouts.values(), *policies.values()):
            try:
                await group.close()
            except Exception:  # noqa: BLE001 - a group that never started
                pass
    rows = []
    for (layout, kind), ts in times.items():
        size = sizes[layout]
        ps = peaks[layout, kind][1:]
        rows.append({"model": model, "params": size["params"], "rank": rank, "adapter_params": size["adapter_params"],
                     "layout": layout, "kind": kind, "bytes": size["full_bytes" if kind == FULL else "adapter_bytes"],
                     "seconds": statistics.median(ts[1:]), "spread": (min(ts[1:]), max(ts[1:])),
                     "peak0": statistics.median(p[0] for p in ps),
                     "peak_others": statistics.median(max(p[1:], default=0) for p in ps)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| model (params) | LoRA rank (adapter params) | policy | sync | bytes moved | seconds, median (min-max) | "
           "vs full | vs the first policy layout | peak RSS of a training rank in the sync, rank 0 / others |",
           "|---|---|---|---|---:|---:|---:|---:|---:|"]
    full = {(r["model"], r["rank"], r["layout"]): r for r in rows if r["kind"] == FULL}
    first: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in rows:
        first.setdefault((r["model"], r["rank"], r["kind"]), r)
    for r in rows:
        f = full.get((r["model"], r["rank"], r["layout"].split(":")[0]))
        ratio = ("" if f is None or r is f else
                 f"{r['bytes'] / f['bytes']:.2%} of the bytes, {r['seconds'] / f['seconds']:.2f}x time")
        b = first[(r["model"], r["rank"], r["kind"])]
        vs = "" if r is b else f"{r['seconds'] / b['seconds']:.2f}x"
        others = f"{r['peak_others'] / 2**20:.0f} MiB" if LAYOUTS[r["layout"]][1] > 1 else "-"
        out.append(f"| {r['model']} ({r['params'] / 1e6:.1f} M) | {r['rank']} ({r['adapter_params'] / 1e6:.2f} M) | "
                   f"{LAYOUT_NAMES[r['layout']]} | {r['kind']} | {r['bytes'] / 2**20:.2f} MiB | {r['seconds']:.4f} "
                   f"({r['spread'][0]:.3f}-{r['spread'][1]:.3f}) | {ratio} | {vs} | {r['peak0'] / 2**20:.0f} MiB / "
                   f"{others} |")
    return "\n".join(out)


async def main_async(args: argparse.Namespace) -> str:
    start = os.getloadavg()[0]
    asyncrl.init(num_cpus=max(4, sum(LAYOUTS[layout][1] + 2 for layout in args.layouts)))  # (logical: a bundle each)
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for rank in args.ranks:
            rows += await measure(model, rank, args.reps, args.layouts)
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
    p.add_argument("--layouts", nargs="+", default=["one"], choices=list(LAYOUTS),
                   help="the policy over its training ranks: one (1 rank), ddp2, fsdp2 (2 ranks each)")
    p.add_argument("--quick", action="store_true", help="tiny model, rank 8, 2 repetitions")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "lora_sync.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.ranks, args.reps = ["tiny"], [8], 2
    write_result(args.out, asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
