"""Where a 2-rank training step's time goes: ddp against fsdp2, with gloo's own collectives or the exchanges.

Two processes (torch.distributed over gloo, one torch thread each, no Ray: the step alone) build the same model
through :class:`~asyncrl.roles.modeling.strategy.TrainStrategy` and time, per step, the forwards, the backwards, the
gradient clipping and the AdamW step of ``--micro`` micro-batches per rank (a mean log-prob loss). Variants:

* ``ddp``: torch's DistributedDataParallel (one all-reduce per gradient bucket, in the last micro-batch's backward);
* ``fsdp2``: per-layer shards, FSDP2's all-gathers and reduce-scatters as the strategy's point-to-point exchanges,
  gradients reduce-scattered once per step (in the last micro-batch's backward), the last decoder layer and the
  root kept gathered from their forward to their backward (the strategy's default);
* ``fsdp2:reshard-all``: every unit resharded after its forward (the root and the last layer all-gathered again in
  the backward);
* ``fsdp2:rs-each``: a reduce-scatter in every micro-batch's backward (``fsdp_reduce_every_micro_batch=true``: no
  whole gradient kept across them);
* ``fsdp2:before``: both, and the exchanges synchronous (the strategy's first policy);
* ``fsdp2:sync``: the exchanges synchronous where FSDP2 calls them (``overlap=False``: no all-gather prefetched ahead
  of its unit, no reduce-scatter finished a unit later);
* ``fsdp2+gloo``: gloo's own all-gather and reduce-scatter (FSDP2's defaults) instead of the exchanges;
* ``+keep``: ``fsdp_reshard_after_forward=false`` (no all-gather in the backward).

Each fsdp2 variant is measured beside ddp: the two variants' processes live side by side (SmolLM2: about 3.7 GB per
ddp rank, up to 3 GB per fsdp2 rank, so one pair of variants at a time), idle while the other runs, and a round is
one step of each in turn (the order alternates), so the two steps compared are seconds apart on a machine whose load
changes by the minute. A ratio to ddp is taken within a round; the table shows the medians over the rounds (a
warm-up round first is dropped) and the ratio's range, with the median step of the ddp beside it.

::

    python benchmarks/fsdp2_step.py                 # SmolLM2-135M, 2 micro-batches per rank, 8 rounds
    python benchmarks/fsdp2_step.py --variants ddp fsdp2:before fsdp2:reshard-all fsdp2:rs-each fsdp2   # each change
    python benchmarks/fsdp2_step.py --micro 1 --variants ddp fsdp2:before fsdp2 fsdp2+gloo fsdp2+keep
    python benchmarks/fsdp2_step.py --micro 1 --variants ddp fsdp2:sync fsdp2   # the exchanges beside the compute
    python benchmarks/fsdp2_step.py --quick         # the tiny model, 3 rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_note, run_header, write_result  # noqa: E402

VARIANTS = ("ddp", "fsdp2:sync", "fsdp2:before", "fsdp2:reshard-all", "fsdp2:rs-each", "fsdp2", "fsdp2+gloo", "fsdp2+keep",
            "fsdp2+gloo+keep")
DEFAULT_VARIANTS = ("ddp", "fsdp2:before", "fsdp2", "fsdp2+keep")
PARTS = ("forward", "backward", "clip", "optimizer", "step")


def _rank(rank: int, port: int, model: str, variant: str, rows: int, seq: int, micro: int, cmds: Any,
          out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from asyncrl.roles import SMOLLM2_135M_INSTRUCT, ModelConfig
    from asyncrl.roles.modeling.parallel import DataParallel
    from asyncrl.roles.modeling.device import Placement
    from asyncrl.roles.modeling.models import load_model
    from asyncrl.roles.modeling.strategy import TrainStrategy

    cfg = (ModelConfig(seed=0, dtype="float32", gguf=SMOLLM2_135M_INSTRUCT) if model == "smollm2" else
           ModelConfig(seed=0, dtype="float32", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                       intermediate_size=1024))
    net, tok = load_model(cfg)
    before = variant.endswith(":before")
    engine = TrainStrategy(net, Placement(torch.device("cpu"), torch.float32, None), DataParallel(rank, 2),
                           variant.split("+")[0].split(":")[0], reshard_after_forward="keep" not in variant,
                           reduce_every_micro_batch=before or variant.endswith(":rs-each"),
                           overlap=not (before or variant.endswith(":sync")))
    if before or variant.endswith(":reshard-all"):  # the root and the last layer resharded after forward too
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in net.modules() if isinstance(m, FSDPModule)]
        for unit in (units[0], units[-1]):  # the root (first in modules()), the last decoder layer
            unit.set_reshard_after_forward(True, recurse=False)
    if "gloo" in variant:  # FSDP2's own collectives instead of the strategy's exchanges
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        for m in net.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(DefaultAllGather())
                m.set_custom_reduce_scatter(DefaultReduceScatter())
    optim = torch.optim.AdamW(net.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(3, len(tok) - 1, (rows, seq), generator=g) for _ in range(micro)]
    out.put(("ready", variant, rank))
    while cmds.get() is not None:  # one step per command
        dist.barrier()
        t0 = time.perf_counter()
        engine.zero_grad(optim)
        fwd = bwd = 0.0
        for i, ids in enumerate(batches):
            with engine.micro_batch(last=i == micro - 1):
                ta = time.perf_counter()
                logits = engine.forward_module(input_ids=ids).logits
                loss = torch.log_softmax(logits.float(), -1)[..., 5].mean()
                tb = time.perf_counter()
                loss.backward()
                fwd, bwd = fwd + tb - ta, bwd + time.perf_counter() - tb
        t2 = time.perf_counter()
        engine.clip_grad_norm(1.0)
        t3 = time.perf_counter()
        optim.step()
        t4 = time.perf_counter()
        out.put(("step", variant, rank, dict(zip(PARTS, (fwd, bwd, t3 - t2, t4 - t3, t4 - t0)))))
    dist.destroy_process_group()


def measure(model: str, variants: list[str], rounds: int, rows: int, seq: int, micro: int, port: int
            ) -> list[dict[str, dict[str, float]]]:
    """Rank 0's times of each variant's step, one dict per round (the first, a warm-up, dropped)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    cmds = {v: [ctx.SimpleQueue(), ctx.SimpleQueue()] for v in variants}
    procs = [ctx.Process(target=_rank, args=(r, port + i, model, v, rows, seq, micro, cmds[v][r], out))
             for i, v in enumerate(variants) for r in range(2)]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get()[0] == "ready"
    results: list[dict[str, dict[str, float]]] = []
    try:
        for i in range(rounds + 1):
            rnd = {}
            for v in variants[i % len(variants):] + variants[:i % len(variants)]:  # the order rotates
                for q in cmds[v]:
                    q.put("step")
                got = [out.get(), out.get()]
                rnd[v] = next(t for kind, name, rank, t in got if rank == 0)
            if i:
                results.append({v: rnd[v] for v in variants})
                print(f"round {i}: " + ", ".join(f"{v} {rnd[v]['step']:.2f} s" for v in variants), flush=True)
    finally:
        for qs in cmds.values():
            for q in qs:
                q.put(None)
        for p in procs:
            p.join()
    return results


