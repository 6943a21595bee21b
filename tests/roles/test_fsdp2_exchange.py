"""FSDP2's collectives over gloo as point-to-point exchanges (asyncrl.roles.modeling.strategy): at 3 ranks on real Ray
processes, the all-gather equals gloo's own and the reduce-scatter is the sum of every rank's chunk in rank order, each
also run beside the compute (an asynchronous all-gather FSDP2 waits for, a reduce-scatter whose sum is written a unit
later); a model trained with the exchanges beside its compute ends bit for bit where the synchronous ones take it, a
failed step included; a gather of chosen parameters per FSDP unit gives them whole, uneven and empty shards included."""

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
        from asyncrl.roles.modeling.parallel import DataParallel

        self.dp = DataParallel(self.rank, self.world_size)

    @register(Dispatch.ONE_TO_ALL)
    def gather_and_scatter(self) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        from asyncrl.roles.modeling.strategy import _ExchangeAllGather, _ExchangeReduceScatter

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
        return {"gathered": out, "native": native, "reduced": reduced, **self._in_flight(group, shard, grads)}

    def _in_flight(self, group, shard: torch.Tensor, grads: torch.Tensor) -> dict:
        """The same exchanges beside the compute: an all-gather's ``Work``, and reduce-scatters deferred one at a time
        (window 1: each new one finishes the one before it; the rest at a drain)."""
        import torch.distributed as dist

        from asyncrl.roles.modeling.strategy import _ExchangeAllGather, _ExchangeReduceScatter, _InFlight

        world, flight = self.world_size, _InFlight()
        out = torch.full((world * 5,), float("nan"))
        out.narrow(0, 5 * self.rank, 5).copy_(shard)
        work = _ExchangeAllGather(flight)(out, out.narrow(0, 5 * self.rank, 5), group, async_op=True)
        seen = {"gather_is_work": isinstance(work, dist.Work), "gathers_posted": len(flight.gathers)}
        work.wait()
        seen["gathers_after_wait"] = len(flight.gathers)
        rs = _ExchangeReduceScatter(flight)
        outs = [torch.full((7,), float("nan")) for _ in range(3)]
        rs(outs[0], grads.clone(), group, dist.ReduceOp.SUM)  # not deferred: finished on return
        flight.defer_reduce = True
        rs(outs[1], grads.clone(), group, dist.ReduceOp.SUM)
        seen["unwritten_while_deferred"] = bool(outs[1].isnan().all())
        rs(outs[2], (2 * grads).clone(), group, dist.ReduceOp.SUM)  # finishes the one before it
        seen["reduces_pending"] = len(flight.reduces)
        seen["unwritten_before_drain"] = bool(outs[2].isnan().all())
        flight.drain()
        seen["reduces_after_drain"] = len(flight.reduces)
        return {"async_gathered": out, "async_reduced": torch.stack(outs), "seen": seen}


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


