"""The streaming path's behaviour log-probs are exact (the evidence on the stream collapse at lr 1e-2,
benchmarks/results/stream_learning.md): prompt groups of different prompt widths generated concurrently by
`RolloutWorker.generate_requests`, a weight update landing between one call's admission and its first
decoding round, and `concat_groups` re-padding them into one step's batch -- every row's
``rollout_log_probs`` equal, on every response token, what `PolicyWorker.compute_log_prob` gives under the
weights of the version the row records, and every row keeps its own prompt, response and group ``uid``."""

from __future__ import annotations

import asyncio

import torch
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.loop.stream_batch import concat_groups
from asyncrl.roles import PolicyWorker, RolloutConfig, RolloutWorker
from tensordict import TensorDict

GROUP = 3
TEXTS = ["hi", "write digits:", "say hello to everyone in this room please"]  # three prompt widths


def _group(worker: RolloutWorker, text: str) -> TensorDict:
    """One prompt group, left-padded to its own width (as StreamRollout slices it from a step's batch)."""
    enc = worker.tokenizer([text] * GROUP, return_tensors="pt")
    return TensorDict({"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"]}, batch_size=[GROUP])


async def test_rows_of_concatenated_groups_carry_the_log_probs_of_the_weights_they_record():
    model = tiny_test().model
    rollout = RolloutWorker(model, RolloutConfig(max_new_tokens=5, chunk_tokens=2, temperature=0.9))
    policy = PolicyWorker(model)
    policy.temperature = 0.9  # the policy's log-probs use the sampling temperature
    v0 = {k: v.clone() for k, v in policy.model.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    v1 = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v for k, v in v0.items()}
    groups = [_group(rollout, t) for t in TEXTS]
    assert len({int(g["prompt_ids"].shape[1]) for g in groups}) == 3
    # group 0 starts under version 0; the update (partial_rollout="off") waits for it and closes the gate,
    # so groups 1 and 2, submitted meanwhile, start after the load: version 1
    first = asyncio.ensure_future(rollout.generate_requests(groups[0], seed=0))
    await asyncio.sleep(0)  # group 0 is in flight (registered with the weight update)
    update = asyncio.ensure_future(rollout.update_weights((1, {k: v.clone() for k, v in v1.items()})))
    await asyncio.sleep(0)  # the update has closed the gate
    later = [asyncio.ensure_future(rollout.generate_requests(g, seed=i)) for i, g in enumerate(groups[1:], 1)]
    parts = [await first, *await asyncio.gather(*later)]
    assert (await update)["waited"] == 1
    assert [p["version"].tolist() for p in parts] == [[0] * GROUP, [1] * GROUP, [1] * GROUP]
    scores = [TensorDict({"scores": torch.full((GROUP,), float(i))}, batch_size=[GROUP]) for i in range(3)]
    batch = concat_groups(parts, scores, pad_id=int(rollout.tokenizer.pad_token_id), uid_base=30)

    assert batch["uid"].tolist() == [30] * GROUP + [31] * GROUP + [32] * GROUP
    assert batch["scores"].tolist() == [0.0] * GROUP + [1.0] * GROUP + [2.0] * GROUP
    width = max(int(p["prompt_ids"].shape[1]) for p in parts)
    for i, p in enumerate(parts):  # each row: its own prompt (re-padded on the left) and response
        rows = slice(i * GROUP, (i + 1) * GROUP)
        own = p["prompt_ids"][p["prompt_mask"].bool()]
        assert torch.equal(batch["prompt_ids"][rows][batch["prompt_mask"][rows].bool()], own)
        assert torch.equal(batch["input_ids"][rows, width:], p["response_ids"])
        assert torch.equal(batch["attention_mask"][rows, width:], p["response_mask"])
        for key in ("response_ids", "response_mask", "rollout_log_probs", "token_versions", "version"):
            assert torch.equal(batch[key][rows], p[key]), key
    mask = batch["response_mask"].bool()
    assert int(mask.sum()) > 3 * GROUP
    lp0 = policy.compute_log_prob(batch)["old_log_probs"]
    policy.model.load_state_dict(v1)
    lp1 = policy.compute_log_prob(batch)["old_log_probs"]
    want = torch.where(batch["version"][:, None] == 0, lp0, lp1)
    torch.testing.assert_close(want[mask], batch["rollout_log_probs"][mask], atol=1e-5, rtol=0)
    # and the other version's weights would not match (the check can fail)
    other = torch.where(batch["version"][:, None] == 0, lp1, lp0)
    assert float((other[mask] - batch["rollout_log_probs"][mask]).abs().max()) > 1e-2
    rollout.on_close()
