"""The OpenAI-compatible gateway: an agent's HTTP calls become exact-token trajectories.

An agent written against any OpenAI-compatible client points its ``base_url`` at a session of the
gateway. The session URL is the capability: its path holds an unguessable token (192 random bits), the
server listens on loopback only, and the client's key is ignored, so ``AsyncOpenAI(base_url=url,
api_key="EMPTY")`` -- what agents written for local OpenAI-compatible servers do -- works unchanged, while
another local process without the URL reaches no session. The gateway owns tokenization (token truth):
each session keeps the exact ids of its rows, and a request is encoded as the row's ids so far plus the
tokens of its *new* text only::

    POST /s/<token>/v1/chat/completions  (any key or none; body <= max_body_bytes)
      ─► checks: the URL's session (404, closed: 410), size (413), JSON and types (400)
      ─► chat template (tools included) of the messages ─► text T
      ─► T extends the row's text?  yes: observe(encode(T minus the row's text))   (mask 0)
                                     no:  a new row of the session, prompt = encode(T) (a prefix break)
      ─► llm.generate(row) on the rollout worker's request-level engine (the trainer's sampling
         settings; the client's are recorded): model tokens with log-probs and versions (mask 1)
      ─► the decoded tokens (``tool_calls`` parsed from Qwen2's ``<tool_call>`` JSON) as the response

A row's text is the text its ids stand for: the rendered prompt, the decoded sampled tokens and the
rendered new messages. Earlier text is never re-encoded, so the trained ids are the sampled ids. A
client that edits an earlier message, or a template that drops earlier reasoning, no longer extends
the row's text: the request starts a new row of the same session. :meth:`Gateway.close_session`
returns the rows as :class:`~asyncrl.roles.agentic.episodes.Trajectory` objects, the type episodes return,
so :func:`~asyncrl.roles.agentic.episodes.pack_trajectories` trains them unchanged.

Errors of one request (a malformed body -- not JSON, nested deeper than :data:`MAX_JSON_DEPTH`, a lone
UTF-16 surrogate, a wrong type --, an unknown or closed session) are a 4xx with an OpenAI-shaped
``{"error": {"message", "type", "code"}}`` body and touch no session state. The server's terminal (the
trainer's, through the rollout worker) gets one line per rejected request, per client that disconnects
mid-request, and per unexpected failure (a 500), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import secrets
import socket
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Literal

import structlog

from asyncrl.roles.engines.base import SamplingParams
from asyncrl.roles.engines.batcher import Generation
from asyncrl.roles.agentic.episodes import LLM, Trajectory
from asyncrl.roles.errors import MissingDependencyError

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = ["MAX_JSON_DEPTH", "Gateway", "SessionInfo", "SessionStats", "parse_tool_calls"]

MAX_JSON_DEPTH = 64
"""Deepest nesting of objects and arrays a request body may have (OpenAI's bodies and tool schemas use under 10)."""

log = structlog.get_logger("asyncrl")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a model's text under Qwen2's convention: each
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block holding valid JSON with a string
    ``name`` becomes an OpenAI tool call (``arguments`` as a JSON string) and leaves the content; a
    block that does not parse stays in the content as text."""
    calls: list[dict[str, Any]] = []

    def take(m: re.Match[str]) -> str:
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return m.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return m.group(0)
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{len(calls)}", "type": "function",
                      "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
        return ""

    content = _TOOL_CALL.sub(take, text)
    return (content.strip() if calls else content), calls


@dataclass
class SessionInfo:
    """What an agent needs to reach its session: ``OpenAI(base_url=info.base_url, api_key="EMPTY")``."""

    id: str
    """The session's name on the gateway (:meth:`Gateway.close_session`, statistics); not a capability."""
    key: str
    """The session's token, the capability its :attr:`base_url` holds (a client may send it as its key; any key
    is accepted)."""
    base_url: str
    """``http://127.0.0.1:<port>/s/<token>/v1``: whoever has it can use the session."""


@dataclass
class SessionStats:
    """What one session did (observable, summed by :meth:`Gateway.statistics`)."""

    requests: int = 0
    """Completions served."""
    rows: int = 0
    """Rows (trajectories) started: the first request's, then one per prefix break or full row."""
    prefix_breaks: int = 0
    """Requests whose text did not extend the row's (edited history, a template that drops reasoning)."""
    model_tokens: int = 0
    """Tokens sampled (mask 1)."""
    new_message_tokens: int = 0
    """Tokens of rendered new messages appended to a row (mask 0)."""


class _HTTPError(Exception):
    """A request's 4xx: its status, OpenAI error type and message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class _Row:
    traj: Trajectory
    text: str | None
    """The text the row's ids stand for; None once the row is full (the next request starts a new row)."""


@dataclass
class _Session:
    info: SessionInfo
    llm: LLM
    rows: list[_Row] = field(default_factory=list)
    stats: SessionStats = field(default_factory=SessionStats)
    closed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    log: list[dict[str, str]] = field(default_factory=list)
    """One ``{"request", "response"}`` digest pair per completion served (:meth:`Gateway.session_log`)."""
    expected: list[dict[str, str]] | None = None
    """A replay's recorded log: each request must match its digest (:meth:`Gateway.open_session`)."""
    diverged: str | None = None
    """Why a replayed request differed from the recording."""


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _request_models() -> tuple[Any, Any]:
    """The pydantic models of the request bodies (built on first use: pydantic comes with fastapi)."""
    from pydantic import BaseModel, ConfigDict, Field

    class Part(BaseModel):
        model_config = ConfigDict(extra="allow")
        type: Literal["text"]
        text: str

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: str | list[Part] | None = None
        tool_calls: list[dict[str, Any]] | None = None
        tool_call_id: str | None = None
        name: str | None = None
        reasoning_content: str | None = None

    class Sampling(BaseModel):
        model_config = ConfigDict(extra="allow")
        model: str
        temperature: float | None = Field(None, ge=0)
        top_p: float | None = Field(None, gt=0, le=1)
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        n: int = 1
        stream: bool = False

    class Chat(Sampling):
        messages: list[Message] = Field(min_length=1)
        tools: list[dict[str, Any]] | None = None

    class Completion(Sampling):
        prompt: str

    return Chat, Completion


class Gateway:
    """An OpenAI-compatible HTTP server over a request-level engine, one session per agent.

    Args:
        submit: the engine's request call, ``submit(prompt_ids, params) -> Generation`` (the rollout
            worker's ``_request_engine()``: every token keeps its log-prob and weight version).
        tokenizer: the rollout's tokenizer (its chat template renders messages and ``tools``).
        params: the trainer's sampling settings; they win over the client's: its temperature, top-p and
            top-k always, its ``max_new_tokens`` as the most tokens a request gets (a client's smaller
            ``max_tokens`` is kept). Both are recorded in each turn: ``turns[i]["client"]``, ``["used"]``.
        max_response_tokens: most tokens after a row's prompt (model and new-message tokens).
        context_length: most tokens of prompt + response the model takes (None: unchecked).
        host, port: where to listen: a loopback address (a session URL is its own capability, so the gateway
            never listens beyond this machine); port 0 picks a free one.
        max_body_bytes: larger request bodies get 413.
        model_name: what ``/v1/models`` lists (requests may name any model; it is recorded).

    ``await gateway.start()`` listens, :meth:`open_session` gives an agent its URL,
    :meth:`close_session` returns its rows as trajectories, ``await gateway.close()`` stops (also
    ``async with Gateway(...)``).
    """

    def __init__(self, submit: Callable[[list[int], SamplingParams], Awaitable[Generation]], tokenizer: Any,
                 params: SamplingParams, *, max_response_tokens: int, context_length: int | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_body_bytes: int = 1 << 20,
                 model_name: str = "asyncrl-policy") -> None:
        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as e:
            raise MissingDependencyError(f"the gateway needs fastapi and uvicorn ({e}); "
                                         "pip install 'asyncrl[gateway]'") from e
        if not _is_loopback(host):
            raise ValueError(f"Gateway host={host!r}: the gateway listens on loopback only (127.0.0.1, ::1, "
                             "localhost): a session's URL is its capability, sent in plain HTTP")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the gateway renders chat messages with the tokenizer's chat template, and this "
                             "tokenizer has none; use a chat model's tokenizer (e.g. ModelConfig.tokenizer='qwen2')")
        self._submit = submit
        self.tokenizer = tokenizer
        self.params = params
        self.max_response_tokens = max_response_tokens
        self.context_length = context_length
        self.max_body_bytes = max_body_bytes
        self.model_name = model_name
        self.host = host
        self._port = port
        self._sessions: dict[str, _Session] = {}
        self._by_token: dict[bytes, _Session] = {}
        """Sessions by the sha256 of their URL token (a lookup's timing then tells nothing of a token)."""
        self._rejected = 0
        self._eos_id = tokenizer.eos_token_id
        self._tool_convention = "<tool_call>" in str(tokenizer.chat_template)
        self._chat_model, self._completion_model = _request_models()
        self.app = self._build_app()
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://host:port`` (the port is known once :meth:`start` returned)."""
        return f"http://{self.host}:{self._port}"

    async def start(self) -> str:
        """Listen (the socket is bound before this returns, so clients may connect at once); returns :attr:`url`."""
        import uvicorn

        if self._task is not None:
            raise RuntimeError("this gateway is already started")

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Any:  # the host process (a Ray actor, pytest) owns its signals
                yield

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it (Nagle + delayed ACK: 40 ms a response)
        sock.bind((self.host, self._port))
        sock.listen(1024)
        self._port = sock.getsockname()[1]
        # keep-alive longer than a client's pool keeps an idle connection (httpx: 5 s), else a request sent just
        # as the server closes the connection is reset
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, timeout_keep_alive=120)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="asyncrl-gateway")
        return self.url

    async def close(self) -> None:
        """Stop serving (requests in flight get up to 5 s); sessions and their rows stay readable."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await self._task
        finally:
            self._task = None

    def request_stop(self) -> None:
        """Ask the server to stop without waiting (a synchronous shutdown path); :meth:`close` awaits it."""
        if self._server is not None:
            self._server.should_exit = True

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- sessions -------------------------------------------------------------------------

    def open_session(self, session_id: str | None = None, *, seed: int | None = None,
                     llm: LLM | None = None, expected: list[dict[str, str]] | None = None) -> SessionInfo:
        """A new session: its id, its token and its ``base_url`` (``<url>/s/<token>/v1``, the session's capability:
        192 random bits). `session_id` names it here (default: random); it is not in the URL. `llm`: the session
        samples through it (a rollout row's client: its engine, sampling settings, seed, length limit and
        round-log key), so an agent's requests enter the engine as an episode's do. Else through the
        gateway's `submit` and `params`, with `seed` as the base sampling seed (default: from the trainer's
        seed and the id, so a session samples the same tokens whatever else is in flight). `expected`: a
        replay's recorded :meth:`session_log` of this session; a request that differs from its recorded one
        gets 409 and marks the session diverged (:meth:`divergence`)."""
        sid = session_id or secrets.token_hex(8)
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", sid):
            raise ValueError(f"session id {sid!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if sid in self._sessions:
            raise ValueError(f"session {sid!r} already exists; pick another id")
        if llm is not None and seed is not None:
            raise ValueError("open_session takes seed or llm (the llm carries its seed), not both")
        if llm is None:
            if seed is None:
                h = hashlib.sha256(f"{self.params.seed}|{sid}".encode()).digest()
                seed = int.from_bytes(h[:4], "little") & 0x3FFFFFFF
            llm = LLM(self._submit, self.tokenizer, replace(self.params, seed=seed), self.max_response_tokens)
        token = secrets.token_urlsafe(24)
        info = SessionInfo(sid, token, f"{self.url}/s/{token}/v1")
        self._sessions[sid] = self._by_token[_token_digest(token)] = _Session(
            info, llm, expected=list(expected) if expected is not None else None)
        return info

    def close_session(self, session_id: str) -> list[Trajectory]:
        """Close a session (its later requests get 410) and return its rows, in order (the gateway keeps
        only the session's URL token and :class:`SessionStats`)."""
        s = self._session(session_id)
        if s.closed:
            raise RuntimeError(f"session {session_id!r} is already closed; its rows were returned then")
        s.closed = True
        rows, s.rows = [r.traj for r in s.rows], []
        return rows

    def session_log(self, session_id: str) -> list[dict[str, str]]:
        """What session `session_id` was asked and answered: per completion, in order, ``request`` (a digest of
        the rendered prompt and the client's sampling fields) and ``response`` (a digest of the text returned).
        A replay of the run compares its agents' requests with these (``expected`` of :meth:`open_session`)."""
        return [dict(x) for x in self._session(session_id).log]

    def divergence(self, session_id: str) -> str | None:
        """Why a replayed session's requests differed from the recording (None: they did not, so far). A session
        that made fewer requests than the recording diverged too."""
        s = self._session(session_id)
        if s.diverged is None and s.expected is not None and s.closed and len(s.log) < len(s.expected):
            return (f"session {s.llm.key or s.info.id!r} made {len(s.log)} requests where the recording has "
                    f"{len(s.expected)}")
        return s.diverged

    def session_stats(self, session_id: str) -> SessionStats:
        """What session `session_id` did so far."""
        return replace(self._session(session_id).stats)

    def statistics(self) -> dict[str, int]:
        """Sessions open and closed, the sums of their :class:`SessionStats`, and ``rejected`` (4xx answers)."""
        out = {"sessions_open": sum(not s.closed for s in self._sessions.values()),
               "sessions_closed": sum(s.closed for s in self._sessions.values()), "rejected": self._rejected}
        for name in SessionStats.__dataclass_fields__:
            out[name] = sum(getattr(s.stats, name) for s in self._sessions.values())
        return out

    def _session(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise KeyError(f"no session {session_id!r}")
        return s

    # ---- token truth ----------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template's text of `messages` (and `tools`) with the generation prompt."""
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        return str(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _row_for(self, s: _Session, text: str) -> _Row:
        """The row `text` extends, its new tokens appended (mask 0); or a new row whose prompt is `text`."""
        row = s.rows[-1] if s.rows else None
        if row is not None and row.text is not None and text.startswith(row.text) and len(text) > len(row.text):
            ids = self._encode(text[len(row.text):])
            if len(ids) < row.traj.room:  # room is left to generate after them
                row.traj.observe(ids)
                row.text = text
                s.stats.new_message_tokens += len(ids)
                return row
            breaks = False  # the row is full: a new row, not a prefix break
        else:
            breaks = row is not None and row.text is not None
        ids = self._encode(text)
        if self.context_length is not None and len(ids) >= self.context_length:  # (refused: the session unchanged)
            raise _HTTPError(400, f"the prompt is {len(ids)} tokens and the model's context is {self.context_length}; "
                                  "shorten the conversation", "context_length_exceeded")
        new = _Row(Trajectory(prompt_ids=ids, max_response_tokens=s.llm.max_response_tokens), text)
        s.rows.append(new)
        s.stats.rows += 1
        s.stats.prefix_breaks += breaks
        return new

    async def _complete(self, s: _Session, text: str, req: Any) -> tuple[Generation, str, int]:
        """Generate on the row `text` belongs to; returns the generation, its decoded text (without the
        EOS it stopped on) and the tokens before it (the usage's prompt tokens)."""
        async with s.lock:  # one conversation: its requests extend the row in order
            if s.closed:
                raise _HTTPError(410, f"session {s.info.id!r} is closed", "session_closed")
            request = _digest(text, req.model, req.temperature, req.top_p, req.max_completion_tokens or req.max_tokens)
            k = len(s.log)
            if s.expected is not None and (k >= len(s.expected) or s.expected[k]["request"] != request):
                s.diverged = s.diverged or (
                    f"request {k} of session {s.llm.key or s.info.id!r} differs from the recorded one (the recording "
                    f"has {len(s.expected)} requests)")
                raise _HTTPError(409, f"replay: {s.diverged}", "replay_diverged")
            row = self._row_for(s, text)
            before, turns = len(row.traj.context_ids), len(row.traj.turns)
            n = min(s.llm.params.max_new_tokens, req.max_completion_tokens or req.max_tokens or 1 << 30)
            if self.context_length is not None:
                n = min(n, self.context_length - before)
            try:
                gen = await s.llm.generate(row.traj, max_new_tokens=max(n, 0))
            except BaseException:  # (the engine failed, the request was cancelled) the row's text no longer
                row.text = None  # says what its ids stand for: the next request starts a new row
                raise
            row.text = None if row.traj.stopped or n < 1 else \
                (row.text or "") + self.tokenizer.decode(gen.response_ids, skip_special_tokens=False)
            if len(row.traj.turns) > turns:  # the trainer's settings won; both are recorded
                row.traj.turns[-1].update(
                    client={"model": req.model, "temperature": req.temperature,
                            "max_tokens": req.max_completion_tokens or req.max_tokens, "top_p": req.top_p},
                    used={"temperature": s.llm.params.temperature, "max_new_tokens": n, "top_p": s.llm.params.top_p})
            s.stats.requests += 1
            s.stats.model_tokens += len(gen.response_ids)
            ids = gen.response_ids
            if gen.finish_reason == "stop" and ids[-1:] == [self._eos_id]:
                ids = ids[:-1]
            out = self.tokenizer.decode(ids, skip_special_tokens=False)
            s.log.append({"request": request, "response": _digest(out)})
        return gen, out, before

    # ---- HTTP -----------------------------------------------------------------------------

    def _build_app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, Response, StreamingResponse
        from starlette.exceptions import HTTPException as StarletteHTTPException
        from starlette.requests import ClientDisconnect

        # Routes take the raw request (Starlette style): the gateway reads the body itself, to bound its
        # size before parsing and to answer every malformed body with its own 4xx.
        app = FastAPI(title="asyncrl gateway", docs_url=None, redoc_url=None, openapi_url=None)

        def error(request: Request, status: int, message: str, kind: str) -> JSONResponse:
            self._rejected += status < 500
            log.info("gateway.rejected", status=status, **where(request), error=message[:200])
            return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

        async def on_error(request: Request, e: Exception) -> JSONResponse:
            assert isinstance(e, _HTTPError)
            return error(request, e.status, e.message, e.kind)

        async def on_http(request: Request, e: Exception) -> JSONResponse:
            assert isinstance(e, StarletteHTTPException)
            return error(request, e.status_code, f"{e.detail}: {request.method} {request.url.path}",
                         "invalid_request_error")

        def where(request: Request) -> dict[str, str]:
            """What a log line names: the session (never its URL token) and the route."""
            token = request.path_params.get("token")
            s = self._by_token.get(_token_digest(token)) if isinstance(token, str) else None
            route = request.url.path.rsplit("/v1/", 1)[-1] if s is not None else "?"
            return {"session": s.info.id if s is not None else "?", "route": f"{request.method} {route}"}

        def guarded(handler: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
            """`handler` whose unexpected failures are one log line and a 500 (the server would print a traceback),
            and whose client, gone mid-request, is one log line."""
            async def run(request: Request) -> Any:
                try:
                    return await handler(request)
                except _HTTPError:
                    raise  # the app's handler answers it
                except ClientDisconnect:
                    log.warning("gateway.client_disconnected", **where(request))
                    return Response(status_code=400)  # (nobody reads it)
                except Exception as e:
                    tb = e.__traceback__
                    while tb is not None and tb.tb_next is not None:
                        tb = tb.tb_next
                    at = f"{tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}" if tb else "?"
                    log.error("gateway.failed", **where(request), error=f"{type(e).__name__}: {e}"[:300], at=at)
                    return error(request, 500, f"the gateway failed on this request: {type(e).__name__}: {e}",
                                 "server_error")
            return run

        app.add_exception_handler(_HTTPError, on_error)
        app.add_exception_handler(StarletteHTTPException, on_http)

        def session_of(request: Request) -> _Session:
            """The session whose token the URL holds (the key the client sends, if any, is not read)."""
            s = self._by_token.get(_token_digest(request.path_params["token"]))
            if s is None:
                raise _HTTPError(404, "no session at this URL: use the base_url the session was opened with "
                                      "(SessionInfo.base_url, the agent's base_url argument)", "session_not_found")
            if s.closed:
                raise _HTTPError(410, f"session {s.info.id!r} is closed", "session_closed")
            return s

        async def body_of(request: Request, model: Any) -> Any:
            length = request.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                raise _HTTPError(413, f"request body over {self.max_body_bytes} bytes", "request_too_large")
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise _HTTPError(413, f"request body over {self.max_body_bytes} bytes", "request_too_large")
            try:
                obj = json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise _HTTPError(400, f"the body is not valid JSON: {e}") from None
            except RecursionError:
                raise _HTTPError(400, f"the body nests objects or arrays deeper than {MAX_JSON_DEPTH} levels; "
                                      "send a flatter body") from None
            if not isinstance(obj, dict):
                raise _HTTPError(400, f"the body must be a JSON object, not {type(obj).__name__}")
            _check_json(obj)
            from pydantic import ValidationError

            try:
                req = model.model_validate(obj)
            except ValidationError as e:
                raise _HTTPError(400, "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())[:2000]) \
                    from None
            if req.n != 1:
                raise _HTTPError(400, f"n={req.n}: the gateway returns one choice per request (n=1)")
            return req

        def usage(row_before: int, gen: Generation) -> dict[str, int]:
            return {"prompt_tokens": row_before, "completion_tokens": len(gen.response_ids),
                    "total_tokens": row_before + len(gen.response_ids)}

        async def models(request: Request) -> Any:
            session_of(request)
            return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                             "owned_by": "asyncrl"}]})

        async def chat(request: Request) -> Any:
            s = session_of(request)
            sid = s.info.id
            req = await body_of(request, self._chat_model)
            messages = [_message_dict(m) for m in req.messages]
            try:
                text = self.render(messages, req.tools)
            except Exception as e:  # a template that rejects these messages (jinja raise_exception, bad tool)
                raise _HTTPError(400, f"the chat template rejected these messages: {type(e).__name__}: {e}") from None
            gen, out, before = await self._complete(s, text, req)
            content, calls = parse_tool_calls(out) if self._tool_convention and req.tools else (out, [])
            finish = "tool_calls" if calls else ("stop" if gen.finish_reason == "stop" else "length")
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            cid, created = f"chatcmpl-{sid}-{s.stats.requests}", int(time.time())
            if not req.stream:
                return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": req.model,
                        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                        "usage": usage(before, gen)})

            def chunk(delta: dict[str, Any], reason: str | None) -> str:
                return "data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created,
                                              "model": req.model, "choices": [{"index": 0, "delta": delta,
                                                                               "finish_reason": reason}]}) + "\n\n"

            async def events() -> Any:  # the whole completion as one delta: the engine returns it at once
                yield chunk({"role": "assistant", "content": ""}, None)
                delta: dict[str, Any] = {"content": content}
                if calls:
                    delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(calls)]
                yield chunk(delta, None)
                yield chunk({}, finish)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def completions(request: Request) -> Any:
            s = session_of(request)
            sid = s.info.id
            req = await body_of(request, self._completion_model)
            if req.stream:
                raise _HTTPError(400, "stream=true is served on /v1/chat/completions only; send stream=false")
            if not req.prompt:
                raise _HTTPError(400, "prompt: must not be empty")
            gen, out, before = await self._complete(s, req.prompt, req)
            return JSONResponse({"id": f"cmpl-{sid}-{s.stats.requests}", "object": "text_completion", "created": int(time.time()),
                    "model": req.model, "choices": [{"index": 0, "text": out, "logprobs": None,
                                                     "finish_reason": "stop" if gen.finish_reason == "stop" else "length"}],
                    "usage": usage(before, gen)})

        app.add_route("/s/{token}/v1/models", guarded(models), methods=["GET"])
        app.add_route("/s/{token}/v1/chat/completions", guarded(chat), methods=["POST"])
        app.add_route("/s/{token}/v1/completions", guarded(completions), methods=["POST"])
        return app


