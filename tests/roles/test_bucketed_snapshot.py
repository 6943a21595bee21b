"""Collective snapshots staged in the channel's buckets: the send path broadcasts each bucket's
buffer as it is (no concatenation), and the receivers get the same bits as from a plain state."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from asyncrl.roles.weights.weight_channel import OK, WeightChannel, _buckets, _one_buffer, bucketed_snapshot, free_port, layout_of


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, generator=g), "b": torch.randn(5, 7, generator=g), "c": torch.arange(3),
            "d": torch.randn(4, generator=g), "e": torch.randn(2, 3, generator=g)}


def test_a_bucketed_snapshot_casts_into_one_buffer_per_bucket_except_unaligned_tensors():
    state = _state()
    layout = [(n, s, "bfloat16" if n in ("a", "e") else d) for n, s, d in layout_of(state)]
    snap = bucketed_snapshot(state, layout, bucket_bytes=64, device="cpu")
    assert list(snap) == ["a", "b", "c", "d", "e"]
    for n, t in snap.items():
        assert torch.equal(t, state[n].to(t.dtype)) and t.dtype == (torch.bfloat16 if n in ("a", "e") else state[n].dtype)
    plan = _buckets(layout, 64)
    assert plan == [[0], [1], [2, 3, 4]]  # a: 6 B (b would pass 64); b: 140 B alone; c+d+e: 24+16+12 B
    shared = [_one_buffer([snap[layout[i][0]] for i in idx]) is not None for idx in plan]
    assert shared == [True, True, True]  # every bucket is sent as it is, no concatenation
    assert snap["c"].untyped_storage().data_ptr() == snap["d"].untyped_storage().data_ptr()


def test_an_unaligned_tensor_gets_its_own_buffer_and_its_bucket_is_concatenated():
    state = {"a": torch.randn(3).to(torch.bfloat16), "b": torch.randn(2)}  # b at byte 6: not a float32 offset
    layout = layout_of(state)
    snap = bucketed_snapshot(state, layout, bucket_bytes=1 << 20, device="cpu")
    assert torch.equal(snap["a"], state["a"]) and torch.equal(snap["b"], state["b"])
    assert snap["a"].untyped_storage().data_ptr() != snap["b"].untyped_storage().data_ptr()
    assert _one_buffer([snap["a"], snap["b"]]) is None
    assert _one_buffer([state["b"]]) is not None  # a lone tensor owning its storage is its own buffer


def test_a_bucketed_snapshot_sends_the_same_bits_as_a_plain_state():
    state = _state()
    layout = layout_of(state)
    port = free_port()
    with ThreadPoolExecutor(2) as ex:
        chans = list(ex.map(lambda r: WeightChannel("b", "127.0.0.1", port, r, 2, backend="gloo",
                                                    device=torch.device("cpu"), timeout_s=30, bucket_bytes=64),
                            range(2)))
        for version, sent in ((1, bucketed_snapshot(state, layout, 64, "cpu")), (2, state)):
            s = ex.submit(chans[0].send, version, sent, layout)
            got = ex.submit(chans[1].receive, version, layout, lambda v: OK, torch.device("cpu")).result(timeout=60)
            assert s.result(timeout=60)["bytes"] == 12 + 140 + 24 + 16 + 24  # float32 a and e here
            assert all(torch.equal(got[n].view(torch.uint8), state[n].view(torch.uint8)) for n in state)
    for c in chans:
        c.close()
