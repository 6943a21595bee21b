"""Token-budget micro-batches: ``PolicyWorker.update`` on long-tail response lengths, fixed
micro-batches against a token budget (and activation checkpointing), side by side in one run.

The workload: a real :class:`~asyncrl.roles.PolicyWorker` in this process (a tiny Qwen2 built
from a config, float32, CPU), batches of ``--rows`` rows whose prompts are ``--prompt-min`` to
``--prompt-max`` tokens (left-padded to the longest) and whose responses have the long-tail
lengths of ``benchmarks/longtail.py``: log-normal, median ``--median``, log-space deviation
``--sigma`` (p99/p50 = exp(2.326 sigma) = 16 at 1.2), capped at ``--max-new-tokens``, right-padded
to that cap (the width a rollout returns).

Variants (each its own PolicyWorker, same seed, same batches in the same order):

* ``fixed``: ``micro_batch_size=--micro`` rows per forward/backward, every row as wide as the batch
  (today's default);
* ``budget``: ``max_tokens_per_micro_batch = --micro x the batch width``: the same peak padded
  tokens per forward as ``fixed``, so the same activation memory, but rows grouped by length and
  each micro-batch cut to its own width;
* ``budget+ckpt``: the same with ``model.gradient_checkpointing=true`` (what the memory saving costs).

One repetition updates every variant once on the same batch, the variant order rotating; the
first repetition is a warm-up. Figures: median seconds per update, its ratio to ``fixed``, padded
tokens per update (forward inputs, rows x columns), micro-batches per update, and the largest
weight difference to ``fixed`` at the end (the token budget changes how, not what, it computes).

    python benchmarks/token_budget.py            # the default workload, ~2 minutes on 2 cores
    python benchmarks/token_budget.py --quick    # tiny sizes: the mechanism only (for tests)

Writes ``benchmarks/results/token_budget.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from _common import load_note, parse_variants, run_header, write_result  # noqa: E402  (benchmarks/ is the script dir)
from asyncrl.roles import ModelConfig, OptimConfig, PolicyWorker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "token_budget.md")
VARIANTS = ("fixed", "budget", "budget+ckpt")
COLUMNS = ["variant", "micro-batching", "update s (median)", "vs fixed", "padded tokens/update", "vs fixed tokens",
           "micro-batches/update", "max weight diff vs fixed"]


def make_batches(args: argparse.Namespace, vocab: int) -> list[TensorDict]:
    """``--batches`` batches of the long-tail workload (seeded), with the fields ``update`` reads."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.batches):
        n, R = args.rows, args.max_new_tokens
        prompt = torch.randint(args.prompt_min, args.prompt_max + 1, (n,), generator=g)
        resp = (args.median * torch.exp(args.sigma * torch.randn(n, generator=g))).round().clamp(1, R).long()
        P = args.prompt_max  # every batch as wide, so that one budget means the same for each
        cols = torch.arange(P + R)
        attention = ((cols >= P - prompt[:, None]) & (cols < P + resp[:, None])).long()
        ids = torch.randint(2, vocab, (n, P + R), generator=g) * attention
        mask = attention[:, P:]
        out.append(TensorDict({
            "input_ids": ids, "attention_mask": attention, "response_ids": ids[:, P:], "response_mask": mask,
            "advantages": torch.randn(n, R, generator=g) * mask,
        }, batch_size=[n]))
    return out