class Cell(torch.nn.Module):
    """A unit of :class:`Chain`: 7 rows shard as 3, 3, 1 over 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


class Chain(torch.nn.Module):
    _no_split_modules = ["Cell"]

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cells = torch.nn.ModuleList([Cell() for _ in range(4)])
        self.head = torch.nn.Linear(7, 3)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for cell in self.cells:  # checkpointed: each cell's forward computed again in the backward
            x = torch.utils.checkpoint.checkpoint(cell, x, use_reentrant=False) if self.checkpointed else cell(x)
        return self.head(x)


class TrainProbe(Worker):
    """A :class:`Chain` under the fsdp2 strategy, trained two micro-batches per step."""

    @register(Dispatch.ONE_TO_ALL)
    def train(self, overlap: bool, fail: str | None = None, checkpointed: bool = False) -> dict:
        """Two clipped AdamW steps, after a step that raises in its last micro-batch's `fail` (``forward``: on
        entering the second cell, with the third's all-gather prefetched; ``backward``: in the second cell's, after
        the cells above posted their reduce-scatters). The whole weights and what stays in flight after the failure."""
        from asyncrl.roles.modeling.parallel import DataParallel
        from asyncrl.roles.modeling.device import Placement
        from asyncrl.roles.modeling.strategy import TrainStrategy

        net = Chain(checkpointed)
        engine = TrainStrategy(net, Placement(torch.device("cpu"), torch.float32, None),
                               DataParallel(self.rank, self.world_size), "fsdp2", overlap=overlap)
        optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(self.rank)
        batches = [torch.randn(2 + self.rank, 7, generator=g) for _ in range(2)]
        cell = net.cells[1]

        def step(fail: str | None = None) -> None:
            engine.zero_grad(optim)
            for i, x in enumerate(batches):
                hooks = []
                if fail is not None and i == 1:
                    def boom(*_):
                        raise RuntimeError(f"injected failure in the {fail}")

                    def arm(module, args, out) -> None:
                        out.register_hook(boom)

                    hooks.append(cell.register_forward_pre_hook(boom) if fail == "forward"
                                 else cell.register_forward_hook(arm))
                try:
                    with engine.micro_batch(last=i == 1):
                        (net(x) ** 2).sum().backward()
                finally:
                    for h in hooks:
                        h.remove()
            engine.clip_grad_norm(0.05)
            optim.step()

        left = None
        if fail is not None:
            with pytest.raises(RuntimeError, match=f"injected failure in the {fail}"):
                step(fail)
            flight = engine._flight
            left = (len(flight.gathers), len(flight.reduces)) if flight is not None else None
        step()
        step()
        return {"weights": dict(engine.full_tensors(net.state_dict())), "left_in_flight": left}


class UnitGatherProbe(Worker):
    """A small model sharded by the fsdp2 strategy over the group."""

    @register(Dispatch.ONE_TO_ALL)
    def gather(self) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
        from asyncrl.roles.modeling.parallel import DataParallel
        from asyncrl.roles.modeling.device import Placement
        from asyncrl.roles.modeling.strategy import TrainStrategy

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
        assert torch.equal(res["async_gathered"], whole), rank
        assert torch.equal(res["async_reduced"], torch.stack([res["reduced"], res["reduced"],
                                                              (2 * chunks[0] + 2 * chunks[1]) + 2 * chunks[2]])), rank
        assert res["seen"] == {"gather_is_work": True, "gathers_posted": 1, "gathers_after_wait": 0,
                               "unwritten_while_deferred": True, "reduces_pending": 1, "unwritten_before_drain": True,
                               "reduces_after_drain": 0}, rank


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


async def test_training_with_the_exchanges_beside_the_compute_ends_where_the_synchronous_ones_do(ray_cluster):
    """Three ranks, uneven shards and batches: the same weights bit for bit (the same sums in the same order), also
    after a step that failed in its forward or its backward with exchanges in flight, none of which is left over, and
    with each unit's forward computed again in the backward (activation checkpointing)."""
    async with asyncrl.RayWorkerGroup(TrainProbe, world_size=3, name="exchange-train") as group:
        sync = await group.train(False)
        beside = await group.train(True)
        failed = {where: await group.train(True, where) for where in ("forward", "backward")}
        recomputed = await group.train(False, None, True), await group.train(True, None, True)
    start = Chain().state_dict()
    for rank in range(3):
        assert sync[rank]["left_in_flight"] is None and beside[rank]["left_in_flight"] is None
        for k, t in sync[rank]["weights"].items():
            assert not torch.equal(t, start[k]), k  # trained
            assert torch.equal(beside[rank]["weights"][k], t), (rank, k)
            for where, res in failed.items():
                assert torch.equal(res[rank]["weights"][k], t), (where, rank, k)
            assert torch.equal(recomputed[0][rank]["weights"][k], t), (rank, k)  # activation checkpointing
            assert torch.equal(recomputed[1][rank]["weights"][k], t), (rank, k)
        for where, res in failed.items():
            assert res[rank]["left_in_flight"] == (0, 0), (where, rank)
