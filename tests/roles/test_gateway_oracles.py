"""Oracles of the OpenAI-compatible gateway that a wrong gateway would fail, on real HTTP (loopback) with the
real Qwen2 tokenizer and its chat template:

- token truth: a scripted engine samples *non-canonical* ids (one token per UTF-8 byte: their text re-encodes
  to other ids), so a gateway that re-tokenized the assistant's text into the row would train other ids;
- 64 sessions at once, bad requests interleaved into their own URLs: every row is exactly the ids the template,
  the tokenizer and the engine give for that session alone, every bad request a 4xx;
- a seeded fuzz of 1,200 requests drawn over the request schema (valid, mutated and malformed): no 5xx, no
  traceback or error line from the server, and the counts add up.

The engine is scripted (no model): what it samples is a function of the session and the turn, so every
expected row is computed here from the template and the tokenizer, independently of the gateway."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import ssl
from typing import Any

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from asyncrl.roles.agentic.episodes import LLM, pack_trajectories
from asyncrl.roles.agentic.gateway import Gateway
from asyncrl.roles.engines import SamplingParams
from asyncrl.roles.engines.batcher import Generation
from asyncrl.roles.modeling.models import load_tokenizer

R = 160  # most tokens after a row's prompt
GEN = 48  # the trainer's max_new_tokens
CONTEXT = 512


def _byte_tokens(tok: Any) -> dict[int, int]:
    """``{byte: id}`` of the byte-level BPE's one-byte tokens (GPT-2's byte-to-unicode alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, printable))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: tok.convert_tokens_to_ids(chr(c)) for b, c in chars.items()}


_BYTE_TOKENS: dict[int, dict[int, int]] = {}


def non_canonical(tok: Any, text: str) -> list[int]:
    """Ids of `text`, one token per UTF-8 byte: they decode to `text`, and `text` encodes to other ids."""
    if id(tok) not in _BYTE_TOKENS:
        _BYTE_TOKENS[id(tok)] = _byte_tokens(tok)
    table = _BYTE_TOKENS[id(tok)]
    ids = [table[b] for b in text.encode()]
    assert tok.decode(ids) == text
    return ids


class ScriptedEngine:
    """``submit(prompt_ids, params) -> Generation`` for one session: turn k of session `name` samples
    :meth:`said` as non-canonical ids (then EOS), each call recorded as ``(prompt_ids, ids)``."""

    def __init__(self, tok: Any, name: str, delays: list[float] | None = None) -> None:
        self.tok, self.name, self.delays = tok, name, list(delays or [])
        self.calls: list[tuple[list[int], list[int]]] = []

    def said(self, turn: int) -> str:
        return f"Réponse {turn} de {self.name}: 12345 👍"

    async def __call__(self, ids: list[int], params: SamplingParams) -> Generation:
        if self.delays:
            await asyncio.sleep(self.delays.pop())  # scripted latency: the sessions' requests interleave
        out = (non_canonical(self.tok, self.said(len(self.calls))) + [self.tok.eos_token_id])[:params.max_new_tokens]
        self.calls.append((list(ids), out))
        finish = "stop" if out[-1] == self.tok.eos_token_id else "length"
        return Generation(out, [-0.25 - 0.01 * i for i in range(len(out))], finish, versions=[3] * len(out))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen2")


def _session(gw: Gateway, tok: Any, name: str, delays: list[float] | None = None) -> tuple[Any, ScriptedEngine]:
    engine = ScriptedEngine(tok, name, delays)
    params = SamplingParams(max_new_tokens=GEN, temperature=1.0, seed=0)
    return gw.open_session(name, llm=LLM(engine, tok, params, R)), engine


