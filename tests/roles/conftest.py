"""Fixtures of the roles tests: tiny models, the tiny tokenizer, prompt batches."""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from asyncrl.roles import ModelConfig, PolicyWorker, RolloutConfig, RolloutWorker, tiny_tokenizer, toy_dataset


def _prompt_batch(task: str = "char_class", n: int = 4, repeat: int = 1, seed: int = 0) -> TensorDict:
    """A data-loader batch (left-padded prompts, strings, answers, uids), rows repeated `repeat` times."""
    tok = tiny_tokenizer()
    if task == "mixed":  # prompts of different lengths (real left padding)
        rows = [r for pair in zip(toy_dataset("char_class", n, seed), toy_dataset("echo_word", n, seed)) for r in pair][:n]
    else:
        rows = toy_dataset(task, n, seed=seed)
    enc = tok([r["prompt"] for r in rows], padding=True, return_tensors="pt")
    td = TensorDict(
        {
            "prompt_ids": enc["input_ids"],
            "prompt_mask": enc["attention_mask"],
            "prompt": NonTensorStack(*[r["prompt"] for r in rows]),
            "answer": NonTensorStack(*[r["answer"] for r in rows]),
            "uid": torch.arange(n),
        },
        batch_size=[n],
    )
    if repeat > 1:
        td = td[torch.arange(n).repeat_interleave(repeat)]
    return td


@pytest.fixture(scope="session")
def model_config() -> ModelConfig:
    """The tiny test model. ``ASYNCRL_TEST_DEVICE=cuda`` puts the roles that tests build in-process on
    the GPU (in float32 without autocast, so the exact log-prob checks keep their meaning); tests that
    build Ray groups need ``cpu`` (their bundles reserve no GPU). benchmarks/gpu_check.sh sets it."""
    return ModelConfig(seed=0, device=os.environ.get("ASYNCRL_TEST_DEVICE", "cpu"), dtype="float32", autocast="off")


@pytest.fixture(scope="session")
def prompt_batch():
    """``prompt_batch(task="char_class", n=4, repeat=1, seed=0)`` -> a data-loader TensorDict."""
    return _prompt_batch


async def _channel_sender(rollout, name: str):
    """Join `rollout` to a 2-rank gloo weight channel `name` whose sender (channel rank 0) lives in
    this process; returns the sender's :class:`~asyncrl.roles.weights.weight_channel.WeightChannel`."""
    import asyncio

    from asyncrl.roles.weights.weight_channel import WeightChannel, free_port

    port = free_port()
    join = asyncio.ensure_future(rollout.join_weight_channel(name, "127.0.0.1", port, 2, "gloo", timeout_s=30))
    root = await asyncio.to_thread(WeightChannel, name, "127.0.0.1", port, 0, 2, backend="gloo",
                                   device=torch.device("cpu"), timeout_s=30)
    await join
    return root


@pytest.fixture
def channel_sender():
    """``await channel_sender(rollout, name)``: the in-process sender of a 2-rank gloo channel `rollout` joined."""
    return _channel_sender


@pytest.fixture(scope="module")
async def uneven_batch(model_config, prompt_batch):
    """8 rows: rank 0 of two gets rows 0-3 with their full responses, rank 1 rows 4-7 cut to one token."""
    b = (await RolloutWorker(model_config, RolloutConfig(max_new_tokens=6)).generate(prompt_batch(n=4, repeat=2)))
    b = b.clone(False)
    P = b["prompt_ids"].shape[1]
    mask = b["response_mask"].clone()
    mask[4:, 1:] = 0
    b["response_mask"] = mask
    b["attention_mask"] = torch.cat([b["prompt_mask"], mask], 1)
    b.update(PolicyWorker(model_config).compute_log_prob(b))
    g = torch.Generator().manual_seed(0)
    noise = lambda: torch.randn(mask.shape, generator=g) * 0.3 * mask  # noqa: E731
    b["rollout_log_probs"] = b["old_log_probs"] + noise()  # importance weights around 1, some above the cap
    b["ref_log_probs"] = b["old_log_probs"] + noise()
    b["advantages"] = torch.randn(mask.shape, generator=g) * mask
    b["values"] = torch.randn(mask.shape, generator=g) * mask
    b["returns"] = b["values"] + torch.randn(mask.shape, generator=g) * mask
    b["scores"] = torch.randn(8, generator=g)
    tokens = mask.sum(1)
    assert tokens[:4].sum() >= 4 * tokens[4:].sum() and P > 0  # very unequal shards
    return b


@pytest.fixture
def server_log():
    """``(events, records)``: the structlog events (the gateway's log lines) and the records uvicorn logged (a
    traceback there is what a trainer's terminal would print) while the test runs."""
    import logging

    from structlog.testing import capture_logs

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, loggers = Keep(), [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "uvicorn.asgi")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with capture_logs() as events:
            yield events, records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
