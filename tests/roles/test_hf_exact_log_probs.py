"""HFEngine(exact_log_probs=True): the sampled tokens are unchanged and their log-probs are the
policy's full-pass recomputation (the KV-cached decode's differ by depth-dependent fp32 rounding)."""

from __future__ import annotations

import pytest

from asyncrl.roles import OptimConfig, PolicyWorker, RolloutConfig, RolloutWorker, SamplingParams, load_model, make_engine


async def test_exact_log_probs_keep_the_samples_and_equal_the_policy(model_config, prompt_batch):
    batch = prompt_batch("mixed", n=5, repeat=2)
    cached = RolloutWorker(model_config, RolloutConfig(max_new_tokens=10, seed=4))
    exact = RolloutWorker(model_config, RolloutConfig(max_new_tokens=10, seed=4,
                                                      engine_kwargs={"exact_log_probs": True}))
    policy = PolicyWorker(model_config, OptimConfig(micro_batch_size=4))
    a, b = await cached.generate(batch), await exact.generate(batch)
    assert a["response_ids"].tolist() == b["response_ids"].tolist()  # same samples, only the log-probs differ
    mask = b["response_mask"].bool()
    assert mask.sum() > 20 and (b["rollout_log_probs"][~mask] == 0).all()
    recomputed = policy.compute_log_prob(b)["old_log_probs"]
    assert (recomputed - b["rollout_log_probs"])[mask].abs().max().item() < 1e-6
    assert (a["rollout_log_probs"] - b["rollout_log_probs"])[mask].abs().max().item() < 1e-5


async def test_exact_log_probs_refuse_filtered_sampling(model_config):
    model, tok = load_model(model_config)
    eng = make_engine("hf", model=model, tokenizer=tok, model_dir=None, exact_log_probs=True)
    with pytest.raises(ValueError, match="cannot be used with top-k/top-p"):
        await eng.generate([tok(" cat")["input_ids"]], SamplingParams(max_new_tokens=2, top_k=5))
    (greedy,) = await eng.generate([tok(" cat")["input_ids"]], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(greedy.log_probs) == 3 and all(lp <= 0 for lp in greedy.log_probs)
