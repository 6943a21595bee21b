"""A training run with ``actor.strategy=fsdp2`` on 2 training ranks (real Ray, gloo): its weights reach the
rollout gathered from the shards, its checkpoints are shards that a resume at 1 rank continues exactly,
and ``asyncrl export`` writes the checkpoint's weights.

Slow (a 2-rank run and its resume at 1 rank); what they pin stays in the default suite elsewhere: fsdp2 ranks checkpointing
shards, syncing and restarting from them to a fault-free run's weights (``tests/cluster/test_lost_nodes.py``), a
trainer-level fsdp2 run resumed at 1 rank and exported (the LoRA run of ``test_lora_run.py``), and the full model's
2 -> 1 -> 2 resume, the gathered weights by each transport and the other strategy's checkpoint refused
(``tests/roles/test_strategies.py``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from asyncrl.pipelines.checkpoints.checkpoint import CheckpointError, checkpoint_dir
from asyncrl.pipelines.commands.cli import main
from asyncrl.pipelines.checkpoints.export import read_policy_state
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer


def _config(out, train_workers: int, steps: int):
    cfg = tiny_test()
    cfg.actor.strategy = "fsdp2"
    cfg.trainer.train_workers = train_workers
    cfg.trainer.steps = steps
    cfg.trainer.checkpoint_every = 2
    cfg.trainer.output_dir = str(out)
    return cfg.validate()


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    """3 steps of fsdp2 at 2 training ranks (rollout on its own worker), checkpointed after steps 2 and 3."""
    out = tmp_path_factory.mktemp("fsdp2") / "run"
    GRPOTrainer(_config(out, 2, 3)).fit_sync()
    return out


@pytest.mark.slow  # the module's 2-rank run (and a resume): default siblings in the docstring
def test_an_fsdp2_run_checkpoints_shards_and_syncs_gathered_weights(run):
    ckpt = checkpoint_dir(run, 3)
    meta = json.loads((ckpt / "policy" / "meta.json").read_text())
    assert (meta["format"], meta["world_size"], meta["version"]) == ("dcp", 2, 3)
    assert sorted(p.name for p in (ckpt / "policy" / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["version"] == r["step"] + 1 for r in rows)  # every step trained and synced a version


@pytest.mark.slow  # the module's 2-rank run (and a resume): default siblings in the docstring
def test_an_fsdp2_run_resumed_at_one_rank_continues_like_the_uninterrupted_run(run, tmp_path):
    """2 -> 1 training ranks from the step-2 checkpoint: step 3 samples the same batch (its weights were
    restored bit for bit) and trains it at one rank to the weights of the 2-rank run, within 1e-6."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(checkpoint_dir(copy, 3))
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    GRPOTrainer(_config(copy, 1, 3), resume=str(checkpoint_dir(copy, 2))).fit_sync()
    assert json.loads((checkpoint_dir(copy, 3) / "policy" / "meta.json").read_text())["world_size"] == 1
    whole, resumed = read_policy_state(checkpoint_dir(run, 3)), read_policy_state(checkpoint_dir(copy, 3))
    assert whole.keys() == resumed.keys()
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    a, b = _metrics(run)[2], _metrics(copy)[2]
    assert a["reward/mean"] == b["reward/mean"]  # the same sampled batch
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k


@pytest.mark.slow  # the module's 2-rank run (and a resume): default siblings in the docstring
def test_a_resume_with_the_other_strategy_is_refused_naming_it(run):
    cfg = _config(run, 2, 4)
    cfg.actor.strategy = "ddp"
    with pytest.raises(CheckpointError, match=r"differs in: actor\.strategy\).*; resume with actor\.strategy='fsdp2' "
                                              r"\(at any number of training ranks\), or export its weights"):
        GRPOTrainer(cfg.validate(), resume=str(run))


@pytest.mark.slow  # the module's 2-rank run (and a resume): default siblings in the docstring
def test_the_export_of_an_fsdp2_run_holds_the_gathered_checkpoint_weights(run, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).state_dict()
    stored = read_policy_state(checkpoint_dir(run, 3))
    assert set(state) == set(stored)
    for k, t in state.items():
        assert torch.equal(t, stored[k]), k


@pytest.mark.parametrize("override, line", [
    ("actor.strategy=fsdp", "actor.strategy must be one of ['ddp', 'fsdp2'], got 'fsdp'"),
    ("actor.fsdp_offload=true", "actor: fsdp_offload=true keeps FSDP2 shards in CPU memory: it needs strategy=fsdp2"),
    ("actor.strategy=fsdp2 actor.fsdp_offload=true", "actor.fsdp_offload=true keeps a GPU model's shards in CPU memory "
     "between uses, but the training pool has no GPU (trainer.gpus_per_worker=0): they already are in CPU memory; set "
     "actor.fsdp_offload=false"),
])
def test_a_bad_strategy_setting_is_one_line_and_exit_2_before_ray_starts(override, line, capsys, tmp_path):
    assert main(["train", *override.split(), f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(line), err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two 2-rank runs (~35 s); default siblings: tests/README.md (Duration)
def test_colocated_runs_give_each_rollout_rank_its_own_snapshot_and_fsdp2_trains_like_ddp(tmp_path):
    """Colocated at 2 ranks, the ``local`` sync stages a snapshot in each process and each rollout rank takes its
    own (before, rank 0's handle reached rank 1: a WeightSyncError); fsdp2 samples and trains what ddp does."""
    runs = {}
    for strategy in ("ddp", "fsdp2"):
        cfg = _config(tmp_path / strategy, 2, 2)
        cfg.actor.strategy = strategy
        cfg.trainer.colocated = True
        GRPOTrainer(cfg.validate()).fit_sync()
        runs[strategy] = _metrics(tmp_path / strategy)
    for a, b in zip(runs["ddp"], runs["fsdp2"], strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["version"] == b["version"] == a["step"] + 1
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-5, abs=1e-7)
    whole = {s: read_policy_state(checkpoint_dir(tmp_path / s, 2)) for s in runs}
    for k in whole["ddp"]:
        torch.testing.assert_close(whole["fsdp2"][k], whole["ddp"][k], rtol=0, atol=1e-6)
