"""``asyncrl export``: a run's checkpointed policy becomes a Hugging Face directory that
``from_pretrained`` loads offline with the checkpoint's weights bit for bit (a tied LM head
still tied); each bad input is one line on stderr and exit status 2, before anything is written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.pipelines.checkpoints import export
from asyncrl.pipelines.checkpoints.checkpoint import CheckpointError, checkpoint_dir, write_manifest
from asyncrl.pipelines.commands.cli import main
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    """A 2-step run of the tiny model with a tied LM head, checkpointed after steps 1 and 2."""
    out = tmp_path_factory.mktemp("export") / "run"
    cfg = tiny_test()
    cfg.model.tie_word_embeddings = True
    cfg.trainer.steps = 2
    cfg.trainer.checkpoint_every = 1
    cfg.trainer.colocated = True
    cfg.trainer.output_dir = str(out)
    GRPOTrainer(cfg).fit_sync()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    return out


def _exported_state(out):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    return model, model.state_dict()


def test_the_export_loads_offline_with_the_checkpoints_weights_bit_for_bit(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert f"(step 2, float32) to {out}" in capsys.readouterr().err
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob("hf.tmp-*"))

    stored = load_file(str(checkpoint_dir(run, 2) / "policy" / "model.safetensors"))
    model, state = _exported_state(out)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings is True
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size) == (32, 1, 384)
    # the checkpoint stores the tied tensor once (as lm_head.weight); the export fills its twin through the tie
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert set(state) - set(stored) == {"model.embed_tokens.weight"} and set(stored) < set(state)
    for name, t in state.items():
        want = stored["lm_head.weight" if name == "model.embed_tokens.weight" else name]
        assert t.dtype == torch.float32 and want.dtype == torch.float32, name
        assert torch.equal(t.view(torch.int32), want.view(torch.int32)), name
    # the checkpoint after step 1 is another policy: the export picks the newest by default
    older = load_file(str(checkpoint_dir(run, 1) / "policy" / "model.safetensors"))
    assert not torch.equal(older["model.norm.weight"], stored["model.norm.weight"])

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "write digits: 0123 say cat."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert (tok.pad_token, tok.eos_token, tok.pad_token_id, tok.eos_token_id) == ("<|pad|>", "<|endoftext|>", 0, 1)
    assert json.loads((out / "generation_config.json").read_text())["pad_token_id"] == 0


PROBES = ["write digits: 12345", "0 1 22 333 4444 55555 6666666 3.14159", "  two  spaces,\ttab\nnew line  ",
          "café naïve ﬁ e\u0301 Ω Å", "日本語のテキスト 👍🏽 \u202eevil", "say cat.", "<|endoftext|> digits"]


def _trained_policy(run):
    """The tokenizer and the policy of `run`'s newest checkpoint as training builds them (a PolicyWorker that
    loads the checkpoint, the tokenizer its config names)."""
    from asyncrl.pipelines.checkpoints.checkpoint import verify
    from asyncrl.pipelines import configlib
    from asyncrl.roles import PolicyWorker
    from asyncrl.roles.modeling.models import ModelConfig, tokenizer_for

    ckpt = checkpoint_dir(run, 2)
    model_cfg = configlib.from_dict(ModelConfig, verify(ckpt)["config"]["model"], _path="model")
    policy = PolicyWorker(model_cfg)
    assert policy.load(str(ckpt / "policy")) == 2
    return tokenizer_for(model_cfg), policy


def test_the_exported_model_and_tokenizer_are_the_trained_policys(run, tmp_path):
    """``AutoTokenizer`` of the export gives the training tokenizer's ids (transformers 5 would load a qwen2 model's
    tokenizer as Qwen2Tokenizer, which splits digits one per token), and ``AutoModelForCausalLM`` gives the
    trained policy's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.roles.modeling.models import position_ids_from_mask

    out = tmp_path / "hf"
    export.export_policy(run, out)
    trained, policy = _trained_policy(run)
    exported = AutoTokenizer.from_pretrained(out, local_files_only=True)
    for text in PROBES:
        assert exported(text)["input_ids"] == trained(text)["input_ids"], text
        assert exported.decode(exported(text)["input_ids"]) == text
    assert trained("write digits: 12345")["input_ids"][-2:] == [383, 22]  # "123", "45": what digits look like here

    enc = trained(PROBES, padding=True, return_tensors="pt")  # left-padded, as rollout prompts are
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
              "position_ids": position_ids_from_mask(enc["attention_mask"])}
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        want = policy.model(**inputs).logits.float()
        got = model(**inputs).logits
    real = enc["attention_mask"].bool()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want)[real].abs().max().item() <= 1e-5


