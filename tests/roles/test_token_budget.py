"""Token-budget micro-batches (``max_tokens_per_micro_batch``) and activation checkpointing
(``model.gradient_checkpointing``) change how a trained role computes, never what it computes:
the final weights, metrics and log-probs equal those of fixed micro-batches without
checkpointing, to fp32 tolerance."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.pipelines.job.config import ConfigError, JobConfig
from asyncrl.roles import (CriticWorker, OptimConfig, PolicyWorker, ReferenceWorker, RolloutConfig,
                           RolloutCorrectionConfig, RolloutWorker)
from asyncrl.roles._util import row_extents, split_micro_batches, token_budget_micro_batches
from asyncrl.roles.functional import LOSS_AGG_MODES

RESPONSE_LENGTHS = [12, 1, 2, 1, 9, 1, 3, 1, 2, 12, 1, 4]  # a long tail: two rows of 12, most of 1-2


@pytest.fixture(scope="module")
async def long_tail_batch(model_config, prompt_batch):
    """12 rows: prompts of different lengths (real left padding), responses cut to a long tail."""
    b = await RolloutWorker(model_config, RolloutConfig(max_new_tokens=12)).generate(prompt_batch("mixed", n=6,
                                                                                                  repeat=2))
    b = b.clone(False)
    keep = torch.arange(12)[None] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    mask = b["response_mask"] * keep
    b["response_mask"] = mask
    b["attention_mask"] = torch.cat([b["prompt_mask"], mask], 1)
    b.update(PolicyWorker(model_config).compute_log_prob(b))
    g = torch.Generator().manual_seed(0)
    noise = lambda: torch.randn(mask.shape, generator=g) * 0.3 * mask  # noqa: E731
    b["rollout_log_probs"] = b["old_log_probs"] + noise()
    b["ref_log_probs"] = b["old_log_probs"] + noise()
    b["advantages"] = torch.randn(mask.shape, generator=g) * mask
    b["values"] = torch.randn(mask.shape, generator=g) * mask
    b["returns"] = b["values"] + torch.randn(mask.shape, generator=g) * mask
    prompts = b["prompt_mask"].sum(1)
    assert prompts.min() < prompts.max() and mask.sum(1).max() >= 4 * mask.sum(1).median()
    return b


def _longest(batch) -> int:
    return max(a + b for a, b in row_extents(batch["attention_mask"], batch["response_ids"].shape[1]))


def _shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Records ``(rows, columns)`` of every forward of `model` from now on."""
    seen: list[tuple[int, int]] = []
    model.register_forward_pre_hook(lambda m, args, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    return seen


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")


# lr 1e-4: Adam turns a gradient that is zero in exact arithmetic (the key biases': softmax ignores a
# shift shared by all keys) into steps of ~lr x (rounding noise / eps), which any change of summation
# order changes; at 1e-3 that alone reached 1.2e-6 after 12 steps. The weights still move ~1e-3.
OPTIM = OptimConfig(lr=1e-4, micro_batch_size=3, mini_batch_size=6, ppo_epochs=2, kl_coef=0.1,
                    kl_loss_type="low_var_kl", entropy_coef=0.01,
                    rollout_correction=RolloutCorrectionConfig(mode="tis", rollout_is_threshold=1.5))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_token_budget_micro_batches_reach_the_weights_of_fixed_ones(model_config, long_tail_batch, mode):
    budget = 2 * _longest(long_tail_batch)
    fixed = PolicyWorker(model_config, replace(OPTIM, loss_agg_mode=mode))
    packed = PolicyWorker(model_config, replace(OPTIM, loss_agg_mode=mode, max_tokens_per_micro_batch=budget))
    shapes = _shapes(packed.model)
    for _ in range(3):
        m1, m2 = fixed.update(long_tail_batch), packed.update(long_tail_batch)
        for k, v in m1.items():
            assert m2[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    _same_weights(fixed.model, packed.model)
    moved = fixed.model.state_dict()["lm_head.weight"] - PolicyWorker(model_config).model.state_dict()["lm_head.weight"]
    assert moved.abs().max() > 5e-4  # it trained: the tolerance is a small fraction of the steps taken
    assert all(rows * cols <= budget for rows, cols in shapes)
    assert len({cols for _, cols in shapes}) > 1  # micro-batches are cut to their own width
    full = 3 * 2 * long_tail_batch["input_ids"].numel()  # 3 updates x 2 epochs, every row as wide as the batch
    assert sum(rows * cols for rows, cols in shapes) < 0.6 * full


def test_log_probs_values_of_a_token_budget_come_back_in_the_batch_order_and_width(model_config, long_tail_batch):
    budget = _longest(long_tail_batch) + 3
    b = long_tail_batch.exclude("old_log_probs", "entropy")
    lp1 = PolicyWorker(model_config, OPTIM).compute_log_prob(b)
    lp2 = PolicyWorker(model_config, replace(OPTIM, max_tokens_per_micro_batch=budget)).compute_log_prob(b)
    torch.testing.assert_close(lp2.to_dict(), lp1.to_dict(), rtol=1e-6, atol=1e-6)  # entropies ~6
    ref1 = ReferenceWorker(model_config, micro_batch_size=3).compute_ref_log_prob(b)
    ref2 = ReferenceWorker(model_config, max_tokens_per_micro_batch=budget).compute_ref_log_prob(b)
    torch.testing.assert_close(ref2["ref_log_probs"], ref1["ref_log_probs"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ref1["ref_log_probs"], lp1["old_log_probs"], rtol=0, atol=1e-6)
    critic = OptimConfig(lr=1e-3, micro_batch_size=3, mini_batch_size=6, loss_agg_mode="seq-mean-token-sum-norm")
    c1 = CriticWorker(model_config, critic)
    c2 = CriticWorker(model_config, replace(critic, max_tokens_per_micro_batch=budget))
    for _ in range(2):
        c1.update(long_tail_batch), c2.update(long_tail_batch)
    _same_weights(c1.model, c2.model)
    torch.testing.assert_close(c2.compute_values(b)["values"], c1.compute_values(b)["values"], rtol=0, atol=1e-6)


def test_a_budget_below_the_longest_row_is_an_error_that_names_the_key_and_the_row(model_config, long_tail_batch):
    longest = _longest(long_tail_batch)
    policy = PolicyWorker(model_config, replace(OPTIM, max_tokens_per_micro_batch=longest - 1))
    with pytest.raises(ValueError, match=rf"actor\.max_tokens_per_micro_batch={longest - 1} .*longest row.*"
                                         rf"\({longest} tokens"):
        policy.update(long_tail_batch)
    assert policy.version == 0
    _same_weights(policy.model, PolicyWorker(model_config).model)  # refused before any mini-batch stepped
    late = long_tail_batch[torch.tensor([1, 0, *range(2, 12)])]  # the longest row now in the 2nd mini-batch
    with pytest.raises(ValueError, match=r"actor\.max_tokens_per_micro_batch"):
        policy.update(late)
    _same_weights(policy.model, PolicyWorker(model_config).model)
    critic = CriticWorker(model_config, OptimConfig(max_tokens_per_micro_batch=longest - 1))
    with pytest.raises(ValueError, match=r"critic\.max_tokens_per_micro_batch"):
        critic.compute_values(long_tail_batch)
    with pytest.raises(ValueError, match=r"critic\.max_tokens_per_micro_batch"):
        critic.update(long_tail_batch)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 1"):
        OptimConfig(max_tokens_per_micro_batch=0).validate()


def test_job_config_refuses_a_budget_below_prompt_plus_response():
    cfg = JobConfig()
    cfg.rollout.max_new_tokens, cfg.data.max_prompt_length = 64, 100
    cfg.actor.max_tokens_per_micro_batch = 163
    with pytest.raises(ConfigError, match=r"actor\.max_tokens_per_micro_batch=163 .* = 164 tokens"):
        cfg.validate()
    cfg.actor.max_tokens_per_micro_batch = 164
    cfg.validate()
    cfg.data.max_prompt_length = None
    cfg.actor.max_tokens_per_micro_batch = 64  # a one-token prompt and a full response do not fit
    with pytest.raises(ConfigError, match="one-token prompt"):
        cfg.validate()


def on(m: torch.nn.Module) -> bool:
    """Whether transformers' activation checkpointing is on (renamed from gradient checkpointing in 5.x)."""
    if hasattr(type(m), "is_activation_checkpointing"):
        return m.is_activation_checkpointing
    return m.is_gradient_checkpointing


def test_gradient_checkpointing_is_on_and_gives_the_same_weights(model_config, long_tail_batch):
    plain = PolicyWorker(model_config, OPTIM)
    ckpt_config = replace(model_config, gradient_checkpointing=True)
    ckpt = PolicyWorker(ckpt_config, OPTIM)
    assert on(ckpt.model) and not on(plain.model)
    calls = []
    ckpt.model.model.layers[0].register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    for _ in range(2):
        plain.update(long_tail_batch), ckpt.update(long_tail_batch)
    _same_weights(plain.model, ckpt.model)
    assert len(calls) == 2 * 2 * 2 * 2  # 2 updates x 2 epochs x 2 mini-batches x (forward + recomputation)
    critic = CriticWorker(ckpt_config)
    assert on(critic.model.backbone)


# --------------------------------------------------------------------------- the grouping itself

lengths = st.lists(st.one_of(st.integers(1, 40), st.tuples(st.integers(0, 20), st.integers(0, 20))), max_size=30)


def _width(rows, group) -> int:
    pairs = [(x, 0) if isinstance(x, int) else x for x in (rows[i] for i in group)]
    return max(a for a, _ in pairs) + max(b for _, b in pairs)


@settings(max_examples=200, deadline=None)
@given(lengths, st.integers(0, 60), st.integers(1, 12))
def test_every_row_lands_in_one_micro_batch_within_the_budget_and_the_count_is_agreed(rows, slack, min_count):
    budget = max([_width(rows, [i]) for i in range(len(rows))] + [1]) + slack
    own = token_budget_micro_batches(rows, budget)
    groups = token_budget_micro_batches(rows, budget, min_count)
    assert len(groups) == max(min_count, len(own))  # exactly the count the ranks agreed on
    assert sorted(i for g in groups for i in g) == list(range(len(rows)))
    assert all(len(g) * _width(rows, g) <= budget for g in groups if g)
    nonempty = [bool(g) for g in groups]
    assert nonempty == sorted(nonempty, reverse=True) and sum(nonempty) == min(len(groups), len(rows))


def _partitions(items: list[int], k: int):
    if not items:
        if k == 0:
            yield []
        return
    if k == 0:
        return
    first, rest = items[0], items[1:]
    for sub in _partitions(rest, k - 1):
        yield [[first], *sub]
    for sub in _partitions(rest, k):
        for j in range(len(sub)):
            yield [*sub[:j], [first, *sub[j]], *sub[j + 1:]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=7), st.integers(0, 40), st.integers(1, 7))
def test_the_grouping_is_as_few_and_as_little_padded_as_any_partition(rows, slack, min_count):
    budget = max(rows) + slack
    fits = lambda p: all(len(g) * max(rows[i] for i in g) <= budget for g in p)  # noqa: E731
    padded = lambda p: sum(len(g) * max(rows[i] for i in g) for g in p if g)  # noqa: E731
    fewest = next(k for k in itertools.count(1) if any(fits(p) for p in _partitions(list(range(len(rows))), k)))
    assert len(token_budget_micro_batches(rows, budget)) == fewest
    k = min(max(min_count, fewest), len(rows))
    best = min(padded(p) for p in _partitions(list(range(len(rows))), k) if fits(p))
    assert padded(token_budget_micro_batches(rows, budget, min_count)) == best


def test_the_grouping_evens_out_equally_padded_cuts_and_refuses_a_row_over_the_budget():
    assert token_budget_micro_batches([20] * 8, 80, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert token_budget_micro_batches([(3, 5), (5, 3), (2, 2)], 16) == [[0], [1, 2]]  # 5 + 5 wide would be 20
    with pytest.raises(ValueError, match=r"budget of 9 tokens is smaller than the longest row \(10 tokens\)"):
        token_budget_micro_batches([3, 10], 9)


class _Ranks:
    """A DataParallel stand-in whose other rank needs `count` micro-batches."""

    def __init__(self, count: int) -> None:
        self.count = count

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op == "max"
        return torch.maximum(t, torch.tensor([self.count, 0]))


def test_a_rank_with_fewer_rows_than_the_agreed_count_runs_masked_stand_ins(long_tail_batch):
    b = long_tail_batch[:3]
    parts = split_micro_batches(b, 8, 10_000, _Ranks(5), "actor.max_tokens_per_micro_batch")
    assert len(parts) == 5
    assert sorted(int(r) for rows, _ in parts for r in rows) == [0, 1, 2]
    for rows, mb in parts[3:]:
        assert rows.numel() == 0 and mb.batch_size[0] == 1 and not mb["response_mask"].any()
    for rows, mb in parts[:3]:  # cut columns are padding only
        torch.testing.assert_close(mb["attention_mask"].sum(1), b["attention_mask"][rows].sum(1))
        torch.testing.assert_close(mb["advantages"].sum(1), b["advantages"][rows].sum(1))
