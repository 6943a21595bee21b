"""What a hostile or careless user can hand the CLI and the config: each bad file or value ends in one line
naming it and exit 2 (``--print-config`` stops right after loading and validating, before Ray), never a
traceback, a hang or a silent change."""

from __future__ import annotations

import pytest

from asyncrl.pipelines.job.cli import main


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
