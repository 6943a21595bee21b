"""The OpenAI-compatible gateway on real HTTP (loopback) with the real ``openai`` client: token truth
across turns, new rows on rewritten history, the trainer's sampling settings, the session URL as the
capability, and bad input (a lone surrogate, deep nesting, a client gone mid-request). The oracles a
re-tokenizing or fragile gateway would fail (non-canonical ids, 64 concurrent sessions, a seeded fuzz of the
schema) are in test_gateway_oracles.py.

The engine is a real in-process RolloutWorker's request-level engine (the tiny Qwen2 model with the
real Qwen2 tokenizer and its chat template); `recorded` keeps what the engine returned per request."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from asyncrl.roles import RolloutConfig, RolloutWorker
from asyncrl.roles.engines import SamplingParams
from asyncrl.roles.agentic.episodes import pack_trajectories
from asyncrl.roles.agentic.gateway import Gateway, parse_tool_calls
from asyncrl.roles.modeling.models import ModelConfig

R = 160  # most tokens after a row's prompt
GEN = 6  # the trainer's max_new_tokens


@pytest.fixture(scope="module")
def rollout():
    cfg = ModelConfig(seed=0, tokenizer="qwen2", device=os.environ.get("ASYNCRL_TEST_DEVICE", "cpu"),
                      dtype="float32", autocast="off")
    return RolloutWorker(cfg, RolloutConfig(max_new_tokens=GEN, temperature=0.0))


@pytest.fixture(scope="module")
async def served(rollout):
    """``(gateway, recorded)``: a started gateway over the worker's engine; `recorded` lists each
    ``(prompt_ids, Generation)`` the engine returned."""
    engine = rollout._request_engine()
    recorded: list = []

    async def submit(ids, params):
        gen = await engine(ids, params)
        recorded.append((list(ids), gen))
        return gen

    params = SamplingParams(max_new_tokens=GEN, temperature=0.0, seed=0)
    gw = Gateway(submit, rollout.tokenizer, params, max_response_tokens=R, context_length=rollout.context_length,
                 max_body_bytes=64 << 10)
    await gw.start()
    yield gw, recorded
    await gw.close()


def client(info) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=info.base_url, api_key=info.key, max_retries=0, timeout=60)


async def test_a_multi_turn_chat_trains_the_sampled_ids_plus_the_new_messages_tokens(served):
    gw, recorded = served
    info = gw.open_session("chat")
    oa = client(info)
    tok = gw.tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+3?"}]
    start = len(recorded)
    for turn in range(3):
        r = await oa.chat.completions.create(model="any-name", messages=msgs)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        if turn < 2:
            msgs.append({"role": "user", "content": f"and times {turn + 2}?"})
    (row,) = gw.close_session("chat")
    gens = [g for _, g in recorded[start:]]
    # each request continued the row's ids (turn 1 of the row starts right after the prompt)
    assert [p for p, _ in recorded[start:]] == [row.prompt_ids + row.response_ids[:i] for i in _turn_starts(row)]
    assert row.prompt_ids == tok.encode(tok.apply_chat_template(msgs[:2], add_generation_prompt=True, tokenize=False),
                                        add_special_tokens=False)
    # model tokens (mask 1) are exactly the engine's sampled ids, log-probs and versions, turn by turn
    model = [(t, lp, v) for t, m, lp, v in zip(row.response_ids, row.response_mask, row.log_probs, row.versions) if m]
    assert model == [x for g in gens for x in zip(g.response_ids, g.log_probs, g.versions)]
    # the rest (mask 0) is the new messages' tokens, rendered relative to the conversation so far: the whole
    # row decodes to the template's text of the conversation, without any earlier text re-encoded
    full = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=False)
    text = tok.decode(row.prompt_ids + row.response_ids, skip_special_tokens=False)
    assert text.startswith(full) and text == full + tok.decode(gens[-1].response_ids, skip_special_tokens=False)
    env = [t for t, m in zip(row.response_ids, row.response_mask) if not m]
    assert tok.decode(env, skip_special_tokens=False).count("<|im_start|>user\n") == 2
    stats = gw.session_stats("chat")
    assert (stats.requests, stats.rows, stats.prefix_breaks, stats.model_tokens) == (3, 1, 0, sum(
        len(g.response_ids) for g in gens))
    # the rows are Trajectory objects: the batch packing trains them unchanged
    P = len(row.prompt_ids)
    fields = pack_trajectories([row], torch.tensor([row.prompt_ids]), torch.ones(1, P, dtype=torch.long), R,
                               int(tok.pad_token_id), 0)
    n = len(row.response_ids)
    assert fields["response_ids"][0, :n].tolist() == row.response_ids
    assert fields["response_mask"][0, :n].tolist() == row.response_mask and fields["num_turns"].tolist() == [3]


def _turn_starts(row) -> list[int]:
    """Response positions where each model turn starts."""
    m = row.response_mask
    return [i for i in range(len(m)) if m[i] and (i == 0 or not m[i - 1])]


async def test_a_client_that_rewrites_history_gets_a_new_row_of_the_same_session(served):
    gw, _ = served
    info = gw.open_session("edit")
    oa = client(info)
    msgs = [{"role": "user", "content": "name a colour"}]
    r = await oa.chat.completions.create(model="m", messages=msgs)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "another"}]
    await oa.chat.completions.create(model="m", messages=msgs)  # extends row 1
    edited = [{"role": "user", "content": "name a fruit"}] + msgs[1:]  # the first message edited
    await oa.chat.completions.create(model="m", messages=edited)
    rows = gw.close_session("edit")
    stats = gw.session_stats("edit")
    assert (len(rows), stats.rows, stats.prefix_breaks, stats.requests) == (2, 2, 1, 3)
    assert len(rows[0].turns) == 2 and len(rows[1].turns) == 1
    assert "fruit" in gw.tokenizer.decode(rows[1].prompt_ids)


async def test_the_trainers_temperature_wins_over_the_clients_and_both_are_recorded(served):
    gw, _ = served
    outs = []
    for sid in ("hot1", "hot2"):  # different sessions (seeds), the client asks for temperature 2
        info = gw.open_session(sid)
        r = await client(info).chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}],
                                                       temperature=2.0, max_tokens=99)
        outs.append(r.choices[0].message.content)
        (row,) = gw.close_session(sid)
        assert row.turns[0]["client"] == {"model": "m", "temperature": 2.0, "max_tokens": 99, "top_p": None}
        assert row.turns[0]["used"] == {"temperature": 0.0, "max_new_tokens": GEN, "top_p": 1.0}
        assert len(row.model_ids()) <= GEN
    assert outs[0] == outs[1]  # the trainer's greedy decoding, whatever the client asked
    info = gw.open_session("short")  # a client's smaller max_tokens is kept (the trainer's is the cap)
    await client(info).chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=2)
    (row,) = gw.close_session("short")
    assert row.turns[0]["used"]["max_new_tokens"] == 2 and len(row.model_ids()) <= 2


async def test_the_session_url_is_the_capability_whatever_key_the_client_sends(served):
    """An agent written for a local OpenAI-compatible server sets its own key ("EMPTY"); the URL alone opens
    the session, and a closed session's URL gets 410."""
    gw, _ = served
    a, b = gw.open_session("key_a"), gw.open_session("key_b")
    for key in ("EMPTY", "sk-anything", b.key):
        oa = AsyncOpenAI(base_url=a.base_url, api_key=key, max_retries=0, timeout=60)
        assert [m.id for m in (await oa.models.list()).data] == ["asyncrl-policy"]
    r = await AsyncOpenAI(base_url=a.base_url, api_key="EMPTY", max_retries=0, timeout=60).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason in ("stop", "length") and gw.session_stats("key_a").requests == 1
    async with httpx.AsyncClient(timeout=60) as h:  # no Authorization header at all
        r = await h.post(f"{a.base_url}/chat/completions", json={"model": "m", "messages": [{"role": "user",
                                                                                             "content": "hi"}]})
        assert r.status_code == 200 and gw.session_stats("key_a").requests == 2
        assert a.base_url.startswith(f"{gw.url}/s/") and "key_a" not in a.base_url and a.key in a.base_url
        gw.close_session("key_b")
        r = await h.post(f"{b.base_url}/chat/completions", json={"model": "m", "messages": [{"role": "user",
                                                                                             "content": "hi"}]})
        assert r.status_code == 410 and "closed" in r.json()["error"]["message"]
    gw.close_session("key_a")


