"""``metrics.jsonl`` across a resume: the rows before the checkpoint's step read as one run, also when the file
lost one of them (a process killed mid-write tears its last line; the checkpoint's history still holds it)."""

from __future__ import annotations

import json

from asyncrl.pipelines.observe.metrics import MetricsWriter, read_jsonl


def _row(step: int) -> dict:
    return {"step": step, "reward/mean": step / 10, "actor/pg_loss": -step / 100}


def test_a_torn_row_is_restored_from_the_checkpoint_history_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    evaluation = {"kind": "eval", "eval/version": 1, "eval/reward_mean": 0.5}  # of the weights after step 0
    lines = [json.dumps(_row(0)), json.dumps(_row(1))[:17]]  # step 1's row torn, the evaluation's lost before it
    path.write_text("\n".join(lines))  # the kill came mid-line: no newline either
    w = MetricsWriter(tmp_path, tensorboard=False, start_step=2, history=[_row(0), _row(1)], evals=[evaluation])
    w.write(2, {"reward/mean": 0.2, "actor/pg_loss": -0.02})
    w.close()
    rows = read_jsonl(path)
    assert [(r["step"], r.get("kind")) for r in rows] == [(0, None), (1, "eval"), (1, None), (2, None)]
    assert rows[1] == {"step": 1, **evaluation} and rows[2] == _row(1)


def test_a_file_that_lost_nothing_is_kept_as_it_was(tmp_path):
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps(_row(s)) + "\n" for s in range(4))
    path.write_text(text)
    MetricsWriter(tmp_path, tensorboard=False, start_step=3, history=[_row(s) for s in range(3)]).close()
    assert path.read_text() == "".join(json.dumps(_row(s)) + "\n" for s in range(3))  # step 3 is redone


def test_a_resume_after_a_torn_row_leaves_no_gap_in_the_steps(ray_cluster, tmp_path):
    from asyncrl.pipelines.commands.cli import main

    out = tmp_path / "run"
    assert main(["train", "--preset", "grpo_toy", "trainer.steps=2", "model.num_layers=1", "model.hidden_size=32",
                 "trainer.batch_size=16", "trainer.progress=false", "trainer.plot=false",
                 f"trainer.output_dir={out}"]) == 0
    path = out / "metrics.jsonl"
    first, second = path.read_text().splitlines()
    path.write_text(first + "\n" + second[:20])  # killed while writing step 1's row
    assert main(["train", "--resume", str(out), "trainer.steps=3"]) == 0
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    assert read_jsonl(path)[1] == json.loads(second)