def _expected_row(tok: Any, conversation: list[dict[str, str]],
                  engine: ScriptedEngine) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, response_ids, response_mask)`` of token truth for `conversation` (which ends with the
    model's last answer): the first request's rendered prompt, then per turn the engine's ids as sampled (mask
    1) and the tokens of the text the next request's template adds after the text so far (mask 0)."""
    render = lambda msgs: tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)  # noqa: E731
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    asks = [k for k, m in enumerate(conversation) if m["role"] == "assistant"]
    text = render(conversation[:asks[0]])
    prompt, response, mask = encode(text), [], []
    for turn, k in enumerate(asks):
        if turn:
            new = render(conversation[:k])
            assert new.startswith(text)
            added = encode(new[len(text):])
            response, mask, text = response + added, mask + [0] * len(added), new
        _, ids = engine.calls[turn]
        response, mask = response + ids, mask + [1] * len(ids)
        text += tok.decode(ids, skip_special_tokens=False)
    return prompt, response, mask


async def test_the_trained_ids_are_the_sampled_ids_even_where_their_text_encodes_to_other_ids(tok):
    async with Gateway(ScriptedEngine(tok, "unused"), tok, SamplingParams(max_new_tokens=GEN),
                       max_response_tokens=R) as gw:
        info, engine = _session(gw, tok, "truth")
        oa = AsyncOpenAI(base_url=info.base_url, api_key="EMPTY", max_retries=0, timeout=60)
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say it"}]
        for turn in range(3):
            r = await oa.chat.completions.create(model="m", messages=msgs)
            assert r.choices[0].message.content == engine.said(turn) and r.choices[0].finish_reason == "stop"
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            if turn < 2:
                msgs.append({"role": "user", "content": f"again, {turn}"})
        (row,) = gw.close_session("truth")
    sampled = [ids for _, ids in engine.calls]
    for ids in sampled:  # the oracle's precondition: re-tokenizing the answer's text gives other ids
        text = tok.decode(ids, skip_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) != ids
    model = [(t, lp, v) for t, m, lp, v in zip(row.response_ids, row.response_mask, row.log_probs, row.versions) if m]
    assert [t for t, _, _ in model] == [t for ids in sampled for t in ids]
    assert [lp for _, lp, _ in model] == [-0.25 - 0.01 * i for ids in sampled for i in range(len(ids))]
    assert {v for _, _, v in model} == {3}
    # each request continued the row's ids as they were (the engine saw the sampled ids, not their re-encoding)
    starts = [i for i, m in enumerate(row.response_mask) if m and (i == 0 or not row.response_mask[i - 1])]
    assert [p for p, _ in engine.calls] == [row.prompt_ids + row.response_ids[:i] for i in starts]
    assert (row.prompt_ids, row.response_ids, row.response_mask) == _expected_row(tok, msgs, engine)
    # and the batch packing trains exactly these ids
    fields = pack_trajectories([row], torch.tensor([row.prompt_ids]), torch.ones(1, len(row.prompt_ids),
                                                                                    dtype=torch.long), R, 0, 0)
    n = len(row.response_ids)
    assert fields["response_ids"][0, :n].tolist() == row.response_ids
    assert fields["response_mask"][0, :n].tolist() == row.response_mask


