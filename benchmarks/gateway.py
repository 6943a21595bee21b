"""The gateway's cost: the same chats over HTTP (the ``openai`` client) and in-process (``llm.generate``).

One in-process rollout worker (the tiny Qwen2 model with the real Qwen2 tokenizer, CPU) runs
``--sessions`` chats of ``--turns`` turns, all in flight at once, twice: through the gateway with the
``openai`` client on loopback, and as the same token sequences submitted to the same request-level
engine directly. Reported: model tokens/s of each and their ratio, and the gateway's added latency per
request (HTTP round trip minus the engine's time for that request, measured one request at a time so
the two are unambiguous), p50 and p99. Greedy sampling, so both runs generate the same tokens.

    python benchmarks/gateway.py                      # 64 sessions x 3 turns
    python benchmarks/gateway.py --sessions 8 --turns 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openai import AsyncOpenAI  # noqa: E402

from asyncrl.roles import RolloutConfig, RolloutWorker  # noqa: E402
from asyncrl.roles.engines import SamplingParams  # noqa: E402
from asyncrl.roles.episodes import LLM, Trajectory  # noqa: E402
from asyncrl.roles.gateway import Gateway  # noqa: E402
from asyncrl.roles.models import ModelConfig  # noqa: E402


async def main(args: argparse.Namespace) -> None:
    rollout = RolloutWorker(ModelConfig(seed=0, tokenizer="qwen2", device="cpu", dtype="float32", autocast="off"),
                            RolloutConfig(max_new_tokens=args.tokens, temperature=0.0))
    engine = rollout._request_engine()
    engine_s: dict[int, float] = {}

    async def timed(ids: list[int], params: SamplingParams) -> object:
        t = time.perf_counter()
        gen = await engine(ids, params)
        engine_s[len(engine_s)] = time.perf_counter() - t
        return gen

    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0, seed=0)
    R = args.turns * (args.tokens + 40)
    gw = Gateway(timed, rollout.tokenizer, params, max_response_tokens=R, context_length=rollout.context_length)
    await gw.start()
    added: list[float] = []
    rows: list[Trajectory] = []

    async def chat(i: int, latency: bool = False) -> None:
        info = gw.open_session(f"{'lat' if latency else 's'}{i}")
        oa = AsyncOpenAI(base_url=info.base_url, api_key=info.key, max_retries=0, timeout=600)
        msgs = [{"role": "user", "content": f"count to {i}"}]
        for turn in range(args.turns):
            n = len(engine_s)
            t = time.perf_counter()
            r = await oa.chat.completions.create(model="m", messages=msgs)
            if latency:  # alone on the engine: the round trip minus the engine's time is the gateway's
                added.append(time.perf_counter() - t - list(engine_s.values())[n])
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
        (rows if not latency else []).extend(gw.close_session(info.id))

    for i in range(max(40 // args.turns, 2)):  # the added latency: one request at a time
        await chat(i, latency=True)
    t0 = time.perf_counter()
    await asyncio.gather(*(chat(i) for i in range(args.sessions)))
    http_s = time.perf_counter() - t0
    await gw.close()
    tokens = sum(len(r.model_ids()) for r in rows)

    # the same token sequences in-process: each row's context before each model turn, submitted in turn order
    async def replay(row: Trajectory) -> int:
        llm = LLM(engine, rollout.tokenizer, params, R)
        m, n, i = row.response_mask, 0, 0
        while i < len(m):
            if m[i]:
                j = i
                while j < len(m) and m[j]:
                    j += 1
                gen = await llm.generate(row.prompt_ids + row.response_ids[:i], max_new_tokens=args.tokens)
                n += len(gen.response_ids)
                i = j
            else:
                i += 1
        return n

    t0 = time.perf_counter()
    direct = sum(await asyncio.gather(*(replay(r) for r in rows)))
    direct_s = time.perf_counter() - t0
    q = statistics.quantiles(added, n=100) if len(added) >= 2 else [float("nan")] * 99
    print(f"| sessions x turns | HTTP tokens/s | in-process tokens/s | ratio | added latency p50 | p99 | measured |")
    print(f"|---|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.sessions} x {args.turns} | {tokens / http_s:.0f} | {direct / direct_s:.0f} | "
          f"{(tokens / http_s) / (direct / direct_s):.2f} | {1e3 * statistics.median(added):.1f} ms | "
          f"{1e3 * q[98]:.1f} ms | {len(added)} requests one at a time |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16, help="the trainer's max_new_tokens per request")
    asyncio.run(main(p.parse_args()))
