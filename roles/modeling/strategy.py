"""How a trained role's model is spread over the ranks of its group: ``ddp`` or ``fsdp2``.

``ddp``
    Every rank holds the whole model, its gradients and its optimizer state (about 16 bytes per
    parameter in fp32 with AdamW). Gradients are summed by torch's ``DistributedDataParallel``
    during the last micro-batch's backward (``no_sync`` before it).
``fsdp2``
    torch's FSDP2 (``fully_shard``) per decoder layer and at the root, over a mesh of the group's
    ranks (gloo on CPU, NCCL on GPUs): each rank keeps 1/N of the parameters, gradients and
    optimizer state, and all-gathers a layer's parameters just before it computes. The last decoder layer and
    the root stay gathered from their forward to their backward, which needs them first (torchtitan's policy; a
    forward without autograd reshards them). On a GPU with
    bf16 autocast, parameters are all-gathered in bf16 and gradients reduced in fp32. Over gloo (CPU)
    FSDP2's all-gather and reduce-scatter are direct sends between the ranks (``_ExchangeAllGather``,
    ``_ExchangeReduceScatter``): gloo's own ran a decoder layer's shards at about a third of that speed on
    one machine. They run beside the compute, as DDP's all-reduce does (``_InFlight``): each unit's all-gather
    is posted one unit ahead (FSDP2's asynchronous unshard, prefetched in the forward and in the backward) and
    waited for before the unit computes; a reduce-scatter returns once its sends are posted and its sum is
    written when the next one is posted, the last at the end of the micro-batch (FSDP2 only makes views of it
    until then). Gradients are reduce-scattered once per optimizer step, in the last micro-batch's backward, as
    DDP all-reduces them (``set_requires_gradient_sync``): until then each rank accumulates each layer's whole
    gradient (a replica's gradient bytes; parameters and optimizer state stay sharded).

A micro-batch that raises fails the step and leaves nothing of it behind (DDP's reducer reset; under FSDP2 the
exchanges already posted finished, ``reset_iter_state``, its unsynced whole gradients dropped, no new collective):
the next step runs as if the failed one never had.

Both keep the loss's math: every micro-batch's loss is its share of the *global* loss (global
token and sequence denominators), so gradients are **summed** over ranks, never averaged (DDP gets a
sum hook; FSDP2 a divide factor of 1), and 2 ranks train like 1 to fp32 rounding.

With one rank (or a worker outside a multi-process group) both strategies are the plain module.

Sharded parameters are ``DTensor`` s. What needs whole tensors reads them through collectives that every
rank runs in the same order, so no rank ever holds the whole gathered model at once: a weight sync with
:meth:`TrainStrategy.whole_by_unit` (one all-gather per decoder layer), an adapter sync with
:meth:`TrainStrategy.gather_by_unit` (one all-gather per unit of its LoRA factors alone), checksums and
``export_weights`` with :meth:`TrainStrategy.full_tensors` (one tensor at a time).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Literal, Mapping

import torch
from torch import nn

from asyncrl import Dispatch
from asyncrl.dispatch import dispatch_one_to_all

from asyncrl.roles.modeling.parallel import DataParallel
from asyncrl.roles.modeling.device import Placement

__all__ = ["EVERY_RANK_GIVES_RANK_ZEROS", "STRATEGIES", "Strategy", "TrainStrategy", "decoder_layers", "is_sharded",
           "full_tensor", "layer_classes"]

Strategy = Literal["ddp", "fsdp2"]
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp2")


def _rank_zeros(world: Any, results: list[Any]) -> Any:
    return results[0]


EVERY_RANK_GIVES_RANK_ZEROS = Dispatch.custom("every_rank_gives_rank_zeros", dispatch_one_to_all, _rank_zeros)
"""Every rank runs the call (it may hold a collective, as gathering FSDP2 shards does); the call resolves to
rank 0's result, as ``Execute.RANK_ZERO`` would."""


