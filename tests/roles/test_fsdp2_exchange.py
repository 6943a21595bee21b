"""FSDP2's collectives over gloo as point-to-point exchanges (asyncrl.roles.training.strategy): at 3 ranks on real Ray
processes, the all-gather equals gloo's own and the reduce-scatter is the sum of every rank's chunk in rank order; a
gather of chosen parameters per FSDP unit gives them whole, uneven and empty shards included."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

import asyncrl
from asyncrl import Dispatch, Worker, register


def _inputs(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s shard (an all-gather input) and its world-chunked gradient (a reduce-scatter input)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(5, generator=g), torch.randn(world * 7, generator=g)


class CollectiveProbe(Worker):
    """Runs the exchange collectives and gloo's own on the group's default process group."""

    def __init__(self) -> None:
        from asyncrl.roles._util import DataParallel

        self.dp = DataParallel(self.rank, self.world_size)

    @register(Dispatch.ONE_TO_ALL)
    def gather_and_scatter(self) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        from asyncrl.roles.training.strategy import _ExchangeAllGather, _ExchangeReduceScatter

        group, world = self.dp.grad_group(), self.world_size
        shard, grads = _inputs(self.rank, world)
        ag = _ExchangeAllGather()
        out = ag.allocate((world * 5,), dtype=torch.float32, device=torch.device("cpu"))
        mine = out.narrow(0, 5 * self.rank, 5)  # FSDP2 copies its shard into its slot of the output first
        mine.copy_(shard)
        assert ag(out, mine, group) is None
        native = torch.empty(world * 5)
        dist.all_gather_into_tensor(native, shard, group=group)
        rs = _ExchangeReduceScatter()
        reduced = rs.allocate((7,), dtype=torch.float32, device=torch.device("cpu"))
        rs(reduced, grads.clone(), group, dist.ReduceOp.SUM)
        with pytest.raises(ValueError, match="the exchange reduce-scatter sums; FSDP2 asked for"):
            rs(reduced.clone(), grads.clone(), group, dist.ReduceOp.MAX)  # refused before anything is sent
        return {"gathered": out, "native": native, "reduced": reduced}


class Block(torch.nn.Module):
    """A unit FSDP2 shards on its own (named in ``_no_split_modules``); its tensors' first dimensions do not divide by
    3 ranks: 5 rows shard as 2, 2, 1; 2 rows as 1, 1 and an empty shard."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 5)
        self.b = torch.nn.Linear(4, 2, bias=False)
        self.c = torch.nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x) + self.b(self.a(x)[..., :4]).sum(-1, keepdim=True)


class Net(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(4, 7)


class UnitGatherProbe(Worker):
    """A small model sharded by the fsdp2 strategy over the group."""

    @register(Dispatch.ONE_TO_ALL)
    def gather(self) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
        from asyncrl.roles._util import DataParallel
        from asyncrl.roles.modeling.device import Placement
        from asyncrl.roles.training.strategy import TrainStrategy

        net = Net()
        engine = TrainStrategy(net, Placement(torch.device("cpu"), torch.float32, None),
                               DataParallel(self.rank, self.world_size), "fsdp2")
        chosen = {n: p for n, p in net.named_parameters() if not n.endswith(".c.weight")}  # not a unit's all
        whole: dict[str, torch.Tensor] = {}
        groups = []
        for got in engine.gather_by_unit(chosen):
            groups.append(sorted(got))
            whole.update(got)
        return whole, groups


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this test module is not importable by workers


async def test_exchange_all_gather_and_reduce_scatter_at_three_ranks(ray_cluster):
    async with asyncrl.RayWorkerGroup(CollectiveProbe, world_size=3, name="exchange-collectives") as group:
        results = await group.gather_and_scatter()
    inputs = [_inputs(r, 3) for r in range(3)]
    whole = torch.cat([shard for shard, _ in inputs])
    for rank, res in enumerate(results):
        assert torch.equal(res["gathered"], whole) and torch.equal(res["native"], whole), rank
        chunks = [grads.view(3, 7)[rank] for _, grads in inputs]
        assert torch.equal(res["reduced"], chunks[0] + chunks[1] + chunks[2]), rank  # rank order, bit for bit


async def test_a_gather_per_unit_gives_the_chosen_parameters_whole_from_uneven_shards(ray_cluster):
    async with asyncrl.RayWorkerGroup(UnitGatherProbe, world_size=3, name="unit-gather") as group:
        results = await group.gather()
    expected = {n: p.detach() for n, p in Net().named_parameters() if not n.endswith(".c.weight")}
    for whole, groups in results:
        assert groups == [["head.bias", "head.weight"],  # the root unit, then each block: one all-gather each
                          [f"blocks.0.{n}" for n in ("a.bias", "a.weight", "b.weight", "c.bias")],
                          [f"blocks.1.{n}" for n in ("a.bias", "a.weight", "b.weight", "c.bias")]]
        assert whole.keys() == expected.keys()
        for n, t in expected.items():
            assert torch.equal(whole[n], t), n
