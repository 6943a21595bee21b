"""The worker side of streaming rollout, `RolloutWorker.generate_requests` (in process): the `generate`
layout plus per-token versions, a reproducible per-row seed, and a weight update that reaches rows in
flight at a round boundary without waiting for them (every token's version and log-prob are true)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.roles import RolloutConfig, RolloutWorker
from asyncrl.roles._util import response_log_probs
from tensordict import TensorDict

from tests.forward_hooks import update_at_forwards


def _batch(worker: RolloutWorker, texts: list[str]) -> TensorDict:
    enc = worker.tokenizer(texts, padding=True, return_tensors="pt")
    return TensorDict({"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"]}, batch_size=[len(texts)])


@pytest.fixture
def model_config():
    return tiny_test().model


async def test_requests_return_the_generate_layout_with_token_versions_and_reproducible_rows(model_config):
    w = RolloutWorker(model_config, RolloutConfig(max_new_tokens=6, chunk_tokens=4))
    batch = _batch(w, ["write digits:"] * 3)
    a = await w.generate_requests(batch, seed=7)
    b = await w.generate_requests(batch, seed=7)
    for key in ("response_ids", "response_mask", "rollout_log_probs", "input_ids", "attention_mask", "version",
                "token_versions"):
        assert key in a.keys()
    assert a["response_ids"].shape == (3, 6)
    mask = a["response_mask"].bool()
    assert (a["token_versions"][mask] == 0).all() and (a["token_versions"][~mask] == -1).all()
    assert a["version"].tolist() == [0, 0, 0]
    assert torch.equal(a["response_ids"], b["response_ids"])  # same call, same weights: same rows
    rows = {tuple(r) for r in a["response_ids"].tolist()}
    assert len(rows) == 3  # one prompt's rows sample with different seeds
    other = await w.generate_requests(batch, seed=8)
    assert not torch.equal(other["response_ids"], a["response_ids"])
    # the behaviour log-probs are the model's own at temperature 1
    lp, _ = response_log_probs(w.model, a["input_ids"], a["attention_mask"], a["response_ids"], 1.0,
                               with_entropy=False)
    torch.testing.assert_close(lp[mask].double(), a["rollout_log_probs"][mask].double(), atol=2e-5, rtol=0)
    w.on_close()


async def test_a_partial_rollout_update_reaches_rows_in_flight_without_waiting_for_them(model_config):
    w = RolloutWorker(model_config, RolloutConfig(max_new_tokens=6, chunk_tokens=2, partial_rollout="recompute"))
    w._request_engine()  # build the batcher now, to hook its first decode step
    batch = _batch(w, ["write digits:", "say hello"])
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    new = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) if v.is_floating_point()
           else v for k, v in w.model.state_dict().items()}
    task: asyncio.Future[Any] | None = None
    receipts: list[tuple[dict[str, Any], bool]] = []

    async def update() -> None:
        receipt = await w.update_weights((1, new))
        receipts.append((receipt, task is not None and task.done()))

    # the update starts after the first forward (the first round's prefill: token 0 under version 0), and that
    # step is held until the update has asked for its pause, so the round stops right after token 0
    handle, started = update_at_forwards(w.engine.model, {1: update}, w.requests._batcher._interrupt)
    try:
        task = asyncio.ensure_future(w.generate_requests(batch, seed=1))
        out = await task
        await asyncio.wrap_future(started[0])
    finally:
        handle.remove()
    (receipt, generation_done_first), = receipts
    assert receipt["version"] == 1 and receipt["waited"] == 0 and receipt["in_flight"] == 2
    assert not generation_done_first  # the update did not wait for the rows in flight
    mask = out["response_mask"].bool()
    tv = out["token_versions"]
    # recompute stops the first round after its current decode step: token 0 is version 0, the rest 1
    first = 1
    assert (tv[:, :first][mask[:, :first]] == 0).all() and mask[:, 0].all()
    assert (tv[:, :first][mask[:, :first]] == 0).all() and (tv[:, first:][mask[:, first:]] == 1).all()
    assert out["version"].tolist() == [0, 0]  # the first token's version
    assert mask[:, first:].any()  # (the tiny model at temperature 1 does not stop this early here)
    # each version-1 token's behaviour log-prob is its log-prob under version 1 given the tokens before it
    lp, _ = response_log_probs(w.model, out["input_ids"], out["attention_mask"], out["response_ids"], 1.0,
                               with_entropy=False)
    late = mask.clone()
    late[:, :first] = False
    torch.testing.assert_close(lp[late].double(), out["rollout_log_probs"][late].double(), atol=1e-5, rtol=0)
    # ... and each version-0 token's is its log-prob under version 0
    w.model.load_state_dict(before)
    lp0, _ = response_log_probs(w.model, out["input_ids"], out["attention_mask"], out["response_ids"], 1.0,
                                with_entropy=False)
    early = mask & ~late
    torch.testing.assert_close(lp0[early].double(), out["rollout_log_probs"][early].double(), atol=1e-5, rtol=0)
    w.on_close()


async def test_without_partial_rollout_an_update_waits_for_the_rows_in_flight(model_config):
    w = RolloutWorker(model_config, RolloutConfig(max_new_tokens=6, chunk_tokens=2))
    w._request_engine()
    first_round = asyncio.Event()
    version_of = w.requests._batcher.version_fn

    def version() -> int:
        first_round.set()
        return version_of()

    w.requests._batcher.version_fn = version
    task = asyncio.ensure_future(w.generate_requests(_batch(w, ["write digits:", "say hello"]), seed=1))
    await first_round.wait()
    receipt = await w.update_weights((1, {k: v.clone() for k, v in w.model.state_dict().items()}))
    assert receipt["waited"] == 1 and task.done()  # the call finished first, under version 0 only
    out = task.result()
    assert set(out["token_versions"][out["response_mask"].bool()].tolist()) == {0}
    w.on_close()
