"""LoRA on the policy (``actor.lora``, through peft): only the adapters train, the reference is the base model with
the adapters disabled, the weights leave merged under the base names, checkpoints resume, and 2 ddp ranks train
like one."""

from __future__ import annotations

import copy
import sys
from dataclasses import replace

import pytest
import torch

import asyncrl
from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import load_config
from asyncrl.roles import CheckpointFormatError, ModelConfig, OptimConfig, PolicyWorker
from asyncrl.roles.modeling.lora import LoraConfig
from asyncrl.roles.modeling.models import load_model, state_dict_checksums
from asyncrl.roles.training.policy import _log_probs

LORA = OptimConfig(lr=1e-2, micro_batch_size=3, max_grad_norm=1.0, kl_coef=0.1, lora=LoraConfig(rank=4, alpha=8))
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _base_log_probs(model_config, batch):
    base, _ = load_model(model_config)
    return _log_probs(base, batch, 8, 1.0, "lp", False, "base")["lp"]


@pytest.fixture(scope="module")
def trained(model_config, uneven_batch):
    """A LoRA policy after two updates, with its state before them."""
    w = PolicyWorker(model_config, LORA)
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    for _ in range(2):
        w.update(uneven_batch)
    return w, before


def test_only_the_adapters_train_and_the_base_stays_bit_identical(trained):
    w, before = trained
    trainable = [n for n, p in w.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == set(TARGETS)  # every linear layer of the decoder, no LM head
    assert sum(len(s) for s in w.optimizer.state.values()) == 3 * len(trainable)  # step, exp_avg, exp_avg_sq each
    after = w.model.state_dict()
    assert after.keys() == before.keys()
    for k in after:
        assert torch.equal(after[k], before[k]) != ("lora_" in k), k  # every adapter moved, every base weight did not


def test_reference_log_probs_with_the_adapter_disabled_are_the_base_models_exactly(trained, model_config, uneven_batch):
    w, _ = trained
    base = _base_log_probs(model_config, uneven_batch)
    assert torch.equal(w.compute_ref_log_prob(uneven_batch)["ref_log_probs"], base)
    assert not torch.equal(w.compute_log_prob(uneven_batch)["old_log_probs"], base)  # the adapters are back on


def test_a_policy_without_lora_has_no_reference_to_give(model_config, uneven_batch):
    with pytest.raises(RuntimeError, match="without LoRA .* use a ReferenceWorker"):
        PolicyWorker(model_config).compute_ref_log_prob(uneven_batch)


def test_the_exported_weights_are_merged_under_the_base_names_without_touching_the_model(trained, model_config):
    """W + scale * B @ A by hand, and peft's merge_and_unload on a copy: both bit for bit; the live model keeps its
    unmerged base (peft's ``merged`` flag stays off) and the checksums are the exported tensors'."""
    w, before = trained
    version, exported = w.export_weights()
    assert version == 2
    base_names = set(load_model(model_config)[0].state_dict())
    assert set(exported) == base_names
    peft_base = w.model.get_base_model()
    for name in TARGETS:
        layer = getattr(peft_base.model.layers[0].self_attn if name[0] in "qkvo" else peft_base.model.layers[0].mlp,
                        name)
        W, A, B = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert layer.scaling["default"] == 8 / 4 and not layer.merged
        assert torch.equal(exported[f"model.layers.0.{'self_attn' if name[0] in 'qkvo' else 'mlp'}.{name}.weight"],
                           W + 2.0 * (B @ A))
    merged = copy.deepcopy(w.model).merge_and_unload().state_dict()
    assert merged.keys() == exported.keys()
    for k in merged:
        assert torch.equal(exported[k], merged[k]), k
    assert w.weights_checksum() == state_dict_checksums(exported.items())
    for k, v in w.model.state_dict().items():  # nothing was merged into the trained model
        assert torch.equal(v, before[k]) or "lora_" in k


def test_a_saved_adapter_and_optimizer_resume_bit_for_bit(model_config, uneven_batch, tmp_path):
    """Saved after one update, resumed into a fresh worker (a base rebuilt from the config), one more update: the
    same weights as the worker that went on (so the optimizer's moments came back too)."""
    w = PolicyWorker(model_config, LORA)
    w.update(uneven_batch)
    w.save(str(tmp_path))
    assert {p.name for p in tmp_path.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "meta.json",
                                                   "model.safetensors", "optimizer.pt"}
    resumed = PolicyWorker(model_config, LORA)
    assert resumed.load(str(tmp_path)) == 1
    assert resumed.weights_checksum() == w.weights_checksum()
    w.update(uneven_batch)
    resumed.update(uneven_batch)
    a, b = resumed.model.state_dict(), w.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    with pytest.raises(CheckpointFormatError, match="lora.rank=4 but this PolicyWorker runs lora.rank=0"):
        PolicyWorker(model_config).load(str(tmp_path))
    other = replace(model_config, seed=model_config.seed + 1)
    with pytest.raises(CheckpointFormatError, match="adapter trained on other base weights"):
        PolicyWorker(other, LORA).load(str(tmp_path))


def test_target_modules_that_match_nothing_are_refused_listing_the_linear_layers(model_config):
    with pytest.raises(ValueError, match=r"\['qkv'\] match no linear layer of Qwen2ForCausalLM; its linear layers are "
                                         r"\['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', "
                                         r"'v_proj'\]"):
        PolicyWorker(model_config, replace(LORA, lora=LoraConfig(rank=2, target_modules=["q_proj", "qkv"])))
    with pytest.raises(ConfigError, match=r"actor.lora.target_modules: \['lm_head'\] match no linear layer"):
        load_config(None, ["actor.lora.rank=2", "actor.lora.target_modules=[lm_head]"])
    with pytest.raises(ConfigError, match="actor.lora.alpha must be > 0, got 0.0"):
        load_config(None, ["actor.lora.rank=2", "actor.lora.alpha=0"])
    with pytest.raises(ConfigError, match=r"weight_sync=adapter sends only the LoRA factors, which needs "
                                          r"actor.lora.rank > 0 \(a LoRA policy\)"):
        load_config(None, ["trainer.weight_sync=adapter"])
    with pytest.raises(ConfigError, match="which needs rollout.sleep_level=0"):
        load_config(None, ["trainer.weight_sync=adapter", "actor.lora.rank=2", "trainer.colocated=true",
                           "rollout.sleep_level=1"])
    with pytest.raises(ConfigError, match="critic.lora.rank=2: LoRA adapts the policy only"):
        load_config(None, ["algorithm.name=ppo", "algorithm.group_size=1", "critic.lora.rank=2"])
    cfg = load_config(None, ["actor.lora.rank=2", "actor.lora.target_modules=[q_proj,v_proj]", "actor.kl_coef=0.1"])
    from asyncrl.pipelines.run.build import role_specs

    assert sorted(role_specs(cfg, None)[1]) == ["advantage", "policy"]  # no ReferenceWorker


def test_lora_without_peft_is_a_config_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # find_spec answers None: the package is not installed
    with pytest.raises(ConfigError, match=r"^actor.lora.rank=8 needs the peft package: pip install 'asyncrl\[lora\]' "
                                          r"\(or bash scripts/setup.sh lora\), or set actor.lora.rank=0$"):
        load_config(None, ["actor.lora.rank=8"])
    assert load_config(None, ["actor.lora.rank=0"]).actor.lora.rank == 0


CLIPPED = replace(LORA, max_grad_norm=0.05)  # a bound below the gradient's norm: clipping is live


def _close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=lambda m: f"{what}, {k}: {m}")


