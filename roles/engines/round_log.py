"""The request batcher's round log, and the batcher that replays it bit for bit.

A streaming partial-rollout run decodes each request in rounds whose composition depends on
timing: which requests were pending, where a weight update interrupted a round. The float
results of a forward pass depend on its batch (shape, padding, row order), so regenerating the
same tokens needs the same rounds. :class:`~.batcher.RequestBatcher` with ``record_rounds=True``
writes one :class:`RoundRecord` per round; :class:`ReplayBatcher` runs exactly those rounds::

    record:  RequestBatcher(engine, record_rounds=True)      generate(prompt, params, key="step3/g7/0")
             log = [r.to_dict() for r in batcher.round_log()]   (JSON; the journal keeps it)
    replay:  ReplayBatcher(engine, [RoundRecord.from_dict(d) for d in log])
             generate(prompt, params, key="step3/g7/0")   same keys, same params (seeds), any order

The replay forms each recorded round from its keys in the recorded batch order (waiting until
they are all submitted), runs each segment for its recorded number of decode steps under its
recorded version, and holds a pause (a weight update) until the next segment needs a newer
version -- so the caller performs the same updates in the same order and they land where they
landed. While it waits for the next round's requests, an update that round needs may land (the
recording loaded it before that round as well), so an update of several replaying ranks never waits
for a rank that is idle until later requests come. Requests sample from their own seeded generators, so the tokens, log-probs and versions
come out bit-identical (same machine, same thread count; tested on CPU).

Failure cases (each raises, never hangs):

1. a request whose key is not in the log: ``ValueError`` at submission (with ``hold_unknown=True`` it
   is held, never decoded, until it is cancelled or the batcher closes: the requests a recording had
   in flight when it ended, which no recorded round ran);
2. the weights are already newer than a segment's recorded version (updates out of order or
   missing): every request of that round fails with :class:`ReplayDivergedError`.

Hand-over (a resize or preemption stopped rows to continue them on another pool, docs/nodes.md): the
recording's hand-over stopped each row after its last recorded round, so the replay's
:meth:`ReplayBatcher.hand_over` waits until the script has run every round of the named requests and
takes them as they stand then (finished ones too), never at its own next decoding step.

Not recorded: cancellations (a cancelled request's round mates decode on as recorded).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

from asyncrl.roles.errors import HandedOverError, RolesError
from asyncrl.roles.engines.batcher import Generation, RequestBatcher, RoundRecord, _Request, _Round

__all__ = ["RoundRecord", "ReplayBatcher", "ReplayDivergedError"]


class ReplayDivergedError(RolesError, RuntimeError):
    """Raised when a replay meets weights newer than the recorded round needs (updates out of order)."""


class ReplayBatcher(RequestBatcher):
    """A :class:`~.batcher.RequestBatcher` that runs recorded rounds instead of scheduling its own.

    Args:
        engine: the HF engine (same model and initial weights as the recording).
        rounds: the recording's :meth:`~.batcher.RequestBatcher.round_log`.
        hold_unknown: hold a request whose key no recorded round ran (never decode it) instead of
            refusing it.
        kwargs: as for :class:`~.batcher.RequestBatcher` (the same ``chunk_tokens``, ``version_fn``
            and ``partial_rollout`` as the recording).
    """

    def __init__(self, engine: Any, rounds: list[RoundRecord], *, hold_unknown: bool = False, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self.hold_unknown = hold_unknown
        self._script = list(rounds)
        self._known = {k for r in self._script for k in r.keys}
        self._by_key: dict[str, _Request] = {}
        self._grants: asyncio.Semaphore | None = None  # one per weight update the script needs now
        self._pause_ended: asyncio.Event | None = None
        self._script_done = False
        self._ran = 0  # script rounds run (or failed) so far
        self._progress: asyncio.Event | None = None  # set (and replaced) after each script round

    def _key(self, key: str | None) -> str:
        if key is not None and self.hold_unknown:
            return str(key)
        if key is None or str(key) not in self._known:
            raise ValueError(f"request key {key!r} is not in the replayed round log; replay the recorded requests "
                             "with the keys they were recorded under")
        return str(key)

    async def aclose(self) -> None:
        """Stop the replay; every request submitted and not finished is cancelled."""
        self._waiting += [r for r in self._by_key.values() if r not in self._waiting]
        await super().aclose()

    async def hand_over(self, keys: Iterable[str]) -> dict[str, Generation]:
        """The recording's hand-over of `keys`, re-created: once the script has run every round of those
        requests (where the recording stopped them), take each away as it stands -- unfinished ones with
        ``finish_reason=""`` (their futures fail with :class:`HandedOverError`), finished ones as they
        finished -- by key. Keys never submitted here are left out."""
        wanted = {str(k) for k in keys}
        last = max((i for i, rec in enumerate(self._script) if wanted.intersection(rec.keys)), default=-1)
        while self._ran <= last and not self._script_done:
            if self._progress is None:
                self._progress = asyncio.Event()
            await self._progress.wait()
        async with self._lock():
            out: dict[str, Generation] = {}
            for r in [*self._by_key.values(), *(r for r in self._waiting if r.key not in self._by_key)]:
                if r.key not in wanted:
                    continue
                if not r.future.done():
                    out[r.key] = Generation(list(r.tokens), list(r.log_probs), "", versions=list(r.versions))
                    r.future.set_exception(HandedOverError(f"request {r.key!r} was handed over after "
                                                           f"{len(r.tokens)} tokens (replayed)"))
                    r.future.exception()  # (retrieved: its awaiter may be gone)
                elif not r.future.cancelled() and r.future.exception() is None:
                    out[r.key] = r.future.result()
            return out

    def _round_ran(self) -> None:
        self._ran += 1
        if self._progress is not None:
            self._progress.set()
            self._progress = None

    def _rounds_to_replay(self) -> list[Any] | None:
        return self._script

    def _ensure_driver(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._script_done:  # the script ran once; later requests are held (hold_unknown), never re-run it
            if self._wakeup is None:
                self._wakeup = asyncio.Event()
            return
        super()._ensure_driver(loop)

    def _events(self) -> tuple[asyncio.Semaphore, asyncio.Event]:
        if self._grants is None or self._pause_ended is None:
            self._grants, self._pause_ended = asyncio.Semaphore(0), asyncio.Event()
        return self._grants, self._pause_ended

    async def _pause_point(self) -> None:
        grants, _ = self._events()
        if self._script_done:
            return
        await grants.acquire()  # the driver grants one pause per update the next segment needs
        if self._script_done:
            grants.release()  # wake the next waiting pause too

    def _paused_done(self) -> None:
        _, ended = self._events()
        ended.set()

    async def _drive(self) -> None:
        assert self._wakeup is not None
        lock = self._lock()
        grants, ended = self._events()
        granted = False  # a pause granted and not ended yet (one at a time: the updates land one by one)
        for rec in self._script:
            first = rec.segments[0][0] if rec.segments else 0
            while not all(k in self._by_key for k in rec.keys):
                self._by_key.update({r.key: r for r in self._waiting})
                self._waiting.clear()
                if all(k in self._by_key for k in rec.keys):
                    break
                if granted and ended.is_set():
                    granted = False
                if not granted and int(self.version_fn()) < first:
                    # idle until the round's requests come: an update it needs may land meanwhile (the recording
                    # loaded it before that round too), so a load on several ranks waits for none of them
                    ended.clear()
                    grants.release()
                    granted = True
                self._wakeup.clear()
                waits = [asyncio.ensure_future(self._wakeup.wait())]
                if granted:
                    waits.append(asyncio.ensure_future(ended.wait()))
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
            batch = [self._by_key[k] for k in rec.keys]
            self._active = batch
            rnd: _Round | None = None
            try:
                for version, steps in rec.segments:
                    while int(self.version_fn()) < version:  # the next weight update lands here
                        if not granted:
                            ended.clear()
                            grants.release()
                        granted = True
                        await ended.wait()
                        granted = False
                    if int(self.version_fn()) > version:
                        raise ReplayDivergedError(
                            f"the replayed round of {rec.keys[:3]}... ran under version {version} but the weights "
                            f"are at version {int(self.version_fn())}; perform the recorded updates in order")
                    async with lock:
                        if rnd is not None:
                            for b, r in enumerate(batch):
                                rnd.done[b] = rnd.done[b] or r.future.done()
                        rnd, _ = await asyncio.to_thread(self._segment, batch, rnd, version, steps)
            except Exception as e:
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                self._round_ran()
                continue
            assert rnd is not None
            self._finish_round(rnd)
            self._round_ran()
        self._active = []
        self._script_done = True  # later pauses need not wait for the script
        grants.release()
        if self._progress is not None:
            self._progress.set()