def is_sharded(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (a shard of an FSDP2 parameter)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: an all-gather for a DTensor (a collective: every rank must call it), else `t`."""
    return t.full_tensor() if is_sharded(t) else t


def layer_classes(model_dir: str) -> tuple[str, list[str]]:
    """``(causal LM class name, its decoder layer class names)`` of the Hugging Face model in `model_dir`,
    read from its config without building it (what ``fsdp2`` would shard one by one; empty: nothing)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    cls = AutoModelForCausalLM._model_mapping[type(conf)]
    return cls.__name__, list(getattr(cls, "_no_split_modules", None) or ())


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: transformers' ``_no_split_modules`` classes (the
    decoder layers), found anywhere in `model` (a causal LM, or the value model's backbone)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


class TrainStrategy:
    """A trained role's model over its group's ranks (see the module docstring).

    Args:
        model: the module, already on its placement's device and dtype (``fsdp2`` shards it in place).
        placement: where it computes (a GPU's bf16 autocast becomes FSDP2's mixed precision).
        dp: the group's collectives (its process group is the one the model is spread over).
        strategy: ``ddp`` or ``fsdp2``.
        offload: ``fsdp2`` only: keep the shards and optimizer state in CPU memory between uses.
        reshard_after_forward: ``fsdp2`` only: free a layer's gathered parameters after its forward (all but the
            last layer and the root, which the backward needs first).
        reduce_every_micro_batch: ``fsdp2`` only: reduce-scatter every micro-batch's gradient, not the step's once.
        overlap: ``fsdp2`` over gloo only: run the exchanges beside the compute (all-gathers prefetched one unit ahead,
            reduce-scatters finished a unit later); false: each one synchronous where FSDP2 calls it.
        who: the role's name, for errors.
    """

    def __init__(self, model: nn.Module, placement: Placement, dp: DataParallel, strategy: str = "ddp", *,
                 offload: bool = False, reshard_after_forward: bool = True, reduce_every_micro_batch: bool = False,
                 overlap: bool = True, trainable: bool = True, who: str = "the role") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"{who}: strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
        if offload and strategy != "fsdp2":
            raise ValueError(f"{who}: offload keeps FSDP2 shards in CPU memory; it needs strategy='fsdp2'")
        if offload and placement.device.type != "cuda":
            raise ValueError(f"{who}: fsdp_offload keeps a GPU model's shards in CPU memory between uses, but this "
                             f"model computes on {placement.device}, where they already are; set fsdp_offload=false")
        self.name = strategy
        self.dp = dp
        self.placement = placement
        self.module = model
        """The model itself (its state dict has the model's own names); FSDP2's shards live in it."""
        self._ddp: nn.Module | None = None
        self.sharded = False
        self._units: list[nn.Module] = []
        self._kept: list[nn.Module] = []
        self._reduce_each = reduce_every_micro_batch
        self._flight: _InFlight | None = None
        layers = decoder_layers(model) if strategy == "fsdp2" else []
        if strategy == "fsdp2" and not layers:  # (checked at one rank too: the config must work at any count)
            raise ValueError(
                f"{who}: strategy=fsdp2 shards a model per decoder layer, but {type(model).__name__} declares none "
                "(transformers' `_no_split_modules`); set strategy=ddp for this model")
        if not dp.active:
            return
        if strategy == "fsdp2":
            self._shard(model, layers, offload, reshard_after_forward, overlap)
            self.sharded = True
        elif trainable:
            self._ddp = _ddp(model, placement, dp)

    def _shard(self, model: nn.Module, layers: list[nn.Module], offload: bool, reshard_after_forward: bool,
               overlap: bool) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if self.placement.device.type == "cuda" and self.dp.backend != "nccl":
            raise ValueError("strategy=fsdp2 on GPUs needs a GPU of its own per training rank (NCCL refuses two ranks "
                             "on one GPU, and FSDP2 needs its reduce-scatter); give each training worker a whole GPU "
                             "(trainer.gpus_per_worker=1) or set strategy=ddp")
        group = self.dp.grad_group()
        mesh = DeviceMesh.from_group(group, device_type=self.placement.device.type)
        amp = self.placement.autocast_dtype
        mp = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32) if amp is not None else MixedPrecisionPolicy()
        kw: dict[str, Any] = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
        # torchtitan's policy: the last layer and the root are the first the backward needs, so they stay gathered
        # from their forward to it (no second all-gather); a no-grad forward reshards them (_reshard_kept)
        for i, layer in enumerate(layers):
            fully_shard(layer, reshard_after_forward=reshard_after_forward and i < len(layers) - 1, **kw)
        fully_shard(model, reshard_after_forward=False, **kw)
        exchange = self.dp.backend == "gloo"
        self._units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._flight = _InFlight() if exchange and overlap else None
        for m in self._units:
            m.set_gradient_divide_factor(1.0)  # each rank's loss is its share of the global one: sum
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM; NCCL is fine)
            if exchange:
                m.set_custom_all_gather(_ExchangeAllGather(self._flight))
                m.set_custom_reduce_scatter(_ExchangeReduceScatter(self._flight))
        if self._flight is not None:
            # on the CPU FSDP2's all-gathers are synchronous unless asked for asynchronous ones: then its backward
            # prefetch (the next unit's all-gather, issued before this unit's backward) and the forward prefetch set
            # here run beside the compute, and FSDP2 waits for each before its unit computes
            model._set_unshard_async_op(True)  # type: ignore[operator]
            chain = [model, *layers]
            for unit, after in zip(chain, chain[1:]):
                unit.set_modules_to_forward_prefetch([after])  # type: ignore[operator]
        self._kept = [layers[-1], model] if reshard_after_forward else list(self._units)
        # registered after fully_shard's own hooks, so it runs after the root's post-forward
        model.register_forward_hook(self._reshard_kept)

    def _reshard_kept(self, module: nn.Module, args: Any, output: Any) -> None:
        """After a forward without autograd (log-probs, values, evaluation) no backward will reshard the units kept
        gathered after their forward: reshard them, so that between calls every rank holds shards only (what the
        weight sync, the checksums and a checkpoint read)."""
        if not torch.is_grad_enabled():
            for unit in self._kept:
                unit.reshard()  # type: ignore[operator]

    @property
    def forward_module(self) -> nn.Module:
        """The module to call for a training forward (DDP's wrapper under ``ddp`` with several ranks)."""
        return self._ddp if self._ddp is not None else self.module

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward. Gradients are summed over the ranks once per optimizer
        step, in the `last` micro-batch's backward: DDP's ``no_sync`` before it, and under FSDP2 no reduce-scatter
        before it (``set_requires_gradient_sync``: each layer's whole gradient accumulates on every rank until
        then), unless ``reduce_every_micro_batch``. Over gloo the exchanges still in flight at its end are finished
        before it returns (the gradient shards are whole then). A micro-batch that raises leaves no gathered
        parameter, no exchange in flight and no FSDP2 state of the failed step behind (:meth:`zero_grad` drops its
        gradients): the next step runs as if the failed one never had."""
        if self._ddp is not None:
            try:
                with self._ddp.no_sync() if not last else contextlib.nullcontext():  # type: ignore[operator]
                    yield
            except BaseException:
                # a backward that raised mid-reduction leaves DDP's reducer waiting for the rest of its buckets,
                # and the next forward refuses to start: reset it as DDP's own _update_process_group does
                self._ddp.reducer._reset_state()  # type: ignore[union-attr, operator]
                raise
        elif self.sharded:
            self.module.set_requires_gradient_sync(last or self._reduce_each)  # type: ignore[operator]
            flight = self._flight
            if flight is not None:  # FSDP2 adds into an existing gradient shard at once: defer only the first
                flight.defer_reduce = all(p.grad is None for p in self.module.parameters())
            try:
                yield
                if flight is not None:
                    flight.drain()
            except BaseException:
                self._abandon_step()
                raise
            finally:
                if flight is not None:
                    flight.defer_reduce = False
        else:
            yield

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop every gradient before an optimizer step's micro-batches: the optimizer's (the shards' under FSDP2)
        and FSDP2's whole gradients that a failed step accumulated without syncing them."""
        optimizer.zero_grad(set_to_none=True)
        if self.sharded:
            self._drop_unsynced_grads()

    def _abandon_step(self) -> None:
        """After a forward or backward raised mid-step: FSDP2 reshards every unit and forgets the step's
        collectives and hooks (``reset_iter_state``, on the root), and the whole gradients it accumulated without a
        reduce-scatter are dropped. No new collective: the exchanges already posted are finished first (the peers
        posted theirs in the same order up to the same point), so that none is left to match a later one."""
        if self._flight is not None:
            self._flight.drain()
        reset = getattr(self.module, "reset_iter_state", None)  # torch >= 2.13
        if reset is not None:
            reset()
        else:  # older torch: reshard what the failed pass gathered (its per-iteration trackers restart next forward)
            for unit in self._units:
                unit.reshard()  # type: ignore[operator]
        self._drop_unsynced_grads()

    def _drop_unsynced_grads(self) -> None:
        """FSDP2 keeps the gradient of a micro-batch run without gradient sync whole, on its unsharded parameter
        (``unsharded_accumulated_grad`` under mixed precision), until a synced backward reduce-scatters it; torch
        offers no call that drops it (``reset_iter_state`` keeps it, the optimizer's ``zero_grad`` sees the shards
        only), so it is cleared here on each FSDP2 parameter."""
        for unit in self._units:
            for group in unit._get_fsdp_state()._fsdp_param_groups:  # type: ignore[operator]
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    unsharded = getattr(param, "_unsharded_param", None)  # created by the first all-gather
                    if unsharded is not None:
                        unsharded.grad = None

    def clip_grad_norm(self, max_norm: float | None) -> float:
        """The total gradient norm over every rank's gradient (before clipping); clips in place when
        `max_norm` is set. Called between the last backward and the optimizer step."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        if max_norm is not None and max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.grad is not None],
                                                  max_norm)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
        return float(full_tensor(norm))

    def whole_by_unit(self, names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        """``{name: whole tensor}`` of the state-dict `names` (parameters and buffers of :attr:`module`), one FSDP
        unit (a decoder layer, then the root) at a time: one all-gather per unit, resharded before the next, so a
        rank holds at most one unit whole. Every rank must iterate it to the end over the same `names`. The
        tensors are views of the unit's gathered storage: copy what you keep before the next one is yielded."""
        for keys in self.by_unit({n: n for n in names}):
            yield {n: self._leaf(n) for n in keys}

    def by_unit(self, sources: Mapping[str, str]) -> Iterator[list[str]]:
        """The keys of `sources` (``{key: the state-dict name of :attr:`module` it reads}``), one FSDP unit at a
        time, while that unit's parameters are whole in the modules (gathered; resharded when the next is asked
        for): read them from the modules then (a LoRA layer's merged weight reads three of its unit's tensors).
        Not sharded: every key at once. Every rank must iterate it to the end over the same `sources`."""
        if not self.sharded:
            yield list(sources)
            return
        for unit, keys in self._per_unit(sources):
            unit.unshard()  # type: ignore[operator]  # (not recursive: this unit's own parameters)
            try:
                yield keys
            finally:
                unit.reshard()  # type: ignore[operator]

    def gather_by_unit(self, tensors: Mapping[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """``{name: whole tensor}`` of `tensors` (parameters of :attr:`module` under their state-dict names), one
        FSDP unit at a time: one all-gather per unit of these tensors' shards alone, not of the unit's other
        parameters (a LoRA adapter's factors without the frozen base weights beside them). New tensors. Not
        sharded: all at once, as given. Every rank must iterate it to the end over the same names."""
        if not self.sharded:
            yield dict(tensors)
            return
        for _, keys in self._per_unit({k: k for k in tensors}):
            yield self._gather_shards({k: tensors[k] for k in keys})

    def _per_unit(self, sources: Mapping[str, str]) -> list[tuple[nn.Module, list[str]]]:
        """``(unit, its keys of `sources`)`` for each FSDP unit that holds one: a key belongs to the innermost unit
        whose prefix holds the name it reads."""
        units = [(prefix, m) for prefix, m in self.module.named_modules() if m in self._units]
        owner: dict[str, list[str]] = {prefix: [] for prefix, _ in units}
        for key, n in sources.items():
            best = max((p for p, _ in units if p == "" or n.startswith(p + ".")), key=len)
            owner[best].append(key)
        return [(unit, owner[prefix]) for prefix, unit in units if owner[prefix]]

    def _gather_shards(self, shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole tensors of FSDP2 parameters (DTensors sharded on dim 0 over the group, as ``torch.chunk``
        splits it) in one all-gather: each rank's shards, each padded to its largest chunk, side by side."""
        import torch.distributed as dist

        group = self.dp.grad_group()
        world = group.size()
        locals_ = {k: t.to_local().detach() for k, t in shards.items()}  # type: ignore[attr-defined]
        dtypes = {t.dtype for t in locals_.values()}
        if len(dtypes) != 1:
            raise ValueError(f"gathering shards of one dtype at a time, got {sorted(map(str, dtypes))}")
        layout = []  # (name, whole shape, rows per rank's slot, elements per row, offset in a rank's slot)
        offset = 0
        for k, t in shards.items():
            rows = -(-t.shape[0] // world)
            per_row = math.prod(t.shape[1:])
            layout.append((k, t.shape, rows, per_row, offset))
            offset += rows * per_row
        send = torch.zeros(offset, dtype=dtypes.pop(), device=self.placement.device)
        for k, shape, rows, per_row, at in layout:
            piece = locals_[k].reshape(-1)
            send[at:at + piece.numel()].copy_(piece)
        out = torch.empty(world, offset, dtype=send.dtype, device=send.device)
        if self.dp.backend == "gloo":
            _ExchangeAllGather()(out, send, group)
        else:
            dist.all_gather_into_tensor(out, send, group=group)
        return {k: out[:, at:at + rows * per_row].reshape(world * rows, *shape[1:])[:shape[0]].clone()
                for k, shape, rows, per_row, at in layout}

    def _leaf(self, name: str) -> torch.Tensor:
        path, _, leaf = name.rpartition(".")
        return getattr(self.module.get_submodule(path), leaf).detach()

    def full_tensors(self, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole tensor)`` for each entry of `state` (a state dict of :attr:`module`), one at a
        time. Sharded: an all-gather per tensor, so every rank must run this over the same `state`, in full
        (tied names repeat the gather; the caller may skip the copy)."""
        for name, t in state.items():
            yield name, full_tensor(t)


def _post(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], group: Any) -> list[Any]:
    """Point-to-point sends and receives, all posted at once; their works (gloo moves them in its own thread)."""
    import torch.distributed as dist

    glob = lambda r: dist.get_global_rank(group, r)  # noqa: E731  (P2POp names peers by global rank)
    ops = [dist.P2POp(dist.isend, t, glob(peer), group) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, glob(peer), group) for peer, t in recvs]
    return dist.batch_isend_irecv(ops)


class _InFlight:
    """The exchanges of one sharded model that run beside its compute: all-gathers that FSDP2 prefetches (it waits
    for each before the unit computes) and reduce-scatters whose sum is finished later, at most `window` of them
    outstanding after each new one and all of them by :meth:`drain`. Both ranks post them in the same order (FSDP2's
    schedule is the model's), so each pair's sends and receives match in order as the synchronous ones do."""

    def __init__(self, window: int = 1) -> None:
        self.window = window
        self.defer_reduce = False
        """Whether a reduce-scatter may finish later (set per micro-batch: only while no sharded gradient exists, since
        FSDP2 adds a new gradient shard into an existing one as soon as the reduce-scatter returns)."""
        self.gathers: list[_ExchangeWork] = []
        self.reduces: list[Callable[[], None]] = []

    def drain(self) -> None:
        """Finish every exchange in flight (the reduce-scatters' sums included), oldest first."""
        while self.reduces:
            self.reduces.pop(0)()
        while self.gathers:
            self.gathers[0].wait()


class _ExchangeWork(torch.distributed.Work):  # type: ignore[misc]
    """An asynchronous all-gather's exchange as FSDP2 waits for it (a ``Work``): its sends and receives."""

    def __init__(self, works: list[Any], flight: _InFlight) -> None:
        super().__init__()
        self._works, self._flight = works, flight
        flight.gathers.append(self)

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait()
        self._works = []
        if self in self._flight.gathers:
            self._flight.gathers.remove(self)
        return True


class _ExchangeAllGather:
    """FSDP2's all-gather over gloo as direct sends to every other rank: each rank sends its shard once to each
    peer (what a ring moves too), while gloo's own all-gather moved a decoder layer's shards (14 MiB) at about a third
    of the speed of these sends between two processes of one machine. Synchronous unless FSDP2 asks for an
    asynchronous one (a prefetch, with `flight`): then a ``Work`` that FSDP2 waits for before the unit computes."""

    def __init__(self, flight: _InFlight | None = None) -> None:
        self._flight = flight

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        rank, world = group.rank(), group.size()
        slots = output_tensor.view(world, -1)
        if slots[rank].data_ptr() != input_tensor.data_ptr():  # FSDP2 copies its shard in place already
            slots[rank].copy_(input_tensor.view(-1))
        peers = [r for r in range(world) if r != rank]
        works = _post([(r, input_tensor) for r in peers], [(r, slots[r]) for r in peers], group)
        if async_op and self._flight is not None:
            return _ExchangeWork(works, self._flight)
        for work in works:
            work.wait()
        return None


class _ExchangeReduceScatter:
    """FSDP2's reduce-scatter over gloo as direct sends: rank r receives every peer's chunk r and sums the chunks in
    rank order (the same sum on any number of ranks); gloo's own reduce-scatter is slower still than its all-gather
    here. Only SUM (the strategy forces it). With `flight` deferring, it returns once the sends and receives are
    posted and the sum is written into the output later (FSDP2 only makes views of it until the optimizer reads them):
    the exchange runs beside the backward of the units below."""

    def __init__(self, flight: _InFlight | None = None) -> None:
        self._flight = flight

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        import torch.distributed as dist

        if op not in (dist.ReduceOp.SUM, "sum"):
            raise ValueError(f"the exchange reduce-scatter sums; FSDP2 asked for {op}")
        rank, world = group.rank(), group.size()
        chunks = input_tensor.view(world, -1)
        got = torch.empty(world - 1, chunks.shape[1], dtype=chunks.dtype, device=chunks.device)
        peers = [r for r in range(world) if r != rank]
        works = _post([(r, chunks[r]) for r in peers], list(zip(peers, got)), group)

        def finish() -> None:
            for work in works:
                work.wait()
            parts = [chunks[rank] if r == rank else got[r - (r > rank)] for r in range(world)]
            out = output_tensor.view(-1)
            out.copy_(parts[0])
            for part in parts[1:]:
                out.add_(part)

        flight = self._flight
        if flight is None or not flight.defer_reduce:
            finish()
            return
        flight.reduces.append(finish)
        while len(flight.reduces) > flight.window:
            flight.reduces.pop(0)()


def _ddp(model: nn.Module, placement: Placement, dp: DataParallel) -> nn.Module:
    """torch's DistributedDataParallel over the group, summing (not averaging) gradients."""
    from torch.nn.parallel import DistributedDataParallel

    group = dp.grad_group()
    ids = [placement.device.index] if placement.device.type == "cuda" else None
    # every rank built the same model from the same seed (or checkpoint): no start-up broadcast
    ddp = DistributedDataParallel(model, device_ids=ids, process_group=group, init_sync=False,
                                  forward_sync_buffers=False)
    ddp.register_comm_hook(group, _sum_hook)
    return ddp


def _sum_hook(group, bucket):  # type: ignore[no-untyped-def]  # (DDP rejects any annotation but GradBucket)
    """DDP's all-reduce without its division by the world size (the losses are shares of one sum)."""
    import torch.distributed as dist

    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])