def _factors(delta) -> dict:
    return {f"{k}/{i}": t for k, (a, b, scaling, _) in delta.factors.items() for i, t in enumerate((a, b))}


async def test_lora_trains_alike_under_fsdp2_at_two_ranks_ddp_at_two_and_one_rank(ray_cluster, model_config,
                                                                                   uneven_batch, tmp_path):
    """Shards of very unequal token counts, two clipped AdamW steps: the metrics (grad_norm too) and the merged
    weights of fsdp2 x2 (frozen base and adapters sharded) and ddp x2 equal one rank's within 1e-6; the reference
    (adapters disabled) is the base model's on every rank, before and after training; the merged weights and the
    adapter gathered from the shards load into an HF rollout alike; and the fsdp2 checkpoint (the adapters and their
    AdamW state in torch.distributed.checkpoint shards) resumes at one rank and trains on like the two ranks."""
    from asyncrl.roles import RolloutConfig, RolloutWorker

    fsdp2 = replace(CLIPPED, strategy="fsdp2")
    one = PolicyWorker(model_config, CLIPPED)
    col = asyncrl.colocate({"ddp": (PolicyWorker, (model_config, CLIPPED), {}),
                            "fsdp2": (PolicyWorker, (model_config, fsdp2), {})}, world_size=2, name="lora-strategies")
    await col.setup()
    try:
        base = _base_log_probs(model_config, uneven_batch)
        ref = await col["fsdp2"].compute_ref_log_prob(uneven_batch)  # the first gather, with the adapters off
        assert torch.equal(ref["ref_log_probs"], base)
        for step in range(2):
            m1 = one.update(uneven_batch)
            md, mf = await col["ddp"].update(uneven_batch), await col["fsdp2"].update(uneven_batch)
            assert m1["grad_norm"] > CLIPPED.max_grad_norm, step
            for k, v in m1.items():
                assert md[0][k] == pytest.approx(v, rel=1e-5, abs=1e-6), ("ddp", step, k)
                assert mf[0][k] == pytest.approx(v, rel=1e-5, abs=1e-6), ("fsdp2", step, k)
            assert mf[0] == mf[1]
        version, mine = one.export_weights()
        assert (await col["ddp"].export_weights())[0] == (await col["fsdp2"].export_weights())[0] == version == 2
        _close((await col["ddp"].export_weights())[1], mine, "ddp x2")
        sharded = (await col["fsdp2"].export_weights())[1]
        _close(sharded, mine, "fsdp2 x2")
        assert max((sharded[k] - base_w).abs().max().item() for k, base_w in
                   load_model(model_config)[0].state_dict().items()) > 1e-3  # the merged weights did move
        assert await col["fsdp2"].weights_checksum() == state_dict_checksums(sharded.items())
        ref = await col["fsdp2"].compute_ref_log_prob(uneven_batch)
        assert torch.equal(ref["ref_log_probs"], base)  # the adapters are off for the reference only ...
        lp = (await col["fsdp2"].compute_log_prob(uneven_batch))["old_log_probs"]
        torch.testing.assert_close(lp, one.compute_log_prob(uneven_batch)["old_log_probs"], rtol=0, atol=1e-5)

        delta = await col["fsdp2"].export_adapter()  # the factors gathered from the shards
        mine_delta = one.export_adapter()
        assert delta.version == 2 and delta.base_digest == mine_delta.base_digest
        _close(_factors(delta), _factors(mine_delta), "adapter of fsdp2 x2")
        by_adapter, by_store = (RolloutWorker(model_config, RolloutConfig(max_new_tokens=2)) for _ in range(2))
        await by_adapter.update_weights(delta)
        await by_store.update_weights(await col["fsdp2"].stage_weights("object_store"))  # gathered unit by unit
        assert by_adapter.weights_checksum() == by_store.weights_checksum() == state_dict_checksums(sharded.items())

        await col["fsdp2"].save(str(tmp_path / "two"))
        assert {p.name for p in (tmp_path / "two").iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                                                 "dcp", "meta.json", "model.safetensors"}
        from safetensors.torch import load_file

        stored = load_file(str(tmp_path / "two" / "model.safetensors"))
        assert all(torch.equal(stored[k], sharded[k]) for k in stored)  # the merged weights, for export
        resumed = PolicyWorker(model_config, fsdp2)  # one rank: the plain model
        assert resumed.load(str(tmp_path / "two")) == 2
        _close(resumed.export_weights()[1], sharded, "loaded at one rank")
        resumed.update(uneven_batch)
        await col["fsdp2"].update(uneven_batch)
        _close(resumed.export_weights()[1], (await col["fsdp2"].export_weights())[1], "one step after 2 -> 1")
    finally:
        await col.close()


