"""Checked by mypy in test_typing.py: group methods carry the worker's types."""

from __future__ import annotations

from typing import Any, assert_type

from tensordict import TensorDict

from asyncrl import Dispatch, Execute, GroupFuture, GroupMethod, RayWorkerGroup, Worker, register


class Typed(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def add(self, x: int) -> int:
        return x

    @register(Dispatch.DP_COMPUTE)
    def score(self, batch: TensorDict) -> TensorDict:
        return batch

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def name(self) -> str:
        return "a"

    @register(Dispatch.DP_COMPUTE_METRIC)
    def metrics(self, batch: TensorDict) -> dict[str, float]:
        return {}


def check(wg: RayWorkerGroup[Typed], batch: TensorDict) -> None:
    assert_type(Typed().add(1), int)  # a local call is the plain method
    assert_type(wg.method(Typed.add)(1), GroupFuture[list[int]])
    assert_type(wg.method(Typed.score)(batch), GroupFuture[TensorDict])
    assert_type(wg.method(Typed.name)(), GroupFuture[str])
    assert_type(wg.method(Typed.metrics)(batch), GroupFuture[list[dict[str, float]]])
    assert_type(wg.add, GroupMethod[..., Any])
    wg.method(Typed.add)("not an int")  # type: ignore[arg-type]


async def awaited(wg: RayWorkerGroup[Typed]) -> None:
    assert_type(await wg.method(Typed.add)(1), list[int])