_PROBE = """
import json, sys, httpx
port, sid, url = sys.argv[1], sys.argv[2], sys.argv[3]
base = f"http://127.0.0.1:{port}"
body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
out = {}
with httpx.Client(timeout=30) as h:
    for key in (None, "EMPTY", sid):
        hdr = {} if key is None else {"Authorization": f"Bearer {key}"}
        for path in (f"/s/{sid}/v1/models", "/v1/models", "/models", f"/s/{sid}/models", "/s//v1/models",
                     "/s/" + "A" * 32 + "/v1/models", "/docs", "/openapi.json"):
            out[f"GET {path} {key}"] = h.get(base + path, headers=hdr).status_code
        out[f"POST /s/{sid}/v1/chat/completions {key}"] = h.post(
            f"{base}/s/{sid}/v1/chat/completions", headers=hdr, json=body).status_code
    out["with the url"] = h.get(url + "/models").status_code
print(json.dumps(out))
"""


async def test_another_local_process_without_the_session_url_reaches_no_session(served):
    """Another process on this machine knows the port, the session's id and the API's paths, and sends no key,
    the id, or "EMPTY": every request is a 404. Given the URL, the same process gets in."""
    import sys

    gw, _ = served
    info = gw.open_session("private")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _PROBE, str(gw.url.rsplit(":", 1)[1]), info.id,
                                                info.base_url, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    statuses = json.loads(out)
    assert statuses.pop("with the url") == 200
    assert set(statuses.values()) == {404}, statuses
    assert gw.session_stats("private").requests == 0
    gw.close_session("private")


