"""Weight sync of :class:`~asyncrl.roles.generation.rollout.RolloutWorker` (a mixin it composes).

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
transaction) -- or, from a LoRA policy, a :class:`~asyncrl.roles.training.lora.LoraDelta` (``export_adapter``:
the factors alone), which the HF engine merges into its copy of the base weights (:meth:`_merge_adapter`).
Floating tensors are cast to the rollout's dtype (e.g. the policy's float32 master weights into a bf16
rollout). What a handle brought, the HF engine adopts as its
parameters instead of copying it (``HFEngine.adopt_weights``; a plain state dict is copied).

Memory on a shared GPU: ``sleep()`` releases the engine's weights (level 1: to the CPU;
level 2: discarded) and KV cache around training, ``wake_up()`` re-acquires them; after a
level-2 sleep the next sync may reload the same version (``RolloutConfig.sleep_level``).

The state it reads and writes (``engine``, ``config``, ``_version``, ``_jobs``, ``_channel``, ...) is
set up by ``RolloutWorker`` in :mod:`asyncrl.roles.generation.rollout`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping

import torch

from asyncrl import Dispatch, Execute, register

from asyncrl.roles.errors import StaleWeightsError, WeightSyncError
from asyncrl.roles.training.lora import LoraDelta, digest, merge_delta
from asyncrl.roles.modeling.models import state_dict_checksums
from asyncrl.roles.weights.transfer import SNAPSHOTS, WeightHandle, fetch_stored
from asyncrl.roles.weights.weight_channel import OK, STALE, WeightChannel, layout_of, member_info
from asyncrl.roles.engines.batcher import PauseInfo
from asyncrl.roles.training.lora import save_adapter

if TYPE_CHECKING:
    from asyncrl.roles.generation.rollout_config import RolloutConfig

__all__ = ["WeightSyncMixin", "unpack_weights"]


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


class WeightSyncMixin:
    """Weight sync: the ``update_weights`` transaction, weight transports and ``sleep``/``wake_up``."""

    if TYPE_CHECKING:  # what it uses of RolloutWorker (roles/generation/rollout.py)
        config: RolloutConfig
        engine: Any
        model: torch.nn.Module
        placement: Any
        _shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
        _version: int
        _needs_weights: bool
        _asleep: int
        _channel: WeightChannel | None
        _committed: dict[str, torch.Tensor] | None
        _initial_state: dict[str, torch.Tensor]
        _jobs: set[Any]
        _episode_tasks: set[asyncio.Task[Any]]
        _batcher: Any
        _updates: list[dict[str, Any]]
        _rolled_back: bool
        _replay: list[dict[str, Any]] | None

        @property
        def rank(self) -> int: ...
        def _gate_event(self) -> asyncio.Event: ...
        def _request_engine(self) -> Any: ...

    _lora_base: dict[str, torch.Tensor] | None = None
    """Adapter sync: a copy of the base weights of the adapted layers, taken at the first :class:`LoraDelta`."""
    _lora_base_digest: str | None = None
    """Its digest (checked against the policy's once, when it was taken)."""
    _adapter_dir: Any = None
    """vLLM adapter sync: the temporary directory the adapters are written into for the engine to read."""
    _engine_base_replaced: bool = False
    """vLLM adapter sync: whole weights were loaded, so the engine no longer holds the base an adapter needs."""

    # ---- weight sync ----------------------------------------------------------------------

    def _vote(self, version: int) -> int:
        """A collective transfer's vote on `version` (before any bytes move)."""
        if version < self._version or (version == self._version and not self._needs_weights):
            return STALE
        return OK

    def _check_version(self, version: int) -> None:
        if self._vote(version) != OK:
            raise StaleWeightsError(
                f"refusing weights of version {version}: rank {self.rank} already has version {self._version}; "
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

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{name: (shape, dtype)}`` of the weights this rollout holds (what a sync must bring)."""
        return {k: (shape, str(dtype).removeprefix("torch.")) for k, (shape, dtype) in self._shapes.items()}

    @register(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)
    def tied_weights(self) -> dict[str, str]:
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

    @register(Dispatch.ONE_TO_ALL)
    def channel_member(self) -> dict[str, Any]:
        """This rank's process and device, for choosing a weight channel's backend."""
        return member_info(self.placement.device)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def join_weight_channel(self, name: str, host: str, port: int, world_size: int, backend: str,
                                  timeout_s: float = 120.0, bucket_bytes: int = 256 << 20) -> dict[str, Any]:
        """Join weight channel `name` as channel rank ``1 + rank`` (policy rank 0 sends)."""
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        ch = await asyncio.to_thread(WeightChannel, name, host, port, 1 + self.rank, world_size, backend=backend,
                                     device=self.placement.device, timeout_s=timeout_s, bucket_bytes=bucket_bytes)
        self._channel = ch
        return {"rank": ch.rank, "backend": ch.backend, "world_size": world_size}

    async def _receive(self, handle: WeightHandle) -> dict[str, torch.Tensor]:
        ch = self._channel
        if ch is None or ch.name != handle.channel:
            raise WeightSyncError(f"rollout rank {self.rank} has no open weight channel {handle.channel!r}; call "
                                  "open_weight_channel(policy, rollout) first")
        tied = self.tied_weights()
        layout = [entry for entry in layout_of(self.weight_spec()) if entry[0] not in tied]  # a tied tensor once
        target = self.placement.device if self.config.engine == "hf" else torch.device("cpu")
        out = await asyncio.to_thread(ch.receive, handle.version, layout, self._vote, target, self._on_bucket_received,
                                      self._held())
        for name, source in tied.items():
            out[name] = out[source]
        return out

    def _on_bucket_received(self, what: str) -> None:
        """Called after each bucket a transfer receives (a seam for fault-injection tests)."""

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
                    f"rollout rank {self.rank} (version {self._version}) does not hold the base weights the policy's "
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
                    f"rollout rank {self.rank} (version {self._version}) does not hold the base weights the policy's "
                    "adapters were trained on: an adapter sync serves the adapter on the base, so the rollout must "
                    "start from the policy's model config and receive only adapter syncs (or sync whole weights)")
            self._lora_base_digest = delta.base_digest
        elif delta.base_digest != self._lora_base_digest or self._engine_base_replaced:
            raise WeightSyncError(f"the adapter of version {delta.version} was trained on other base weights than "
                                  f"the ones rollout rank {self.rank} serves it on")
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="asyncrl-lora-")
        path = save_adapter(delta, os.path.join(self._adapter_dir.name, f"v{delta.version}"))
        gate = self._gate_event()
        gate.clear()
        try:
            waited, aborted = await self._stop_generation()
            await self.engine.aload_adapter(delta.version, path)
            self._version = delta.version
            self._needs_weights = False
        finally:
            gate.set()
        for old in os.listdir(self._adapter_dir.name):  # the engine read them; only the served one is kept
            if old != f"v{delta.version}":
                shutil.rmtree(os.path.join(self._adapter_dir.name, old), ignore_errors=True)
        return {"version": delta.version, "num_tensors": 2 * len(delta.factors), "waited": waited, "aborted": aborted,
                "checksums_verified": False, "adapter": True}

    async def _resolve_weights(self, weights: Any, version: int | None) -> tuple[int, dict[str, torch.Tensor]]:
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

    @register(Dispatch.ONE_TO_ALL)
    async def sleep(self, level: int | None = None) -> dict[str, Any]:
        """Release the engine's weights and KV cache until :meth:`wake_up` (`level` defaults to
        ``RolloutConfig.sleep_level``; 0 does nothing). In-flight generation finishes first."""
        lvl = self.config.sleep_level if level is None else level
        if lvl == 0 or self._asleep:
            return {"asleep": bool(self._asleep), "level": self._asleep}
        gate = self._gate_event()
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
            self._asleep = lvl
        finally:
            gate.set()
        return {"asleep": True, "level": lvl}

    @register(Dispatch.ONE_TO_ALL)
    async def wake_up(self) -> dict[str, Any]:
        """Re-acquire what :meth:`sleep` released. Returns ``{"needs_weights", "version"}``: after a
        level-2 sleep the weights must be synced again (the same version is accepted) before generating."""
        if self._asleep:
            awake = getattr(self.engine, "awake_up", None)
            if awake is not None:
                await awake()
            else:
                await asyncio.to_thread(self.engine.wake_up)  # type: ignore[attr-defined]
            self._needs_weights = self._needs_weights or self._asleep == 2
            self._asleep = 0
        return {"needs_weights": self._needs_weights, "version": self._version}

    @register(Dispatch.ONE_TO_ALL)
    async def update_weights(self, weights: Any, version: int | None = None, *,
                             expected_checksums: dict[str, str] | None = None) -> dict[str, Any]:
        """Load policy weights as one transaction (begin, transfer, commit).

        `weights` is the ``(version, state_dict)`` pair of ``PolicyWorker.export_weights`` --
        pass that future straight in so the tensors go through the object store, not the
        controller -- a state dict with `version`, or a ``WeightHandle`` of ``stage_weights``
        (``local``: copied from the colocated policy's snapshot; ``collective``: received over
        the weight channel while ``PolicyWorker.send_weights`` sends it). Refuses a version <=
        the current one (:class:`StaleWeightsError`) and malformed weights
        (:class:`WeightSyncError`) without changing anything. Returns ``{"version",
        "num_tensors", "waited", "aborted", "checksums_verified"}``. With
        ``RolloutConfig.partial_rollout`` the update does not wait for request-level generations
        in flight (episodes, streaming calls): it pauses the engine, loads, publishes the version
        and resumes; the receipt adds ``pause_latency_s``, ``in_flight`` and ``interrupted``
        (docs/partial_rollout.md).
        """
        if self._asleep == 2:
            raise RuntimeError(f"rollout rank {self.rank} is asleep at level 2 (weights discarded); call wake_up() "
                               "before syncing weights")
        handle = weights[0] if isinstance(weights, list) and len(weights) == 1 else weights
        if isinstance(handle, LoraDelta) and callable(getattr(self.engine, "aload_adapter", None)):
            return await self._update_adapter(handle, version, expected_checksums)
        version, state = await self._resolve_weights(weights, version)
        # begin: every check before anything changes
        self._validate(version, state)
        state = self._cast(state)
        if isinstance(handle, (WeightHandle, LoraDelta)):  # a delta: fresh merged tensors and the engine's own
            state = Adoptable(state)
        if self.config.partial_rollout != "off":
            return await self._update_in_flight(version, state, handle, expected_checksums)
        gate = self._gate_event()
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
        await self._engine_load(state)
        if callable(getattr(self.engine, "aload_adapter", None)):
            self._engine_base_replaced = True  # (the weights an adapter sync would serve its adapter on are gone)
        # commit (verify first)
        if verify:
            got = await self._engine_checksum()
            want = expected_checksums if expected_checksums is not None else state_dict_checksums(state.items())
            bad = sorted(k for k in want if got.get(k) != want[k])
            if bad or set(want) != set(got):
                if self.config.verify_checksums:  # roll back to the last verified weights
                    await self._engine_load(self._committed or self._initial_state)
                    self._rolled_back = True
                    outcome = f"rolled back to version {self._version}"
                else:
                    outcome = "the engine holds unverified weights: sync again (verify_checksums=True rolls back)"
                raise WeightSyncError(
                    f"checksum mismatch after loading version {version} on rank {self.rank} for {bad[:5]}; {outcome}"
                )
        if self.config.verify_checksums:
            self._committed = state  # what a later failed verification rolls back to
        self._version = version
        self._needs_weights = False
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
        gate = self._gate_event()
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
                        self._needs_weights = True  # a sync of any version >= the current one restores them
                        failed = self._fail_in_flight(WeightSyncError(
                            f"weights of version {version} failed to load on rollout rank {self.rank} while this "
                            f"request was in flight ({type(e).__name__}: {e}); it was stopped, since the weights it "
                            "would continue on are no longer known -- sync weights again and resubmit"))
                        self._updates.append({"version": version, "failed": True, "failed_requests": failed})
                    raise
            receipt = {"version": version, "num_tensors": len(state), "waited": len(tasks), "aborted": 0,
                       "checksums_verified": verify, "pause_latency_s": paused.latency_s,
                       "in_flight": paused.in_flight, "interrupted": paused.interrupted}
            self._updates.append({k: receipt[k] for k in ("version", "pause_latency_s", "in_flight", "interrupted")})
            if cancelled:
                raise asyncio.CancelledError(f"update_weights was cancelled while loading; version {version} was "
                                             "loaded and published before it stopped")
            return receipt
        finally:
            gate.set()

    def _engine_paused(self) -> Any:
        """The engine held still for a weight load (the request batcher's pause, or the engine's own)."""
        deadline = self.config.pause_deadline_s
        if self._batcher is None and self._replay is not None:
            self._request_engine()  # a replay's updates wait until its rounds need them
        if self._batcher is not None:
            return self._batcher.paused(deadline)
        apaused = getattr(self.engine, "apaused", None)  # engines that schedule requests themselves (vLLM)
        if apaused is not None:
            return apaused(self.config.partial_rollout, deadline)

        @contextlib.asynccontextmanager
        async def idle() -> AsyncIterator[PauseInfo]:  # no request-level generation was ever started
            yield PauseInfo(0.0, 0, False)

        return idle()

    def _fail_in_flight(self, error: BaseException) -> int:
        if self._batcher is not None:
            return self._batcher.fail_in_flight(error)
        fail = getattr(self.engine, "fail_in_flight", None)
        return fail(error) if fail is not None else 0

    async def _engine_load(self, state: dict[str, torch.Tensor]) -> None:
        aload = getattr(self.engine, "aload_weights", None)  # engines with their own loop (vLLM)
        adopt = getattr(self.engine, "adopt_weights", None)  # the HF engine: no copy (docs/performance.md)
        if aload is not None:
            await aload(state.items())
        elif adopt is not None and isinstance(state, Adoptable):
            await asyncio.to_thread(adopt, state.items())
        else:
            await asyncio.to_thread(self.engine.load_weights, state.items())

    def _held(self) -> list[torch.Tensor]:
        """The tensors a receive must not write into: the engine's (adopted) and the rollback point's."""
        held = list((self._committed or {}).values())
        return held + list((getattr(self.engine, "adopted", None) or {}).values())

    async def _engine_checksum(self) -> dict[str, str]:
        achecksum = getattr(self.engine, "aweights_checksum", None)
        if achecksum is not None:
            return await achecksum()
        return await asyncio.to_thread(self.engine.weights_checksum)
