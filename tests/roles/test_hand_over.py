"""Handing a request over between request batchers (a rollout replica removed or told to stop): the old
batcher stops the request at a decode-step boundary and returns its prefix (token ids, behaviour log-probs,
versions); a new batcher continues from it, so the completion begins with exactly those tokens and nothing
decoded is thrown away. The rollout worker's ``hand_over`` / ``generate_requests(resume=...)`` carry it
through a whole call. The streaming trainer's use of it on real Ray: tests/pipelines/test_stream_scale.py."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
import torch

from asyncrl import Dispatch, register
from asyncrl.roles import RolloutConfig, RolloutWorker, load_model
from asyncrl.roles.engines import SamplingParams
from asyncrl.roles.engines.batcher import Generation, RequestBatcher, continuation_seed
from asyncrl.roles.engines.hf import HFEngine
from asyncrl.roles.errors import HandedOverError, PreemptedError

from tests.forward_hooks import update_at_forwards
from tests.roles.test_partial_rollout import perturbed

PROMPT = "write digits:"


@pytest.fixture
def tiny(model_config):
    """A fresh engine (the continuation loads new weights into it) and its tokenizer."""
    model, tok = load_model(model_config)
    return HFEngine(model=model, tokenizer=tok), tok


async def _handed_over_at(eng: HFEngine, prompt: list[int], params: SamplingParams, mode: str, forward: int,
                          mate: list[int] | None = None) -> tuple[Generation, Generation | None, RequestBatcher]:
    """Decode `prompt` (and a round mate) on a batcher in `mode`; after the `forward`-th forward pass hand the
    first request over. Returns its prefix, the mate's completion and the batcher's statistics holder."""
    b = RequestBatcher(eng, chunk_tokens=64, partial_rollout=mode)
    taken: dict[str, Generation] = {}

    async def take() -> None:
        taken.update(await b.hand_over(["row"]))

    handle, started = update_at_forwards(eng.model, {forward: take}, b._halt)
    try:
        first = asyncio.ensure_future(b.generate(prompt, params, key="row"))
        other = asyncio.ensure_future(b.generate(mate, SamplingParams(max_new_tokens=10, seed=12), key="mate")
                                      ) if mate is not None else None
        with pytest.raises(HandedOverError, match=r"request 'row' was handed over after 3 tokens"):
            await first
        await asyncio.wrap_future(started[0])
        mate_gen = await other if other is not None else None
    finally:
        handle.remove()
        await b.aclose()
    return taken["row"], mate_gen, b


@pytest.mark.parametrize("mode", ["off", "recompute", "keep"])
async def test_a_hand_over_stops_at_the_step_boundary_and_the_continuation_begins_with_its_prefix(tiny, mode):
    eng, tok = tiny
    prompt, mate = tok.encode(PROMPT), tok.encode("say hello")
    params = SamplingParams(max_new_tokens=10, seed=7)
    alone = (await eng.generate([prompt], params))[0]  # the uninterrupted generation, same seed
    prefix, mate_gen, b = await _handed_over_at(eng, prompt, params, mode, 3, mate)
    # exactly the 3 tokens decoded before the hand-over (those of the uninterrupted run), version 0, unfinished
    assert prefix.response_ids == alone.response_ids[:3] == [200, 307, 87]
    assert prefix.log_probs == pytest.approx(alone.log_probs[:3], abs=1e-5)
    assert prefix.versions == [0, 0, 0] and prefix.finish_reason == ""
    # its round mate decodes on, untouched: the tokens it decodes alone
    ref = (await eng.generate([mate], SamplingParams(max_new_tokens=10, seed=12)))[0]
    assert mate_gen.response_ids == ref.response_ids and mate_gen.versions == [0] * len(ref.response_ids)
    assert b.statistics().requests == 1  # the handed-over request is not counted as finished here

    # a new replica (new weights, version 1) continues it: the prefix kept whole, then new tokens of version 1
    eng.load_weights(perturbed(eng.model, 1).items())
    new = RequestBatcher(eng, chunk_tokens=64, version_fn=lambda: 1)
    try:
        cont = await new.generate(prompt, params, key="row", prefix=prefix)
        again = await new.generate(prompt, params, key="row2", prefix=prefix)
    finally:
        await new.aclose()
    assert cont.response_ids[:3] == [200, 307, 87] and cont.log_probs[:3] == prefix.log_probs
    assert cont.versions == [0, 0, 0] + [1] * (len(cont.response_ids) - 3)
    assert cont.response_ids == [200, 307, 87, 131, 122, 289, 347, 118, 27, 151] and cont.finish_reason == "length"
    assert again.response_ids == cont.response_ids  # the continuation is a function of the prefix and seed
    stats = new.statistics()  # the new replica counts only what it decoded (7 tokens each, version 1)
    assert (stats.requests, stats.tokens, stats.tokens_per_version, stats.spanning_requests) == (2, 14, {1: 14}, 2)


async def test_a_request_handed_over_before_its_first_token_continues_as_the_fresh_request(tiny):
    eng, tok = tiny
    prompt = tok.encode(PROMPT)
    params = SamplingParams(max_new_tokens=8, seed=3)
    b = RequestBatcher(eng, chunk_tokens=64)
    taken: dict[str, Generation] = {}
    late: list[asyncio.Future] = []

    async def take() -> None:  # the second request is still waiting for a round: nothing decoded yet
        late.append(asyncio.ensure_future(b.generate(prompt, params, key="waiting")))
        await asyncio.sleep(0)
        taken.update(await b.hand_over(["waiting", "not-here"]))

    handle, started = update_at_forwards(eng.model, {1: take}, b._halt)
    try:
        first = await b.generate(tok.encode("x"), SamplingParams(max_new_tokens=4, seed=1), key="first")
        await asyncio.wrap_future(started[0])
        with pytest.raises(HandedOverError, match="after 0 tokens"):
            await late[0]
    finally:
        handle.remove()
        await b.aclose()
    assert len(first.response_ids) == 4 and list(taken) == ["waiting"]  # an unknown key is left out
    empty = taken["waiting"]
    assert (empty.response_ids, empty.log_probs, empty.versions, empty.finish_reason) == ([], [], [], "")
    assert continuation_seed(3, 0) == 3 and continuation_seed(3, 2) != 3
    new = RequestBatcher(eng, chunk_tokens=64)
    try:
        cont = await new.generate(prompt, params, key="waiting", prefix=empty)
    finally:
        await new.aclose()
    fresh = (await eng.generate([prompt], params))[0]
    assert cont.response_ids == fresh.response_ids and cont.log_probs == pytest.approx(fresh.log_probs, abs=1e-5)


async def test_a_prefix_at_its_length_or_finished_is_the_completion_and_a_bad_one_is_refused(tiny):
    eng, tok = tiny
    prompt = tok.encode(PROMPT)
    b = RequestBatcher(eng, chunk_tokens=64)
    full = Generation([5, 6, 7], [-1.0, -2.0, -3.0], "", versions=[0, 1, 1])
    stopped = Generation([5, 2], [-1.0, -0.5], "stop", versions=[2, 2])
    try:
        at_max = await b.generate(prompt, SamplingParams(max_new_tokens=3, seed=1), key="a", prefix=full)
        done = await b.generate(prompt, SamplingParams(max_new_tokens=8, seed=1), key="b", prefix=stopped)
        with pytest.raises(ValueError, match="a handed-over prefix of 3 tokens is longer than max_new_tokens=2"):
            await b.generate(prompt, SamplingParams(max_new_tokens=2, seed=1), key="c", prefix=full)
        with pytest.raises(ValueError, match="one log-prob and one version per token; got 3 tokens, 3 log-probs, "
                                             "1 versions"):
            await b.generate(prompt, SamplingParams(max_new_tokens=8, seed=1), key="d",
                             prefix=Generation([5, 6, 7], [-1.0, -2.0, -3.0], "", versions=[0]))
        stats = b.statistics()
    finally:
        await b.aclose()
    assert (at_max.response_ids, at_max.log_probs, at_max.versions, at_max.finish_reason) == (
        [5, 6, 7], [-1.0, -2.0, -3.0], [0, 1, 1], "length")
    assert (done.response_ids, done.versions, done.finish_reason) == ([5, 2], [2, 2], "stop")
    assert stats.rounds == 0  # nothing was decoded for them


async def test_a_rollout_worker_hands_a_call_over_and_another_resumes_it(model_config, prompt_batch):
    """``hand_over(seeds)`` stops a running ``generate_requests`` call: the call raises ``PreemptedError``
    whose ``partial`` holds each row's prefix (also returned by ``hand_over``); ``generate_requests(...,
    resume=partial)`` on another worker continues every row from it."""
    old = RolloutWorker(model_config, RolloutConfig(max_new_tokens=10, temperature=1.0))
    batch = prompt_batch(n=2)
    submit = old._request_engine()  # builds the batcher
    assert submit is not None
    got: list[dict] = []

    async def take() -> None:
        got.append(await old.hand_over([11]))

    handle, started = update_at_forwards(old.model, {3: take}, old.requests._batcher._halt)
    try:
        with pytest.raises(PreemptedError, match=r"handed its rows over \(a resize\).*\(2 rows with 6 tokens "
                                                 r"decoded kept\)") as err:
            await old.generate_requests(batch, seed=11)
        await asyncio.wrap_future(started[0])
    finally:
        handle.remove()
        await old.requests._batcher.aclose()
    partial = err.value.partial
    assert got == [{11: partial}] and sorted(partial) == ["11:0", "11:1"]
    assert [len(r["ids"]) for r in partial.values()] == [3, 3]
    assert all(r["versions"] == [0, 0, 0] and r["finish"] == "" for r in partial.values())
    assert await old.hand_over([11]) == {}  # nothing running under that seed any more

    new = RolloutWorker(model_config, RolloutConfig(max_new_tokens=10, temperature=1.0))
    try:
        out = await new.generate_requests(batch, seed=11, resume=partial)
    finally:
        if new.requests._batcher is not None:
            await new.requests._batcher.aclose()
    P = batch["prompt_ids"].shape[1]
    for i in range(2):
        row = partial[f"11:{i}"]
        ids = out["response_ids"][i][out["response_mask"][i].bool()].tolist()
        assert ids[:3] == row["ids"] and len(ids) == 10
        assert out["rollout_log_probs"][i][:3].tolist() == pytest.approx(row["log_probs"], abs=1e-6)
        assert out["token_versions"][i][:3].tolist() == [0, 0, 0]
        assert torch.equal(out["prompt_ids"][i], batch["prompt_ids"][i]) and out["input_ids"].shape[1] == P + 10


# ---- across processes --------------------------------------------------------------------------


async def test_two_ray_ranks_hand_a_call_over_and_one_rank_continues_every_row(ray_cluster, model_config,
                                                                               prompt_batch, tmp_path):
    """On real Ray workers: a call split over 2 ranks whose rows are held after 3 tokens is handed over
    (``hand_over``, a group call: each rank returns its rows); the call fails with ``PreemptedError`` whose
    ``partial`` crossed the process boundary; a worker of a 1-rank pool continues all 4 rows from exactly those
    tokens."""
    import json

    import asyncrl
    from asyncrl import RemoteError

    from asyncrl.pipelines.rollout.stream_rollout import handed_rows
    from tests.pipelines.test_stream_hand_over import HELD, StallingRollout

    calls, stall = tmp_path / "calls.jsonl", tmp_path / "stall"
    stall.write_text("*")
    kwargs = {"model": model_config, "rollout": RolloutConfig(max_new_tokens=6, chunk_tokens=HELD, temperature=1.0),
              "calls": str(calls), "hang": str(tmp_path / "hang"), "stall": str(stall)}
    batch = prompt_batch(n=4)
    async with asyncrl.RayWorkerGroup(StallingRollout, world_size=2, name="hand-over-two", kwargs=kwargs) as two:
        gen = two.generate_requests(batch, seed=5)

        def held() -> set[str]:
            lines = [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []
            return {k for c in lines if "held" in c for k in c["held"]}

        async with asyncio.timeout(60):  # (a remote condition: the workers note each held row in the file)
            while held() != {"5:0", "5:1", "5:2", "5:3"}:
                await asyncio.sleep(0.02)
        parts = await two.hand_over([5])
        with pytest.raises(RemoteError, match="PreemptedError.*handed its rows over") as err:
            await gen
    rows = {k: r for p in parts for k, r in p[5].items()}
    assert [sorted(p[5]) for p in parts] == [["5:0", "5:1"], ["5:2", "5:3"]]  # each rank's own rows
    assert handed_rows(err.value) in ({k: rows[k] for k in ("5:0", "5:1")}, {k: rows[k] for k in ("5:2", "5:3")})
    assert {k: r["ids"] for k, r in rows.items()} == {"5:0": [45, 42, 112], "5:1": [200, 225, 34],
                                                     "5:2": [176, 353, 144], "5:3": [22, 345, 126]}
    assert all(r["versions"] == [0] * HELD and r["finish"] == "" for r in rows.values())

    one = RolloutWorker(model_config, kwargs["rollout"])  # the pool of one (in this process: rank 0 of 1)
    try:
        out = await one.generate_requests(batch, seed=5, resume=rows)
    finally:
        await one.requests._batcher.aclose()
    for i in range(4):
        m = out["response_mask"][i].bool()
        ids, lps = out["response_ids"][i][m].tolist(), out["rollout_log_probs"][i][m].tolist()
        row = rows[f"5:{i}"]
        assert ids[:HELD] == row["ids"] and lps[:HELD] == pytest.approx(row["log_probs"], abs=1e-6)
        assert out["token_versions"][i][m].tolist() == [0] * len(ids) and len(ids) == 6
    assert [out["response_ids"][i][out["response_mask"][i].bool()].tolist() for i in range(4)] == [
        [45, 42, 112, 280, 73, 68], [200, 225, 34, 9, 102, 103], [176, 353, 144, 349, 150, 34],
        [22, 345, 126, 223, 192, 206]]


class ScoresAsTheNoticeStopsRollout(RolloutWorker):
    """A rollout worker (with a colocated reward worker) that forces the order in which a SIGTERM's preemption notice
    meets a ``generate_requests(compute_reward=True)`` call finishing its generation: the call's generation returns
    only once the notice's hand-over has begun (the notice listed the call as generating), and the hand-over goes
    on only once the call is scoring its rows, whose score waits for the hand-over to end. :meth:`generated` answers
    (this process's pid) once the call's rows are generated."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._generated, self._noticed, self._scoring, self._handed = (asyncio.Event() for _ in range(4))
        req = self.requests
        generate, hand_over, score = req._generate_requests, req._hand_over_calls, req._score

        async def generate_until_noticed(*args: Any) -> Any:
            out = await generate(*args)
            self._generated.set()
            await self._noticed.wait()
            return out

        async def hand_over_once_scoring(calls: Any) -> Any:
            self._noticed.set()
            await self._scoring.wait()
            try:
                return await hand_over(calls)
            finally:
                self._handed.set()

        async def score_after_hand_over(rows: Any) -> Any:
            self._scoring.set()
            await self._handed.wait()
            return await score(rows)

        req._generate_requests, req._hand_over_calls, req._score = (generate_until_noticed, hand_over_once_scoring,
                                                                    score_after_hand_over)

    @register(Dispatch.ONE_TO_ALL, concurrent=True)
    async def generated(self) -> int:
        """This process's pid, once a call's rows are generated."""
        await self._generated.wait()
        return os.getpid()


async def test_a_sigterm_while_a_call_scores_its_finished_rows_returns_them_not_a_cancellation(ray_cluster,
                                                                                              model_config,
                                                                                              prompt_batch):
    """On a real Ray process: a SIGTERM's notice lists a fused ``generate_requests`` call as generating, and the
    call's generation returns before the notice's hand-over stops it (the order forced by the worker above). The
    call then scores its whole rows and returns them: the hand-over stops only calls still generating, so the
    controller never sees a cancellation it did not ask for (``CallCancelledError``, which a streaming run's
    recovery does not take for a preemption)."""
    import asyncrl
    from asyncrl.roles import RewardWorker
    from tests.roles.test_hand_over import ScoresAsTheNoticeStopsRollout as Rollout  # (by a name Ray workers import)

    batch = prompt_batch(n=4)
    rollout = (Rollout, (model_config, RolloutConfig(max_new_tokens=6, temperature=1.0)), {})
    async with asyncrl.colocate({"rollout": rollout, "reward": RewardWorker}, world_size=1,
                                name="notice-while-scoring") as groups:
        gen = groups["rollout"].generate_requests(batch, seed=7, compute_reward=True)
        [pid] = await groups["rollout"].generated()
        os.kill(pid, signal.SIGTERM)
        summary = await gen.summary()  # without the fix: CallCancelledError (the notice cancelled the scoring)
        rows = await gen
        assert rows["scores"].shape == (4,) and torch.equal(summary["scores"], rows["scores"])
        assert torch.equal(summary["response_length"], rows["response_length"])
        assert bool((rows["response_length"] > 0).all())


@pytest.mark.parametrize("mode", ["off", "recompute", "keep"])
async def test_a_replayed_hand_over_takes_each_row_where_the_recorded_rounds_stopped_it(tiny, mode):
    """The recording hands ``row`` over after its 3rd decode step while its round mate decodes on (``keep``: the
    mate is handed over too, as a resize hands every row in flight over). The replaying batcher is asked for the
    hand-over before any round ran: it waits for the rows' recorded rounds and returns exactly the recorded
    prefixes (ids, log-probs, versions), and the mate's completion is the recorded one."""
    from asyncrl.roles.engines.round_log import ReplayBatcher, RoundRecord

    eng, tok = tiny
    prompt, mate = tok.encode(PROMPT), tok.encode("say hello")
    params, mate_params = SamplingParams(max_new_tokens=10, seed=7), SamplingParams(max_new_tokens=10, seed=12)
    wanted = ["row", "mate"] if mode == "keep" else ["row"]
    rec = RequestBatcher(eng, chunk_tokens=4, partial_rollout=mode, record_rounds=True)
    taken: dict[str, Generation] = {}

    async def take() -> None:
        taken.update(await rec.hand_over(wanted))

    handle, started = update_at_forwards(eng.model, {3: take}, rec._halt)
    try:
        runs = [asyncio.ensure_future(rec.generate(prompt, params, key="row")),
                asyncio.ensure_future(rec.generate(mate, mate_params, key="mate"))]
        done = await asyncio.gather(*runs, return_exceptions=True)
        await asyncio.wrap_future(started[0])
        await rec.settled()  # the stopped round recorded (keep: after its last segment)
        log = [r.to_dict() for r in rec.round_log()]
    finally:
        handle.remove()
        await rec.aclose()
    assert len(taken["row"].response_ids) == 3 and taken["row"].finish_reason == ""
    assert isinstance(done[0], HandedOverError)

    rep = ReplayBatcher(eng, [RoundRecord.from_dict(d) for d in log], chunk_tokens=4, partial_rollout=mode)
    try:
        runs = [asyncio.ensure_future(rep.generate(prompt, params, key="row")),
                asyncio.ensure_future(rep.generate(mate, mate_params, key="mate"))]
        got = await rep.hand_over(wanted)  # issued before any round ran
        again = await asyncio.gather(*runs, return_exceptions=True)
    finally:
        await rep.aclose()
    assert set(got) == set(taken)
    for k, g in taken.items():
        assert (got[k].response_ids, got[k].log_probs, got[k].versions, got[k].finish_reason) == (
            g.response_ids, g.log_probs, g.versions, g.finish_reason)
    assert isinstance(again[0], HandedOverError)
    if mode != "keep":  # the mate decoded on, in the recorded rounds: its recorded completion
        assert again[1].response_ids == done[1].response_ids and again[1].log_probs == done[1].log_probs
