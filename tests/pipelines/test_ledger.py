"""The per-sample ledger (pipelines/journaling/ledger.py) on journals written record by record: what it counts
when it holds, each violation named by its sample, the rows' facts measured from a batch, what a rewind keeps,
and ``asyncrl ledger``'s exit statuses. Real runs (batch and stream, with faults) check it in
tests/reliability/test_ledger_runs.py and beside the fault tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.journaling.journal import Journal, read_journal
from asyncrl.pipelines.journaling.ledger import LEDGER, LedgerFile, check_ledger, read_samples, row_facts

G, B = 4, 2  # tiny_test: batch_size 8 = 2 groups of 4


def header(mode: str = "batch", k: int = 1) -> dict:
    cfg = tiny_test()
    cfg.trainer.max_staleness, cfg.trainer.rollout_mode = k, mode
    if mode == "stream":
        cfg.trainer.rollout_weights = "latest"
    return {"fingerprint": "f", "config": to_dict(cfg.validate())}


def facts(lo: list[int], hi: list[int] | None = None, replica: int = 0) -> TensorDict:
    n = len(lo)
    return TensorDict({"replica": torch.full((n,), replica, dtype=torch.int32), "lo": torch.tensor(lo).int(),
                       "hi": torch.tensor(hi if hi is not None else lo).int(), "tokens": torch.full((n,), 4).int()},
                      batch_size=[n])


def batch_run(run: Path, *, steps: int = 3, k: int = 1, measured: dict[int, list[int]] | None = None) -> Journal:
    """A batch-mode run of `steps` steps, batch t at version max(0, t - k), each step measured at its version."""
    j = Journal(run / "journal.jsonl")
    j.start(header("batch", k))
    rows = LedgerFile(run / LEDGER)
    rows.start(None, 0)
    for t in range(steps):
        v = max(0, t - k)
        j.batch(t, prompts=[2 * t, 2 * t + 1], seed=t, version=v, rows=8)
        j.step(t, batch=t, version=v)
        rows.append(t, facts((measured or {}).get(t, [v] * 8)))
    return j


def test_a_clean_batch_run_holds_and_counts_every_sample(tmp_path):
    j = batch_run(tmp_path)
    j.left(batches=[], groups=[])
    j.end(3, None)
    rep = check_ledger(tmp_path)
    assert rep.ok, rep.render()
    assert (rep.samples, rep.trained, rep.dropped, rep.steps, rep.measured_steps) == (24, 24, {}, 3, 3)
    assert rep.staleness == {0: 8, 1: 16}  # step 0 at version 0, steps 1 and 2 one version behind
    assert rep.replicas == 1
    samples, _, by_step = read_samples(tmp_path)
    assert [(s.group, s.row, s.seed) for s in by_step[1][:5]] == [(2, 0, 1), (2, 1, 1), (2, 2, 1), (2, 3, 1),
                                                                   (3, 0, 1)]
    assert samples[(5, 3, 2)].as_dict() == {"group": 5, "row": 3, "seed": 2, "admitted_version": 1,
                                            "trained_step": 2, "dropped": None, "replica": 0, "versions": [1, 1],
                                            "tokens": 4}


def test_a_sample_never_trained_nor_dropped_is_lost_and_named(tmp_path):
    j = batch_run(tmp_path)
    j.batch(3, prompts=[6, 7], seed=3, version=2, rows=8)  # generated, never trained, not in `left`
    j.left(batches=[], groups=[])
    j.end(3, None)
    rep = check_ledger(tmp_path, limit=1)
    assert not rep.ok and rep.lost == 8
    assert rep.violations == ["lost: sample 6:0 (seed 3), admitted at version 2, was never trained, dropped or left"]


def test_what_the_end_leaves_untrained_and_stale_drops_are_dropped_with_their_reason(tmp_path):
    j = batch_run(tmp_path)
    j.batch(3, prompts=[6, 7], seed=3, version=2, rows=8)
    j.batch(4, prompts=[8, 9], seed=4, version=2, rows=8)
    j.drop(3, version=0, at_version=2)
    j.left(batches=[4], groups=[])
    j.end(3, None)
    rep = check_ledger(tmp_path)
    assert rep.ok, rep.render()
    assert rep.dropped == {"stale": 8, "left": 8} and rep.trained == 24


def test_a_sample_trained_twice_is_named_with_both_steps(tmp_path):
    j = batch_run(tmp_path, steps=2)
    j.step(2, batch=1, version=0)  # batch 1 again
    LedgerFile(tmp_path / LEDGER).append(2, facts([0] * 8))
    j.end(3, None)
    rep = check_ledger(tmp_path, limit=1)
    assert rep.trained_twice == 8
    assert "trained_twice: sample 2:0 (seed 1) was trained at steps [1, 2]" in rep.violations


def test_a_token_older_than_the_bound_is_stale_and_named_with_its_versions(tmp_path):
    j = batch_run(tmp_path, measured={2: [1] * 7 + [0]})  # row 7 of step 2: a token of version 0 (k = 1)
    j.end(3, None)
    rep = check_ledger(tmp_path)
    assert rep.violations == ["stale: sample 5:3 (seed 2) trained at step 2 has tokens of versions 0..0 "
                              "(admitted at 1, max_staleness=1)"]


def test_a_token_newer_than_the_step_or_older_than_its_admission_breaks_the_bound(tmp_path):
    j = batch_run(tmp_path, k=2, measured={1: [0] * 7 + [2]})  # step 1 cannot train version 2's tokens
    j.end(3, None)
    [v] = check_ledger(tmp_path).violations
    assert v.startswith("stale: sample 3:3 (seed 1) trained at step 1 has tokens of versions 2..2")


def test_an_unfinished_run_an_unmeasured_step_and_an_unadmitted_group_are_violations(tmp_path):
    j = batch_run(tmp_path, steps=2)
    j.step(2, batch=9, version=1)  # batch 9 was never generated
    LedgerFile(tmp_path / LEDGER).append(2, None, lost="ActorDiedError: the worker died")
    rep = check_ledger(tmp_path, limit=1)
    assert rep.counts == {"run": 1, "unmeasured": 1, "unadmitted": 1}
    assert rep.violations[0].startswith("run: the run has no end record")
    assert "unmeasured: step 2's rows were not measured (ActorDiedError: the worker died)" in rep.violations
    assert "unadmitted: step 2 trained group 18, which the journal never admitted" in rep.violations
    assert check_ledger(tmp_path, finished=False).counts == {"unmeasured": 1, "unadmitted": 1}


def test_dynamic_sampling_trains_its_picks_and_drops_the_other_groups_as_filtered(tmp_path):
    j = Journal(tmp_path / "journal.jsonl")
    j.start(header("batch", 0))
    LedgerFile(tmp_path / LEDGER).start(None, 0)
    j.filter(0, seeds=[7, 1_000_000_014], picks=[(1, 1), (0, 0)])  # call 1's group 1, then call 0's group 0
    j.batch(0, prompts=[0, 1], seed=7, version=0, rows=8)
    j.step(0, batch=0, version=0)
    LedgerFile(tmp_path / LEDGER).append(0, facts([0] * 8))
    j.left(batches=[], groups=[])
    j.end(1, None)
    rep = check_ledger(tmp_path)
    assert rep.ok, rep.render()
    assert (rep.samples, rep.trained, rep.dropped) == (16, 8, {"filtered": 8})
    _, _, by_step = read_samples(tmp_path)
    assert [(s.group, s.seed) for s in by_step[0][::G]] == [(1, 1_000_000_014), (0, 7)]


def stream_run(run: Path) -> Journal:
    """A streaming run: groups 0-5 admitted; steps 0 and 1 train [1, 0] and [2, 4]; 3 rejected; 5 dropped."""
    j = Journal(run / "journal.jsonl")
    j.start(header("stream", 1))
    LedgerFile(run / LEDGER).start(None, 0)
    for g, v in [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (5, 1)]:
        j.group(g, seed=100 + g, version=v)
    j.step(0, batch=0, version=0, groups=[1, 0])
    LedgerFile(run / LEDGER).append(0, facts([0] * 8))
    j.group_filter(3, version=0)
    j.step(1, batch=1, version=0, groups=[2, 4])
    LedgerFile(run / LEDGER).append(1, facts([0] * 4 + [1] * 4, [1] * 8, replica=1))
    j.group_drop(5, version=1, at_version=3)
    return j


def test_a_stream_run_holds_with_its_rejects_drops_and_the_groups_left_at_the_end(tmp_path):
    j = stream_run(tmp_path)
    j.group(6, seed=106, version=2)
    j.left(batches=[], groups=[6])
    j.end(2, None)
    rep = check_ledger(tmp_path)
    assert rep.ok, rep.render()
    assert (rep.samples, rep.trained, rep.dropped) == (28, 16, {"filtered": 4, "stale": 4, "left": 4})
    assert rep.staleness == {0: 8 + 4, 1: 4}
    samples, _, _ = read_samples(tmp_path)
    assert samples[(4, 0, 104)].replica == 1 and samples[(4, 0, 104)].versions == (1, 1)


def test_a_stream_group_trained_past_its_admission_bound_is_stale(tmp_path):
    j = stream_run(tmp_path)
    j.group(6, seed=106, version=0)
    j.group(7, seed=107, version=2)
    j.step(2, batch=2, version=0, groups=[6, 7])  # group 6, admitted at 0, two versions behind step 2
    LedgerFile(tmp_path / LEDGER).append(2, facts([2] * 8))
    j.left(batches=[], groups=[])
    j.end(3, None)
    rep = check_ledger(tmp_path, limit=1)
    assert rep.violations == ["stale: sample 6:0 (seed 106) admitted at version 0 was trained at step 2 "
                              "(max_staleness=1)"]


def test_a_balanced_steps_rows_are_measured_in_the_order_of_its_batch_not_of_its_groups(tmp_path):
    """``trainer.balance_batch`` deals a step's groups out to the training ranks by their tokens, so the batch's
    rows (and ``ledger.jsonl``'s measurements of them) follow another order than the groups the step took; the
    step record's ``rows`` names it, and each sample gets its own group's measured versions."""
    j = Journal(tmp_path / "journal.jsonl")
    j.start(header("stream", 4))
    LedgerFile(tmp_path / LEDGER).start(None, 0)
    j.group(0, seed=100, version=0)
    j.group(1, seed=101, version=0)
    j.step(0, batch=0, version=0, groups=[0, 1])
    LedgerFile(tmp_path / LEDGER).append(0, facts([0] * 8))
    j.group(2, seed=102, version=0)  # decoded with version 0 ...
    j.group(3, seed=103, version=1)  # ... and this one with version 1, admitted at 1
    j.step(1, batch=1, version=0, groups=[2, 3], rows=[3, 2])  # the batch holds group 3's rows first
    LedgerFile(tmp_path / LEDGER).append(1, facts([1] * 4 + [0] * 4))
    j.left(batches=[], groups=[])
    j.end(2, None)
    rep = check_ledger(tmp_path)
    assert rep.ok, rep.render()  # read in the groups' order, group 3 (admitted at 1) would hold version-0 tokens
    samples, _, by_step = read_samples(tmp_path)
    assert [s.group for s in by_step[1][::G]] == [3, 2]
    assert samples[(3, 0, 103)].versions == (1, 1) and samples[(2, 0, 102)].versions == (0, 0)
    assert read_journal(tmp_path / "journal.jsonl").steps[1]["groups"] == [2, 3]  # what a replay takes, unchanged


def test_a_restart_rewind_keeps_the_groups_settled_before_its_checkpoint_and_records_what_it_discarded(tmp_path):
    """A rewind to the checkpoint of step 1, whose stream state lists groups 2, 4 and 5 as pending (admitted,
    untrained when it was written: 2 trained at the discarded step 1, 5 dropped at a later take) and 6 as the
    next new group: the groups settled before it (0 and 1 trained at step 0, 3 rejected) keep their records, the
    pending ones are admitted again, and the rewind record names the discarded step."""
    j = stream_run(tmp_path)
    j.rewind(next_gen=0, start_step=1, pending=[2, 4, 5], next_group=6)
    data = read_journal(tmp_path)
    assert sorted(data.groups) == [0, 1, 3]  # trained at step 0, or rejected before the checkpoint
    assert sorted(data.steps) == [0]
    assert [r["index"] for r in data.group_filters] == [3] and data.group_drops == []
    assert data.rewinds == [{"kind": "rewind", "start_step": 1, "next_gen": 0, "discarded_steps": [1]}]
    rows = LedgerFile(tmp_path / LEDGER)
    rows.start(rows.path, 1)
    assert [json.loads(x)["step"] for x in rows.path.read_text().splitlines()] == [0]
    # the restarted segment admits the pending groups again, trains them, and ends
    for g, v in [(2, 1), (4, 1), (5, 1)]:
        j.group(g, seed=100 + g, version=v)
    j.step(1, batch=1, version=1, groups=[2, 4])
    rows.append(1, facts([1] * 8))
    j.left(batches=[], groups=[5])
    j.end(2, None)
    rep = check_ledger(tmp_path)
    assert rep.ok, rep.render()
    assert (rep.rewinds, rep.discarded_steps, rep.trained, rep.dropped) == (1, 1, 16, {"filtered": 4, "left": 4})


def test_row_facts_measure_replica_and_the_oldest_and_newest_model_token_version():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    tv = torch.tensor([[2, 3, 3, -1], [-1, 4, -1, -1], [-1, -1, -1, -1]])  # row 1: an environment token first
    td = TensorDict({"response_mask": mask, "token_versions": tv, "version": torch.tensor([2, 4, 5]),
                     "replica": torch.tensor([3, 3, 7])}, batch_size=[3])
    out = row_facts(td)
    assert out["replica"].tolist() == [3, 3, 7] and out["tokens"].tolist() == [3, 2, 0]
    assert out["lo"].tolist() == [2, 4, 5] and out["hi"].tolist() == [3, 4, 5]  # row 2 has no model token
    plain = row_facts(TensorDict({"response_mask": mask, "version": torch.tensor([1, 1, 2])}, batch_size=[3]))
    assert plain["replica"].tolist() == [-1, -1, -1] and plain["lo"].tolist() == plain["hi"].tolist() == [1, 1, 2]


def test_asyncrl_ledger_exits_0_when_it_holds_1_naming_the_sample_when_not_and_2_without_a_journal(
        tmp_path, capsys):
    from asyncrl.pipelines.commands.cli import main

    j = batch_run(tmp_path / "ok")
    j.left(batches=[], groups=[])
    j.end(3, None)
    assert main(["ledger", str(tmp_path / "ok"), "--samples", str(tmp_path / "s.jsonl")]) == 0
    assert "ledger holds" in capsys.readouterr().out
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert len(lines) == 24 and lines[0]["group"] == 0 and lines[0]["trained_step"] == 0
    j = batch_run(tmp_path / "bad")
    j.end(2, None)  # steps 0..2 recorded, but the end says 2: fine; lose batch 2's samples instead
    (tmp_path / "bad" / "journal.jsonl").write_text("".join(
        x + "\n" for x in (tmp_path / "bad" / "journal.jsonl").read_text().splitlines() if '"step": 2' not in x))
    assert main(["ledger", str(tmp_path / "bad")]) == 1
    assert "lost: sample 4:0 (seed 2), admitted at version 1, was never trained, dropped or left" in \
        capsys.readouterr().out
    assert main(["ledger", str(tmp_path / "nothing")]) == 2
    assert "no run journal at" in capsys.readouterr().err
