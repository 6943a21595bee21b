"""Bring your own agent: ``RolloutConfig.agent`` runs the user's OpenAI-client agent as an episode.

``async def agent(sample, base_url) -> float | None`` is any code that talks to ``base_url`` with an
OpenAI-compatible client (any model name, any key: the URL is the session's capability). It returns the
episode's reward, or None to leave it to the reward function::

    async def solve(sample, base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY")
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": sample.prompt}])
        return float(sample.answer in r.choices[0].message.content)

Data flow on a rollout worker (one :class:`~asyncrl.roles.agentic.gateway.Gateway` per worker, started at its
first episode, on the worker's request-level engine)::

    row ─► open_session (seed: the row's) ─► agent(sample, session URL) ─► HTTP requests ─► gateway rows
        ─► close_session ─► the last row is the episode's Trajectory (its prompt is the gateway's rendered
           chat, not the batch's prompt); earlier rows (prefix breaks) are counted, not trained
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Awaitable, Callable

from asyncrl.roles.agentic.episodes import LLM, Sample, Trajectory
from asyncrl.roles.errors import EpisodeConfigError, EpisodeError
from asyncrl.roles.agentic.gateway import Gateway
from asyncrl.roles.engines.round_log import ReplayDivergedError

__all__ = ["SessionURL", "AgentEpisode", "resolve_agent"]

Agent = Callable[..., Awaitable[float | None]]


class SessionURL(str):
    """A session's ``base_url`` (a ``str``) that also carries the session's token as :attr:`api_key` (for agents
    that send it; the gateway accepts any key, the URL is the capability)."""

    api_key: str

    def __new__(cls, url: str, api_key: str) -> SessionURL:
        obj = super().__new__(cls, url)
        obj.api_key = api_key
        return obj


def resolve_agent(spec: str) -> Agent:
    """The ``async def`` named by `spec`: ``path/to/file.py:function`` or ``package.module:function``;
    an :class:`~asyncrl.roles.errors.EpisodeConfigError` says what is wrong with it."""
    path, sep, attr = spec.rpartition(":")
    if not sep or not path or not attr:
        raise EpisodeConfigError(f"agent {spec!r} must be 'path/to/file.py:function' or 'package.module:function'")
    try:
        if path.endswith(".py"):
            if not os.path.isfile(path):
                raise ImportError(f"no file {path!r} (relative paths start at {os.getcwd()!r})")
            name = "asyncrl_agent_" + os.path.splitext(os.path.basename(path))[0]
            module = sys.modules.get(name)
            if module is None or getattr(module, "__file__", None) != os.path.abspath(path):
                loader_spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
                assert loader_spec is not None and loader_spec.loader is not None
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[name] = module  # before running it: a dataclass in the file looks its module up
                try:
                    loader_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
        else:
            module = importlib.import_module(path)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, SyntaxError) as e:
        raise EpisodeConfigError(f"agent {spec!r} cannot be imported ({type(e).__name__}: {e})") from None
    if not inspect.iscoroutinefunction(fn):
        raise EpisodeConfigError(f"agent {spec!r} must be an `async def` taking (sample, base_url)")
    n = len([p for p in inspect.signature(fn).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    if n not in (2, 3):
        raise EpisodeConfigError(f"agent {spec!r} takes {n} positional parameters; it must take (sample, base_url) "
                                 "or (sample, base_url, api_key)")
    return fn  # type: ignore[no-any-return]


class AgentEpisode:
    """The episode that runs `agent` against a session of this worker's gateway (see the module docstring).

    Args:
        spec: ``RolloutConfig.agent`` (what errors name).
        context_length: the model's context (the gateway refuses longer prompts with a 400).
        host: where the gateway listens (loopback by default).
    """

    def __init__(self, spec: str, *, context_length: int | None = None, host: str = "127.0.0.1") -> None:
        self.spec = spec
        self.agent = resolve_agent(spec)
        self._takes_key = len(inspect.signature(self.agent).parameters) >= 3
        self.context_length = context_length
        self.host = host
        self.gateway: Any = None  # started on the worker's loop by the first episode
        self.sessions: list[dict[str, Any]] = []
        """``{"session": key, "requests": [...]}`` of each closed session whose row has a round-log key (the
        streaming trainer's rows), what :meth:`Gateway.session_log` recorded; the run's round log carries them."""
        self.expected: dict[str, list[dict[str, str]]] | None = None
        """A replay's recorded sessions by key: each session's requests must match them (:meth:`replay`)."""

    def replay(self, sessions: list[dict[str, Any]]) -> None:
        """Check this worker's sessions against recorded `sessions` (``self.sessions`` of the recording): an agent
        whose requests differ -- not a deterministic function of the responses it got -- fails its row with
        :class:`~asyncrl.roles.engines.round_log.ReplayDivergedError`."""
        self.expected = {str(x["session"]): list(x["requests"]) for x in sessions}

    async def __call__(self, llm: LLM, sample: Sample) -> Trajectory:
        if self.gateway is None:  # start() binds without awaiting anything, so episodes cannot race here
            gw = Gateway(llm.submit, llm.tokenizer, llm.params, max_response_tokens=llm.max_response_tokens,
                         context_length=self.context_length, host=self.host)
            await gw.start()
            self.gateway = gw
        gw = self.gateway
        expected = None
        if self.expected is not None:
            if llm.key not in self.expected:
                raise EpisodeError(f"agent {self.spec!r} (row {sample.index}): the replayed run recorded no session "
                                   f"{llm.key!r}; restore the run's rounds.jsonl")
            expected = self.expected[llm.key]
        # the session samples through the row's llm: its seed, params and round-log keys
        info = gw.open_session(llm=llm, expected=expected)
        url = SessionURL(info.base_url, info.key)
        try:
            reward = await (self.agent(sample, url, info.key) if self._takes_key else self.agent(sample, url))
        except Exception:
            gw.close_session(info.id)
            self._check_replayed(gw, info.id)  # a replayed agent fails on its refused request: say why
            raise
        rows = gw.close_session(info.id)
        self._check_replayed(gw, info.id)
        if llm.key is not None:
            self.sessions.append({"session": llm.key, "requests": gw.session_log(info.id)})
        if not rows:
            raise EpisodeError(f"agent {self.spec!r} (row {sample.index}) made no completion request to its base_url; "
                               "an agent must call the model through the session URL it is given")
        if reward is not None and not isinstance(reward, (int, float)):
            raise EpisodeError(f"agent {self.spec!r} (row {sample.index}) returned {type(reward).__name__}; return "
                               "a float reward or None (the reward function scores it)")
        traj = rows[-1]
        traj.reward = None if reward is None else float(reward)
        stats = gw.session_stats(info.id)
        traj.count("gateway_rows", stats.rows)
        traj.count("prefix_breaks", stats.prefix_breaks)
        return traj

    def _check_replayed(self, gw: Any, session_id: str) -> None:
        why = gw.divergence(session_id)
        if why is not None:
            raise ReplayDivergedError(f"agent {self.spec!r}: {why}: the agent's calls are not a deterministic function "
                                      "of the responses it received, so this run cannot be replayed")

    async def close(self) -> None:
        """Stop the gateway (the worker's shutdown)."""
        if self.gateway is not None:
            await self.gateway.close()
            self.gateway = None
