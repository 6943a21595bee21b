"""Streaming's step batch built in shards (``stages.concat_sharded``), on real Ray: each training rank builds the
shard of its chunk of groups, and the shards are the batch ``concat_groups`` builds on one rank, row for row
(same order, uids, prompt padding), read in place by a data-parallel call of the same world size."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from asyncrl import RayWorkerGroup
from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.loop.stages import AdvantageWorker, Groups


def _group(g: int, width: int) -> tuple[TensorDict, TensorDict]:
    """Group g's generate result (2 rows, prompts `width` wide, right-aligned) and its scores."""
    ids = torch.full((2, width), 0, dtype=torch.long)
    ids[:, -1] = g + 1
    mask = torch.zeros((2, width), dtype=torch.long)
    mask[:, -1] = 1
    resp = torch.full((2, 3), 10 + g, dtype=torch.long)
    td = TensorDict({"prompt_ids": ids, "prompt_mask": mask, "response_ids": resp,
                     "response_mask": torch.ones(2, 3, dtype=torch.long),
                     "input_ids": torch.cat([ids, resp], 1),
                     "attention_mask": torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1),
                     "uid": torch.full((2,), 99)}, batch_size=[2])
    return td, TensorDict({"scores": torch.tensor([float(g), -float(g)])}, batch_size=[2])


async def test_the_sharded_step_batch_is_the_one_rank_batch_row_for_row(ray_cluster):
    async with RayWorkerGroup(AdvantageWorker, world_size=3, ranks_per_process=3, name="adv") as adv:
        g = Groups(rollout=None, reward=None, policy=None, advantage=adv)  # type: ignore[arg-type]
        made = [_group(i, 1 + i % 3) for i in range(7)]  # 7 groups over 3 ranks: chunks of 3, 2, 2
        gens = [adv.echo.options(rank=i % 3)(td) for i, (td, _) in enumerate(made)]  # futures, as generate's are
        scores = [adv.echo.options(rank=i % 3)(sc) for i, (_, sc) in enumerate(made)]
        one = await adv.concat_groups(gens, scores, pad_id=0, uid_base=40)
        sharded = stages.concat_sharded(g, gens, scores, pad_id=0, uid_base=40, width=3)
        assert sharded.ranks == [0, 1, 2]
        got = await sharded
        assert got.batch_size == one.batch_size == torch.Size([14])
        for key in ("prompt_ids", "prompt_mask", "response_ids", "input_ids", "uid", "scores"):
            assert torch.equal(got[key], one[key]), key
        assert got["uid"].tolist() == [40 + i for i in range(7) for _ in range(2)]
        rows = await adv.echo(sharded)  # a data-parallel consumer of the same world: each rank its own shard
        assert torch.equal(rows["response_ids"], one["response_ids"])
