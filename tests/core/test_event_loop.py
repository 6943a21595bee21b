"""The controller's event loop: ``asyncrl.run`` (uvloop's loop by default, asyncio's on request).

What must hold on either loop: `run` behaves as ``asyncio.run`` (the result, the error as
itself, a clear error for an unknown or missing loop, never a coroutine left un-awaited),
and every protocol of a group call that depends on the loop (the fetch's one wake-up per
call from Ray's thread, pipelined futures, a deadline, a cancel, an error named by rank,
hundreds of calls in flight) gives the same outcomes on uvloop as on asyncio (the rest of
the suite runs them on asyncio's loop), on both Ray host kinds.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import warnings

import pytest
import torch
import uvloop
from tensordict import TensorDict

import asyncrl
from asyncrl import CallCancelledError, CallTimeoutError, RemoteError
from asyncrl.runtime import loop_factory

from tests.core import kinds
from tests.core.workers import Probe

EXPECTED = {"uvloop": uvloop.Loop, "asyncio": asyncio.SelectorEventLoop}


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


@pytest.mark.parametrize("kind, expected", [("auto", uvloop.Loop), ("uvloop", uvloop.Loop),
                                            ("asyncio", asyncio.SelectorEventLoop)])
def test_run_gives_main_the_loop_asked_for(kind, expected) -> None:
    assert asyncrl.run(_loop_type(), loop=kind) is expected
    assert asyncrl.run(_loop_type()) is uvloop.Loop  # the default is auto


def test_run_returns_the_result_and_raises_the_error_as_itself() -> None:
    async def ok() -> tuple[int, str]:
        await asyncio.sleep(0)
        return 7, "x"

    async def fails() -> None:
        await asyncio.sleep(0)
        raise KeyError("the user's own error")

    assert asyncrl.run(ok()) == (7, "x")
    with pytest.raises(KeyError, match="the user's own error"):
        asyncrl.run(fails(), loop="uvloop")


def test_an_unknown_loop_is_a_clear_error_and_leaves_no_unawaited_coroutine() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"unknown event loop 'trio': use one of 'auto', 'uvloop', 'asyncio'"):
            asyncrl.run(_loop_type(), loop="trio")
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_without_uvloop_auto_falls_back_to_asyncio_and_uvloop_names_the_fix(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert loop_factory("auto") is None
    assert asyncrl.run(_loop_type(), loop="auto") is asyncio.SelectorEventLoop
    with pytest.raises(ValueError, match=r"'uvloop' asked for, but uvloop cannot be imported .*pip install uvloop"):
        loop_factory("uvloop")


def test_the_trainer_config_rejects_a_loop_it_cannot_run(monkeypatch) -> None:
    from asyncrl.pipelines.job.config import ConfigError
    from asyncrl.pipelines.job.presets import load_config

    assert load_config(overrides=["trainer.event_loop=asyncio"]).trainer.event_loop == "asyncio"
    with pytest.raises(ConfigError, match=r"trainer.event_loop must be one of \['auto', 'uvloop', 'asyncio'\]"):
        load_config(overrides=["trainer.event_loop=trio"])
    monkeypatch.setitem(sys.modules, "uvloop", None)
    with pytest.raises(ConfigError, match=r"trainer.event_loop: event loop 'uvloop' asked for, but uvloop cannot"):
        load_config(overrides=["trainer.event_loop=uvloop"])
    assert load_config(overrides=["trainer.event_loop=auto"]).trainer.event_loop == "auto"


def test_run_inside_a_running_loop_is_refused() -> None:
    async def nested() -> None:
        coro = _loop_type()
        try:
            asyncrl.run(coro)
        finally:
            coro.close()

    with pytest.raises(RuntimeError, match="[Aa]lready running"):
        asyncrl.run(nested())


def _rows(n: int) -> TensorDict:
    td = TensorDict({"x": torch.arange(n)}, batch_size=[n])
    td["prompt"] = [f"p{i}" for i in range(n)]
    return td


async def _protocols(backend: str) -> dict:
    """The loop-dependent protocols of group calls, on the running loop; returns what each gave."""
    out: dict = {"loop": type(asyncio.get_running_loop())}
    async with kinds.group(backend, Probe, world_size=2, name=f"loop-{backend}") as g:
        out["add"] = await g.add(5)
        tagged = g.tag(_rows(6))
        out["chain"] = (await g.inc(tagged))["y"].tolist()  # a pipelined future, worker to worker
        try:
            await g.boom_on_rank(_rows(4), 1)
        except RemoteError as e:
            out["error"] = (e.rank, e.method, "rank 1 failed" in str(e))
        held = g.block()  # both ranks hold their ordered thread until unblocked
        await kinds.until(lambda: _all(g.is_blocked()))
        try:
            await g.add.options(timeout=0.2)(1)  # waits its turn behind `held`: the deadline fires
        except CallTimeoutError:
            out["deadline"] = True
        await g.unblock()
        out["held"] = await held
        held = g.block()
        await kinds.until(lambda: _all(g.is_blocked()))
        held.cancel()
        try:
            await held
        except CallCancelledError:
            out["cancelled"] = True
        await g.unblock()
        futures = [g.add(i) for i in range(300)]  # past the fetch's batching limit (256 refs)
        out["many"] = [r[0] for r in await asyncrl.gather(*futures)] == list(range(300))
        out["after"] = await g.add(1)  # the lanes are free again
    return out


async def _all(fut) -> bool:
    return all(await fut)


@pytest.mark.parametrize("backend", ["ray-threaded", "ray"])
def test_group_calls_keep_every_protocol_on_uvloop(ray_cluster, backend) -> None:
    # (the rest of the suite runs every protocol on asyncio's loop, pytest-asyncio's)
    loop = "uvloop"
    got = asyncrl.run(_protocols(backend), loop=loop)
    assert got == {
        "loop": EXPECTED[loop],
        "add": [5, 6],
        "chain": [1, 3, 5, 7, 9, 11],
        "error": (1, "boom_on_rank", True),
        "deadline": True,
        "held": [0, 1],
        "cancelled": True,
        "many": True,
        "after": [1, 2],
    }