def test_the_gateway_listens_on_loopback_only():
    from asyncrl.roles.modeling.models import load_tokenizer

    async def submit(ids, params):
        raise AssertionError("never called")

    tok, params = load_tokenizer("qwen2"), SamplingParams(max_new_tokens=4)
    for host in ("0.0.0.0", "192.168.1.7", "::", "example.org"):
        with pytest.raises(ValueError, match=rf"host='{host}': the gateway listens on loopback only"):
            Gateway(submit, tok, params, max_response_tokens=R, host=host)
    for host in ("127.0.0.1", "::1", "localhost"):
        assert Gateway(submit, tok, params, max_response_tokens=R, host=host).host == host


async def test_completions_and_streamed_chat_extend_the_same_row(served):
    gw, _ = served
    info = gw.open_session("text")
    oa = client(info)
    r1 = await oa.completions.create(model="m", prompt="Once upon a time")
    await oa.completions.create(model="m", prompt="Once upon a time" + r1.choices[0].text + " and then")
    (row,) = gw.close_session("text")
    assert len(row.turns) == 2 and gw.tokenizer.decode(row.prompt_ids) == "Once upon a time"
    info = gw.open_session("stream")
    chunks = [c async for c in await client(info).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True)]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (row,) = gw.close_session("stream")
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert content == gw.tokenizer.decode(row.model_ids(), skip_special_tokens=False).removesuffix("<|im_end|>")


def test_tool_calls_are_parsed_from_qwen2_tool_call_blocks():
    text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "17*23"}}\n</tool_call>\n'
            '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("call_0", "calc", {"expression": "17*23"}), ("call_1", "calc", {"expression": "1+1"})]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name: not a call


TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]


async def test_tools_reach_the_template_and_a_tool_round_trip_extends_the_row(served):
    gw, _ = served
    tok = gw.tokenizer
    info = gw.open_session("tools")
    oa = client(info)
    msgs = [{"role": "user", "content": "what is 17*23?"}]
    r = await oa.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "tool", "tool_call_id": "call_0", "content": "391"}]
    await oa.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    (row,) = gw.close_session("tools")
    assert '"name": "calc"' in tok.decode(row.prompt_ids)  # the tools are in the rendered system prompt
    env = tok.decode([t for t, m in zip(row.response_ids, row.response_mask) if not m], skip_special_tokens=False)
    assert "<tool_response>\n391\n</tool_response>" in env and len(row.turns) == 2
    # a tool call the client appends after the model's text extends the row as mask-0 tokens: the model's
    # tokens stay exactly as sampled (a call the model wrote in the template's form extends it the same way)
    info = gw.open_session("tools_appended")
    oa = client(info)
    r = await oa.chat.completions.create(model="m", messages=msgs[:1], tools=TOOLS)
    call = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "17*23"}'}}
    msgs[1:2] = [{"role": "assistant", "content": r.choices[0].message.content, "tool_calls": [call]}]
    await oa.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    (row,) = gw.close_session("tools_appended")
    env = tok.decode([t for t, m in zip(row.response_ids, row.response_mask) if not m], skip_special_tokens=False)
    assert env.startswith('\n<tool_call>\n{"name": "calc", "arguments": {"expression": "17*23"}}\n</tool_call>')


