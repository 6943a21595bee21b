"""Multi-turn episodes on one rollout worker: 64 in flight vs one at a time; agents over HTTP vs in-process.

Part ``episodes``: one rollout worker (a Ray process, the tiny model on the CPU) runs the same 64 episodes of the
``char_class_retry`` environment (``--turns`` turns of ``--tokens-per-turn`` tokens, feedback between)
twice: one episode at a time (``max_in_flight=1``) and all 64 in flight, where the request-level
engine batches their pending ``generate`` requests into shared decoding rounds. Throughput counts
model tokens (``response_mask``) per second of the call. Meanwhile the controller's event loop lag
is measured with a 10 ms heartbeat (``LoopLag``), and the worker reports its peak RSS after each run.

Part ``gateway``: one rollout worker (the tiny Qwen2 model with the Qwen2 tokenizer) configured with
``rollout.agent`` (benchmarks/_chat_agent.py: an ``openai``-client chat, ``--turns`` turns of at most
``--tokens-per-turn`` tokens) runs ``--episodes`` agents over HTTP against its gateway, all in flight, and the
same chats as in-process episodes (``generate_episodes(episode=...)``) on the same engine, greedy. Both go
through the worker's one generation seam. Reported: model tokens/s of each and their ratio, how many
trajectories came out identical, and the gateway's added latency per request (the agent's HTTP round trip
minus the engine's time for that request, one session at a time so the two pair up), p50 and p99.

    python benchmarks/agents.py                    # both parts; writes benchmarks/results/agents.md
    python benchmarks/agents.py --part gateway --reps 2   # writes benchmarks/results/agents_gateway.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import ray
import torch
from tensordict import NonTensorStack, TensorDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import asyncrl  # noqa: E402
from asyncrl import Dispatch, RayWorkerGroup, register  # noqa: E402
from asyncrl.pipelines.supervision.heartbeat import LoopLag  # noqa: E402
from asyncrl.roles import ModelConfig, RolloutConfig, RolloutWorker, tiny_tokenizer, toy_dataset  # noqa: E402
from benchmarks._common import load_note, run_header, write_result  # noqa: E402


@dataclass(kw_only=True)
class Args:
    """Benchmark settings."""

    episodes: int = 64
    """Episodes per call (rows of one batch)."""
    turns: int = 4
    """Turns per episode (an episode that gets a turn perfect ends early)."""
    tokens_per_turn: int = 16
    """Model tokens per turn."""
    reps: int = 3
    """Timed calls per mode (median reported), after one warm-up call."""
    output: str = ""
    """Where the markdown table goes (default: benchmarks/results/agents.md, agents_gateway.md for
    ``--part gateway``)."""
    part: str = "both"
    """``episodes``, ``gateway`` or ``both``."""
    latency_sessions: int = 12
    """Sessions run one at a time for the gateway's added latency (``turns`` requests each)."""


class BenchRollout(RolloutWorker):
    """The rollout worker plus its peak resident memory."""

    @register(Dispatch.ONE_TO_ALL)
    def peak_rss_mib(self) -> float:
        """``ru_maxrss`` of this process in MiB (Linux reports KiB)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class GatewayBenchRollout(RolloutWorker):
    """A rollout worker running benchmarks/_chat_agent.py's agent (``rollout.agent``) that also runs the same
    chat as an in-process episode (registered as ``bench_chat``) and times its engine's requests."""

    def __init__(self, *args: object, turns: int = 3, tokens: int = 16, **kwargs: object) -> None:
        os.environ["ASYNCRL_BENCH_TURNS"], os.environ["ASYNCRL_BENCH_TOKENS"] = str(turns), str(tokens)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        from asyncrl.roles.agentic.episodes import register_episode

        self._agent_module = sys.modules[self.requests._episode_fn.agent.__module__]
        register_episode("bench_chat", replace=True)(self._agent_module.chat_episode)
        self.engine_s: list[float] = []

    def _request_engine(self) -> object:
        submit = super()._request_engine()

        async def timed(ids: list[int], params: object, key: str | None = None) -> object:
            t0 = time.perf_counter()
            gen = await submit(ids, params, key=key)
            self.engine_s.append(time.perf_counter() - t0)
            return gen

        return timed

    @register(Dispatch.ONE_TO_ALL)
    def take_timings(self) -> tuple[list[float], list[float]]:
        """``(HTTP round trips, engine times)`` of the requests since the last call, in order; forgets them."""
        trips, engine = list(self._agent_module.ROUND_TRIPS), list(self.engine_s)
        self._agent_module.ROUND_TRIPS.clear()
        self.engine_s.clear()
        return trips, engine


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def batch(n: int) -> TensorDict:
    """`n` char_class prompts (left-padded)."""
    tok = tiny_tokenizer()
    rows = toy_dataset("char_class", n, seed=0)
    enc = tok([r["prompt"] for r in rows], padding=True, return_tensors="pt")
    return TensorDict({"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
                       "prompt": NonTensorStack(*[r["prompt"] for r in rows]),
                       "answer": NonTensorStack(*[r["answer"] for r in rows]), "uid": torch.arange(n)}, batch_size=[n])


