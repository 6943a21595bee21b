"""Worker classes shared by the core tests (importable by Ray worker processes)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import threading
import time

import torch
from tensordict import TensorDict

from asyncrl import Dispatch, DispatchMode, Execute, Worker, register, register_dispatch_mode
from asyncrl.dispatch import collect_dp


def _repeat_dispatch(world, xs):
    """Custom mode: a 2-element list repeated to world size (rank r gets xs[r % 2])."""
    return ([xs[r % len(xs)] for r in range(world.world_size)],), {}


def _sum_collect(world, results):
    return sum(results)


REPEAT = Dispatch.custom("repeat_pair", _repeat_dispatch, _sum_collect)


def _short_pad_dispatch(world, x):
    """A broken custom mode: padding reported for one rank only."""
    from asyncrl.dispatch import Sharded

    return Sharded(([x] * world.world_size,), {}, pad=[0])


SHORT_PAD = Dispatch.custom("short_pad", _short_pad_dispatch, _sum_collect)
register_dispatch_mode(Dispatch.custom("named_repeat_pair", _repeat_dispatch, _sum_collect), replace=True)


def _parts_dispatch(world, parts):
    """Rank r gets ``parts[r]`` (a list, of futures too), as a streaming step's ``concat_shard`` takes its groups."""
    return ([list(p) for p in parts],), {}


PARTS = DispatchMode("parts", _parts_dispatch, collect_dp, data_parallel=True)


FRAGILE_ENV = "ASYNCRL_TEST_FRAGILE"


def _fragile(value: int) -> "Fragile":
    if os.environ.get(FRAGILE_ENV):
        raise RuntimeError(f"Fragile({value}) cannot be unpickled in this process ({FRAGILE_ENV} is set)")
    return Fragile(value)


