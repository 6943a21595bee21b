"""A GRPO run with ``actor.lora.rank > 0`` and a KL loss (real Ray, colocated): no ReferenceWorker (the policy gives
the reference log-probs with its adapters disabled), the rollout holds the merged policy weights, a resume from its
checkpoint continues exactly (syncing only the adapter), and ``asyncrl export`` writes the merged model or
(``--adapter``) the peft adapter. Under fsdp2 (not colocated): 2 training ranks resumed at 1 end with the 2-rank
run's merged weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from asyncrl.pipelines.checkpoints.checkpoint import checkpoint_dir
from asyncrl.pipelines.commands.cli import main
from asyncrl.pipelines.checkpoints.export import read_policy_state
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.roles.modeling.models import state_dict_checksums


def _config(out, steps: int = 3):
    cfg = tiny_test()
    cfg.actor.lora.rank = 4
    cfg.actor.lr = 3e-2
    cfg.actor.kl_coef = 0.05  # a KL loss: the run needs reference log-probs
    cfg.trainer.steps = steps
    cfg.trainer.checkpoint_every = 2
    cfg.trainer.colocated = True  # one process: the merged weights reach the rollout as a local snapshot
    cfg.trainer.output_dir = str(out)
    return cfg.validate()


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
async def run(ray_cluster, tmp_path_factory):
    """3 steps, checkpointed after steps 2 and 3; what the trainer's groups held at the end."""
    out = tmp_path_factory.mktemp("lora") / "run"
    async with GRPOTrainer(_config(out)) as t:
        await t.fit()
        roles = sorted(t.workers.parts[-1].groups)
        reference_is_policy = t.groups.reference is t.groups.policy
        policy_sum = await t.groups.policy.weights_checksum()
        rollout_sum = (await t.groups.rollout.weights_checksum())[0]
    return out, {"roles": roles, "reference_is_policy": reference_is_policy, "policy": policy_sum,
                 "rollout": rollout_sum}


def test_lora_learns_when_the_output_layer_has_contrast(ray_cluster, tmp_path):
    """LoRA (rank 4, the decoder's linear layers, merged-weights sync) raises the toy's reward from chance to over
    0.5 in 10 steps of 8 prompts x 4, on a tiny Qwen2 whose LM head is its random init x30: a "pretrained" output
    layer whose logits have contrast. (On the toy's own init, logits stay near-uniform whatever the adapted layers
    below do: reward ~0.05 after 80 steps, docs/training.md.) Adapters that do not train, or merged weights that
    do not carry them to the rollout, stay at ~0.05: the threshold tells."""
    from asyncrl.roles.modeling.models import ModelConfig, load_model, save_model_dir

    base = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)
    model, tok = load_model(base)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    save_model_dir(model, tok, str(tmp_path / "base"))
    cfg = tiny_test()
    cfg.model = ModelConfig(path=str(tmp_path / "base"), tokenizer="tiny", seed=0, num_threads=1)
    cfg.actor.lora.rank, cfg.actor.lora.alpha, cfg.actor.lr = 4, 8, 3e-2
    cfg.trainer.steps, cfg.trainer.batch_size, cfg.trainer.colocated = 10, 32, True
    cfg.trainer.output_dir = str(tmp_path / "run")
    GRPOTrainer(cfg.validate()).fit_sync()
    reward = [m["reward/mean"] for m in _metrics(tmp_path / "run") if "reward/mean" in m]
    assert len(reward) == 10
    assert sum(reward[:2]) / 2 <= 0.15, reward  # chance: the task's tokens are a few of 384
    assert sum(reward[-3:]) / 3 >= 0.5, reward


def test_a_lora_run_has_no_reference_worker_and_its_rollout_holds_the_merged_policy(run):
    out, seen = run
    assert seen["reference_is_policy"] and seen["roles"] == ["advantage", "policy", "reward", "rollout"]
    rows = _metrics(out)
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert rows[0]["actor/kl"] == 0.0  # version 0: the adapters' B is zero, the policy is the base exactly
    assert all(r["actor/kl"] > 0 for r in rows[1:])
    # the rollout sampled the last batch with version 2: the merged weights the step-2 checkpoint holds
    assert seen["rollout"] == state_dict_checksums(read_policy_state(checkpoint_dir(out, 2)).items())
    assert seen["policy"] == state_dict_checksums(read_policy_state(checkpoint_dir(out, 3)).items())
    assert seen["rollout"] != seen["policy"]


