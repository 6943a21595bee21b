"""Shared fixtures: one embedded Ray per test session (starting Ray costs seconds)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray with 32 logical CPUs (accounting only; the machine has 2 cores)."""
    import asyncrl

    resources = asyncrl.init(num_cpus=32)
    yield resources
    asyncrl.shutdown()
