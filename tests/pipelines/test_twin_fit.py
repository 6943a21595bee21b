"""Fitting a twin profile to runs (pipelines/commands/fit.py, ``asyncrl profile``): run directories written record by
record with known costs give exactly those costs back, in a profile that loads with a source for every number;
runs it cannot fit are refused naming the fix. The real runs it is fitted to: benchmarks/twin_vs_real.py."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.journaling.journal import Journal
from asyncrl.pipelines.journaling.ledger import LEDGER, LedgerFile
from asyncrl.pipelines.run.build import build_data
from asyncrl.pipelines.commands.fit import FitError, fit_profile, run_costs, write_fitted
from asyncrl.pipelines.twin.profile import load_profile
from asyncrl.pipelines.twin.workers import train_costs

STEP_S, PREFILL_S, SEQ_S = 0.010, 0.0005, 0.002  # the costs the synthetic runs are made of
FORWARD_S, OPT_S = 20e-6, 0.005  # per token; the update's rest per step
LENGTHS = {0: 4, 1: 2, 2: 3, 3: 4, 4: 1, 5: 3}  # every row's response tokens, by step


def make_run(out: Path, *, workers: int, mode: str = "batch", steps: int = 6) -> None:
    """A run directory whose trace says: a generate call of n rows per rank with L tokens each costs
    L * (STEP_S + SEQ_S * n) + PREFILL_S * prompt tokens; a forward FORWARD_S per token; an update 3 forwards +
    OPT_S."""
    import torch
    from tensordict import TensorDict

    cfg = tiny_test()
    cfg.trainer.rollout_workers, cfg.trainer.steps, cfg.trainer.output_dir = workers, steps, str(out)
    if mode == "stream":
        cfg.trainer.rollout_mode, cfg.trainer.max_staleness = "stream", 1
    cfg.validate()
    loader, _ = build_data(cfg, out / "_data")
    prompt = statistics.fmean(float(loader.batch(s)["prompt_mask"].sum(1).float().mean()) for s in range(1, steps))
    j = Journal(out / "journal.jsonl")
    j.start({"fingerprint": "f", "config": to_dict(cfg)})
    rows = LedgerFile(out / LEDGER)
    rows.start(None, 0)
    events = []
    n = 8 // workers
    for s in range(steps):
        L = LENGTHS[s]
        j.batch(s, prompts=loader.indices(s), seed=s, version=s, rows=8)
        j.step(s, batch=s, version=s)
        rows.append(s, TensorDict({k: torch.full((8,), v, dtype=torch.int32) for k, v in
                                   (("replica", 0), ("lo", s), ("hi", s), ("tokens", L))}, batch_size=[8]))
        tokens = 8 * prompt + 8 * L
        gen = L * (STEP_S + SEQ_S * n) + PREFILL_S * n * prompt
        for name, dur, args in (("generate", gen, {"step": s, "version": s}), ("old_log_prob", FORWARD_S * tokens, {}),
                                ("actor_update", 3 * FORWARD_S * tokens + OPT_S, {}),
                                ("export_weights", 0.004, {}), ("weight_sync", 0.006, {"version": s + 1})):
            args = {"step": s, **args, "part": "exec" if name != "weight_sync" else None}
            events.append({"name": name, "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": dur * 1e6,
                           "args": {k: v for k, v in args.items() if v is not None}})
    j.end(steps, None)
    (out / "trace.json").write_text(json.dumps({"traceEvents": events}))


def test_a_fit_to_runs_with_known_costs_gives_those_costs_back(tmp_path):
    make_run(tmp_path / "one", workers=1)
    make_run(tmp_path / "two", workers=2)  # 8 and 4 rows per rank: the per-row cost is separable
    p = fit_profile([tmp_path / "one", tmp_path / "two"], name="mine", skip=1)
    r = p.rollout
    assert r.decode_base_ms == pytest.approx(STEP_S * 1e3, rel=1e-6)
    assert r.decode_ms_per_seq == pytest.approx(SEQ_S * 1e3, rel=1e-6)
    assert r.prefill_ms_per_token == pytest.approx(PREFILL_S * 1e3, rel=1e-6)
    costs = run_costs(tmp_path / "one", skip=1)
    for (f, tokens), (u, _) in zip(costs.forward, costs.update):  # the training cost model reproduces every call
        c = train_costs(p, tokens, ranks=1)
        assert c["forward"] == pytest.approx(f, rel=1e-6)
        assert c["forward"] + c["backward"] + c["optimizer"] == pytest.approx(u, rel=1e-6)
    lm = p.lengths
    assert lm.kind == "histogram" and lm.max_new_tokens == 4 and lm.edges == (1.0, 1.5, 2.5, 3.5, 4.5)
    # steps 1..5 of both runs, 8 rows each: lengths 2, 3, 4, 1, 3
    assert lm.counts == (16.0, 16.0, 32.0, 16.0)
    assert "fitted (asyncrl profile) from the runs one, two, steps >= 1" in p.source("rollout.decode_base_ms")


def test_one_rows_per_rank_value_fits_no_per_row_cost_and_says_so(tmp_path):
    make_run(tmp_path / "one", workers=1)
    p = fit_profile([tmp_path / "one"], skip=1)
    assert p.rollout.decode_ms_per_seq == 0.0  # folded into the step: 8 rows per rank in every call
    assert p.rollout.decode_base_ms == pytest.approx((STEP_S + 8 * SEQ_S) * 1e3, rel=1e-6)
    assert "not separable, 0" in p.source("rollout.decode_ms_per_seq")


def test_the_written_profile_loads_with_a_source_for_every_number_and_the_cli_writes_it(tmp_path, capsys):
    from asyncrl.pipelines.commands.cli import main

    make_run(tmp_path / "one", workers=1)
    written = write_fitted([tmp_path / "one"], tmp_path / "p.yaml", skip=1)
    again = load_profile(str(tmp_path / "p.yaml"))
    assert again == written and sorted(again.sources) == sorted(fit_profile([tmp_path / "one"], skip=1).sources)
    assert main(["profile", str(tmp_path / "one"), "--out", str(tmp_path / "q.yaml")]) == 0
    assert f"run it with twin.profile={tmp_path / 'q.yaml'}" in capsys.readouterr().out
    assert load_profile(str(tmp_path / "q.yaml")).name == "fitted_one"


def test_runs_that_cannot_be_fitted_are_refused_naming_the_fix(tmp_path, capsys):
    from asyncrl.pipelines.commands.cli import main

    make_run(tmp_path / "stream", workers=1, mode="stream")
    with pytest.raises(FitError, match="add a run with trainer.rollout_mode=batch"):
        fit_profile([tmp_path / "stream"])
    (tmp_path / "bare").mkdir()
    assert main(["profile", str(tmp_path / "bare"), "--out", str(tmp_path / "x.yaml")]) == 2
    assert "no run journal at" in capsys.readouterr().err
    make_run(tmp_path / "notrace", workers=1)
    (tmp_path / "notrace" / "trace.json").unlink()
    with pytest.raises(FitError, match="trainer.trace=true"):
        fit_profile([tmp_path / "notrace"])