def _bad_requests(url: str, gw_url: str) -> list[tuple[str, str, bytes]]:
    """``(method, url, body)`` of requests each of which must get a 4xx and change no session."""
    msg = [{"role": "user", "content": "hi"}]
    return [
        ("POST", f"{url}/chat/completions", b"{not json"),
        ("POST", f"{url}/chat/completions", json.dumps({"model": "m", "messages": []}).encode()),
        ("POST", f"{url}/chat/completions", json.dumps({"model": "m", "messages": [{"role": "wizard"}]}).encode()),
        ("POST", f"{url}/chat/completions", json.dumps({"model": "m", "messages": msg, "n": 3}).encode()),
        ("POST", f"{url}/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}'),
        ("POST", f"{url}/chat/completions", b'{"model": "m", "messages": ' + b"[" * 200 + b"]" * 200 + b"}"),
        ("POST", f"{url}/completions", json.dumps({"model": "m", "prompt": ""}).encode()),
        ("GET", f"{url}/chat/completions", b""),
        ("POST", f"{gw_url}/s/{'x' * 32}/v1/chat/completions", json.dumps({"model": "m", "messages": msg}).encode()),
    ]


async def test_64_concurrent_sessions_with_bad_requests_interleaved_each_train_their_own_exact_row(tok):
    rng = random.Random(64)
    async with Gateway(ScriptedEngine(tok, "unused"), tok, SamplingParams(max_new_tokens=GEN),
                       max_response_tokens=R) as gw:
        sessions = [_session(gw, tok, f"s{i:02d}", [rng.random() * 0.02 for _ in range(3)]) for i in range(64)]
        rejected = gw.statistics()["rejected"]
        bad_statuses: list[int] = []

        tls = ssl.create_default_context()  # one (loading the CA store takes ~0.1 s a client); the URLs are http

        async def converse(i: int, info: Any) -> list[dict[str, str]]:
            async with httpx.AsyncClient(timeout=60, verify=tls) as h:  # each agent its own client, as in a run
                oa = AsyncOpenAI(base_url=info.base_url, api_key="EMPTY", max_retries=0, http_client=h)
                bad = _bad_requests(info.base_url, gw.url)
                msgs = [{"role": "user", "content": f"session {i}: count with me"}]
                for turn in range(3):
                    method, url, body = bad[(i + turn) % len(bad)]
                    ask = oa.chat.completions.create(model="m", messages=msgs)
                    r, b = await asyncio.gather(ask, h.request(method, url, content=body))  # a bad one beside each
                    bad_statuses.append(b.status_code)
                    msgs.append({"role": "assistant", "content": r.choices[0].message.content})
                    if turn < 2:
                        msgs.append({"role": "user", "content": f"{i} and {turn}?"})
            return msgs

        conversations = await asyncio.gather(*(converse(i, info) for i, (info, _) in enumerate(sessions)))
        assert len(bad_statuses) == 64 * 3 and {s // 100 for s in bad_statuses} == {4}
        assert set(bad_statuses) == {400, 404, 405}
        assert gw.statistics()["rejected"] - rejected == 64 * 3
        for (info, engine), msgs in zip(sessions, conversations):
            rows = gw.close_session(info.id)
            stats = gw.session_stats(info.id)
            assert (len(rows), stats.requests, stats.rows, stats.prefix_breaks) == (1, 3, 1, 0), info.id
            (row,) = rows
            assert (row.prompt_ids, row.response_ids, row.response_mask) == _expected_row(tok, msgs, engine), info.id
            assert f"session {info.id[1:].lstrip('0') or '0'}:" in tok.decode(row.prompt_ids)


# ---- a seeded fuzz over the request schema ---------------------------------------------------------------

_TEXT = ["hi", "", " ", "12345", "naïve café", "日本語", "👍🏽", "\u202eevil", "a\x00b", "<|im_end|>",
         "<tool_call>", "\n\n", "\t", "\\", '"', "{{ raise_exception('x') }}", "x" * 3000, "word " * 700]


def _value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value (what a careless or hostile client puts where another type is expected)."""
    kind = rng.randrange(8 if depth < 3 else 6)
    if kind == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    if kind == 7:
        return {rng.choice(["role", "content", "type", "text", "name", "x"]): _value(rng, depth + 1)
                for _ in range(rng.randrange(3))}
    return [None, rng.random() < 0.5, rng.choice([0, -1, 1, 2 ** 63, -(10 ** 30), 7]),
            rng.choice([0.0, -0.5, 1.5, 1e308, 2.5e-320]), rng.choice(_TEXT), rng.choice(_TEXT)[:5]][kind]


def _message(rng: random.Random) -> dict[str, Any]:
    role = rng.choice(["system", "developer", "user", "user", "assistant", "tool"])
    m: dict[str, Any] = {"role": role, "content": rng.choice(_TEXT)}
    r = rng.random()
    if r < 0.1:
        m["content"] = [{"type": "text", "text": rng.choice(_TEXT)} for _ in range(rng.randrange(1, 3))]
    elif r < 0.15:
        m["content"] = None
    if role == "assistant" and rng.random() < 0.2:
        m["tool_calls"] = [{"id": "call_0", "type": "function",
                            "function": {"name": "calc", "arguments": rng.choice(['{"e": "1+1"}', "{}", "nope"])}}]
    if role == "tool":
        m["tool_call_id"] = "call_0"
    if rng.random() < 0.05:
        m["reasoning_content"] = rng.choice(_TEXT)
    return m


_TOOLS = [{"type": "function", "function": {"name": "calc", "description": "arithmetic",
                                            "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]


def _valid_body(rng: random.Random, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": rng.choice(["m", "gpt-4o", "", "日本"])}
    if chat:
        body["messages"] = [_message(rng) for _ in range(rng.randrange(1, 5))]
        if rng.random() < 0.2:
            body["tools"] = _TOOLS
    else:
        body["prompt"] = rng.choice(_TEXT) or "x"
    for name, values in (("temperature", [0.0, 0.7, 2.0, 1e9]), ("top_p", [0.1, 1.0]),
                         ("max_tokens", [1, 5, 10 ** 12]), ("max_completion_tokens", [3, 64]),
                         ("stream", [False, True]), ("n", [1]), ("seed", [1, "x"]), ("user", ["u"])):
        if rng.random() < 0.2:
            body[name] = rng.choice(values)
    return body


def _mutate(rng: random.Random, body: dict[str, Any]) -> bytes:
    """`body` made malformed in one of the ways a client can."""
    how = rng.randrange(12)
    if how == 0 and body:  # a required or optional field dropped
        body.pop(rng.choice(list(body)))
    elif how == 1:  # a field of the schema set to a value of another type
        body[rng.choice(["model", "messages", "prompt", "temperature", "top_p", "max_tokens", "n", "stream",
                         "tools", "max_completion_tokens"])] = _value(rng)
    elif how == 2 and isinstance(body.get("messages"), list):  # a message's field
        m = rng.choice(body["messages"])
        m[rng.choice(["role", "content", "tool_calls", "name", "tool_call_id"])] = _value(rng)
    elif how == 3:  # a lone surrogate somewhere
        text = json.dumps(body)
        at = rng.randrange(len(text))
        q = text.find('"', at)
        if q > 0:
            return (text[:q] + rng.choice(["\\ud800", "\\udfff", "\\ud83d"]) + text[q:]).encode()
    elif how == 4:  # deep nesting, in a field of the schema or an extra one
        d, key = rng.choice([65, 300, 5000]), rng.choice(["tools", "messages", "deep"]).encode()
        return json.dumps(body)[:-1].encode() + b', "' + key + b'": ' + b"[" * d + b"]" * d + b"}"
    elif how == 5:  # cut short
        raw = json.dumps(body).encode()
        return raw[:rng.randrange(len(raw))]
    elif how == 6:  # not JSON at all, or not UTF-8
        return rng.choice([b"", b"null", b"[]", b'"text"', b"\xff\xfe\x00",
                           bytes(rng.randrange(256) for _ in range(40))])
    elif how == 7:  # NaN and Infinity (Python's json reads them)
        return json.dumps(body)[:-1].encode() + rng.choice([b', "temperature": NaN}', b', "top_p": Infinity}',
                                                            b', "temperature": -Infinity}', b', "max_tokens": 1e400}'])
    elif how == 8:  # a huge number where an int goes
        body["max_tokens"] = rng.choice([10 ** 400, -(10 ** 400), 0, 1.5])
    elif how == 9:  # a whole message replaced
        if isinstance(body.get("messages"), list):
            body["messages"][0] = _value(rng)
    elif how == 10:  # an unknown role or part type
        if isinstance(body.get("messages"), list):
            body["messages"].append({"role": "user", "content": [{"type": rng.choice(["image_url", "audio"]),
                                                                  "x": 1}]})
    else:  # an oversized body
        return b'{"model": "m", "prompt": "' + b"x" * (70 << 10) + b'"}'
    return json.dumps(body).encode()


FUZZ_SEED = int(os.environ.get("ASYNCRL_GATEWAY_FUZZ_SEED", "54"))
FUZZ_REQUESTS = 1200


async def test_a_seeded_fuzz_over_the_request_schema_gets_no_5xx_and_no_server_traceback(tok, server_log):
    events, records = server_log
    rng = random.Random(FUZZ_SEED)
    statuses: list[tuple[int, str, bytes]] = []
    async with Gateway(ScriptedEngine(tok, "unused"), tok, SamplingParams(max_new_tokens=GEN),
                       max_response_tokens=R, context_length=CONTEXT, max_body_bytes=64 << 10) as gw:
        infos = [_session(gw, tok, f"f{i}")[0] for i in range(6)]
        gw.close_session(infos[5].id)
        unknown = f"{gw.url}/s/{'q' * 32}/v1"
        plan = []
        for _ in range(FUZZ_REQUESTS):
            base = rng.choice([i.base_url for i in infos[:5]] * 6 + [infos[5].base_url, unknown])
            r = rng.random()
            if r < 0.05:
                plan.append((rng.choice(["GET", "GET", "DELETE"]), f"{base}/models", b""))
                continue
            chat = rng.random() < 0.75
            body = _valid_body(rng, chat)
            raw = json.dumps(body).encode() if r < 0.35 else _mutate(rng, body)
            path = "/chat/completions" if chat else "/completions"
            if rng.random() < 0.03:
                path = rng.choice(["/embeddings", "/chat/completions/x", "/../v1/models", "/responses"])
            plan.append((rng.choice(["POST"] * 30 + ["PUT", "GET"]), base + path, raw))
        queue, tls = plan[::-1], ssl.create_default_context()

        async def client() -> None:
            async with httpx.AsyncClient(timeout=60, verify=tls) as h:
                while queue:
                    method, url, raw = queue.pop()
                    resp = await h.request(method, url, content=raw,
                                           headers={"Content-Type": "application/json"})
                    await resp.aread()
                    statuses.append((resp.status_code, method + " " + url.rsplit("/v1", 1)[-1], raw[:300]))

        rejected = gw.statistics()["rejected"]
        await asyncio.gather(*(client() for _ in range(8)))
        stats = gw.statistics()
        rows = [t for i in infos[:5] for t in gw.close_session(i.id)]
    assert len(statuses) == FUZZ_REQUESTS
    server_errors = [s for s in statuses if s[0] >= 500]
    assert not server_errors, (f"seed {FUZZ_SEED}", server_errors[:5])
    codes = {s for s, _, _ in statuses}
    assert {200, 400, 404, 405, 410, 413} <= codes <= {200, 400, 404, 405, 410, 413}, codes
    assert not [r for r in records if r.levelno >= logging.WARNING or r.exc_info], records[:3]
    assert not [e for e in events if e["event"] != "gateway.rejected"], events[:3]
    # every 4xx was counted and logged once, every 200 completion served once (models lists are 200s too)
    fours = sum(400 <= s < 500 for s, _, _ in statuses)
    assert stats["rejected"] - rejected == fours == len(events)
    completions = sum(s == 200 and not route.endswith("/models") for s, route, _ in statuses)
    assert stats["requests"] == completions > 100
    for t in rows:  # every row is well formed
        n = len(t.response_ids)
        assert len(t.response_mask) == len(t.log_probs) == len(t.versions) == n <= R
        assert all(math.isfinite(lp) for lp, m in zip(t.log_probs, t.response_mask) if m)
        assert len(t.prompt_ids) + n <= CONTEXT
