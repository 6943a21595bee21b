"""Role workers constructed in-process: engines, log-prob equality, errors, updates, sync policies."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from asyncrl.roles import (
    CriticWorker,
    ModelConfig,
    ModelNotFoundError,
    OptimConfig,
    PolicyWorker,
    PromptTooLongError,
    ReferenceWorker,
    RewardConfig,
    RewardFnError,
    RewardWorker,
    RolloutConfig,
    RolloutWorker,
    SamplingParams,
    StaleWeightsError,
    TokenizerNotFoundError,
    UnknownNameError,
    WeightSyncError,
    load_model,
    load_tokenizer,
    make_engine,
    register_engine,
    register_reward_fn,
    save_model_dir,
    tiny_tokenizer,
)
from asyncrl.roles.engines import Completion
from asyncrl.roles.functional import grpo_advantages
from asyncrl.roles.modeling.models import qwen2_tokenizer_dir


# ---------------------------------------------------------------- models and tokenizers


def test_tiny_tokenizer_is_deterministic_and_has_pad_and_eos():
    tok = tiny_tokenizer()
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token, tok.eos_token_id) == ("<|pad|>", 0, "<|endoftext|>", 1)
    assert len(tok) == 384
    assert tok(" cat")["input_ids"] == [316]  # pins the vocabulary: a change means a new tokenizer
    assert tok.decode(tok("any text, even ünïcode")["input_ids"]) == "any text, even ünïcode"


def test_qwen2_tokenizer_from_the_wheel():
    tok = load_tokenizer("qwen2")
    assert os.path.isdir(qwen2_tokenizer_dir())
    assert len(tok) == 151669 and tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"


def test_tiny_model_is_built_from_config_with_the_tokenizer_vocab():
    for arch in ("qwen2", "llama"):
        model, tok = load_model(ModelConfig(arch=arch, seed=3))
        assert model.config.vocab_size == len(tok) and model.config.num_hidden_layers == 2
        assert model.config.hidden_size == 64 and next(model.parameters()).dtype == torch.float32
    a, _ = load_model(ModelConfig(seed=3))
    b, _ = load_model(ModelConfig(seed=3))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_missing_model_dir_and_missing_tokenizer_are_typed_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(ModelConfig(path=str(tmp_path / "nope")))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(ModelConfig(path=str(tmp_path)))
    with pytest.raises(TokenizerNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
    model, tok = load_model(ModelConfig())
    model.save_pretrained(str(tmp_path / "m"))  # a model directory without tokenizer files
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer files"):
        load_model(ModelConfig(path=str(tmp_path / "m")))


def test_model_directory_round_trip(tmp_path):
    model, tok = load_model(ModelConfig(seed=5))
    path = save_model_dir(model, tok, str(tmp_path / "m"))
    m2, t2 = load_model(ModelConfig(path=path))
    assert len(t2) == len(tok) and t2.eos_token_id == tok.eos_token_id
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))


def test_unknown_engine_is_a_typed_error():
    model, tok = load_model(ModelConfig())
    with pytest.raises(UnknownNameError, match="no generation engine named 'nope'"):
        make_engine("nope", model=model, tokenizer=tok, model_dir=None)


# ---------------------------------------------------------------- HF engine


async def test_hf_engine_log_probs_equal_policy_recomputed_log_probs(model_config, prompt_batch):
    """Same weights and tokens: engine log-probs == PolicyWorker.compute_log_prob within 1e-5 (fp32)."""
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=12))
    policy = PolicyWorker(model_config, OptimConfig(micro_batch_size=3))
    batch = prompt_batch("mixed", n=5, repeat=2)
    assert (batch["prompt_mask"] == 0).any()
    out = await rollout.generate(batch)
    lp = policy.compute_log_prob(out)
    mask = out["response_mask"].bool()
    assert (lp["old_log_probs"][~mask] == 0).all() and (out["rollout_log_probs"][~mask] == 0).all()
    diff = (lp["old_log_probs"] - out["rollout_log_probs"]).abs().max().item()
    assert diff < 1e-5
    assert lp["entropy"][mask].min() > 0


async def test_hf_engine_respects_eos_and_max_new_tokens(model_config):
    model, tok = load_model(model_config)
    eng = make_engine("hf", model=model, tokenizer=tok, model_dir=None)
    prompt = [tok(" cat")["input_ids"]]
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    (first,) = await eng.generate(prompt, greedy)
    assert first.finish_reason == "length" and len(first.response_ids) == 5 == len(first.log_probs)
    with torch.no_grad():  # make EOS the greedy choice after this prompt
        model.lm_head.weight[tok.eos_token_id] = 10 * model.lm_head.weight[first.response_ids[0]]
    (stopped,) = await eng.generate(prompt, greedy)
    assert stopped.finish_reason == "stop" and stopped.response_ids == [tok.eos_token_id]


async def test_hf_engine_same_seed_same_samples_and_stream_yields_every_index(model_config):
    model, tok = load_model(model_config)
    eng = make_engine("hf", model=model, tokenizer=tok, model_dir=None)
    prompts = [tok(w)["input_ids"] for w in ("say cat", "write digits:", "echo")]
    p = SamplingParams(max_new_tokens=6, seed=11, top_k=50, top_p=0.9)
    a = await eng.generate(prompts, p)
    b = await eng.generate(prompts, p)
    assert [c.response_ids for c in a] == [c.response_ids for c in b]
    seen = {i: c.response_ids async for i, c in eng.stream(prompts, p)}
    assert seen == {i: c.response_ids for i, c in enumerate(a)}


# ---------------------------------------------------------------- rollout


async def test_rollout_fills_fields_and_tags_version(model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=7))
    batch = prompt_batch(n=3, repeat=2)
    out = await rollout.generate(batch)
    B, P = batch["prompt_ids"].shape
    assert out.batch_size[0] == B and out["response_ids"].shape == (B, 7)
    assert torch.equal(out["input_ids"], torch.cat([batch["prompt_ids"], out["response_ids"]], 1))
    assert torch.equal(out["attention_mask"], torch.cat([batch["prompt_mask"], out["response_mask"]], 1))
    assert out["version"].tolist() == [0] * B and out["answer"] == batch["answer"]
    # same prompts, same weights version -> same samples (seed derived from content, not call order)
    again = await rollout.generate(batch)
    assert torch.equal(again["response_ids"], out["response_ids"])
    rows = [row async for row in rollout.stream_generate(batch)]
    assert sorted(int(r["index"]) for r in rows) == list(range(B))


async def test_too_long_prompt_is_refused_never_truncated(prompt_batch):
    rollout = RolloutWorker(ModelConfig(max_position_embeddings=16), RolloutConfig(max_new_tokens=8))
    batch = prompt_batch("echo_word", n=2)
    batch["prompt_ids"] = torch.cat([batch["prompt_ids"]] * 5, 1)
    batch["prompt_mask"] = torch.cat([batch["prompt_mask"]] * 5, 1)
    with pytest.raises(PromptTooLongError, match="exceeds the model's context of 16"):
        await rollout.generate(batch)


async def test_rollout_update_refuses_stale_and_malformed_weights(model_config):
    rollout = RolloutWorker(model_config)
    policy = PolicyWorker(model_config)
    before = rollout.weights_checksum()
    with pytest.raises(StaleWeightsError, match="version 0"):
        await rollout.update_weights(policy.export_weights())  # version 0 == current
    with pytest.raises(WeightSyncError, match="missing names"):
        await rollout.update_weights({"lm_head.weight": torch.zeros(1)}, 1)
    sd = policy.export_weights()[1]
    sd["lm_head.weight"] = sd["lm_head.weight"][:, :3]
    with pytest.raises(WeightSyncError, match="lm_head.weight"):
        await rollout.update_weights(sd, 1)
    assert rollout.version == 0 and rollout.weights_checksum() == before  # nothing changed
    result = await rollout.update_weights(policy.export_weights()[1], 5)
    assert result["version"] == 5 and rollout.version == 5
    with pytest.raises(StaleWeightsError, match="already has version 5"):
        await rollout.update_weights(policy.export_weights()[1], 4)


# ---------------------------------------------------------------- sync policies (wait / abort)


class GatedEngine:
    """An engine that finishes prompt 0 at once and holds the others until released."""

    def __init__(self, *, model, tokenizer, model_dir=None):
        from asyncrl.roles.engines.hf import HFEngine

        self.inner = HFEngine(model=model, tokenizer=tokenizer)
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.log: list[str] = []

    async def generate(self, prompts, params):
        return [c async for _, c in self.stream(prompts, params)]

    async def stream(self, prompts, params):
        self.log.append(f"stream{len(prompts)}")
        self.started.set()
        try:
            yield 0, Completion([5], [-1.0], "length")
            await self.release.wait()
            for i in range(1, len(prompts)):
                yield i, Completion([6], [-2.0], "length")
            self.log.append("done")
        except (asyncio.CancelledError, GeneratorExit):
            self.log.append("aborted")
            raise

    def load_weights(self, named):
        self.log.append("load")
        self.inner.load_weights(named)

    def weights_checksum(self):
        return self.inner.weights_checksum()

    def close(self):
        pass


register_engine("gated_test", replace=True)(GatedEngine)


async def test_sync_policy_wait_lets_in_flight_generation_finish_under_old_weights(model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(engine="gated_test", sync_policy="wait", max_new_tokens=2))
    policy = PolicyWorker(model_config)
    eng: GatedEngine = rollout.engine  # type: ignore[assignment]
    gen = asyncio.ensure_future(rollout.generate(prompt_batch(n=3)))
    await eng.started.wait()
    upd = asyncio.ensure_future(rollout.update_weights(policy.export_weights()[1], 1))
    eng.release.set()
    out, result = await asyncio.gather(gen, upd)
    assert eng.log == ["stream3", "done", "load"]  # loaded only after generation finished
    assert out["version"].tolist() == [0, 0, 0] and result == {
        "version": 1, "num_tensors": len(policy.export_weights()[1]), "waited": 1, "aborted": 0,
        "checksums_verified": False}
    later = await rollout.generate(prompt_batch(n=2))
    assert later["version"].tolist() == [1, 1]


async def test_sync_policy_abort_resubmits_unfinished_rows_under_new_weights(model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(engine="gated_test", sync_policy="abort", max_new_tokens=2,
                                                       verify_checksums=True))
    policy = PolicyWorker(model_config)
    eng: GatedEngine = rollout.engine  # type: ignore[assignment]
    gen = asyncio.ensure_future(rollout.generate(prompt_batch(n=3)))
    await eng.started.wait()
    result = await rollout.update_weights(policy.export_weights()[1], 1)  # does not wait for the engine
    assert result["aborted"] == 2 and result["checksums_verified"] is True
    eng.release.set()
    out = await gen
    # row 0 finished under version 0; rows 1-2 were aborted and regenerated entirely under version 1
    assert eng.log == ["stream3", "aborted", "load", "stream2", "done"]
    assert out["version"].tolist() == [0, 1, 1]
    assert out["response_ids"][:, 0].tolist() == [5, 5, 6]  # the resubmitted call's own index 0 and 1


# ---------------------------------------------------------------- policy, reference, critic


def _trained_batch(rollout_out, policy, reference, critic, reward):
    b = rollout_out.clone(False)
    b.update(reward.compute_reward(b))
    b.update(policy.compute_log_prob(b))
    b.update(reference.compute_ref_log_prob(b))
    b.update(critic.compute_values(b))
    b["advantages"] = grpo_advantages(b["scores"], b["uid"], b["response_mask"])
    b["returns"] = b["advantages"] + b["values"]
    return b


async def test_policy_update_is_deterministic_versioned_and_checkpointable(model_config, tmp_path, prompt_batch):
    optim = OptimConfig(micro_batch_size=3, mini_batch_size=4, kl_coef=0.1, entropy_coef=0.01, lr=1e-2)
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=6))
    p1, p2 = PolicyWorker(model_config, optim), PolicyWorker(model_config, optim)
    ref, critic, reward = ReferenceWorker(model_config), CriticWorker(model_config), RewardWorker()
    batch = _trained_batch(await rollout.generate(prompt_batch(n=4, repeat=2)), p1, ref, critic, reward)
    assert torch.equal(batch["ref_log_probs"], batch["old_log_probs"])  # same initial weights
    m1 = p1.update(batch)
    assert set(m1) >= {"pg_loss", "kl", "entropy", "clip_frac", "clip_frac_lower", "ppo_kl", "grad_norm", "lr", "version"}
    assert all(isinstance(v, float) for v in m1.values()) and m1["version"] == 1.0
    m2 = p2.update(batch)
    assert m1 == m2 and p1.weights_checksum() == p2.weights_checksum()  # same seeds -> identical weights
    assert p1.weights_checksum() != ref.weights_checksum()
    version, sd = p1.export_weights()
    assert version == 1 and p1.get_version() == 1
    p1.save(str(tmp_path / "ckpt"))
    p1.update(batch)
    p3 = PolicyWorker(model_config, optim)
    assert p3.load(str(tmp_path / "ckpt")) == 1 and p3.weights_checksum() == p2.weights_checksum()
    p2.update(batch), p3.update(batch)  # optimizer state restored too: the next step is identical
    assert p3.weights_checksum() == p2.weights_checksum() == p1.weights_checksum()
    cm = critic.update(batch)
    assert cm["version"] == 1.0 and cm["vf_loss"] > 0
    del batch["ref_log_probs"]
    with pytest.raises(KeyError, match="ref_log_probs"):
        p1.update(batch)


# ---------------------------------------------------------------- reward


async def test_reward_functions_and_their_errors(model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=4))
    out = await rollout.generate(prompt_batch(n=4))
    worker = RewardWorker(RewardConfig(fn="char_class"))
    x = worker.reward_input(out)
    expected = [sum(1 for t in toks if t.strip() and set(t.lstrip(" ")) <= set("0123456789" if a == "digits" else "aeiou"))
                / 4 for toks, a in zip(x.response_tokens, x.answers)]
    assert worker.compute_reward(out)["scores"].tolist() == pytest.approx(expected)

    @register_reward_fn("test_raises", replace=True)
    def raises(x):
        raise ZeroDivisionError("boom")

    @register_reward_fn("test_wrong_shape", replace=True)
    def wrong_shape(x):
        return [1.0]

    @register_reward_fn("test_not_numbers", replace=True)
    def not_numbers(x):
        return ["a"] * len(x.responses)

    with pytest.raises(RewardFnError, match="'test_raises' raised ZeroDivisionError: boom"):
        RewardWorker(RewardConfig(fn="test_raises")).compute_reward(out)
    with pytest.raises(RewardFnError, match=r"'test_wrong_shape' returned shape \(1,\) for a batch of 4 rows"):
        RewardWorker(RewardConfig(fn="test_wrong_shape")).compute_reward(out)
    with pytest.raises(RewardFnError, match="'test_not_numbers' must return a sequence of 4 floats"):
        RewardWorker(RewardConfig(fn="test_not_numbers")).compute_reward(out)
    with pytest.raises(UnknownNameError, match="no reward function named 'nope'"):
        RewardWorker(RewardConfig(fn="nope"))


def test_char_class_scores_by_hand():
    from asyncrl.roles.scoring.reward import RewardInput, char_class

    x = RewardInput(responses=[], prompts=None, answers=["digits", "vowels"], response_ids=[],
                    response_tokens=[["12", " 3", "a", "<|endoftext|>"], ["a", " io", "b", "7"]], max_new_tokens=4)
    assert char_class(x) == [0.5, 0.5]


async def test_reward_model_variant_scores_each_row(model_config, prompt_batch):
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=4))
    out = await rollout.generate(prompt_batch(n=3))
    worker = RewardWorker(RewardConfig(model=ModelConfig(seed=1)))
    scores = worker.compute_reward(out)["scores"]
    assert scores.shape == (3,) and torch.isfinite(scores).all()
    single = worker.compute_reward(out[1:2])["scores"]  # a row's score does not depend on its batch
    assert single.item() == pytest.approx(scores[1].item(), abs=1e-5)


async def test_char_class_is_learnable_with_grpo(prompt_batch):
    """The toy task of the main job: GRPO lifts the mean reward from < 0.3 to > 0.8 (steps, not time)."""
    mc = ModelConfig(seed=0)
    rollout = RolloutWorker(mc, RolloutConfig(max_new_tokens=8))
    policy = PolicyWorker(mc, OptimConfig(lr=1e-2, micro_batch_size=64))
    reward = RewardWorker(RewardConfig(fn="char_class"))
    means = []
    for step in range(40):
        out = await rollout.generate(prompt_batch("char_class", n=8, repeat=8, seed=step))
        out.update(reward.compute_reward(out))
        out.update(policy.compute_log_prob(out))
        out["advantages"] = grpo_advantages(out["scores"], out["uid"], out["response_mask"])
        policy.update(out)
        await rollout.update_weights(policy.export_weights())
        means.append(out["scores"].mean().item())
        if means[-1] > 0.8:
            break
    assert means[0] < 0.3 and means[-1] > 0.8, means


async def test_verify_mode_rolls_back_on_checksum_mismatch(model_config):
    rollout = RolloutWorker(model_config, RolloutConfig(verify_checksums=True))
    policy = PolicyWorker(model_config, OptimConfig(lr=0.1))
    policy.model.lm_head.weight.data.add_(1.0)  # different weights than version 0
    before = rollout.weights_checksum()
    good = policy.weights_checksum()
    wrong = dict(good, **{"lm_head.weight": "0" * 16})
    with pytest.raises(WeightSyncError, match="checksum mismatch .* rolled back to version 0"):
        await rollout.update_weights(policy.export_weights()[1], 1, expected_checksums=wrong)
    assert rollout.version == 0 and rollout.weights_checksum() == before
    result = await rollout.update_weights(policy.export_weights()[1], 1, expected_checksums=good)
    assert result["checksums_verified"] and rollout.weights_checksum() == good
