"""Streaming's step batch built in shards (``stages.concat_sharded``), on real Ray: each training rank builds the
shard of its chunk of groups, and the shards are the batch ``concat_groups`` builds on one rank, row for row
(same order, uids, prompt padding), read in place by a data-parallel call of the same world size."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from asyncrl import RayWorkerGroup, RemoteError
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
                     "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
                     "input_ids": torch.cat([ids, resp], 1),
                     "attention_mask": torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1),
                     "uid": torch.full((2,), 99), "replica": torch.full((2,), g % 4),
                     "version": torch.full((2,), g), "token_versions": torch.tensor([[g, g, g + 1], [g, g, -1]])},
                    batch_size=[2])
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


def test_balance_batch_gives_each_rank_about_the_same_tokens_in_whole_groups():
    """``trainer.balance_batch``: the order whose contiguous chunks (as ``concat_sharded`` cuts them) hold equal
    group counts and about equal tokens; each chunk keeps its groups' order; one rank keeps the order."""
    import random

    from asyncrl.pipelines.rollout.stream_rollout import balanced_order

    assert balanced_order([5, 1, 1, 1, 4, 4], 2) == [0, 1, 2, 3, 4, 5]  # {5,1,1} 7 and {1,4,4} 9: the best split
    assert balanced_order([9, 1, 1, 9], 2) == [0, 1, 2, 3]  # already balanced: kept
    assert balanced_order([9, 9, 1, 1], 2) == [0, 2, 1, 3]  # 10 and 10, not 18 and 2
    assert balanced_order([3, 1, 2], 2) == [0, 1, 2]  # chunks of 2 and 1: {3,1} first, {2}
    assert balanced_order([1, 2, 3], 1) == [0, 1, 2]
    rng = random.Random(0)
    tokens = [int(800 * rng.lognormvariate(0, 0.8)) + 256 for _ in range(256)]  # the 7B profile's tail
    order = balanced_order(tokens, 64)
    assert sorted(order) == list(range(256))
    chunks = [sum(tokens[i] for i in order[r * 4:(r + 1) * 4]) for r in range(64)]
    plain = [sum(tokens[r * 4:(r + 1) * 4]) for r in range(64)]
    mean = sum(tokens) / 64
    best = max(mean, max(tokens) + sum(sorted(tokens)[:3]))  # no split does better: the longest group is whole
    assert max(chunks) < 1.01 * best < 1.3 * best < max(plain)  # within 1 % of the best split here
    assert round(max(chunks) / mean, 2) == 1.33 and round(max(plain) / mean, 2) == 1.76  # 1.76x the mean before


def test_the_reward_returns_each_rows_response_length():
    from asyncrl.roles.scoring.reward import scored

    batch = TensorDict({"response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}, batch_size=[2])
    out = scored(batch, torch.tensor([1.0, 0.0]))
    assert out["scores"].tolist() == [1.0, 0.0] and out["response_length"].tolist() == [2, 1]
    assert set(scored(TensorDict({}, batch_size=[2]), torch.zeros(2)).keys()) == {"scores"}


async def test_the_shards_ledger_facts_ride_in_their_reply_as_ledger_rows_measures_them(ray_cluster):
    """``concat_shard``'s reply carries its rows' ledger facts (``GroupFuture.summary``): what ``ledger_rows`` (a call
    to every rank) gives, without that call; a rank that fails to build its shard raises its error there."""
    async with RayWorkerGroup(AdvantageWorker, world_size=3, ranks_per_process=3, name="adv-facts") as adv:
        g = Groups(rollout=None, reward=None, policy=None, advantage=adv)  # type: ignore[arg-type]
        made = [_group(i, 1 + i % 3) for i in range(7)]
        gens = [adv.echo.options(rank=i % 3)(td) for i, (td, _) in enumerate(made)]
        scores = [adv.echo.options(rank=i % 3)(sc) for i, (_, sc) in enumerate(made)]
        sharded = stages.concat_sharded(g, gens, scores, pad_id=0, uid_base=40, width=3)
        calls = adv.stats.calls
        facts = await sharded.summary()
        assert adv.stats.calls == calls and adv.stats.results_fetched == 0  # no call, nothing fetched
        measured = await adv.ledger_rows(sharded)
        assert set(facts) == {"replica", "lo", "hi", "tokens"}
        for key in facts:
            assert torch.equal(facts[key], measured[key]), key
        assert facts["replica"].tolist() == [i % 4 for i in range(7) for _ in range(2)]
        assert facts["lo"].tolist() == [i for i in range(7) for _ in range(2)]
        assert facts["hi"].tolist() == [x for i in range(7) for x in (i + 1, i)]
        assert facts["tokens"].tolist() == [3, 2] * 7
        # a group without scores in rank 1's chunk (groups 3, 4): that rank fails, and the facts with it
        broken = stages.concat_sharded(g, gens, scores[:3] + [None] + scores[4:], pad_id=0, uid_base=40, width=3)
        with pytest.raises(RemoteError, match="has no scores") as info:
            await broken.summary()
        assert (info.value.method, info.value.rank) == ("concat_shard", 1)