def test_a_lora_run_resumed_from_its_checkpoint_continues_exactly_with_adapter_sync(run, tmp_path):
    """Resumed from the step-2 checkpoint with ``trainer.weight_sync=adapter`` (a fresh rollout holding the base
    merges the factors itself): step 3 samples the same batch (its rollout weights equal the merged ones the
    uninterrupted run synced) and ends with the same weights, bit for bit."""
    out, seen = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    shutil.rmtree(checkpoint_dir(copy, 3))
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    cfg = _config(copy)
    cfg.trainer.weight_sync = "adapter"
    GRPOTrainer(cfg.validate(), resume=str(checkpoint_dir(copy, 2))).fit_sync()
    whole, resumed = read_policy_state(checkpoint_dir(out, 3)), read_policy_state(checkpoint_dir(copy, 3))
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    a, b = _metrics(out)[2], _metrics(copy)[2]
    for k in ("reward/mean", "actor/pg_loss", "actor/kl", "actor/grad_norm", "version"):
        assert b[k] == a[k], k


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft asks transformers
def test_the_export_of_a_lora_run_is_the_merged_model_or_with_adapter_the_peft_adapter(run, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from asyncrl.roles.modeling.models import load_model

    out, seen = run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["export", str(out), "--out", str(tmp_path / "hf")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).state_dict()
    assert state_dict_checksums(merged.items()) == seen["policy"]

    assert main(["export", str(out), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    base, _ = load_model(_config(out).model)  # the base the run started from (built from the config)
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    assert state_dict_checksums(adapted.items()) == seen["policy"]


def test_a_lora_run_under_fsdp2_at_two_ranks_resumes_at_one_rank_exactly_and_exports(ray_cluster, tmp_path,
                                                                                     monkeypatch):
    """``actor.strategy=fsdp2`` with LoRA at 2 training ranks, adapter sync to the HF rollout: the checkpoint holds the
    adapters in shards beside the merged weights; resumed at 1 rank from step 1, step 2 ends with the 2-rank run's
    merged weights (within 1e-6, the same metrics), and ``asyncrl export`` writes them."""
    from transformers import AutoModelForCausalLM

    def config(out, workers: int):
        cfg = _config(out, steps=2)
        cfg.trainer.colocated = False
        cfg.trainer.train_workers = workers
        cfg.trainer.checkpoint_every = 1
        cfg.actor.strategy = "fsdp2"
        cfg.trainer.weight_sync = "adapter"
        return cfg.validate()

    out = tmp_path / "run"
    GRPOTrainer(config(out, 2)).fit_sync()
    policy = checkpoint_dir(out, 2) / "policy"
    meta = json.loads((policy / "meta.json").read_text())
    assert (meta["format"], meta["world_size"], meta["version"]) == ("dcp", 2, 2)
    assert {p.name for p in policy.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "dcp",
                                                  "meta.json", "model.safetensors"}
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shutil.rmtree(checkpoint_dir(copy, 2))
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text(lines[0] + "\n")
    GRPOTrainer(config(copy, 1), resume=str(checkpoint_dir(copy, 1))).fit_sync()
    whole, resumed = read_policy_state(checkpoint_dir(out, 2)), read_policy_state(checkpoint_dir(copy, 2))
    assert whole.keys() == resumed.keys()
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=1e-6)
    a, b = _metrics(out)[1], _metrics(copy)[1]
    assert b["reward/mean"] == a["reward/mean"]  # the same batch: the rollout's weights were restored exactly
    for k in ("actor/pg_loss", "actor/kl", "actor/grad_norm", "version"):
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["export", str(out), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).state_dict()
    assert state_dict_checksums(exported.items()) == state_dict_checksums(whole.items())
