"""Where a 2-rank training step's time goes: ddp against fsdp2, with gloo's own collectives or the exchanges.

Two processes (torch.distributed over gloo, one torch thread each, no Ray: the step alone) build the same model
through :class:`~asyncrl.roles.training.strategy.TrainStrategy` and time, per step, the forwards, the backwards, the
gradient clipping and the AdamW step of ``--micro`` micro-batches per rank (a mean log-prob loss). Variants:

* ``ddp``: torch's DistributedDataParallel (one all-reduce per gradient bucket, in the last micro-batch's backward);
* ``fsdp2``: per-layer shards, FSDP2's all-gathers and reduce-scatters as the strategy's point-to-point exchanges,
  gradients reduce-scattered once per step (in the last micro-batch's backward), the last decoder layer and the
  root kept gathered from their forward to their backward (the strategy's default);
* ``fsdp2:reshard-all``: every unit resharded after its forward (the root and the last layer all-gathered again in
  the backward);
* ``fsdp2:rs-each``: a reduce-scatter in every micro-batch's backward (``fsdp_reduce_every_micro_batch=true``: no
  whole gradient kept across them);
* ``fsdp2:before``: both (the strategy's previous default);
* ``fsdp2+gloo``: gloo's own all-gather and reduce-scatter (FSDP2's defaults) instead of the exchanges;
* ``+keep``: ``fsdp_reshard_after_forward=false`` (no all-gather in the backward).

Every variant runs once per round, in turn; a ratio to ddp is taken within a round; the table shows the medians
over the rounds and the range of the ratio.

::

    python benchmarks/fsdp2_step.py                 # SmolLM2-135M, 2 micro-batches per rank, 3 rounds of 3 steps
    python benchmarks/fsdp2_step.py --micro 1 --variants ddp fsdp2:before fsdp2 fsdp2+gloo fsdp2+keep
    python benchmarks/fsdp2_step.py --quick         # the tiny model, one round
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

VARIANTS = ("ddp", "fsdp2:before", "fsdp2:reshard-all", "fsdp2:rs-each", "fsdp2", "fsdp2+gloo", "fsdp2+keep",
            "fsdp2+gloo+keep")
DEFAULT_VARIANTS = ("ddp", "fsdp2:before", "fsdp2:reshard-all", "fsdp2:rs-each", "fsdp2", "fsdp2+keep")
PARTS = ("forward", "backward", "clip", "optimizer", "step")


def _rank(rank: int, port: int, model: str, variant: str, steps: int, rows: int, seq: int, micro: int,
          out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from asyncrl.roles import SMOLLM2_135M_INSTRUCT, ModelConfig
    from asyncrl.roles._util import DataParallel
    from asyncrl.roles.modeling.device import Placement
    from asyncrl.roles.modeling.models import load_model
    from asyncrl.roles.training.strategy import TrainStrategy

    cfg = (ModelConfig(seed=0, dtype="float32", gguf=SMOLLM2_135M_INSTRUCT) if model == "smollm2" else
           ModelConfig(seed=0, dtype="float32", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                       intermediate_size=1024))
    net, tok = load_model(cfg)
    before = variant.endswith(":before")
    engine = TrainStrategy(net, Placement(torch.device("cpu"), torch.float32, None), DataParallel(rank, 2),
                           variant.split("+")[0].split(":")[0], reshard_after_forward="keep" not in variant,
                           reduce_every_micro_batch=before or variant.endswith(":rs-each"))
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
    times: dict[str, list[float]] = {k: [] for k in PARTS}
    for _ in range(steps):
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
        for k, v in zip(PARTS, (fwd, bwd, t3 - t2, t4 - t3, t4 - t0)):
            times[k].append(v)
    if rank == 0:
        out.put({k: statistics.median(v[1:] or v) for k, v in times.items()})  # the first step warms up
    dist.destroy_process_group()


def measure(model: str, variant: str, steps: int, rows: int, seq: int, micro: int, port: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, port, model, variant, steps, rows, seq, micro, out)) for r in range(2)]
    for p in procs:
        p.start()
    res = out.get()
    for p in procs:
        p.join()
    return res


def table(rounds: list[dict[str, dict[str, float]]]) -> str:
    out = ["| variant | " + " | ".join(f"{k} s" for k in PARTS) + " | vs ddp, median (range) |",
           "|---|" + "---:|" * (len(PARTS) + 1)]
    for v in rounds[0]:
        med = {k: statistics.median(r[v][k] for r in rounds) for k in PARTS}
        ratios = [r[v]["step"] / r["ddp"]["step"] for r in rounds]
        out.append(f"| {v} | " + " | ".join(f"{med[k]:.2f}" for k in PARTS) +
                   f" | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="per variant and round (the first is not timed)")
    p.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per rank and step")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="the tiny model, one round of 2 steps")
    p.add_argument("--out", default=None, help="default: benchmarks/results/fsdp2_step.md (_quick.md with --quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.rounds, args.steps = "tiny", 1, 2
    if args.out is None:
        name = "fsdp2_step_quick.md" if args.quick else "fsdp2_step.md"
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    loads = [os.getloadavg()[0]]
    rounds: list[dict[str, dict[str, float]]] = []
    port = 29400 + os.getpid() % 500
    for i in range(args.rounds):
        rnd = {}
        for v in args.variants:
            port += 1
            rnd[v] = measure(args.model, v, args.steps, args.rows, args.seq, args.micro, port)
            loads.append(os.getloadavg()[0])
            print(f"round {i + 1}, {v}: {rnd[v]['step']:.3f} s", flush=True)
        rounds.append(rnd)
    note = load_note(loads[0], loads[-1]) + f"; between variants: median {statistics.median(loads):.1f}, max {max(loads):.1f}"
    write_result(args.out, f"{run_header('fsdp2_step.py', note)}\n\n{args.model}, {args.micro} micro-batch(es) of "
                           f"{args.rows} rows x {args.seq} tokens per rank, {args.rounds} round(s) of every variant in turn, medians over the rounds.\n\n"
                           f"{table(rounds)}\n")


if __name__ == "__main__":
    main()
