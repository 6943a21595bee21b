"""Memory and step time of a training rank: replicated (ddp) against sharded (fsdp2), at 1 and 2 ranks.

Each layout is a real Ray group of PolicyWorker processes (gloo between them) running PPO updates on a
synthetic batch. Per rank it reports:

- the bytes of the parameters, gradients and AdamW state the rank holds (what sharding divides);
- the peak resident memory above the rank's resting level during the updates, and during the second of two
  weight syncs (``stage_weights("object_store")``, steady state: the first also allocates rank 0's kept buffer;
  under fsdp2 every rank gathers the weights one decoder layer at a time, rank 0 packs them in host memory
  for the rollout and puts them into the object store, the others hold one layer at a time);
- the median seconds of an update and of the weight sync.

Layouts: ddp x1, ddp x2, fsdp2 x2, and ``fsdp2+keep`` x2 (``actor.fsdp_reshard_after_forward=false``: the
gathered parameters stay until the backward, one all-gather per layer fewer); on request ``fsdp2:sync`` x2 (the
strategy's exchanges synchronous where FSDP2 calls them, not beside the compute).

::

    python benchmarks/train_memory.py                      # tiny and SmolLM2-135M (~3 minutes on 2 cores)
    python benchmarks/train_memory.py --models large       # ~0.86 B parameters built from a config: fsdp2 at
                                                           # 2 ranks only (two replicas do not fit in 24 GiB)
    python benchmarks/train_memory.py --quick              # the tiny model, one update: a smoke run
    python benchmarks/train_memory.py --models smollm2 --layouts ddp2 fsdp2:sync fsdp2 fsdp2+keep --rounds 3
                                                           # the step ratios alone, three rounds

Every layout runs in turn, ``--rounds`` times: a ratio to ddp x2 is taken within a round (the machine's load
changes between rounds), and the table shows the median ratio and its range.

Torch threads: 2 // ranks per rank, so each layout uses the machine's 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from typing import Any

import ray
import torch
from tensordict import TensorDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_note, run_header, write_result  # noqa: E402

import asyncrl  # noqa: E402
from asyncrl import Dispatch, register  # noqa: E402
from asyncrl.roles import SMOLLM2_135M_INSTRUCT, ModelConfig, OptimConfig, PolicyWorker  # noqa: E402
from asyncrl.roles.modeling.models import tokenizer_for  # noqa: E402

GIB = 1024 ** 3
MODELS = {
    "tiny": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024),
    "smollm2": dict(gguf=SMOLLM2_135M_INSTRUCT),
    "large": dict(hidden_size=2048, num_layers=19, num_heads=16, num_kv_heads=4, intermediate_size=5632,
                  max_position_embeddings=256),
}
"""``large``: ~0.86 B parameters with the tiny tokenizer's vocabulary; a replica with AdamW needs ~16 bytes
per parameter (13.7 GB), so two replicas (27.4 GB) do not fit in this machine's 24 GiB."""


LAYOUTS = {"ddp1": ("ddp", 1), "ddp2": ("ddp", 2), "fsdp2": ("fsdp2", 2), "fsdp2+keep": ("fsdp2+keep", 2),
           "fsdp2:sync": ("fsdp2:sync", 2), "ddp2+fused": ("ddp+fused", 2), "fsdp2+fused": ("fsdp2+fused", 2)}
"""``--layouts``: ``(strategy, ranks)``; ``fsdp2+keep`` is fsdp2 with ``fsdp_reshard_after_forward=false``,
``fsdp2:sync`` fsdp2 with its exchanges synchronous (the strategy's ``overlap=False``), ``+fused`` torch's fused
AdamW (``optimizer_impl=fused``)."""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """Samples this process's resident memory every 2 ms in a thread; ``peak`` above ``base``."""

    def __init__(self) -> None:
        self.base = _rss()
        self.top = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.top = max(self.top, _rss())
            self._stop.wait(0.002)

    def __enter__(self) -> "_Peak":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.top = max(self.top, _rss())

    @property
    def peak(self) -> int:
        return self.top - self.base


