"""``benchmarks/lora_sync.py --quick --layouts one fsdp2`` prints its table: a full and an adapter sync of the tiny
model from one rank and from fsdp2 x2 shards, the adapter moving a fraction of the bytes, the same bytes from either
layout, and each training rank's peak memory (slow: Ray worker start-ups in a process of its own)."""

from __future__ import annotations

import pytest

from .test_benchmarks_quick import run, table_rows


@pytest.mark.slow
def test_lora_sync_quick(tmp_path):
    rows = table_rows(run("lora_sync.py", tmp_path / "lora_sync.md", "--layouts", "one", "fsdp2"))
    assert rows[0] == ["model (params)", "LoRA rank (adapter params)", "policy", "sync", "bytes moved",
                       "seconds, median (min-max)", "vs full", "vs the first policy layout",
                       "peak RSS of a training rank in the sync, rank 0 / others"]
    body = rows[2:]
    assert [(r[2], r[3]) for r in body] == [("1 rank", "full (object_store)"), ("1 rank", "adapter"),
                                            ("fsdp2 x2", "full (object_store)"), ("fsdp2 x2", "adapter")]
    one_full, one_adapter, shard_full, shard_adapter = body
    assert float(one_adapter[4].split()[0]) < float(one_full[4].split()[0]) / 4
    assert "% of the bytes" in one_adapter[6] and "% of the bytes" in shard_adapter[6]
    assert (shard_full[4], shard_adapter[4]) == (one_full[4], one_adapter[4])  # what crosses does not depend on sharding
    assert shard_full[7].endswith("x") and one_full[7] == ""
    assert one_full[8].endswith("/ -") and shard_full[8].count("MiB") == 2  # rank 0 / the other rank