def test_step_and_dtype_pick_the_checkpoint_and_cast_its_weights(run, tmp_path):
    out = tmp_path / "bf16"
    result = export.export_policy(run, out, step=1, dtype="bfloat16")
    assert (result.step, result.dtype, result.checkpoint) == (1, "bfloat16", checkpoint_dir(run, 1))
    stored = load_file(str(checkpoint_dir(run, 1) / "policy" / "model.safetensors"))
    written = load_file(str(out / "model.safetensors"))
    # Hugging Face stores the tied tensor under the embedding's name
    assert set(written) == set(stored) - {"lm_head.weight"} | {"model.embed_tokens.weight"}
    for name, t in written.items():
        want = stored["lm_head.weight" if name == "model.embed_tokens.weight" else name]
        assert t.dtype == torch.bfloat16 and torch.equal(t, want.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_force_replaces_a_non_empty_out_and_an_empty_one_needs_no_force(run, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    assert export.export_policy(run, out).step == 2  # empty: fine
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(run), "--out", str(out), "--force", "--step", "1"]) == 0
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()


def _fails(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert err.startswith("asyncrl export: error: "), err
    return err


def test_bad_inputs_exit_2_with_one_line_naming_the_fix(run, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert "does not exist" in _fails(["export", str(tmp_path / "nowhere"), "--out", out], capsys)
    (tmp_path / "plain").mkdir()
    assert "is not a run directory" in _fails(["export", str(tmp_path / "plain"), "--out", out], capsys)

    err = _fails(["export", str(checkpoint_dir(run, 1)), "--out", out], capsys)
    assert err.endswith(f"is a checkpoint, not a run directory: pass its run and step, asyncrl export {run} --step 1")

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text("")
    assert "trainer.checkpoint_at_end=true" in _fails(["export", str(bare), "--out", out], capsys)

    err = _fails(["export", str(run), "--step", "7", "--out", out], capsys)
    assert "no complete checkpoint of step 7 (step_000007); its checkpoints are of steps: 1, 2" in err

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("")
    err = _fails(["export", str(run), "--out", str(taken)], capsys)
    assert "exists and is not empty" in err and "pass --force to overwrite it" in err
    assert "holds the checkpoint" in _fails(["export", str(run), "--out", str(run), "--force"], capsys)
    assert (taken / "x").exists() and (run / "checkpoints" / "step_000002").is_dir()

    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    weights = checkpoint_dir(broken, 2) / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # same size, one bit flipped
    weights.write_bytes(bytes(data))
    err = _fails(["export", str(broken), "--out", out], capsys)
    assert "model.safetensors" in err and "sha256 differs" in err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_without_policy_weights_names_the_formats_looked_for(tmp_path):
    (tmp_path / "policy").mkdir()
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*safetensors.*policy/dcp.*torch\.distributed"):
        export.read_policy_state(tmp_path)


def _checkpoint_of(model, run, model_cfg):
    """A checkpoint at step 1 of `run` holding `model`'s weights as PolicyWorker.save stores them."""
    from safetensors.torch import save_model

    from tests.pipelines.test_checkpoint import _fake_checkpoint

    cfg = tiny_test()
    cfg.model = model_cfg
    d = _fake_checkpoint(run, cfg)
    save_model(model, str(d / "policy" / "model.safetensors"))
    write_manifest(d)
    return d


def test_an_untied_model_is_exported_with_every_weight_under_its_own_name(tmp_path):
    from asyncrl.roles.modeling.models import ModelConfig, load_model

    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=3)
    model, _ = load_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # not what the skeleton (same seed) starts from
    d = _checkpoint_of(model, tmp_path / "run", cfg)
    export.export_policy(tmp_path / "run", tmp_path / "hf")
    stored = load_file(str(d / "policy" / "model.safetensors"))
    loaded, state = _exported_state(tmp_path / "hf")
    assert loaded.config.tie_word_embeddings is False and "lm_head.weight" in stored
    assert set(state) == set(stored)
    for name, t in stored.items():
        assert torch.equal(state[name].view(torch.int32), t.view(torch.int32)), name


@pytest.mark.slow
def test_smollm2_exports_with_its_tie_and_chat_template(tmp_path):
    from tests.roles.test_smollm import _missing_extra

    if _missing_extra():
        pytest.skip(f"needs the smollm extra (missing {_missing_extra()}): bash scripts/setup.sh smollm")
    from asyncrl.roles.modeling.gguf import SMOLLM2_135M_INSTRUCT
    from asyncrl.roles.modeling.models import ModelConfig

    _assert_the_export_keeps_the_tie_and_the_chat_template(ModelConfig(gguf=SMOLLM2_135M_INSTRUCT, num_threads=2),
                                                            tmp_path)


def test_a_tied_chat_model_exports_with_its_tie_and_chat_template(tmp_path):
    """The default suite's twin of the SmolLM2 export above (a tied pretrained chat model): a tied model with the real
    Qwen2 tokenizer (its chat template) keeps its tie and the template the run trained with."""
    from asyncrl.roles.modeling.models import ModelConfig

    _assert_the_export_keeps_the_tie_and_the_chat_template(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=2,
                    tokenizer="qwen2", tie_word_embeddings=True), tmp_path)


