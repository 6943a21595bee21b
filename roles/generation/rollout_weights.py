"""Weight sync of a rollout worker: :class:`RolloutWeights`, the object a
:class:`~asyncrl.roles.generation.rollout.RolloutWorker` holds as ``self.weights``.

Weight sync is a transaction (``update_weights``): *begin* checks the version is newer
and the tensors match the model (names, shapes, dtypes) before anything changes, and
closes the gate to new generation; in-flight generation is then either waited for
(``sync_policy="wait"``) or aborted and resubmitted after the update
(``"abort"``); *transfer* loads the tensors; *commit* publishes the version (and, in
verify mode, checks checksums first) and reopens the gate. Every row carries the
version of the weights that generated all of its tokens. With ``partial_rollout`` the
update pauses request-level generations in flight instead of waiting for them.

``update_weights`` takes weights by any transport (:mod:`asyncrl.roles.weights.transfer`): the
``(version, state_dict)`` of ``export_weights`` through the object store, or a
:class:`~asyncrl.roles.weights.transfer.WeightHandle` from ``stage_weights`` -- ``object_store`` (read
from the store as zero-copy views), ``local`` (the colocated policy's snapshot in this process)
or ``collective`` (received over the weight channel first, then loaded in the same
transaction) -- or, from a LoRA policy, a :class:`~asyncrl.roles.modeling.lora.LoraDelta` (``export_adapter``:
the factors alone), which the HF engine merges into its copy of the base weights (:meth:`_merge_adapter`).
Floating tensors are cast to the rollout's dtype (e.g. the policy's float32 master weights into a bf16
rollout). What a handle brought, the HF engine adopts as its
parameters instead of copying it (``HFEngine.adopt_weights``; a plain state dict is copied).

Memory on a shared GPU: ``sleep()`` releases the engine's weights (level 1: to the CPU;
level 2: discarded) and KV cache around training, ``wake_up()`` re-acquires them; after a
level-2 sleep the next sync may reload the same version (``RolloutConfig.sleep_level``).

It owns the weight state (the version, the channel, the rollback point, the adapter base) and the generation gate
(closed while an update or a sleep runs), and is given what it needs of the worker: its current engine, the jobs
and request-level calls in flight, the request batcher and the engine load (its constructor's arguments).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Mapping

import torch

from asyncrl.roles.errors import StaleWeightsError, WeightSyncError
from asyncrl.roles.modeling.lora import LoraDelta, digest, merge_delta
from asyncrl.roles.modeling.models import state_dict_checksums
from asyncrl.roles.weights.transfer import SNAPSHOTS, WeightHandle, fetch_stored
from asyncrl.roles.weights.weight_channel import OK, STALE, WeightChannel, layout_of, member_info
from asyncrl.roles.engines.batcher import PauseInfo
from asyncrl.roles.modeling.lora import save_adapter

if TYPE_CHECKING:
    from asyncrl.roles.generation.rollout_config import RolloutConfig

__all__ = ["Adoptable", "RolloutWeights", "unpack_weights"]


class Adoptable(dict):  # type: ignore[type-arg]
    """A state dict whose tensors nothing else writes into while the engine holds them: what a
    ``WeightHandle`` brought (Ray's store, a colocated snapshot, a channel's receive buffers) or the
    rollout's own rollback copies. An engine with ``adopt_weights`` makes them its parameters instead of
    copying them; a plain state dict a caller passed is copied (the caller may change it later)."""


def unpack_weights(weights: Any, version: int | None) -> tuple[int, dict[str, torch.Tensor]]:
    """Normalise what ``update_weights`` receives to ``(version, state_dict)``.

    Accepts the ``(version, state_dict)`` pair of ``PolicyWorker.export_weights`` (also
    pipelined as a future), a state dict, or ``(name, tensor)`` pairs with `version`.
    """
    if (isinstance(weights, list) and len(weights) == 1 and isinstance(weights[0], tuple) and len(weights[0]) == 2
            and isinstance(weights[0][0], int)):
        weights = weights[0]  # the per-rank list of a ONE_TO_ALL (not RANK_ZERO) export
    if isinstance(weights, tuple) and len(weights) == 2 and isinstance(weights[0], int):
        exported, sd = weights
        if version is not None and version != exported:
            raise WeightSyncError(
                f"update_weights(version={version}) but the weights were exported as version {exported}; "
                "pass the policy's export_weights() result and omit version, or pass the matching version"
            )
        version = exported
    else:
        sd = weights
    if isinstance(sd, Mapping):
        sd = dict(sd)
    else:
        try:
            sd = dict(sd)
        except (TypeError, ValueError):
            raise WeightSyncError(
                f"weights must be a state dict, (name, tensor) pairs or (version, state_dict); got {type(sd).__name__}"
            ) from None
    if version is None:
        raise WeightSyncError("update_weights needs a version: pass version=..., or the (version, state_dict) "
                              "pair that PolicyWorker.export_weights returns")
    if isinstance(version, bool) or not isinstance(version, int):
        raise WeightSyncError(f"version must be an int, got {version!r}")
    return version, sd


class RolloutWeights:
    """The weights a rollout worker's engine holds, and how they change: the ``update_weights`` transaction,
    the receiving side of the weight transports and ``sleep``/``wake_up``. A
    :class:`~asyncrl.roles.generation.rollout.RolloutWorker` holds one (``self.weights``); its registered
    weight methods delegate here, and its generation reads :attr:`version`, :attr:`needs_weights` and
    :attr:`asleep`, and waits at :meth:`gate`.

    Args:
        engine: the worker's current engine (``restart_engine`` replaces it, then calls :meth:`engine_replaced`).
        model: the rollout's model (its names, shapes, dtypes and tied weights are what a sync must bring).
        config: the rollout's settings (engine kind, ``sync_policy``, ``partial_rollout``, ``verify_checksums``,
            ``sleep_level``, ``pause_deadline_s``).
        device: where the engine's weights live (a collective receive lands there for the HF engine).
        rank: the rollout rank (channel rank ``1 + rank``; named in errors).
        jobs: the worker's batch generation jobs in flight (each with its ``task``, ``aborted`` and ``pending``),
            which an update aborts or waits for.
        episode_tasks: the request-level calls in flight, which an update (``partial_rollout="off"``) and a
            sleep wait for.
        batcher: the request batcher now running, or None (built first when a replay waits for it); partial
            rollout pauses it for a load.
        load: loads a state dict into the engine (``RolloutWorker._engine_load``: the seam fault-injection
            subclasses wrap).
    """

    def __init__(self, *, engine: Callable[[], Any], model: torch.nn.Module, config: RolloutConfig,
                 device: torch.device | str, rank: int, jobs: set[Any], episode_tasks: set[asyncio.Task[Any]],
                 batcher: Callable[[], Any], load: Callable[[dict[str, torch.Tensor]], Awaitable[None]]) -> None:
        self._engine = engine
        self.model = model
        self.config = config
        self.device = device
        self.rank = rank
        self._gate_event: asyncio.Event | None = None  # created on the worker's loop (gate)
        self._jobs = jobs
        self._episode_tasks = episode_tasks
        self._batcher = batcher
        self._load = load
        self.version = 0
        """Version of the weights the engine holds (0 = the initial weights)."""
        self.needs_weights = False
        """The engine holds no usable weights (a level-2 sleep discarded them, or a load failed part-way)."""
        self.asleep = 0
        """The level of the sleep the engine is in (0: awake)."""
        self.updates: list[dict[str, Any]] = []
        """Partial rollout: what each update's pause found (``statistics``)."""
        self._shapes = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
        self._channel: WeightChannel | None = None
        self._committed: dict[str, torch.Tensor] | None = None
        """The last verified weights (``verify_checksums``): what a failed verification rolls back to."""
        self._initial_state = ({k: v.detach().clone() for k, v in model.state_dict().items()}
                               if config.verify_checksums else {})
        self._rolled_back = False  # the last failed load was undone (verify_checksums)
        self._lora_base: dict[str, torch.Tensor] | None = None
        """Adapter sync: a copy of the base weights of the adapted layers, taken at the first :class:`LoraDelta`."""
        self._lora_base_digest: str | None = None
        """Its digest (checked against the policy's once, when it was taken)."""
        self._adapter_dir: Any = None
        """vLLM adapter sync: the temporary directory the adapters are written into for the engine to read."""
        self._engine_base_replaced = False
        """vLLM adapter sync: whole weights were loaded, so the engine no longer holds the base an adapter needs."""
        self.on_bucket_received: Callable[[str], None] = _no_fault
        """Called after each bucket a transfer receives (a seam for fault-injection tests)."""

    @property
    def engine(self) -> Any:
        """The worker's current engine."""
        return self._engine()

    def gate(self) -> asyncio.Event:
        """The generation gate: set while no update or sleep runs; they clear it, and a new generate call (batch
        or request-level) waits until it is set again."""
        if self._gate_event is None:
            self._gate_event = asyncio.Event()
            self._gate_event.set()
        return self._gate_event

    def engine_replaced(self) -> None:
        """The worker replaced its engine (``restart_engine``): the new one holds the initial weights, version 0."""
        self.version, self._committed, self.needs_weights = 0, None, False

    def close(self) -> None:
        """Close the weight channel (the worker's ``on_close``)."""
        if self._channel is not None:
            self._channel.close()

    # ---- weight sync ----------------------------------------------------------------------

    def _vote(self, version: int) -> int:
        """A collective transfer's vote on `version` (before any bytes move)."""
        if version < self.version or (version == self.version and not self.needs_weights):
            return STALE
        return OK

    def _check_version(self, version: int) -> None:
        if self._vote(version) != OK:
            raise StaleWeightsError(
                f"refusing weights of version {version}: rank {self.rank} already has version {self.version}; "
                "updates must carry strictly increasing versions (sync after each policy update, in order)"
            )

    def _validate(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self._check_version(version)
        unknown = sorted(set(state) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(state))
        if unknown or missing:
            raise WeightSyncError(
                f"weights of version {version} do not match the rollout model: unknown names {unknown[:5]}, "
                f"missing names {missing[:5]}; export the full state_dict of the same architecture"
            )
        for k, t in state.items():
            shape, dtype = self._shapes[k]
            ok = isinstance(t, torch.Tensor) and tuple(t.shape) == shape and (
                t.dtype == dtype or (t.is_floating_point() and dtype.is_floating_point))
            if not ok:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise WeightSyncError(f"weight {k!r}: expected {shape} {dtype}, got {got}")

    def _cast(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with floating tensors in the rollout's dtypes (what the engine will hold)."""
        return {k: t if t.dtype == self._shapes[k][1] else t.to(self._shapes[k][1]) for k, t in state.items()}

    # ---- weight transports ----------------------------------------------------------------

    def spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{name: (shape, dtype)}`` of the weights this rollout holds (what a sync must bring)."""
        return {k: (shape, str(dtype).removeprefix("torch.")) for k, (shape, dtype) in self._shapes.items()}

    def tied(self) -> dict[str, str]:
        """``{name: the earlier name whose tensor it is}`` (tied weights: SmolLM2's ``lm_head.weight`` is its
        ``model.embed_tokens.weight``); a weight channel sends such a tensor once."""
        import itertools

        first: dict[int, str] = {}
        out = {}
        named = itertools.chain(self.model.named_parameters(remove_duplicate=False),
                                self.model.named_buffers(remove_duplicate=False))
        for name, t in named:  # by identity: storage is swapped by loads and emptied by sleep(level=2)
            if name in self._shapes and first.setdefault(id(t), name) != name:
                out[name] = first[id(t)]
        return out

    def member(self) -> dict[str, Any]:
        """This rank's process and device, for choosing a weight channel's backend."""
        return member_info(self.device)

    async def join_channel(self, name: str, host: str, port: int, world_size: int, backend: str,
                           timeout_s: float = 120.0, bucket_bytes: int = 256 << 20) -> dict[str, Any]:
        """Join weight channel `name` as channel rank ``1 + rank`` (policy rank 0 sends)."""
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        ch = await asyncio.to_thread(WeightChannel, name, host, port, 1 + self.rank, world_size, backend=backend,
                                     device=self.device, timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        self._channel = ch
        return {"rank": ch.rank, "backend": ch.backend, "world_size": world_size}

    async def _receive(self, handle: WeightHandle) -> dict[str, torch.Tensor]:
        ch = self._channel
        if ch is None or ch.name != handle.channel:
            raise WeightSyncError(f"rollout rank {self.rank} has no open weight channel {handle.channel!r}; call "
                                  "open_weight_channel(policy, rollout) first")
        tied = self.tied()
        layout = [entry for entry in layout_of(self.spec()) if entry[0] not in tied]  # a tied tensor once
        target = self.device if self.config.engine == "hf" else torch.device("cpu")
        out = await asyncio.to_thread(ch.receive, handle.version, layout, self._vote, target, self.on_bucket_received,
                                      self._held())
        for name, source in tied.items():
            out[name] = out[source]
        return out

    def _merge_adapter(self, delta: LoraDelta) -> dict[str, torch.Tensor]:
        """The whole weights of `delta`'s version: the adapted ones merged into this rollout's copy of the base
        (taken at the first delta, while the engine holds the base, and checked against the policy's), the
        others the engine's own tensors (they never change under adapter sync)."""
        if self.config.engine != "hf":
            raise WeightSyncError(f"an adapter sync merges LoRA factors into the HF engine's weights, or loads them "
                                  f"as an adapter into an engine that serves adapters (vLLM); the "
                                  f"{self.config.engine!r} engine takes whole weights (trainer.weight_sync=auto)")
        self._check_version(delta.version)
        own = self.model.state_dict()
        unknown = sorted(set(delta.factors) - set(own))
        if unknown:
            raise WeightSyncError(f"the adapter of version {delta.version} adapts weights this rollout's model does "
                                  f"not have: {unknown[:5]}; policy and rollout must be the same architecture")
        if self._lora_base is None:  # the first delta: the engine must hold the base now
            base = {k: own[k].detach().clone() for k in delta.factors}
            if digest(base) != delta.base_digest:
                raise WeightSyncError(
                    f"rollout rank {self.rank} (version {self.version}) does not hold the base weights the policy's "
                    "adapters were trained on: an adapter sync merges into the base, so the rollout must start from "
                    "the policy's model config and receive only adapter syncs (or sync whole weights)")
            self._lora_base, self._lora_base_digest = base, delta.base_digest
        elif delta.base_digest != self._lora_base_digest or set(delta.factors) != set(self._lora_base):
            raise WeightSyncError(f"the adapter of version {delta.version} was trained on other base weights (or "
                                  f"layers) than the ones rollout rank {self.rank} merges into")
        return {**own, **merge_delta(self._lora_base, delta)}

    async def _update_adapter(self, delta: LoraDelta, version: int | None,
                              expected_checksums: dict[str, str] | None) -> dict[str, Any]:
        """An adapter sync into an engine that serves LoRA adapters itself (vLLM): the factors are written as a peft
        adapter into a local directory and the engine serves it from the next request on (a ``LoRARequest`` per
        version), its base weights untouched. Checked first, nothing changed on failure: the version, the base the
        adapter trained on (this rollout's own weights, digest checked once), and what cannot be had this way
        (checksums of merged weights, partial rollout: requests in flight would keep the old adapter)."""
        import os
        import shutil
        import tempfile


        if version is not None and version != delta.version:
            raise WeightSyncError(f"update_weights(version={version}) but the adapter is version {delta.version}")
        self._check_version(delta.version)
        if expected_checksums is not None or self.config.verify_checksums:
            raise WeightSyncError("an adapter sync into the vLLM engine keeps the base weights and serves the adapter "
                                  "beside them, so there are no merged weights to checksum; sync without "
                                  "verification (rollout.verify_checksums=false) or sync whole weights")
        if self.config.partial_rollout != "off":
            raise WeightSyncError("an adapter sync into the vLLM engine applies to new requests only, so requests in "
                                  "flight would not switch versions as partial_rollout needs; set "
                                  "partial_rollout='off' or sync whole weights")
        own = self.model.state_dict()
        unknown = sorted(set(delta.factors) - set(own))
        if unknown:
            raise WeightSyncError(f"the adapter of version {delta.version} adapts weights this rollout's model does "
                                  f"not have: {unknown[:5]}; policy and rollout must be the same architecture")
        if self._lora_base_digest is None:
            if self._engine_base_replaced or digest({k: own[k] for k in delta.factors}) != delta.base_digest:
                raise WeightSyncError(
                    f"rollout rank {self.rank} (version {self.version}) does not hold the base weights the policy's "
                    "adapters were trained on: an adapter sync serves the adapter on the base, so the rollout must "
                    "start from the policy's model config and receive only adapter syncs (or sync whole weights)")
            self._lora_base_digest = delta.base_digest
        elif delta.base_digest != self._lora_base_digest or self._engine_base_replaced:
            raise WeightSyncError(f"the adapter of version {delta.version} was trained on other base weights than "
                                  f"the ones rollout rank {self.rank} serves it on")
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="asyncrl-lora-")
        path = save_adapter(delta, os.path.join(self._adapter_dir.name, f"v{delta.version}"))
        gate = self.gate()
        gate.clear()
        try:
            waited, aborted = await self._stop_generation()
            await self.engine.aload_adapter(delta.version, path)
            self.version = delta.version
            self.needs_weights = False
        finally:
            gate.set()
        for old in os.listdir(self._adapter_dir.name):  # the engine read them; only the served one is kept
            if old != f"v{delta.version}":
                shutil.rmtree(os.path.join(self._adapter_dir.name, old), ignore_errors=True)
        return {"version": delta.version, "num_tensors": 2 * len(delta.factors), "waited": waited, "aborted": aborted,
                "checksums_verified": False, "adapter": True}

    async def resolve(self, weights: Any, version: int | None) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, state_dict)`` of what ``update_weights`` received, by its transport (a collective handle's
        tensors are received here), before anything changes."""
        if isinstance(weights, list) and weights and isinstance(weights[0], (WeightHandle, LoraDelta)):
            weights = weights[0]  # (every policy rank gives the same delta)
        if isinstance(weights, LoraDelta):
            if version is not None and version != weights.version:
                raise WeightSyncError(f"update_weights(version={version}) but the adapter is version {weights.version}")
            return weights.version, self._merge_adapter(weights)
        if not isinstance(weights, WeightHandle):
            return unpack_weights(weights, version)
        if version is not None and version != weights.version:
            raise WeightSyncError(f"update_weights(version={version}) but the handle holds version {weights.version}")
        if weights.transport == "local":
            self._check_version(weights.version)
            return weights.version, SNAPSHOTS.take_local(weights)
        if weights.transport == "collective":
            return weights.version, await self._receive(weights)
        if weights.transport == "object_store":
            self._check_version(weights.version)  # a stale version is refused before its bytes are read
            return weights.version, await fetch_stored(weights)
        raise WeightSyncError(f"unknown weight transport {weights.transport!r}")

    # ---- memory on a shared GPU ----------------------------------------------------------

    async def sleep(self, level: int | None = None) -> dict[str, Any]:
        """``RolloutWorker.sleep``: release the engine's weights and KV cache until :meth:`wake_up`, once the
        generation in flight finished."""
        lvl = self.config.sleep_level if level is None else level
        if lvl == 0 or self.asleep:
            return {"asleep": bool(self.asleep), "level": self.asleep}
        gate = self.gate()
        gate.clear()
        try:
            tasks = [j.task for j in self._jobs if j.task is not None] + list(self._episode_tasks)
            if tasks:
                await asyncio.wait(tasks)
            asleep = getattr(self.engine, "asleep", None)
            if asleep is not None:
                await asleep(lvl)
            else:
                await asyncio.to_thread(self.engine.sleep, lvl)  # type: ignore[attr-defined]
            self.asleep = lvl
        finally:
            gate.set()
        return {"asleep": True, "level": lvl}

    async def wake_up(self) -> dict[str, Any]:
        """``RolloutWorker.wake_up``: re-acquire what :meth:`sleep` released (after a level-2 sleep the weights
        must be synced again)."""
        if self.asleep:
            awake = getattr(self.engine, "awake_up", None)
            if awake is not None:
                await awake()
            else:
                await asyncio.to_thread(self.engine.wake_up)  # type: ignore[attr-defined]
            self.needs_weights = self.needs_weights or self.asleep == 2
            self.asleep = 0
        return {"needs_weights": self.needs_weights, "version": self.version}

    async def update(self, weights: Any, version: int | None = None, *,
                     expected_checksums: dict[str, str] | None = None) -> dict[str, Any]:
        """``RolloutWorker.update_weights``: load policy weights as one transaction (begin, transfer, commit;
        the module docstring), or pause-load-resume under partial rollout (:meth:`_update_in_flight`)."""
        if self.asleep == 2:
            raise RuntimeError(f"rollout rank {self.rank} is asleep at level 2 (weights discarded); call wake_up() "
                               "before syncing weights")
        handle = weights[0] if isinstance(weights, list) and len(weights) == 1 else weights
        if isinstance(handle, LoraDelta) and callable(getattr(self.engine, "aload_adapter", None)):
            return await self._update_adapter(handle, version, expected_checksums)
        version, state = await self.resolve(weights, version)
        # begin: every check before anything changes
        self._validate(version, state)
        state = self._cast(state)
        if isinstance(handle, (WeightHandle, LoraDelta)):  # a delta: fresh merged tensors and the engine's own
            state = Adoptable(state)
        if self.config.partial_rollout != "off":
            return await self._update_in_flight(version, state, handle, expected_checksums)
        gate = self.gate()
        gate.clear()
        try:
            waited, aborted = await self._stop_generation()
            verify = await self._load_and_commit(version, state, handle, expected_checksums)
            return {"version": version, "num_tensors": len(state), "waited": waited, "aborted": aborted,
                    "checksums_verified": verify}
        finally:
            gate.set()

    async def _stop_generation(self) -> tuple[int, int]:
        """With the gate closed: the batch jobs in flight aborted (``sync_policy="abort"``) or waited for, and the
        episodes finished; returns ``(calls waited for, requests aborted)``."""
        jobs = [j for j in self._jobs if j.task is not None]
        aborted = 0
        if self.config.sync_policy == "abort":
            for j in jobs:
                j.aborted = True
                j.task.cancel()  # type: ignore[union-attr]
                aborted += len(j.pending)
        tasks = [j.task for j in jobs if j.task is not None]
        tasks += [t for t in self._episode_tasks if t is not asyncio.current_task()]  # episodes finish first
        if tasks:
            await asyncio.wait(tasks)  # abort: until the engine stopped; wait: until they finished
        return (0 if aborted else len(tasks)), aborted

    async def _load_and_commit(self, version: int, state: dict[str, torch.Tensor], handle: Any,
                               expected_checksums: dict[str, str] | None) -> bool:
        """Transfer `state` into the engine, verify it if asked, publish `version`; returns whether it
        verified checksums."""
        verify = self.config.verify_checksums or expected_checksums is not None
        self._rolled_back = False
        await self._load(state)
        if callable(getattr(self.engine, "aload_adapter", None)):
            self._engine_base_replaced = True  # (the weights an adapter sync would serve its adapter on are gone)
        # commit (verify first)
        if verify:
            got = await self._engine_checksum()
            want = expected_checksums if expected_checksums is not None else state_dict_checksums(state.items())
            bad = sorted(k for k in want if got.get(k) != want[k])
            if bad or set(want) != set(got):
                if self.config.verify_checksums:  # roll back to the last verified weights
                    await self._load(self._committed or self._initial_state)
                    self._rolled_back = True
                    outcome = f"rolled back to version {self.version}"
                else:
                    outcome = "the engine holds unverified weights: sync again (verify_checksums=True rolls back)"
                raise WeightSyncError(
                    f"checksum mismatch after loading version {version} on rank {self.rank} for {bad[:5]}; {outcome}"
                )
        if self.config.verify_checksums:
            self._committed = state  # what a later failed verification rolls back to
        self.version = version
        self.needs_weights = False
        if isinstance(handle, WeightHandle) and handle.transport == "local":
            SNAPSHOTS.drop_older(handle.owner, version)
        return verify

    async def _update_in_flight(self, version: int, state: dict[str, torch.Tensor], handle: Any,
                                expected_checksums: dict[str, str] | None) -> dict[str, Any]:
        """Partial rollout: pause the engine (after its current decode step), load, publish the version,
        resume -- generations in flight continue under the new weights (docs/partial_rollout.md).

        Batch :meth:`generate` calls in flight are waited for first (their rows carry one version). A
        pause not reached within ``pause_deadline_s`` raises :class:`PauseDeadlineError` with nothing
        loaded. A load that fails inside the pause fails every request in flight with
        :class:`WeightSyncError` (the weights they would continue on are no longer known) and refuses
        generation until an update succeeds (the same version is accepted again). Cancelled once the
        load has begun (a stop signal), the update still finishes -- load and version together, the
        engine paused meanwhile -- and then raises ``CancelledError``: the engine never resumes on
        half-loaded weights or under the wrong version."""
        gate = self.gate()
        gate.clear()  # new batch calls and new episodes start after the update
        try:
            tasks = [j.task for j in self._jobs if j.task is not None]
            if tasks:
                await asyncio.wait(tasks)
            cancelled = False
            async with self._engine_paused() as paused:
                load = asyncio.ensure_future(self._load_and_commit(version, state, handle, expected_checksums))
                while not load.done():
                    try:
                        await asyncio.wait([load])  # cancelling the update does not cancel the load
                    except asyncio.CancelledError:
                        cancelled = True  # a stop signal: finish the load first, then stop
                try:
                    verify = load.result()
                except BaseException as e:
                    if not self._rolled_back:  # a verified rollback restored the weights: requests continue
                        self.needs_weights = True  # a sync of any version >= the current one restores them
                        failed = self._fail_in_flight(WeightSyncError(
                            f"weights of version {version} failed to load on rollout rank {self.rank} while this "
                            f"request was in flight ({type(e).__name__}: {e}); it was stopped, since the weights it "
                            "would continue on are no longer known -- sync weights again and resubmit"))
                        self.updates.append({"version": version, "failed": True, "failed_requests": failed})
                    raise
            receipt = {"version": version, "num_tensors": len(state), "waited": len(tasks), "aborted": 0,
                       "checksums_verified": verify, "pause_latency_s": paused.latency_s,
                       "in_flight": paused.in_flight, "interrupted": paused.interrupted}
            self.updates.append({k: receipt[k] for k in ("version", "pause_latency_s", "in_flight", "interrupted")})
            if cancelled:
                raise asyncio.CancelledError(f"update_weights was cancelled while loading; version {version} was "
                                             "loaded and published before it stopped")
            return receipt
        finally:
            gate.set()

    def _engine_paused(self) -> Any:
        """The engine held still for a weight load (the request batcher's pause, or the engine's own)."""
        deadline = self.config.pause_deadline_s
        batcher = self._batcher()  # (a replay's updates wait until its rounds need them)
        if batcher is not None:
            return batcher.paused(deadline)
        apaused = getattr(self.engine, "apaused", None)  # engines that schedule requests themselves (vLLM)
        if apaused is not None:
            return apaused(self.config.partial_rollout, deadline)

        @contextlib.asynccontextmanager
        async def idle() -> AsyncIterator[PauseInfo]:  # no request-level generation was ever started
            yield PauseInfo(0.0, 0, False)

        return idle()

    def _fail_in_flight(self, error: BaseException) -> int:
        batcher = self._batcher()
        if batcher is not None:
            return batcher.fail_in_flight(error)
        fail = getattr(self.engine, "fail_in_flight", None)
        return fail(error) if fail is not None else 0

    def _held(self) -> list[torch.Tensor]:
        """The tensors a receive must not write into: the engine's (adopted) and the rollback point's."""
        held = list((self._committed or {}).values())
        return held + list((getattr(self.engine, "adopted", None) or {}).values())

    async def _engine_checksum(self) -> dict[str, str]:
        achecksum = getattr(self.engine, "aweights_checksum", None)
        if achecksum is not None:
            return await achecksum()
        return await asyncio.to_thread(self.engine.weights_checksum)


def _no_fault(what: str) -> None:
    """The default :attr:`RolloutWeights.on_bucket_received`: nothing."""