async def test_an_adapter_sync_moves_only_the_factors_and_the_rollout_merges_them_like_a_full_sync(model_config,
                                                                                                    uneven_batch):
    """Two versions through ``export_adapter`` into one HF rollout and through ``export_weights`` into another: the
    same weights bit for bit, the policy's merged ones; the delta is the factors' bytes alone."""
    from asyncrl.roles import RolloutConfig, RolloutWorker, WeightSyncError

    policy = PolicyWorker(model_config, LORA)
    by_adapter, by_weights = (RolloutWorker(model_config, RolloutConfig(max_new_tokens=4)) for _ in range(2))
    for _ in range(2):
        policy.update(uneven_batch)
        delta = policy.export_adapter()
        receipt = await by_adapter.update_weights(delta)
        await by_weights.update_weights(policy.export_weights())
        assert receipt["version"] == delta.version == policy.version
        assert by_adapter.weights_checksum() == by_weights.weights_checksum() == policy.weights_checksum()
    adapters = sum(p.numel() * 4 for n, p in policy.model.named_parameters() if p.requires_grad)
    assert delta.nbytes == adapters < sum(t.numel() * 4 for t in policy.export_weights()[1].values()) / 4

    policy.update(uneven_batch)
    with pytest.raises(WeightSyncError, match="does not hold the base weights the policy's adapters were trained on"):
        await by_weights.update_weights(policy.export_adapter())  # it holds merged weights, not the base
    with pytest.raises(RuntimeError, match="export_adapter needs LoRA"):
        PolicyWorker(model_config).export_adapter()