def table(sessions: dict[str, list[dict[str, dict[str, float]]]]) -> str:
    """`sessions`: per fsdp2 variant, its rounds beside ddp (``{"ddp": times, variant: times}`` each). Seconds are
    medians within a pair (pairs ran at different times: compare a variant's seconds with its own ddp's)."""
    out = ["| variant | " + " | ".join(f"{k} s" for k in PARTS) + " | ddp beside it: step s | vs ddp, median (range) |",
           "|---|" + "---:|" * (len(PARTS) + 2)]
    for v, rounds in sessions.items():
        med = {k: statistics.median(r[v][k] for r in rounds) for k in PARTS}
        ddp = statistics.median(r["ddp"]["step"] for r in rounds)
        ratios = [r[v]["step"] / r["ddp"]["step"] for r in rounds]
        out.append(f"| {v} | " + " | ".join(f"{med[k]:.2f}" for k in PARTS) + f" | {ddp:.2f} | "
                   f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    p.add_argument("--rounds", type=int, default=8, help="timed steps of each variant, in turn (after a warm-up)")
    p.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per rank and step")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="the tiny model, 3 rounds")
    p.add_argument("--out", default=None, help="default: benchmarks/results/fsdp2_step.md (_quick.md with --quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.rounds = "tiny", 3
    if args.out is None:
        name = "fsdp2_step_quick.md" if args.quick else "fsdp2_step.md"
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    start = os.getloadavg()[0]
    port = 29400 + os.getpid() % 500
    sessions = {v: measure(args.model, ["ddp", v], args.rounds, args.rows, args.seq, args.micro, port + 2 * i)
                for i, v in enumerate(args.variants) if v != "ddp"}
    write_result(args.out, f"{run_header('fsdp2_step.py', load_note(start, os.getloadavg()[0]))}\n\n{args.model}, "
                           f"{args.micro} micro-batch(es) of {args.rows} rows x {args.seq} tokens per rank, "
                           f"{args.rounds} round(s) of one step of each variant and one of ddp beside it, medians "
                           f"over the rounds.\n\n{table(sessions)}\n")


if __name__ == "__main__":
    main()
