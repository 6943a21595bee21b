"""What a hostile or careless user can hand the CLI and the config: each bad file or value ends in one line
naming it and exit 2 (``--print-config`` stops right after loading and validating, before Ray), never a
traceback, a hang or a silent change."""

from __future__ import annotations

import pytest

from asyncrl.pipelines.commands.cli import main


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``asyncrl`` printed on stderr for `argv`, which must exit 2."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(tmp_path, capsys):
    bad = tmp_path / "run.yaml"
    bad.write_bytes(b"trainer:\n  steps: 3\n  output_dir: caf\xe9\n")  # Latin-1, not UTF-8
    line = fails(["train", "--config", str(bad), "--print-config"], capsys)
    assert line.startswith("asyncrl train: config error: config file") and str(bad) in line
    assert "is not UTF-8 text" in line and "byte 0xe9 at offset 37" in line


@pytest.mark.parametrize("text", ["trainer: &t {steps: *t}", "a: &a [*a]"])
def test_a_recursive_yaml_alias_is_one_line_in_a_file_and_in_an_override(tmp_path, capsys, text):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    assert "recursive alias" in fails(["train", "--config", str(f), "--print-config"], capsys)
    line = fails(["train", "--print-config", f"data.task_kwargs={text}"], capsys)
    assert line.startswith("asyncrl train: config error: override 'data.task_kwargs=") and "recursive alias" in line


def test_yaml_aliases_cannot_expand_a_small_override_into_a_huge_config(capsys):
    text = ("{a: &a [x,x,x,x,x,x,x,x,x], b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b], "
            "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c], e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d], "
            "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e], g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]}")
    assert len(text) < 300
    line = fails(["train", "--print-config", f"data.task_kwargs={text}"], capsys)
    assert "expands to more than" in line and "aliases" in line


def _sections(cfg: object, path: str = "") -> list[tuple[str, object]]:
    """``(dotted path, section)`` of every dataclass in the config tree `cfg` (the root as ``""``)."""
    import dataclasses

    out = [(path, cfg)]
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += _sections(value, f"{path}.{f.name}" if path else f.name)
    return out


def test_a_typo_set_in_python_is_an_attribute_error_naming_the_nearest_field():
    from asyncrl.pipelines.job.presets import grpo_toy
    from asyncrl.roles import ModelConfig

    cfg = grpo_toy()
    with pytest.raises(AttributeError, match=r"TrainerConfig has no field 'stpes'; did you mean 'steps'\?"):
        cfg.trainer.stpes = 3  # type: ignore[attr-defined]
    assert cfg.trainer.steps == 80 and not hasattr(cfg.trainer, "stpes")
    cfg.reward.model = ModelConfig()  # a section set to None by default is in the tree too
    sections = _sections(cfg)
    assert {type(x).__name__ for _, x in sections} >= {
        "JobConfig", "ModelConfig", "DataConfig", "RolloutConfig", "OptimConfig", "RolloutCorrectionConfig",
        "LoraConfig", "RewardConfig", "AlgorithmConfig", "FilterGroupsConfig", "TrainerConfig", "StreamConfig",
        "RestartConfig", "EvalConfig"}
    for path, section in sections:
        with pytest.raises(AttributeError, match=f"^{type(section).__name__} has no field 'not_a_field'"):
            section.not_a_field = 1  # type: ignore[attr-defined]
    cfg.trainer.steps = 5  # fields are still set as before
    assert cfg.validate().trainer.steps == 5