class Fragile:
    """A value that cannot be unpickled in a process whose environment sets FRAGILE_ENV
    (as a class missing on one worker's PYTHONPATH would be)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self):
        return (_fragile, (self.value,))


def _typed(x):
    if isinstance(x, torch.Tensor):
        return ["Tensor", x.tolist()]
    if isinstance(x, dict):
        return ["dict", [[_typed(k), _typed(v)] for k, v in x.items()]]
    if isinstance(x, (list, tuple)):
        return [type(x).__name__, [_typed(v) for v in x]]
    return [type(x).__name__, x]


class Unpicklable:
    """A value that cannot be pickled at all (Ray cannot store a result holding one)."""

    def __reduce__(self):
        raise TypeError("Unpicklable cannot be pickled")


class Probe(Worker):
    """Exercises every dispatch mode; records the environment its constructor saw."""

    def __init__(self, base: int = 0, tp: int = 1) -> None:
        self.base = base
        self.env_at_init = {k: os.environ.get(k) for k in
                            ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ASYNCRL_TEST_FLAG")}
        self.rank_at_init = self.rank
        self.log: list[int] = []
        self.inside = 0
        self.peak = 0
        self.crowd: asyncio.Event | None = None
        self.sync_inside = 0  # plain def methods inside right now, and the most ever at once
        self.sync_peak = 0
        self.blocked = False
        self.release = threading.Event()
        self.gate: asyncio.Event | None = None  # fail_or_wait's, on the worker's loop while one waits
        if tp > 1:
            self.register_mesh("train", dp_rank=self.rank // tp, dp_size=self.world_size // tp,
                               collect=self.rank % tp == 0)

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x: int) -> int:
        return x + self.rank + self.base

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def whoami(self) -> int:
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def env(self) -> dict:
        return {**self.env_at_init, "rank_at_init": self.rank_at_init}

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, x: int, factor: int) -> int:
        return x * factor + self.rank

    @register(Dispatch.DP_COMPUTE)
    def tag(self, batch: TensorDict) -> TensorDict:
        """Row-wise: y = 2x, plus the rank that computed the row and the prompt upper-cased."""
        out = TensorDict({"y": batch["x"] * 2, "rank": torch.full((batch.batch_size[0],), self.rank)},
                         batch_size=batch.batch_size)
        out["prompt"] = [p.upper() for p in batch["prompt"]]
        return out

    @register(Dispatch.DP_COMPUTE)
    def text_rows(self, batch: TensorDict) -> TensorDict:
        """A generated group's kind of result: small and large tensors and a text column, per row."""
        from tensordict import NonTensorStack

        x = batch["x"]
        return TensorDict({"ids": x * 10, "big": x[:, None].float().expand(-1, 20_000).clone(),
                           "stop": NonTensorStack(*[f"stop{int(v)}" for v in x])}, batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE)
    def inc(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"y": batch["y"] + 1}, batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE)
    def log_rows(self, batch: TensorDict) -> TensorDict:
        """Ordered, data-parallel: logs its shard's y values, returns y + 1."""
        self.log.extend(int(v) for v in batch["y"])
        return TensorDict({"y": batch["y"] + 1}, batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE)
    def add_fields(self, a: TensorDict, b: TensorDict) -> TensorDict:
        """Two pipelined inputs of one batch: y = a.y + b.y."""
        return TensorDict({"y": a["y"] + b["y"]}, batch_size=a.batch_size)

    @register(Dispatch.DP_COMPUTE)
    def tag_fields(self, batch: TensorDict) -> TensorDict:
        """How many fields its input has, per row."""
        n = batch.batch_size[0]
        return TensorDict({"fields": torch.full((n,), len(list(batch.keys())))}, batch_size=[n])

    @register(Dispatch.DP_COMPUTE)
    def grab(self, batch: TensorDict) -> TensorDict:
        """Writes a key into its input container (its own, whatever path it came by);
        returns the keys it was given, as one row of counts: (number of keys, has 'grabbed')."""
        keys = sorted(batch.keys())
        batch["grabbed"] = torch.zeros(batch.batch_size[0])
        n = batch.batch_size[0]
        return TensorDict({"y": torch.full((n,), len(keys)), "seen": torch.full((n,), int("grabbed" in keys))},
                          batch_size=[n])

    @register(Dispatch.DP_COMPUTE)
    def grab_list(self, xs: list) -> list:
        """Appends to its input list; returns its length before, per row."""
        n = len(xs)
        xs.append(-1)
        return [n] * n

    @register(Dispatch.DP_COMPUTE)
    def refill(self, batch: TensorDict, factor: int) -> TensorDict:
        """Returns a container the worker keeps and refills on its next call (y = x * factor)."""
        n = batch.batch_size[0]
        if getattr(self, "_refilled", None) is None or self._refilled.batch_size[0] != n:
            self._refilled = TensorDict({}, batch_size=[n])
        self._refilled["y"] = batch["x"] * factor  # a new tensor under the same key of the same container
        return self._refilled

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def tag_concurrent(self, batch: TensorDict) -> TensorDict:
        """`tag`, as a concurrent method."""
        return TensorDict({"y": batch["x"] * 2}, batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def inc_concurrent(self, batch: TensorDict) -> TensorDict:
        """`inc`, as a concurrent method."""
        return TensorDict({"y": batch["y"] + 1}, batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE)
    def fragile(self, xs: list) -> list:
        return [Fragile(int(x)) for x in xs]

    @register(Dispatch.DP_COMPUTE)
    def tag_unpicklable(self, batch: TensorDict) -> TensorDict:
        """`tag`, plus a field Ray cannot serialize: its host returns, Ray fails to store it."""
        out = self.tag(batch)
        out.set_non_tensor("unpicklable", Unpicklable())
        return out

    @register(Dispatch.DP_COMPUTE)
    def unwrap(self, xs: list) -> list:
        return [x.value for x in xs]

    @register(Dispatch.DP_COMPUTE)
    def square_list(self, xs: list, offset: int = 0) -> list:
        return [x * x + offset for x in xs]

    @register(Dispatch.DP_COMPUTE)
    def double_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t * 2

    @register(Dispatch.DP_COMPUTE)
    def repeat_rows(self, batch: TensorDict) -> TensorDict:
        """Not row-preserving: two output rows per input row (like n samples per prompt)."""
        out = TensorDict({"x": batch["x"].repeat_interleave(2)}, batch_size=[2 * batch.batch_size[0]])
        out["prompt"] = [p for p in batch["prompt"] for _ in range(2)]
        return out

    @register(Dispatch.DP_COMPUTE_METRIC)
    def shard_rows(self, batch: TensorDict) -> int:
        return int(batch.batch_size[0])

    @register(Dispatch.mesh("train", collect="list"))
    def mesh_info(self, batch: TensorDict) -> tuple[int, list[int]]:
        return self.rank, batch["x"].tolist()

    @register(Dispatch.mesh("train"))
    def mesh_tag(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"y": batch["x"] * 10 + self.rank}, batch_size=batch.batch_size)

    @register(Dispatch.mesh("train"))
    def mesh_inc(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"y": batch["y"] + 1}, batch_size=batch.batch_size)

    @register(REPEAT)
    def pair(self, x: int) -> int:
        return x * 100 + self.rank

    @register(SHORT_PAD)
    def short_pad(self, x: int) -> int:
        return x

    @register("named_repeat_pair")
    def pair_by_name(self, x: int) -> int:
        return x + self.rank

    def _enter_sync(self) -> None:
        self.sync_inside += 1
        self.sync_peak = max(self.sync_peak, self.sync_inside)

    @register()
    def record(self, i: int) -> int:
        self._enter_sync()
        self.log.append(i)
        self.sync_inside -= 1
        return i

    @register(Dispatch.ALL_TO_ALL)
    def record_each(self, x) -> int:
        """Ordered; rank r logs item r."""
        self.log.append(x)
        return x

    @register()
    def block(self) -> int:
        """Ordered plain def: holds its thread until a concurrent `unblock` call releases it."""
        self._enter_sync()
        self.blocked = True
        try:
            self.release.wait()
            self.release.clear()
            return self.rank
        finally:
            self.blocked = False
            self.sync_inside -= 1

    @register(concurrent=True)
    async def unblock(self) -> None:
        self.release.set()

    @register(concurrent=True)
    async def is_blocked(self) -> bool:
        return self.blocked

    @register(concurrent=True)
    async def peak_sync(self) -> int:
        """The most plain def methods ever inside at once on this worker (1: never overlapped)."""
        return self.sync_peak

    @register()
    async def record_async(self, i: int) -> int:
        await asyncio.sleep(0)  # yield: ordered async calls must still not interleave
        self.log.append(i)
        return i

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def types_of(self, *args, **kwargs) -> list:
        """The arguments as they arrived: each value with its exact type, recursively."""
        return [_typed(args), _typed(kwargs)]

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def td_layout(self, td: TensorDict) -> list:
        """A TensorDict argument as it arrived: its class, batch size and, in key order, each value's class and
        contents (a nested TensorDict's layout)."""
        def layout(x):
            return [type(x).__name__, list(x.batch_size), [
                [k, type(v).__name__, layout(v) if type(v).__name__ == "TensorDict" else v.tolist()]
                for k, v in x.items()]]
        return layout(td)

    @register()
    def record_value(self, x) -> int:
        """Ordered; its argument may be a pipelined future."""
        value = int(x) if not isinstance(x, list) else int(x[0])
        self.log.append(value)
        return value

    @register(PARTS)
    def sum_parts(self, parts: list) -> TensorDict:
        """Ordered, data-parallel over its own list of parts (each whole: pipelined futures): logs each part's
        ``y`` sum; a row per part (``sum``, ``rows``)."""
        sums = [int(p["y"].sum()) for p in parts]
        self.log.extend(sums)
        return TensorDict({"sum": torch.tensor(sums), "rows": torch.tensor([p.batch_size[0] for p in parts])},
                          batch_size=[len(parts)])

    @register()
    def get_log(self) -> list[int]:
        out, self.log = self.log, []
        return out

    @register(concurrent=True)
    async def gather_at_barrier(self, n: int) -> int:
        """Returns once `n` calls are inside at the same time: only concurrent calls get there."""
        self.inside += 1
        self.peak = max(self.peak, self.inside)
        if self.crowd is None:
            self.crowd = asyncio.Event()
        if self.inside >= n:
            self.crowd.set()
        await self.crowd.wait()
        self.inside -= 1
        peak = self.peak
        if self.inside == 0:
            self.crowd, self.peak = None, 0
        return peak

    @register()
    def boom(self, message: str) -> None:
        raise ValueError(message)

    @register(Dispatch.DP_COMPUTE)
    def boom_on_rank(self, batch: TensorDict, rank: int) -> TensorDict:
        if self.rank == rank:
            raise KeyError(f"rank {rank} failed")
        return batch

    @register(Dispatch.DP_COMPUTE)
    def no_batch_on_rank(self, batch: TensorDict, rank: int) -> "TensorDict | int":
        """A DP_COMPUTE method that breaks its contract on one rank (returns no batch)."""
        return 7 if self.rank == rank else batch

    @register(concurrent=True)
    async def wait_forever(self, marker: str) -> None:
        """Sleeps until cancelled; records that it saw the cancellation."""
        self.log.append(1)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.log.append(-1)
            raise

    @register(concurrent=True)
    async def peek_log(self) -> list[int]:
        return list(self.log)

    @register(concurrent=True)
    async def noop(self, i: int) -> int:
        return i

    @register()
    async def fail_or_wait(self, rank: int) -> int:
        """Ordered: raises on `rank` at once; every other rank waits until `open_gate`
        (or until cancelled)."""
        if self.rank == rank:
            raise ValueError(f"rank {rank} failed")
        self.gate = asyncio.Event()
        try:
            await self.gate.wait()
        finally:
            self.gate = None
        return self.rank

    @register(concurrent=True)
    async def open_gate(self) -> None:
        if self.gate is not None:
            self.gate.set()

    @register(concurrent=True)
    async def is_waiting(self) -> bool:
        """Whether a fail_or_wait call is waiting at its gate on this rank."""
        return self.gate is not None

    @register()
    def pid(self) -> int:
        return os.getpid()

    @register(concurrent=True)
    async def concurrent_pid(self) -> int:
        return os.getpid()

    @register()
    def thread_name(self) -> str:
        return threading.current_thread().name