async def measure(args: Args) -> dict[str, dict[str, float]]:
    feedback = 12  # " k/n, again:" is at most 12 tiny-tokenizer tokens
    width = args.turns * args.tokens_per_turn + (args.turns - 1) * feedback
    cfg = RolloutConfig(max_new_tokens=width, episode="char_class_retry",
                        episode_kwargs={"max_turns": args.turns, "tokens_per_turn": args.tokens_per_turn})
    model = ModelConfig(seed=0, device="cpu", dtype="float32", autocast="off", num_threads=1)
    out: dict[str, dict[str, float]] = {}
    async with RayWorkerGroup(BenchRollout, world_size=1, args=(model, cfg), name="agents-bench") as g:
        prompts = batch(args.episodes)
        async with LoopLag(interval=0.01) as idle:  # the same heartbeat with no call in flight: the machine's share
            await asyncio.sleep(5.0)
        out["idle (no call)"] = {"loop_lag_max_ms": 1000 * idle.max}
        for mode, in_flight in (("one at a time", 1), (f"{args.episodes} in flight", args.episodes)):
            await g.generate_episodes(prompts[:2], seed=99, max_in_flight=in_flight)  # warm-up
            rates, lags = [], []
            for rep in range(args.reps):
                async with LoopLag(interval=0.01) as lag:
                    t0 = time.perf_counter()
                    res = await g.generate_episodes(prompts, seed=rep, max_in_flight=in_flight)
                    dt = time.perf_counter() - t0
                rates.append(float(res["response_mask"].sum()) / dt)
                lags.append(lag.max)
            (rss,) = await g.peak_rss_mib()
            out[mode] = {"tokens_per_s": statistics.median(rates), "loop_lag_max_ms": 1000 * max(lags),
                         "peak_rss_mib": rss, "turns": float(res["num_turns"].float().mean()),
                         "model_tokens": float(res["response_mask"].sum()),
                         "env_tokens": float((res["attention_mask"][:, -width:].sum() - res["response_mask"].sum()))}
    return out


def chat_batch(n: int, tok: object) -> TensorDict:
    """`n` char_class prompts as the Qwen2 chat template renders them (the agent's first request)."""
    rows = toy_dataset("char_class", n, seed=0)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],  # type: ignore[attr-defined]
                                              add_generation_prompt=True, tokenize=False), add_special_tokens=False)
           for r in rows]
    from asyncrl.roles.generation.rollout_requests import left_pad_prompts

    pid, pmask = left_pad_prompts(ids, int(tok.pad_token_id))  # type: ignore[attr-defined]
    return TensorDict({"prompt_ids": pid, "prompt_mask": pmask, "prompt": NonTensorStack(*[r["prompt"] for r in rows]),
                       "answer": NonTensorStack(*[r["answer"] for r in rows]), "uid": torch.arange(n)}, batch_size=[n])


async def measure_gateway(args: Args) -> dict[str, float]:
    """The gateway part (module docstring)."""
    from asyncrl.roles.modeling.models import load_tokenizer

    here = os.path.dirname(os.path.abspath(__file__))
    width = args.turns * (args.tokens_per_turn + 24)
    cfg = RolloutConfig(max_new_tokens=width, temperature=0.0, agent=os.path.join(here, "_chat_agent.py") + ":chat")
    model = ModelConfig(seed=0, tokenizer="qwen2", device="cpu", dtype="float32", autocast="off", num_threads=1)
    kwargs = {"model": model, "rollout": cfg, "turns": args.turns, "tokens": args.tokens_per_turn}
    chat = {"episode": "bench_chat", "episode_kwargs": asyncrl.Broadcast({"turns": args.turns, "tokens": args.tokens_per_turn})}
    prompts = chat_batch(args.episodes, load_tokenizer("qwen2"))
    out: dict[str, float] = {}
    async with RayWorkerGroup(GatewayBenchRollout, world_size=1, kwargs=kwargs, name="gateway-bench") as g:
        await g.generate_episodes(prompts[:2], seed=99)  # warm-up: starts the gateway
        await g.generate_episodes(prompts[:2], seed=99, **chat)
        await g.take_timings()  # forget the warm-up's (its engine requests are not all the agents')
        await g.generate_episodes(prompts[:args.latency_sessions], seed=98, max_in_flight=1)  # one at a time
        ((trips, engine),) = await g.take_timings()
        added = sorted(t - e for t, e in zip(trips, engine))
        rates: dict[str, list[float]] = {"http": [], "in_process": []}
        same = 0
        for rep in range(args.reps):
            for mode in ("http", "in_process"):
                t0 = time.perf_counter()
                res = await g.generate_episodes(prompts, seed=rep, max_in_flight=args.episodes,
                                                **({} if mode == "http" else chat))
                rates[mode].append(float(res["response_mask"].sum()) / (time.perf_counter() - t0))
                if mode == "http":
                    http = res
            same = sum(torch.equal(http["response_ids"][b], res["response_ids"][b]) and
                       torch.equal(http["response_mask"][b], res["response_mask"][b]) for b in range(args.episodes))
        await g.take_timings()
    q = statistics.quantiles(added, n=100) if len(added) >= 2 else [float("nan")] * 99
    out.update(http=statistics.median(rates["http"]), in_process=statistics.median(rates["in_process"]),
               identical=float(same), p50_ms=1e3 * statistics.median(added), p99_ms=1e3 * q[98],
               latency_requests=float(len(added)))
    return out


