"""What the README promises of a group's surface: closing runs every worker's ``on_close``,
and a group's methods show up in ``dir()`` with the worker method's signature (minus ``self``)."""

from __future__ import annotations

import inspect
import pathlib

import pytest

from asyncrl import Dispatch, Worker, register
from tests.core import kinds
from tests.core.kinds import BACKENDS


class Closing(Worker):
    """Writes a file named after its rank when its group closes."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = pathlib.Path(out)

    @register()
    def ping(self) -> int:
        return self.rank

    def on_close(self) -> None:
        (self.out / f"closed-{self.rank}").write_text(str(self.rank))


class Surface(Worker):
    @register(Dispatch.DP_COMPUTE)
    def score(self, batch: list[int], scale: float = 1.0, *, tag: str = "s") -> list[float]:
        """Scores each item."""
        return [x * scale for x in batch]

    @register(concurrent=True)
    async def status(self) -> str:
        return "ok"

    def helper(self) -> None:  # not registered: not a group method
        pass


@pytest.mark.parametrize("backend", BACKENDS)
async def test_closing_a_group_runs_every_workers_on_close(ray_cluster, backend, tmp_path):
    async with kinds.group(backend, Closing, world_size=2, args=(str(tmp_path),), name=f"closing-{backend}") as g:
        assert await g.ping() == [0, 1]
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing closed while the group is open
    assert sorted((p.name, p.read_text()) for p in tmp_path.iterdir()) == [("closed-0", "0"), ("closed-1", "1")]


async def test_group_methods_are_in_dir_with_the_worker_signature():
    async with kinds.group("local", Surface, world_size=2, name="surface") as g:
        names = dir(g)
        assert {"score", "status"} <= set(names) and "helper" not in names
        assert names == sorted(names)
        sig = inspect.signature(g.score)
        assert str(sig) == "(batch: 'list[int]', scale: 'float' = 1.0, *, tag: 'str' = 's') -> 'list[float]'"
        assert list(sig.parameters) == ["batch", "scale", "tag"]
        assert str(inspect.signature(g.status)) == "() -> 'str'"
        assert g.score.__name__ == "score"
        assert await g.score([1, 2, 3, 4], 2.0) == [2.0, 4.0, 6.0, 8.0]
