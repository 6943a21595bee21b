"""Dynamic sampling (``algorithm.filter_groups``): which groups carry signal, which extra prompts a
step draws, and how groups of batches with different prompt widths are joined into one batch."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import load_config
from asyncrl.pipelines.loop.stream_batch import select_groups
from asyncrl.pipelines.rollout.sampling import extra_indices, group_stds, informative_groups


def test_groups_whose_rewards_are_all_equal_carry_no_signal():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    assert informative_groups(scores, 4) == [0]
    assert group_stds(scores, 4).tolist() == [pytest.approx(0.4330127), 0.0, 0.0]


def test_extra_prompts_are_a_pure_function_of_seed_step_and_call():
    a = extra_indices(10, 3, seed=0, step=5, call=1)
    assert a == extra_indices(10, 3, seed=0, step=5, call=1) and len(set(a)) == 3
    assert a != extra_indices(10, 3, seed=0, step=5, call=2) and a != extra_indices(10, 3, seed=1, step=5, call=1)
    assert len(extra_indices(2, 3, seed=0, step=0, call=1)) == 3  # a dataset smaller than a batch repeats rows


def _batch(prompt_width: int, tag: str, groups: int = 2, g: int = 2) -> TensorDict:
    n = groups * g
    ids = torch.arange(n * prompt_width).reshape(n, prompt_width) + 10
    resp = torch.full((n, 3), 7)
    return TensorDict({
        "prompt_ids": ids, "prompt_mask": torch.ones(n, prompt_width, dtype=torch.long),
        "response_ids": resp, "input_ids": torch.cat([ids, resp], 1),
        "attention_mask": torch.ones(n, prompt_width + 3, dtype=torch.long),
        "uid": torch.arange(groups).repeat_interleave(g), "scores": torch.arange(n, dtype=torch.float32),
        "prompt": NonTensorStack(*[f"{tag}{r}" for r in range(n)]),
    }, batch_size=[n])


def test_groups_of_batches_with_different_prompt_widths_join_left_padded_and_renumbered():
    a, b = _batch(2, "a"), _batch(4, "b")
    out = select_groups([a, b], [(0, 1), (1, 0)], 2, pad_id=0, uid_base=6)
    assert out.batch_size == torch.Size([4])
    assert out["prompt_ids"].tolist() == [[0, 0, 14, 15], [0, 0, 16, 17], [10, 11, 12, 13], [14, 15, 16, 17]]
    assert out["prompt_mask"].tolist() == [[0, 0, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2
    assert out["input_ids"][:, -3:].tolist() == [[7, 7, 7]] * 4 and out["input_ids"].shape == (4, 7)
    assert out["attention_mask"].sum(1).tolist() == [5, 5, 7, 7]
    assert out["uid"].tolist() == [6, 6, 7, 7]
    assert out["scores"].tolist() == [2.0, 3.0, 0.0, 1.0]
    assert list(out["prompt"]) == ["a2", "a3", "b0", "b1"]


def test_filter_groups_is_checked():
    with pytest.raises(ConfigError, match="needs algorithm.name=grpo"):
        load_config(None, ["algorithm.name=ppo", "algorithm.group_size=1", "algorithm.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match="max_num_gen_batches must be >= 1, got 0"):
        load_config(None, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0"])


async def test_out_of_generate_calls_the_batch_is_padded_with_the_first_dropped_groups_in_call_order():
    """``fill_batch``'s out-of-budget path (``max_num_gen_batches`` spent before the batch holds
    ``prompts_per_step`` informative groups): the kept groups come first, then the first dropped groups in
    call order fill the rest, renumbered from the step's uid base, and ``sampling/padded_groups`` counts them."""
    from asyncrl import LocalWorkerGroup
    from asyncrl.pipelines.datasets.data import PromptLoader
    from asyncrl.pipelines.rollout.sampling import fill_batch
    from asyncrl.pipelines.loop.stages import AdvantageWorker

    class Tok:
        pad_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    loader = PromptLoader(Tok(), [(f"p{i}" * (i + 1), "a") for i in range(6)], prompts_per_step=2, group_size=2,
                          seed=0, shuffle=False)
    # per generate call, the rewards of its two groups: call 0 (the step's own prompts) has no informative
    # group, call 1 one (its first); with max_calls=2 the step is one group short
    rewards = {0: [0.5, 0.5, 1.0, 1.0], 1: [0.0, 1.0, 0.0, 0.0]}

    def done(value):
        f = asyncio.get_running_loop().create_future()
        f.set_result(value)
        return f

    issued: list[tuple[int, list[str]]] = []

    def generate(prompts: TensorDict, call: int):
        issued.append((call, list(prompts["prompt"])))
        return done(prompts), done(TensorDict({"scores": torch.tensor(rewards[call])}, batch_size=[4]))

    step = 3
    own = loader.batch(step)
    advantage = LocalWorkerGroup(AdvantageWorker, world_size=1)
    await advantage.setup()
    try:
        fut, scores_fut, scores, metrics, picks = await fill_batch(
            step=step, first=(done(own), done(TensorDict({"scores": torch.tensor(rewards[0])}, batch_size=[4])),
                              torch.tensor(rewards[0])),
            loader=loader, group_size=2, max_calls=2, seed=0, generate=generate, echo=advantage.echo)
        out = await fut
        assert (await scores_fut)["scores"].tolist() == scores.tolist()
    finally:
        await advantage.close()
    extra = [loader.pairs[i][0] for i in extra_indices(6, 2, seed=0, step=step, call=1)]
    assert issued == [(1, [extra[0]] * 2 + [extra[1]] * 2)]  # one extra call: the budget of 2 calls is spent
    # call 1's informative group first, then the first dropped group in call order: call 0's first
    assert list(out["prompt"]) == [extra[0]] * 2 + [list(own["prompt"])[0]] * 2
    assert scores.tolist() == [0.0, 1.0, 0.5, 0.5]
    assert out["uid"].tolist() == [6, 6, 7, 7]  # renumbered from step 3's uid base (3 * 2)
    assert picks == [(1, 0), (0, 0)]  # (call, group) of each group, as the journal's filter record keeps them
    assert metrics == {"sampling/gen_batches": 2.0, "sampling/filtered_groups": 3.0,
                       "sampling/padded_groups": 1.0, "sampling/min_group_std": 0.0}


