"""``benchmarks/lora_sync.py --quick`` prints its table: a full and an adapter sync of the tiny model, the adapter
moving a fraction of the bytes (slow: two Ray worker start-ups in a process of its own)."""

from __future__ import annotations

import pytest

from .test_benchmarks_quick import run, table_rows


@pytest.mark.slow
def test_lora_sync_quick(tmp_path):
    rows = table_rows(run("lora_sync.py", tmp_path / "lora_sync.md"))
    assert rows[0] == ["model (params)", "LoRA rank (adapter params)", "sync", "bytes moved", "seconds (median)",
                       "vs full"]
    full, adapter = rows[2:]
    assert (full[2], adapter[2]) == ("full (object_store)", "adapter")
    assert float(adapter[3].split()[0]) < float(full[3].split()[0]) / 4
    assert "% of the bytes" in adapter[5]
