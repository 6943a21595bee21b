"""benchmarks/vs_trl.py refuses bad input before any run starts: an unknown variant, too few steps,
bad seeds, TRL's venv missing (with the command that makes it); ``--seeds`` reaches every run (asyncrl's
``trainer.seed``, TRL's spec) in a seed-major, alternating order; the per-seed table."""

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
    """The step before and after the redundant pass is removed: k1 and bypass of the
    same run, side by side, with the saving computed from their medians (step 0 skipped)."""
    import argparse

    args = argparse.Namespace(prompts=4, group=4, max_new_tokens=20, steps=3, rounds=1, held_out=64, seeds=[0])

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


def _fake_runs(monkeypatch, tmp_path) -> tuple[list[tuple[str, int]], dict]:
    """Replace the runs (asyncrl and TRL) by recorders that return a fixed result; capture the table."""
    calls: list[tuple[str, int]] = []
    seen: dict = {}
    name = {tuple(o): v for v, (_, o) in vs_trl.VARIANTS.items()}

    def result(seed: int) -> dict:
        return {"step_s": [9.0, 2.0 + seed, 4.0 + seed], "train_s": [1.0] * 3, "generate_s": [1.0] * 3,
                "accuracy": 0.5, "acc_at_s": 10.0, "reward": [0.25]}

    def fake_asyncrl(overrides, args, work, seed):  # noqa: ANN001
        calls.append((name[tuple(overrides)], seed))
        seen["args"] = args
        return result(seed)

    def fake_trl(spec_path, work):  # noqa: ANN001
        import json

        spec = json.loads(spec_path.read_text())
        calls.append(("trl", spec["seed"]))
        seen.setdefault("trl_first_answers", []).append(spec["train"][0]["answer"])
        return result(spec["seed"])

    monkeypatch.setattr(vs_trl, "run_asyncrl", fake_asyncrl)
    monkeypatch.setattr(vs_trl, "run_trl", fake_trl)
    monkeypatch.setattr(vs_trl, "write_result", lambda path, text: seen.update(path=path, text=text))
    return calls, seen


def test_seeds_default_to_zero_and_rounds_alternate_as_before(monkeypatch, tmp_path):
    """Without ``--seeds`` every run is seed 0, round 1 in the given order, round 2 reversed (the order
    before ``--seeds`` existed); the table names the seed and has no per-seed section."""
    calls, seen = _fake_runs(monkeypatch, tmp_path)
    _main(monkeypatch, "--variants", "k1,bypass", "--out", str(tmp_path / "t.md"))
    assert calls == [("k1", 0), ("bypass", 0), ("bypass", 0), ("k1", 0)]
    assert seen["args"].seeds == [0] and seen["args"].rounds == 2 and seen["args"].steps == 8
    assert "8 steps per run, 2 round(s) per seed, seed(s) 0 (`trainer.seed`" in seen["text"]
    assert "Per seed" not in seen["text"]


def test_seeds_run_seed_major_with_the_variants_alternating_and_quick_still_applies(monkeypatch, tmp_path):
    calls, seen = _fake_runs(monkeypatch, tmp_path)
    _main(monkeypatch, "--variants", "k1_follow,bypass_follow", "--seeds", "0,1,2,3", "--rounds", "1", "--quick",
          "--out", str(tmp_path / "t.md"))
    assert calls == [("k1_follow", 0), ("bypass_follow", 0), ("bypass_follow", 1), ("k1_follow", 1),
                     ("k1_follow", 2), ("bypass_follow", 2), ("bypass_follow", 3), ("k1_follow", 3)]
    a = seen["args"]
    assert (a.seeds, a.steps, a.rounds, a.prompts, a.group, a.max_new_tokens, a.held_out) == ([0, 1, 2, 3], 3, 1, 2, 2, 8, 4)
    assert "| held-out accuracy | seed 0 | seed 1 | seed 2 | seed 3 | mean over seeds |" in seen["text"]


def test_the_schedule_alternates_over_every_seed_and_round():
    assert vs_trl.schedule(["a", "b"], [5, 7], 2) == [
        (5, 0, "a"), (5, 0, "b"), (5, 1, "b"), (5, 1, "a"), (7, 0, "a"), (7, 0, "b"), (7, 1, "b"), (7, 1, "a")]
    assert vs_trl.schedule(["a", "b", "c"], [0], 1) == [(0, 0, "a"), (0, 0, "b"), (0, 0, "c")]


@pytest.mark.parametrize("text", ["0,x", "", "1,1", "0,-1", "0,"])
def test_bad_seeds_are_refused(monkeypatch, capsys, text):
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--variants", "k1", "--seeds", text)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --seeds: seeds must be" in err and repr(text) in err


