"""The core example runs end to end (tiny sizes) on the session's Ray."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


async def test_pipelining_example(ray_cluster):
    spec = importlib.util.spec_from_file_location("pipelining_example", ROOT / "examples" / "pipelining.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = await module.main(module.Args(rows=50, width=8))
    assert result == {"total": 2 * sum(range(50)), "bytes_fetched": 0}