class MemoryProbe(PolicyWorker):
    """The policy plus the measurement: updates and a weight sync under a resident-memory sampler (`overlap`: the
    fsdp2 strategy's, false for the ``fsdp2:sync`` layout)."""

    def __init__(self, *args: Any, overlap: bool = True, **kwargs: Any) -> None:
        self._overlap = overlap
        super().__init__(*args, **kwargs)

    def _distribute(self, model: torch.nn.Module, who: str) -> None:
        from asyncrl.roles.modeling.parallel import DataParallel
        from asyncrl.roles.training.policy import _adam
        from asyncrl.roles.modeling.strategy import TrainStrategy

        cfg = self.optim_config
        self.dp = DataParallel(self.rank, self.world_size, self.placement.device)
        self.engine = TrainStrategy(model, self.placement, self.dp, cfg.strategy,
                                    reshard_after_forward=cfg.fsdp_reshard_after_forward, overlap=self._overlap, who=who)
        self.model = self.engine.module
        self.model.train()
        self.optimizer = _adam(self.model, cfg)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def measure(self, batch: TensorDict, steps: int) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        times, peaks = [], []
        for _ in range(steps):
            with _Peak() as p:
                t0 = time.perf_counter()
                self.update(batch)
                times.append(time.perf_counter() - t0)
            peaks.append(p.peak)
        nbytes = lambda ts: sum(local(t).numel() * t.element_size() for t in ts)  # noqa: E731
        held = {"params": nbytes(list(self.model.parameters())),
                "grads": nbytes([p.grad for p in self.model.parameters() if p.grad is not None]),
                "optim": nbytes([v for st in self.optimizer.state.values() for v in st.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0])}
        self.optimizer.zero_grad(set_to_none=True)
        sync_times, sync_peaks = [], []
        for _ in range(2):
            with _Peak() as p:
                t0 = time.perf_counter()
                handle = self.stage_weights("object_store")
                sync_times.append(time.perf_counter() - t0)
            sync_peaks.append(p.peak)
            del handle
        return {"held": held, "step_s": statistics.median(times[1:] or times), "step_peak": max(peaks),
                "sync_s": min(sync_times), "sync_peak": sync_peaks[-1], "rss": _rss(),  # the steady (second) sync
                "params": sum(local(p).numel() for p in self.model.parameters())}


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    return TensorDict({"input_ids": ids, "attention_mask": mask, "response_ids": ids[:, prompt:],
                       "response_mask": mask[:, prompt:], "old_log_probs": torch.full((rows, response), -5.0),
                       "advantages": torch.randn(rows, response, generator=g)}, batch_size=[rows])