def build(variant: str, args: argparse.Namespace, model: ModelConfig, width: int) -> PolicyWorker:
    optim = OptimConfig(lr=1e-4, micro_batch_size=args.micro, max_grad_norm=1.0)
    if variant != "fixed":
        optim = replace(optim, max_tokens_per_micro_batch=args.micro * width)
    return PolicyWorker(replace(model, gradient_checkpointing=variant.endswith("+ckpt")), optim)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 repetitions: the mechanism only")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {','.join(VARIANTS)}")
    p.add_argument("--rows", type=int, default=None, help="rows per batch (default 64; --quick 8)")
    p.add_argument("--micro", type=int, default=8, help="rows per micro-batch of `fixed` (the budget is this x width)")
    p.add_argument("--median", type=float, default=None, help="median response length (default 16; --quick 4)")
    p.add_argument("--sigma", type=float, default=1.2, help="log-space deviation (p99/p50 = exp(2.326 sigma))")
    p.add_argument("--max-new-tokens", type=int, default=None, help="length cap and response width (default 256; "
                                                                    "--quick 32)")
    p.add_argument("--prompt-min", type=int, default=8, help="shortest prompt, tokens")
    p.add_argument("--prompt-max", type=int, default=32, help="longest prompt, tokens")
    p.add_argument("--hidden-size", type=int, default=None, help="tiny model width (default 128; --quick 64)")
    p.add_argument("--num-layers", type=int, default=None, help="tiny model layers (default 4; --quick 2)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, the first a warm-up (default 6; --quick 2)")
    p.add_argument("--batches", type=int, default=3, help="distinct batches, cycled")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    q = args.quick
    args.variants = parse_variants(p, args.variants, VARIANTS)
    args.rows = args.rows or (8 if q else 64)
    args.median = args.median or (4.0 if q else 16.0)
    args.max_new_tokens = args.max_new_tokens or (32 if q else 256)
    args.hidden_size = args.hidden_size or (64 if q else 128)
    args.num_layers = args.num_layers or (2 if q else 4)
    args.reps = args.reps or (2 if q else 6)
    load0 = os.getloadavg()[0]
    model = ModelConfig(seed=0, dtype="float32", autocast="off", device="cpu", hidden_size=args.hidden_size,
                        num_layers=args.num_layers, intermediate_size=4 * args.hidden_size,
                        num_heads=4, num_kv_heads=2, num_threads=args.threads,
                        max_position_embeddings=args.prompt_max + args.max_new_tokens + 8)
    probe = PolicyWorker(model)
    batches = make_batches(args, len(probe.tokenizer))
    for b in batches:
        b.update(probe.compute_log_prob(b).select("old_log_probs"))
    width = batches[0]["input_ids"].shape[1]
    workers = {v: build(v, args, model, width) for v in args.variants}
    shapes: dict[str, list[tuple[int, int]]] = {v: [] for v in args.variants}
    for v, w in workers.items():
        w.model.register_forward_pre_hook(
            lambda m, a, kw, v=v: shapes[v].append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    seconds: dict[str, list[float]] = {v: [] for v in args.variants}
    tokens: dict[str, list[int]] = {v: [] for v in args.variants}
    forwards: dict[str, list[int]] = {v: [] for v in args.variants}
    for rep in range(args.reps):
        batch = batches[rep % len(batches)]
        order = list(args.variants[rep % len(args.variants):]) + list(args.variants[:rep % len(args.variants)])
        for v in order:
            shapes[v].clear()
            t0 = time.perf_counter()
            workers[v].update(batch)
            dt = time.perf_counter() - t0
            if rep > 0:
                seconds[v].append(dt)
                tokens[v].append(sum(r * c for r, c in shapes[v]))
                forwards[v].append(len(shapes[v]))
        print(f"rep {rep}{' (warm-up)' if rep == 0 else ''}: "
              + ", ".join(f"{v} {seconds[v][-1]:.2f} s" for v in args.variants if seconds[v] and rep), flush=True)
    real = statistics.fmean(float(b["attention_mask"].sum()) for b in batches)
    rows = []
    base = "fixed" if "fixed" in args.variants else args.variants[0]
    ref = workers[base].model.state_dict()
    for v in args.variants:
        sd = workers[v].model.state_dict()
        rows.append({"variant": v, "s": statistics.median(seconds[v]), "tokens": statistics.fmean(tokens[v]),
                     "forwards": statistics.fmean(forwards[v]),
                     "dw": max(float((sd[k] - ref[k]).abs().max()) for k in ref)})
    lengths = torch.cat([b["response_mask"].sum(1) for b in batches]).float()
    qs = torch.quantile(lengths, torch.tensor([0.5, 0.99])).tolist()
    sections = [
        "# Token-budget micro-batches: PolicyWorker.update on long-tail lengths",
        run_header("token_budget.py", load_note(load0, os.getloadavg()[0])),
        workload(args, width, qs, real),
        table(rows, base, args),
        verdict(rows, base),
    ]
    write_result(args.out, "\n\n".join(s for s in sections if s) + "\n")


def workload(args: argparse.Namespace, width: int, qs: list[float], real: float) -> str:
    return (
        f"Workload: {args.rows} rows per batch, prompts {args.prompt_min}-{args.prompt_max} tokens, response lengths "
        f"log-normal (median {args.median:g}, sigma {args.sigma:g}: p99/p50 = {math.exp(2.326 * args.sigma):.1f} in "
        f"theory; measured p50 {qs[0]:.0f}, p99 {qs[1]:.0f}), cap {args.max_new_tokens} = the response width, so "
        f"a batch is {width} columns wide and {real:.0f} of its {args.rows * width} tokens are real "
        f"({real / (args.rows * width):.0%}). Tiny Qwen2 from a config: hidden {args.hidden_size}, {args.num_layers} "
        f"layers, float32, CPU, torch threads {torch.get_num_threads()}. One update = one AdamW step on the whole "
        f"batch. {args.reps - 1} timed repetitions after a warm-up, {args.batches} batches cycled, variant order "
        f"rotating. Token budget = {args.micro} x {width} = {args.micro * width} tokens, the padded tokens of one "
        f"fixed micro-batch of {args.micro} rows."
    )


def table(rows: list[dict[str, Any]], base: str, args: argparse.Namespace) -> str:
    by = {r["variant"]: r for r in rows}
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        how = (f"{args.micro} rows" if r["variant"] == "fixed" else "token budget"
               + (" + activation checkpointing" if r["variant"].endswith("+ckpt") else ""))
        out.append("| " + " | ".join([
            r["variant"], how, f"{r['s']:.3f}", f"{r['s'] / by[base]['s']:.2f}x", f"{r['tokens']:,.0f}",
            f"{r['tokens'] / by[base]['tokens']:.2f}x", f"{r['forwards']:.1f}", f"{r['dw']:.1e}",
        ]) + " |")
    return "\n".join(out)


def verdict(rows: list[dict[str, Any]], base: str) -> str:
    by = {r["variant"]: r for r in rows}
    if "budget" not in by or base == "budget":
        return ""
    b = by["budget"]
    line = (f"The token budget takes {b['s'] / by[base]['s']:.2f}x the update time of fixed micro-batches on "
            f"{b['tokens'] / by[base]['tokens']:.0%} of their padded tokens, with the same peak tokens per forward; "
            f"the weights agree within {b['dw']:.0e}.")
    if "budget+ckpt" in by:
        c = by["budget+ckpt"]
        line += (f" Activation checkpointing on top costs {c['s'] / b['s']:.2f}x the budget's time (one more forward "
                 "per layer in the backward) for the same weights.")
    return line


if __name__ == "__main__":
    main()
