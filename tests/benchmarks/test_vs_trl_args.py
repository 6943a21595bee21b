"""benchmarks/vs_trl.py refuses bad input before any run starts: an unknown variant, too few steps,
TRL's venv missing (with the command that makes it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vs_trl  # noqa: E402


def _main(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", *argv])
    vs_trl.main()


def test_an_unknown_variant_is_refused_naming_the_choices(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--variants", "trl,k9")
    assert e.value.code == 2
    assert "unknown variant(s) ['k9']; choose from trl, k1, k0, bypass, k1_threads, bypass_threads" in capsys.readouterr().err


def test_fewer_than_two_steps_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _main(monkeypatch, "--variants", "k1", "--steps", "1")
    assert "--steps must be >= 2 (step 0 is not timed)" in capsys.readouterr().err


def test_a_missing_trl_venv_says_how_to_make_it(monkeypatch, tmp_path):
    monkeypatch.setattr(vs_trl, "TRL_PY", tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(SystemExit, match=r"TRL's venv is missing .*; make it with: bash benchmarks/setup_trl.sh"):
        _main(monkeypatch, "--variants", "trl,k1")