async def test_a_template_that_drops_earlier_reasoning_starts_a_new_row():
    """The Qwen2/3 template renders an earlier assistant turn without its ``<think>`` part, so the next
    request no longer extends the text the model's tokens stand for (a scripted engine writes the reasoning)."""
    from asyncrl.roles.modeling.models import load_tokenizer

    tok = load_tokenizer("qwen2")
    said = tok.encode("<think>\nhmm\n</think>\n\nfour", add_special_tokens=False) + [tok.eos_token_id]

    async def submit(ids, params):
        from asyncrl.roles.engines.batcher import Generation

        return Generation(said, [-0.5] * len(said), "stop", versions=[1] * len(said))

    async with Gateway(submit, tok, SamplingParams(max_new_tokens=32), max_response_tokens=R) as gw:
        info = gw.open_session()
        oa = client(info)
        msgs = [{"role": "user", "content": "2+2?"}]
        r = await oa.chat.completions.create(model="m", messages=msgs)
        assert r.choices[0].message.content == "<think>\nhmm\n</think>\n\nfour" and r.choices[0].finish_reason == "stop"
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "3+3?"}]
        await oa.chat.completions.create(model="m", messages=msgs)
        rows = gw.close_session(info.id)
        stats = gw.session_stats(info.id)
    assert (len(rows), stats.rows, stats.prefix_breaks) == (2, 2, 1)
    assert rows[0].response_ids == said and rows[0].response_mask == [1] * len(said)
    assert "<|im_start|>assistant\nfour<|im_end|>" in tok.decode(rows[1].prompt_ids, skip_special_tokens=False)


async def test_a_lone_surrogate_or_deep_nesting_is_a_400_that_leaves_the_session_as_it_was(served, server_log):
    gw, _ = served
    events, records = server_log
    info = gw.open_session("odd")
    url = f"{info.base_url}/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    async with httpx.AsyncClient(timeout=60) as h:
        r = await h.post(url, json={"model": "m", "messages": msgs})
        msgs.append(r.json()["choices"][0]["message"])
        before = (gw.session_stats("odd"), [list(r.traj.response_ids) for r in gw._sessions["odd"].rows])
        deep = '{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [%s]}'
        bodies = [  # each would have started a new row (another first message), were it encoded
            '{"model": "m", "messages": [{"role": "user", "content": "\\ud800 hi"}]}',
            '{"model": "m", "messages": [{"role": "user", "content": "ok", "\\udfff": 1}]}',
            '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}',
            json.dumps({"model": "m", "messages": msgs + [{"role": "user", "content": "more"}]})[:-1]
            + ', "tools": [{"type": "function", "function": {"name": "\\ud83d"}}]}',
            deep % ("[" * 30_000 + "]" * 30_000), deep % ("[" * 70 + "]" * 70),
            '{"model": "m", "messages": [{"role": "user", "content": "%s"}]}' % ("word " * 600),  # > the context
        ]
        for body in bodies:
            r = await h.post(url, content=body.encode(), headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["message"], r.text
            assert (gw.session_stats("odd"), [list(r.traj.response_ids) for r in gw._sessions["odd"].rows]) == before
        r = await h.post(f"{info.base_url}/completions", content=b'{"model": "m", "prompt": "\\ud800"}')
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
        msgs.append({"role": "user", "content": "go on"})  # the conversation goes on in its row
        assert (await h.post(url, json={"model": "m", "messages": msgs})).status_code == 200
    stats = gw.session_stats("odd")
    assert (stats.requests, stats.rows, stats.prefix_breaks) == (2, 1, 0)
    gw.close_session("odd")
    assert [e["status"] for e in events if e["event"] == "gateway.rejected"] == [400] * (len(bodies) + 1)
    assert all(e["session"] == "odd" and info.key not in str(e) for e in events)
    assert not [r for r in records if r.levelno >= logging.WARNING or r.exc_info], records


async def test_an_idle_connection_outlives_the_clients_pool_so_no_request_meets_a_closing_socket(served):
    """httpx (the openai client's transport) drops a pooled connection after 5 s idle; had the server the same 5 s,
    a request sent as it closes would be reset (seen with 64 agents on a loaded machine). The server waits longer."""
    gw, _ = served
    assert gw._server.config.timeout_keep_alive > httpx.Limits().keepalive_expiry == 5.0


async def test_a_client_that_disconnects_mid_request_is_one_log_line(served, server_log):
    gw, _ = served
    events, records = server_log
    info = gw.open_session("gone")
    path = info.base_url.split(gw.url, 1)[1] + "/chat/completions"
    reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 'Content-Length: 1000\r\n\r\n{"model": "m", '.encode())
    await writer.drain()
    writer.close()  # the body is never finished
    await writer.wait_closed()
    deadline = asyncio.get_running_loop().time() + 30  # the server logs once it reads the close: poll for it
    while not events and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    assert [(e["event"], e["session"], e["route"]) for e in events] == [
        ("gateway.client_disconnected", "gone", "POST chat/completions")]
    assert gw.session_stats("gone") == type(gw.session_stats("gone"))() and not records
    gw.close_session("gone")


