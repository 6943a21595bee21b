"""The core example runs end to end (tiny sizes) on the session's Ray."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.slow  # six worker processes; its mechanisms stay in tests/core/test_pipelining.py (README, Tests)
async def test_pipelining_example(ray_cluster):
    ex = importlib.import_module("examples.pipelining")
    result = await ex.main(ex.Args(rows=48, width=8))
    assert result == {"total": 2 * sum(range(48)), "bytes_fetched": 0}