@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft asks transformers
def test_an_adapter_written_for_vllm_is_the_peft_adapter_of_the_policys_weights(trained, model_config, tmp_path):
    """``save_adapter`` (what the vLLM rollout hands vLLM as a ``LoRARequest``): peft loads it onto the base and
    merges it into the policy's exported weights bit for bit; its config says the rank and alpha trained."""
    import json

    from peft import PeftModel

    from asyncrl.roles.modeling.lora import save_adapter

    w, _ = trained
    path = save_adapter(w.export_adapter(), str(tmp_path / "v2"))
    config = json.loads((tmp_path / "v2" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, sorted(TARGETS))
    merged = PeftModel.from_pretrained(load_model(model_config)[0], path).merge_and_unload().state_dict()
    exported = w.export_weights()[1]
    assert merged.keys() == exported.keys()
    assert all(torch.equal(merged[k], exported[k]) for k in merged)


def test_an_adapter_sync_into_vllm_is_configured_or_refused_in_one_line():
    """``trainer.weight_sync=adapter`` with ``rollout.engine=vllm``: the engine starts serving adapters of the
    policy's rank (rounded up to one vLLM builds kernels for); what it cannot do is a config error."""
    from asyncrl.pipelines.run.build import rollout_config
    from asyncrl.roles.engines.vllm_engine import vllm_lora_rank

    lora = ["trainer.weight_sync=adapter", "actor.lora.rank=4", "rollout.engine=vllm"]
    assert rollout_config(load_config(None, lora)).engine_kwargs["max_lora_rank"] == 4
    assert [vllm_lora_rank(r) for r in (1, 4, 8, 9, 512)] == [1, 8, 8, 16, 512]
    with pytest.raises(ValueError, match="up to rank 512, got rank 600"):
        vllm_lora_rank(600)
    with pytest.raises(ConfigError, match=r"which needs rollout.partial_rollout=off for vllm \(an adapter reaches "
                                          r"new requests only\); or use trainer.weight_sync=auto"):
        load_config(None, [*lora, "rollout.partial_rollout=keep"])
    with pytest.raises(ConfigError, match="which needs rollout.verify_checksums=false for vllm"):
        load_config(None, [*lora, "rollout.verify_checksums=true"])
    with pytest.raises(ConfigError, match=r"needs the hf or vllm rollout engine \(not 'sim'\)"):
        load_config(None, [*lora[:2], "rollout.engine=sim"])