@pytest.mark.parametrize("split", [True, False])
def test_a_stream_group_is_its_slice_of_the_step_batch_and_the_step_is_built_once(monkeypatch, split):
    """Split in the thread that builds the step's batch (``SPLIT_STEP_PROMPTS``) or sliced per group (as before),
    each group's rows are its slice of the step's batch, and the batch is built once however many groups ask."""
    import threading
    from types import SimpleNamespace

    import anyio

    from asyncrl.pipelines.rollout import stream_rollout

    monkeypatch.setattr(stream_rollout, "SPLIT_STEP_PROMPTS", split)

    from asyncrl.pipelines.datasets.data import PromptLoader, make_loader, task_pairs
    from asyncrl.pipelines.job.presets import tiny_test
    from asyncrl.pipelines.rollout.stream_rollout import StreamRollout
    from asyncrl.roles import tiny_tokenizer

    cfg = tiny_test()
    pairs = task_pairs(cfg.data, 0, num_prompts=12)
    loader = make_loader(cfg.data, tiny_tokenizer(), pairs, prompts_per_step=4, group_size=2, seed=0)
    built, threads = [], []
    monkeypatch.setattr(PromptLoader, "batch_of", lambda self, p, step, real=PromptLoader.batch_of: (
        built.append(step), threads.append(threading.current_thread()), real(self, p, step))[2])
    wholes = {step: loader.batch(step) for step in (0, 1, 5)}
    built.clear(), threads.clear()
    stream = SimpleNamespace(_services=SimpleNamespace(loader=lambda: loader, config=cfg), _prompt_batches={},
                             _prompt_widths={}, _prompts_lock=anyio.Lock())

    async def groups(step: int) -> list:
        out: list = [None] * 4

        async def one(slot: int) -> None:
            out[slot] = (await StreamRollout._step_prompts(stream, step))[slot]

        async with anyio.create_task_group() as tg:
            for slot in range(4):
                tg.start_soon(one, slot)
        return out

    for step in (0, 1, 5):
        for slot, part in enumerate(anyio.run(groups, step)):
            want = wholes[step][slot * 2:(slot + 1) * 2]
            assert part["uid"].tolist() == [step * 4 + slot] * 2
            for key in ("prompt_ids", "prompt_mask", "uid"):
                assert part[key].equal(want[key]), key
            assert list(part["prompt"]) == list(want["prompt"]) and list(part["answer"]) == list(want["answer"])
    assert built == [0, 1, 5]  # each step's batch once, however many of its groups asked at once
    assert threading.main_thread() not in threads  # built in a thread, off the controller's loop
    assert stream._prompt_widths == {s: int(w["prompt_ids"].shape[1]) for s, w in wholes.items()}