def _assert_the_export_keeps_the_tie_and_the_chat_template(cfg, tmp_path) -> None:
    """The tied model of `cfg`, its LM head changed, checkpointed and exported: the export is tied, holds the changed
    head, and its tokenizer renders a chat as the run's did."""
    from transformers import AutoTokenizer

    from asyncrl.roles.modeling.models import load_model

    model, tok = load_model(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # the tie: the embedding doubles too
    _checkpoint_of(model, tmp_path / "run", cfg)
    export.export_policy(tmp_path / "run", tmp_path / "hf")
    loaded, _ = _exported_state(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    chat = [{"role": "user", "content": "What is 2+3?"}]
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert exported.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    for text in PROBES:
        assert exported(text)["input_ids"] == tok(text)["input_ids"], text


def test_weights_of_another_architecture_are_refused_naming_the_mismatch(tmp_path):
    from asyncrl.roles.modeling.models import ModelConfig, load_model

    small = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    model, _ = load_model(small)
    d = _checkpoint_of(model, tmp_path / "run", small)
    state = json.loads((d / "state.json").read_text())
    state["config"]["model"]["intermediate_size"] = 48  # the config no longer describes the weights
    (d / "state.json").write_text(json.dumps(state))
    write_manifest(d)
    with pytest.raises(CheckpointError, match=r"do not fit the model its config describes: .*mlp"):
        export.export_policy(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_an_out_directory_that_cannot_be_made_is_one_line_and_exit_2(run, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "a_file" / "policy_hf"
    err = _fails(["export", str(run), "--out", str(out)], capsys)
    assert err == (f"asyncrl export: error: --out {str(out)!r} cannot be created: {str(tmp_path / 'a_file')!r} is a "
                   "file; pick another directory")
    out = "/proc/asyncrl-no-such-dir/policy_hf"  # passes the checks on paper; mkdir fails (as root too)
    err = _fails(["export", str(run), "--out", out], capsys)
    assert err.startswith(f"asyncrl export: error: --out {out!r} cannot be written: ")
    assert err.endswith("; pick another directory")