async def measure(model: str, layout: str, ranks: int, steps: int, rows: int, prompt: int, response: int
                  ) -> dict[str, Any]:
    strategy, _, extra = layout.partition("+")  # "fsdp2+keep": fsdp_reshard_after_forward=false; "+fused": fused AdamW
    strategy, _, sync = strategy.partition(":")  # "fsdp2:sync": the exchanges synchronous
    cfg = ModelConfig(seed=0, dtype="float32", num_threads=max(1, 2 // ranks), **MODELS[model])  # type: ignore[arg-type]
    optim = OptimConfig(lr=1e-5, micro_batch_size=max(1, rows // ranks), strategy=strategy,  # type: ignore[arg-type]
                        fsdp_reshard_after_forward=extra != "keep",
                        optimizer_impl="fused" if extra == "fused" else "foreach")
    group = asyncrl.colocate({"policy": (MemoryProbe, (cfg, optim), {"overlap": sync != "sync"})}, world_size=ranks,
                             name=f"mem-{model}-{strategy}{'-' + extra if extra else ''}{'-sync' if sync else ''}-{ranks}")
    await group.setup()
    vocab = len(tokenizer_for(cfg))
    try:
        res = await group["policy"].measure(batch(vocab, rows, prompt, response), steps)
    finally:
        await group.close()
    return {"model": model, "strategy": layout, "ranks": ranks, "per_rank": res}


def _step(r: dict[str, Any]) -> float:
    return statistics.mean(x["step_s"] for x in r["per_rank"])


def table(rounds: list[list[dict[str, Any]]]) -> str:
    """One row per layout: its bytes, and its medians over the rounds (each round ran every layout in turn, so a
    ratio to ddp x2 is taken within a round, then the median and the range of those ratios)."""
    out = ["| model | layout | parameters | params + grads + AdamW / rank (GiB) | vs replicated | peak RSS in update "
           "(GiB, max rank) | update s | vs ddp x2 (median; min-max over rounds) | sync s (rank 0) | vs ddp x2 | "
           "peak RSS in sync, rank 0 / others (GiB) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    key = lambda r: (r["model"], r["strategy"], r["ranks"])  # noqa: E731
    order = [key(r) for r in rounds[0]]
    by = {k: [next(r for r in rnd if key(r) == k) for rnd in rounds] for k in order}
    for k in order:
        model, layout, n = k
        runs = by[k]
        ranks = runs[0]["per_rank"]
        held = max(sum(x["held"].values()) for x in ranks)
        one = by.get((model, "ddp", 1))
        two = by.get((model, "ddp", 2))
        vs_held = f"{held / max(sum(x['held'].values()) for x in one[0]['per_rank']):.2f}" if one else "-"
        step = statistics.median(_step(r) for r in runs)
        sync = statistics.median(r["per_rank"][0]["sync_s"] for r in runs)
        vs_step = vs_sync = "-"
        if two and n == 2:
            ratios = [_step(r) / _step(b) for r, b in zip(runs, two)]
            vs_step = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            syncs = [r["per_rank"][0]["sync_s"] / b["per_rank"][0]["sync_s"] for r, b in zip(runs, two)]
            vs_sync = f"{statistics.median(syncs):.2f}x"
        params = (sum(x["params"] for x in ranks) if layout.startswith("fsdp2") and n > 1 else ranks[0]["params"])
        peak = statistics.median(max(x["step_peak"] for x in r["per_rank"]) for r in runs)
        peak0 = statistics.median(r["per_rank"][0]["sync_peak"] for r in runs)
        others = statistics.median(max((x["sync_peak"] for x in r["per_rank"][1:]), default=0) for r in runs)
        out.append(f"| {model} | {layout} x{n} | {params / 1e6:.0f} M | {held / GIB:.3f} | {vs_held} | "
                   f"{peak / GIB:.3f} | {step:.3f} | {vs_step} | {sync:.3f} | {vs_sync} | {peak0 / GIB:.3f} / "
                   f"{others / GIB:.3f} |")
    return "\n".join(out)


async def main_async(args: argparse.Namespace) -> str:
    asyncrl.init(num_cpus=4)
    rounds: list[list[dict[str, Any]]] = [[] for _ in range(args.rounds)]
    loads = [os.getloadavg()[0]]
    try:
        for model in args.models.split(","):
            layouts = [("fsdp2", 2)] if model == "large" else [LAYOUTS[name] for name in args.layouts]
            for i, rnd in enumerate(rounds):  # every layout in turn, round after round: ratios within a round
                for strategy, ranks in layouts:
                    print(f"{model}: round {i + 1}, {strategy} x{ranks} ...", flush=True)
                    rnd.append(await measure(model, strategy, ranks, args.steps, args.rows, args.prompt, args.response))
                    loads.append(os.getloadavg()[0])
    finally:
        asyncrl.shutdown()
    n = MODELS["large"]
    rows = rounds[0]
    note = ""
    if "large" in args.models:
        p = rows[-1]["per_rank"][0]["params"] * 2
        note = (f"\n\n`large` has {p / 1e9:.2f} B parameters: a replica with AdamW in fp32 holds 16 bytes per parameter, "
                f"{16 * p / 1e9:.1f} GB, so two replicas ({32 * p / 1e9:.1f} GB) need more than this machine's "
                f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GIB:.0f} GiB; fsdp2 at 2 ranks holds half "
                f"of one replica per rank (config: {n}).")
    spread = f"; 1-minute load average between layouts: median {statistics.median(loads):.1f}, max {max(loads):.1f}"
    return (f"{run_header('train_memory.py', load_note(loads[0], loads[-1]) + spread)}\n\n"
            f"Batch: {args.rows} rows x ({args.prompt} prompt + {args.response} response) tokens, {args.steps} updates "
            f"per layout (the first is not timed), {args.rounds} round(s) of every layout in turn; times are medians "
            f"over the rounds.\n\n{table(rounds)}{note}\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,smollm2", help=f"comma-separated of {sorted(MODELS)}")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="every layout in turn, this many times (ratios per round)")
    p.add_argument("--layouts", nargs="+", default=[k for k in LAYOUTS if not k.endswith("+fused")], choices=list(LAYOUTS),
                   help="which layouts (not for --models large: fsdp2 x2 only)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=48)
    p.add_argument("--response", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="the tiny model, 2 updates")
    p.add_argument("--out", default="benchmarks/results/train_memory.md")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.rounds = "tiny", 2, 1
        args.out = args.out.replace(".md", "_quick.md")
    write_result(args.out, asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