def _check_json(obj: Any) -> None:
    """Refuse (400) a parsed body nested deeper than :data:`MAX_JSON_DEPTH` or holding a lone UTF-16 surrogate
    (JSON's ``"\\ud800"`` escape parses to a ``str`` that is not text: no tokenizer encodes it), naming where."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(obj, ())]
    while stack:
        o, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise _HTTPError(400, f"the body nests objects or arrays deeper than {MAX_JSON_DEPTH} levels (at "
                                  f"{'.'.join(path[:8])}...); send a flatter body")
        if isinstance(o, dict):
            for k, v in o.items():
                key = k if len(k) < 40 and not _SURROGATE.search(k) else "<key>"
                if _SURROGATE.search(k):
                    raise _HTTPError(400, f"{'.'.join((*path, key))}: a key holds a lone UTF-16 surrogate, which is "
                                          "not text; send valid Unicode")
                stack.append((v, (*path, key)))
        elif isinstance(o, list):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(o))
        elif isinstance(o, str) and (m := _SURROGATE.search(o)):
            raise _HTTPError(400, f"{'.'.join(path) or 'body'}: a lone UTF-16 surrogate ({ascii(m.group())} at "
                                  f"character {m.start()}), which is not text; send valid Unicode")


def _token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _message_dict(m: Any) -> dict[str, Any]:
    """A request message as the chat template takes it: text parts joined, ``None`` content as ``""``."""
    d = m.model_dump(exclude_none=True)
    content = m.content
    if isinstance(content, list):
        content = "".join(p.text for p in content)
    d["content"] = content or ""
    return d