# ---- rollout.agent: the user's agent as the episode of a row --------------------------------------

AGENTS = os.path.join(os.path.dirname(__file__), "gateway_agent.py")


@pytest.mark.parametrize("agent", ["two_turns", "own_key"])  # own_key: api_key="EMPTY", as for any local server
async def test_an_agent_file_runs_per_row_against_the_workers_gateway_and_packs_its_rows(prompt_batch, agent):
    cfg = ModelConfig(seed=0, tokenizer="qwen2", device=os.environ.get("ASYNCRL_TEST_DEVICE", "cpu"),
                      dtype="float32", autocast="off")
    rollout = RolloutWorker(cfg, RolloutConfig(max_new_tokens=24, agent=f"{AGENTS}:{agent}"))
    try:
        out = await rollout.generate_episodes(prompt_batch(n=2))
        gw = rollout.requests._episode_fn.gateway
        assert gw.url.startswith("http://127.0.0.1:") and gw.statistics()["sessions_closed"] == 2
    finally:
        await rollout.requests._episode_fn.close()
    tok = rollout.tokenizer
    P = rollout.context_length - 24  # one prompt width on every rank
    assert out["prompt_ids"].shape == (2, P) and out["input_ids"].shape == (2, P + 24)
    assert out["num_turns"].tolist() == [2, 2] and out["episode_reward"].tolist() == [1.0, 1.0]
    for b in range(2):
        prompt = out["prompt_ids"][b][out["prompt_mask"][b].bool()].tolist()
        assert tok.decode(prompt) == tok.apply_chat_template(
            [{"role": "user", "content": out["prompt"][b]}], add_generation_prompt=True, tokenize=False)
        mask = out["response_mask"][b]
        assert 0 < int(mask.sum()) <= 4 + 24 and int(out["attention_mask"][b, P:].sum()) > int(mask.sum())


def test_a_bad_agent_is_a_config_error_naming_it():
    from asyncrl.roles.errors import EpisodeConfigError

    with pytest.raises(EpisodeConfigError, match=r"^RolloutConfig\.agent: agent '.*gateway_agent.py:not_async' must "
                                                 r"be an `async def`"):
        RolloutConfig(agent=f"{AGENTS}:not_async").validate()
    with pytest.raises(EpisodeConfigError, match=r"^RolloutConfig\.agent: .*cannot be imported .*no file"):
        RolloutConfig(agent="no/such/file.py:fn").validate()
    with pytest.raises(EpisodeConfigError, match=r"agent and RolloutConfig\.episode are both set"):
        RolloutConfig(agent=f"{AGENTS}:two_turns", episode="calculator").validate()
    RolloutConfig(agent=f"{AGENTS}:no_reward").validate()
