"""The gateway part of benchmarks/agents.py: a chat agent on the ``openai`` client (``rollout.agent``) and
the same chat as an in-process episode, so one rollout worker can run both on one engine.

Each chat asks the row's prompt, then ``turns - 1`` times "again", at most ``tokens`` model tokens a turn
(the worker sets ``ASYNCRL_BENCH_TURNS`` / ``ASYNCRL_BENCH_TOKENS``). The episode appends, between turns,
the tokens the gateway appends for the agent's next message (the rendered new messages), so under greedy
sampling both produce the same trajectories."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
from openai import AsyncOpenAI

from asyncrl.roles.agentic.episodes import LLM, Sample, Trajectory

NEXT = "again"
ROUND_TRIPS: list[float] = []
"""Seconds of each request's HTTP round trip, in order (read by the benchmark's worker)."""
_HTTP: dict[str, Any] = {}  # one connection pool for every session: a client of its own costs ~65 ms of CPU


def settings() -> tuple[int, int]:
    """``(turns, tokens per turn)``."""
    return int(os.environ.get("ASYNCRL_BENCH_TURNS", "3")), int(os.environ.get("ASYNCRL_BENCH_TOKENS", "16"))


async def chat(sample: Sample, base_url: str) -> float:
    """The agent: one conversation over HTTP."""
    turns, tokens = settings()
    if "pool" not in _HTTP:
        _HTTP["pool"] = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None))
    client = AsyncOpenAI(base_url=base_url, api_key=base_url.api_key, max_retries=0,  # type: ignore[attr-defined]
                         http_client=_HTTP["pool"])
    msgs = [{"role": "user", "content": sample.prompt or ""}]
    for _ in range(turns):
        t0 = time.perf_counter()
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=tokens)  # type: ignore[arg-type]
        ROUND_TRIPS.append(time.perf_counter() - t0)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content or ""}, {"role": "user", "content": NEXT}]
    return 0.0


async def chat_episode(llm: LLM, sample: Sample, *, turns: int, tokens: int) -> Trajectory:
    """The same conversation in process: generate, append the next user message's template tokens."""
    traj = llm.start(sample)
    end = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for t in range(turns):
        gen = await llm.generate(traj, max_new_tokens=tokens)
        if t < turns - 1:
            closed = gen.response_ids[-1:] == [end]
            traj.observe(llm.encode(("" if closed else "<|im_end|>") +
                                    f"\n<|im_start|>user\n{NEXT}<|im_end|>\n<|im_start|>assistant\n"))
    return traj