def render_gateway(args: Args, r: dict[str, float]) -> list[str]:
    ratio = r["http"] / r["in_process"]
    return [
        "## Agents over HTTP (the gateway) vs the same episodes in process", "",
        f"{args.episodes} chats of {args.turns} turns x at most {args.tokens_per_turn} tokens (tiny Qwen2 model, Qwen2 "
        f"tokenizer, greedy), all in flight on one rollout worker on Ray: `rollout.agent` (the `openai` client against "
        f"the worker's gateway) vs `generate_episodes(episode=...)` on the same engine; median of {args.reps} calls. "
        f"Added latency: HTTP round trip minus the engine's time, {r['latency_requests']:.0f} requests one at a time.", "",
        "| agents | HTTP tokens/s | in-process tokens/s | ratio | identical trajectories | added latency p50 | p99 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {args.episodes} | {r['http']:.0f} | {r['in_process']:.0f} | {ratio:.2f} | {r['identical']:.0f}/{args.episodes} "
        f"| {r['p50_ms']:.1f} ms | {r['p99_ms']:.1f} ms |", "",
        f"Tokens/s over HTTP: **{ratio:.2f}x** in process (target >= 0.8).", ""]


def render(args: Args, res: dict[str, dict[str, float]], note: str) -> str:
    lines = ["# Multi-turn episodes: in flight together vs one at a time; agents over HTTP vs in process", "",
             run_header("agents.py", note), ""]
    if res:
        lines += render_episodes(args, res)
    return "\n".join(lines)


def render_episodes(args: Args, res: dict[str, dict[str, float]]) -> list[str]:
    one, many = res["one at a time"], res[f"{args.episodes} in flight"]
    lines = [
        f"{args.episodes} episodes of `char_class_retry` ({args.turns} turns x {args.tokens_per_turn} tokens, "
        f"feedback between), tiny model on the CPU, one rollout worker on Ray; median of {args.reps} calls.", "",
        "| mode | model tokens/s | speed-up | controller loop lag, max | worker peak RSS | turns/episode |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, r in res.items():
        if "tokens_per_s" not in r:
            lines.append(f"| {mode} | | | {r['loop_lag_max_ms']:.1f} ms | | |")
            continue
        lines.append(f"| {mode} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / one['tokens_per_s']:.1f}x | "
                     f"{r['loop_lag_max_ms']:.1f} ms | {r['peak_rss_mib']:.0f} MiB | {r['turns']:.2f} |")
    lines += ["", f"Speed-up of {args.episodes} in flight: **{many['tokens_per_s'] / one['tokens_per_s']:.1f}x** "
              f"(target >= 4x); worst controller loop lag {max(one['loop_lag_max_ms'], many['loop_lag_max_ms']):.1f} ms "
              f"(target < 50 ms) against {res['idle (no call)']['loop_lag_max_ms']:.1f} ms for the same heartbeat with "
              "no call in flight: on a loaded machine the lag is the process waiting for a core, not the controller's "
              "work (the controller only awaits one call).", ""]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f, d in Args.__dataclass_fields__.items():
        p.add_argument("--" + f.replace("_", "-"), type=type(d.default) if not isinstance(d.default, str) else str,
                       default=d.default)
    args = Args(**vars(p.parse_args()))
    load0 = os.getloadavg()[0]
    asyncrl.init(num_cpus=4)
    if args.part not in ("episodes", "gateway", "both"):
        raise SystemExit(f"--part must be episodes, gateway or both, got {args.part!r}")
    try:
        res = asyncio.run(measure(args)) if args.part != "gateway" else {}
        gw = asyncio.run(measure_gateway(args)) if args.part != "episodes" else None
    finally:
        asyncrl.shutdown()
    text = render(args, res, load_note(load0, os.getloadavg()[0]))
    if gw is not None:
        text += "\n" + "\n".join(render_gateway(args, gw))
    default = "benchmarks/results/agents_gateway.md" if args.part == "gateway" else "benchmarks/results/agents.md"
    write_result(args.output or default, text)


if __name__ == "__main__":
    main()