def test_a_key_given_twice_in_yaml_is_refused_not_silently_overwritten(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("trainer:\n  steps: 3\n  batch_size: 16\n  steps: 30\n")
    line = fails(["train", "--config", str(f), "--print-config"], capsys)
    assert line == (f"asyncrl train: config error: config file {str(f)!r} gives key 'steps' twice (lines 2 and 4); "
                    "keep one")
    line = fails(["train", "--print-config", "data.task_kwargs={levels: [1], levels: [2]}"], capsys)
    assert "override 'data.task_kwargs={levels: [1], levels: [2]}' gives key 'levels' twice" in line


def test_a_batch_size_no_job_can_hold_is_refused_before_anything_is_built(capsys):
    line = fails(["train", "--print-config", "trainer.batch_size=1000000000000"], capsys)
    assert line == "asyncrl train: config error: trainer.batch_size must be <= 1048576, got 1000000000000"
    line = fails(["train", "--print-config", "trainer.rollout_workers=1..1000000000", "trainer.rollout_placement=[1]"],
                 capsys)  # its sizes would be listed one by one
    assert line == ("asyncrl train: config error: trainer.rollout_workers=1..1000000000: a pool has at most 4096 "
                    "workers, got max=1000000000")


def test_an_empty_output_dir_is_refused_instead_of_writing_the_run_into_the_current_directory(capsys):
    for value in ("", "  "):
        line = fails(["train", "--print-config", f"trainer.output_dir={value}"], capsys)
        assert line == ("asyncrl train: config error: trainer.output_dir is empty, which would write the run into "
                        "the current directory; name the run's directory (e.g. trainer.output_dir=runs/my_run)")


def test_an_output_dir_that_cannot_be_created_is_one_line_before_ray_starts(tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    line = fails(["train", "--print-config", f"trainer.output_dir={tmp_path / 'a_file' / 'run'}"], capsys)
    assert line == (f"asyncrl train: config error: trainer.output_dir={str(tmp_path / 'a_file' / 'run')!r} cannot be "
                    f"created: {str(tmp_path / 'a_file')!r} is a file; give a directory for the run's outputs")
    import asyncrl

    started = []
    monkeypatch.setattr(asyncrl, "ainit", lambda *a, **k: started.append(1))  # must not be reached
    where = "/proc/asyncrl-no-such-dir/run"  # passes every check on paper; mkdir fails (as root too)
    line = fails(["train", f"trainer.output_dir={where}", "trainer.progress=false"], capsys)
    assert line.startswith(f"asyncrl train: config error: trainer.output_dir={where!r} cannot be created: ")
    assert line.endswith("; give a directory this process can write")
    assert started == []


@pytest.mark.parametrize("overrides, line", [
    (["trainer.num_cpus=-4"], "trainer.num_cpus must be >= 1, got -4"),
    (["rollout.engine_kwargs={max_batch_size: 8, temprature: 0.5}"],
     "rollout.engine_kwargs: 'temprature' is not an option of the 'hf' engine; it takes ['autocast', 'cores', "
     "'exact_log_probs', 'max_batch_size', 'seed']"),
    (["trainer.rollout_placement=[1]", "trainer.rollout_resources={rollout_node: .nan}"],
     "trainer.rollout_resources.rollout_node must be a number, got nan"),
])
def test_values_that_used_to_fail_only_after_ray_started_are_refused_at_validate(overrides, line, capsys):
    assert fails(["train", "--print-config", *overrides], capsys) == f"asyncrl train: config error: {line}"


def test_an_agent_with_a_tokenizer_without_a_chat_template_is_a_config_error_naming_model_tokenizer(capsys):
    from pathlib import Path

    agent = f"{Path(__file__).parents[1] / 'roles' / 'gateway_agent.py'}:two_turns"
    line = fails(["train", "--print-config", f"rollout.agent={agent}"], capsys)
    assert line == ("asyncrl train: config error: rollout.agent runs the agent against the gateway, which renders its "
                    "chat messages with the policy's chat template, but model.tokenizer (null: the tiny model's "
                    "'tiny') has none; set model.tokenizer=qwen2 or a model whose tokenizer has a chat template")
    assert main(["train", "--print-config", f"rollout.agent={agent}", "model.tokenizer=qwen2"]) == 0
    capsys.readouterr()
