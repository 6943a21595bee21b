"""Fixtures of the roles tests: tiny models, the tiny tokenizer, prompt batches."""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from asyncrl.roles import ModelConfig, tiny_tokenizer, toy_dataset


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
    this process; returns the sender's :class:`~asyncrl.roles.weight_channel.WeightChannel`."""
    import asyncio

    from asyncrl.roles.weight_channel import WeightChannel, free_port

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