class Other(Worker):
    """A second class, for colocation."""

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x: int) -> int:
        return 1000 + x + self.rank

    @register()
    def pid(self) -> int:
        return os.getpid()

    def not_registered(self) -> int:
        return 1


def _refuse_unpickling() -> None:
    raise ModuleNotFoundError("No module named 'only_on_the_controller'")


class RefusesUnpickling:
    """Pickles fine; unpickling it fails (as a class whose module the worker lacks would)."""

    def __reduce__(self):
        return (_refuse_unpickling, ())


class DiesInInit(Worker):
    """Its process exits in the constructor."""

    def __init__(self) -> None:
        os._exit(3)

    @register()
    def never(self) -> None:
        """Never reached."""


class WaitsInInit(Worker):
    """Its constructor writes `started-<rank>` in `flags` and waits for `go` there (at most a minute)."""

    def __init__(self, flags: str) -> None:
        d = pathlib.Path(flags)
        (d / f"started-{self.rank}").touch()
        end = time.monotonic() + 60
        while not (d / "go").exists() and time.monotonic() < end:
            time.sleep(0.02)

    @register()
    def ping(self) -> int:
        return self.rank


class Restartable(Probe):
    """A Probe whose start can be refused: when the file `gate` exists as a process starts, its constructor
    raises (the file says ``fail``; the file is removed, so the next start succeeds) or waits until the file is
    removed (``hang``: a start that never ends, as a bundle with no capacity; it first writes its pid to
    ``<gate>.started``, which a test can await)."""

    def __init__(self, gate: str | None = None) -> None:
        super().__init__()
        if gate is None or not os.path.exists(gate):
            return
        with open(gate) as f:
            how = f.read().strip()
        if how == "fail":
            os.remove(gate)
            raise RuntimeError("start refused by the test's gate")
        with open(gate + ".started", "w") as f:
            f.write(str(os.getpid()))  # (the test awaits it: the new process is starting)
        deadline = time.monotonic() + 300.0
        while os.path.exists(gate):  # a constructor that does not return (the test removes the file)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test's gate {gate} was not removed within 300 s")
            time.sleep(0.05)
