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
    assert "unknown variant(s) ['k9']; choose from trl, k1, k0, bypass, k1_threads, bypass_threads, k1_follow, bypass_follow" in capsys.readouterr().err


def test_fewer_than_two_steps_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _main(monkeypatch, "--variants", "k1", "--steps", "1")
    assert "--steps must be >= 2 (step 0 is not timed)" in capsys.readouterr().err


def test_a_missing_trl_venv_says_how_to_make_it(monkeypatch, tmp_path):
    monkeypatch.setattr(vs_trl, "TRL_PY", tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(SystemExit, match=r"TRL's venv is missing .*; make it with: bash benchmarks/setup_trl.sh"):
        _main(monkeypatch, "--variants", "trl,k1")


def test_the_table_says_which_runs_make_the_old_log_prob_pass_and_what_removing_it_saved():
    """Issue 32 item 2's "step before and after the redundant pass is removed": k1 and bypass of the
    same run, side by side, with the saving computed from their medians (step 0 skipped)."""
    import argparse

    args = argparse.Namespace(prompts=4, group=4, max_new_tokens=20, steps=3, rounds=1, held_out=64)

    def run(steps: list[float], train: list[float]) -> dict:
        return {"step_s": steps, "train_s": train, "generate_s": [1.0] * len(steps), "accuracy": 0.5,
                "acc_at_s": 100.0, "reward": [0.25]}

    text = vs_trl.render(args, {"trl": [{**run([30.0, 10.0, 12.0], []), "generate_s": []}],
                                "k1": [run([30.0, 15.0, 17.0], [30.0, 15.0, 17.0])],
                                "bypass": [run([30.0, 12.0, 14.0], [30.0, 11.0, 13.0])]}, "note")
    assert "| TRL 1.16 GRPOTrainer | no (num_iterations=1) | 11.00 |" in text
    assert "| asyncrl, max_staleness=1 | yes | 16.00 |" in text
    assert "| asyncrl, max_staleness=1, bypass | no (bypass) | 13.00 |" in text
    assert ("16.00 -> 13.00 s/step (-3.00 s, -19%); the training worker's seconds per step 16.00 -> 12.00 "
            "(-4.00 s)") in text


def test_held_out_zero_means_no_held_out_set(tmp_path):
    """``--held-out 0`` (its help: "0: none") gives both sides an empty held-out set instead of failing
    on an empty dataset; the training prompts are unchanged."""
    import argparse

    args = argparse.Namespace(prompts=2, group=2, max_new_tokens=8, steps=2, rounds=1, held_out=0)
    spec = vs_trl.make_spec(args, tmp_path)
    assert spec["held_out"] == []
    assert len(spec["train"]) == 2 * 2  # steps x prompts
    assert len(vs_trl.make_spec(argparse.Namespace(**{**vars(args), "held_out": 3}), tmp_path)["held_out"]) == 3