def test_the_asyncrl_command_sets_trainer_seed_before_the_variants_overrides():
    import argparse

    args = argparse.Namespace(prompts=2, group=2, max_new_tokens=8, steps=3, rounds=1, held_out=4, seeds=[2])
    cmd = vs_trl.asyncrl_command(["model.num_threads=follow"], args, Path("/r"), 2)
    assert cmd[1:] == ["-m", "asyncrl.pipelines.commands.cli", "train", "--preset", "grpo_smollm_arith",
                       "trainer.output_dir=/r", "trainer.seed=2", "trainer.progress=false", "trainer.plot=false",
                       "trainer.tensorboard=false", "trainer.checkpoint_at_end=false", "trainer.steps=3",
                       "trainer.batch_size=4", "algorithm.group_size=2", "rollout.max_new_tokens=8",
                       "evaluation.every=0", "evaluation.at_start=false", "evaluation.at_end=true",
                       "evaluation.num_prompts=4", "evaluation.num_samples=0", "model.num_threads=null",
                       "actor.rollout_correction.bypass_mode=off", "model.num_threads=follow"]


def test_the_seed_draws_the_training_prompts_and_their_order_but_not_the_held_out_set(tmp_path):
    """asyncrl's loader with ``trainer.seed`` s (what TRL is given) : other problems, other order; the
    held-out problems are the same for every seed."""
    import argparse

    args = argparse.Namespace(prompts=2, group=2, max_new_tokens=8, steps=2, rounds=1, held_out=2)
    s0, s1 = vs_trl.make_spec(args, tmp_path, 0), vs_trl.make_spec(args, tmp_path, 1)
    assert (s0["seed"], s1["seed"]) == (0, 1)
    assert [t["answer"] for t in s0["train"]] == ["2", "45", "16", "90"]
    assert [t["answer"] for t in s1["train"]] == ["7", "60", "26", "20"]
    assert s0["held_out"] == s1["held_out"] and [h["answer"] for h in s0["held_out"]] == ["26", "6"]
    assert vs_trl.make_spec(args, tmp_path) == s0  # the default is seed 0, the preset's trainer.seed


def test_trl_gets_each_seeds_own_spec(monkeypatch, tmp_path):
    trl_py = tmp_path / "python"
    trl_py.write_text("")
    monkeypatch.setattr(vs_trl, "TRL_PY", trl_py)
    calls, seen = _fake_runs(monkeypatch, tmp_path)
    _main(monkeypatch, "--variants", "trl,k1", "--seeds", "1,0", "--rounds", "1", "--steps", "2", "--prompts", "2",
          "--group", "2", "--held-out", "0", "--out", str(tmp_path / "t.md"))
    assert calls == [("trl", 1), ("k1", 1), ("k1", 0), ("trl", 0)]
    assert seen["trl_first_answers"] == ["7", "2"]


def test_the_per_seed_table_gives_each_seed_the_mean_and_the_bypass_difference():
    import argparse

    args = argparse.Namespace(prompts=4, group=4, max_new_tokens=20, steps=3, rounds=1, held_out=64, seeds=[0, 1, 2])

    def run(seed: int, acc: float, steps: list[float]) -> dict:
        return {"seed": seed, "step_s": steps, "train_s": steps, "generate_s": [1.0] * 3, "accuracy": acc,
                "acc_at_s": 100.0, "reward": [0.25]}

    text = vs_trl.render(args, {
        "k1_follow": [run(0, 0.5, [30.0, 16.0, 18.0]), run(1, 0.25, [30.0, 15.0, 15.0]), run(2, 0.75, [30.0, 17.0, 19.0])],
        "bypass_follow": [run(0, 0.375, [30.0, 13.0, 15.0]), run(1, 0.5, [30.0, 12.0, 12.0]),
                          run(2, 0.5, [30.0, 14.0, 14.0])]}, "note")
    assert "3 steps per run, 1 round(s) per seed, seed(s) 0, 1, 2 (`trainer.seed`" in text
    assert "| asyncrl, max_staleness=1, threads follow the work | 0.500 | 0.250 | 0.750 | 0.500 | 0.250–0.750, sd 0.250 |" in text
    assert ("| asyncrl, max_staleness=1, bypass, threads follow the work | 0.375 | 0.500 | 0.500 | 0.458 | "
            "0.375–0.500, sd 0.072 |") in text
    assert "| difference, `bypass_follow` − `k1_follow` | -0.125 | +0.250 | -0.250 | -0.042 | -0.250 to 0.250, sd 0.260 |" in text
    assert "| asyncrl, max_staleness=1, threads follow the work | 17.00 | 15.00 | 18.00 | 16.67 | 15.00–18.00, sd 1.53 |" in text
    assert "The redundant `old_log_prob` forward removed (`k1_follow` -> `bypass_follow`, nothing else changed" in text
