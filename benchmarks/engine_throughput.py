"""The rollout engine's throughput: the HF engine against plain ``transformers`` ``generate``, same batch.

For each batch size (``--batches``, default 1, 16, 64) both sample ``--new-tokens`` tokens (20) per
prompt from the same model and the same left-padded prompts, at temperature ``--temperature`` (0.7),
in this process on ``--threads`` torch threads (1):

* ``HF engine``: ``asyncrl.roles.make_engine("hf", ...)``'s ``generate`` (what the rollout worker runs),
  with its EOS id set to -1 so every row runs the full ``--new-tokens`` (the same work in both);
* ``HF engine, before the fix``: the same engine computing the LM head on every prompt position at
  the prefill (as it did; now only the last position's, as ``generate`` does);
* ``transformers generate``: ``model.generate(input_ids, attention_mask, do_sample=True,
  temperature=..., max_new_tokens=N, min_new_tokens=N)`` (EOS suppressed the library's way).

Tokens/s counts generated tokens (batch x new tokens) over the wall time of the call. The variants
alternate within each repetition (ABAB...); the table shows medians. The machine is shared: read the
ratio, not the absolute numbers.

    python benchmarks/engine_throughput.py                        # SmolLM2-135M, batch 1/16/64, 3 reps
    python benchmarks/engine_throughput.py --model tiny --reps 5
    python benchmarks/engine_throughput.py --quick                # tiny model, batch 1 and 4, one rep

Writes the table to ``benchmarks/results/engine_throughput.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_note, run_header, write_result  # noqa: E402

from asyncrl.roles import ModelConfig, SamplingParams, load_model, make_engine  # noqa: E402

PROMPTS = [f"Question: what is {a} + {b}? Answer with the number only." for a, b in
           ((12, 35), (7, 8), (120, 44), (3, 991), (56, 56), (1, 2), (80, 19), (305, 7))]


def model_config(name: str, threads: int) -> ModelConfig:
    if name == "tiny":
        return ModelConfig(seed=0, device="cpu", dtype="float32", autocast="off", num_threads=threads)
    from asyncrl.roles.modeling.gguf import SMOLLM2_135M_INSTRUCT

    return ModelConfig(gguf=SMOLLM2_135M_INSTRUCT, device="cpu", dtype="float32", num_threads=threads)


def batch_prompts(tok: Any, n: int) -> list[list[int]]:
    """`n` prompts (the PROMPTS cycled, each with its index so rows differ), tokenized."""
    return [tok(f"{PROMPTS[i % len(PROMPTS)]} ({i})")["input_ids"] for i in range(n)]


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    return ids, mask


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--new-tokens", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny model, batch 1 and 4, one repetition")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "engine_throughput.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.batches, args.reps, args.new_tokens = "tiny", [1, 4], 1, 8
    load0 = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    model, tok = load_model(model_config(args.model, args.threads))
    model.eval()
    engine = make_engine("hf", model=model, tokenizer=tok, model_dir=None, max_batch_size=max(args.batches))
    engine.eos_id = -1  # never stops early: the same number of tokens as generate with min_new_tokens
    before = make_engine("hf", model=model, tokenizer=tok, model_dir=None, max_batch_size=max(args.batches))
    before.eos_id, before._keep_last = -1, {}  # the engine before the fix: the LM head on every prompt position
    pad = engine.pad_id
    n_new, temp = args.new_tokens, args.temperature

    def run_engine(prompts: list[list[int]]) -> int:
        out = asyncio.run(engine.generate(prompts, SamplingParams(max_new_tokens=n_new, temperature=temp, seed=0)))
        return sum(len(c.response_ids) for c in out)

    def run_before(prompts: list[list[int]]) -> int:
        out = asyncio.run(before.generate(prompts, SamplingParams(max_new_tokens=n_new, temperature=temp, seed=0)))
        return sum(len(c.response_ids) for c in out)

    def run_generate(prompts: list[list[int]]) -> int:
        ids, mask = left_pad(prompts, pad)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temp, top_k=0,
                                 top_p=1.0, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=pad)
        return int(out.shape[1] - ids.shape[1]) * len(prompts)

    variants: dict[str, Callable[[list[list[int]]], int]] = {"HF engine": run_engine,
                                                             "HF engine, before the fix": run_before,
                                                             "transformers generate": run_generate}
    rows = []
    for b in args.batches:
        prompts = batch_prompts(tok, b)
        for fn in variants.values():  # warm-up
            fn(prompts[: min(b, 2)])
        times: dict[str, list[float]] = {k: [] for k in variants}
        tokens: dict[str, int] = {}
        names = list(variants)
        for r in range(args.reps):
            for k in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                tokens[k] = variants[k](prompts)
                times[k].append(time.perf_counter() - t0)
        ref = statistics.median(times["transformers generate"])
        for k in names:
            m = statistics.median(times[k])
            rows.append(f"| {b} | {k} | {tokens[k]} | {m:.3f} | {min(times[k]):.3f}–{max(times[k]):.3f} | "
                        f"{tokens[k] / m:.1f} | {ref / m:.2f}x |")
        print(*rows[-len(names):], sep="\n", flush=True)
    load1 = os.getloadavg()[0]
    head = ["| batch | variant | tokens | median s | min–max s | tokens/s | speed vs generate |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    text = (run_header("engine_throughput.py", load_note(load0, load1),
                       extra=f", transformers {__import__('transformers').__version__}") + "\n\n"
            + f"Model `{args.model}`, {n_new} new tokens per prompt, temperature {temp}, {args.threads} torch "
              f"thread(s), {args.reps} repetition(s) after a warm-up.\n\n"
            + "\n".join(head + rows) + "\n")
    write_result(args.out, text)


if __name__ == "__main__":
    main()
