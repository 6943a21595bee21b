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


def make_run(out: Path, *, workers: int, mode: str = "batch", steps: int = 6, k: int = 0, scale: float = 1.0,
             twin_profile: Path | None = None) -> None:
    """A run directory whose trace says: a generate call of n rows per rank with L tokens each costs
    L * (STEP_S + SEQ_S * n) + PREFILL_S * prompt tokens; a forward FORWARD_S per token; an update 3 forwards +
    OPT_S; an export 4 ms (every call times `scale`). With `twin_profile` it is a twin run made with that
    profile."""
    import torch
    from tensordict import TensorDict

    cfg = tiny_test()
    cfg.trainer.rollout_workers, cfg.trainer.steps, cfg.trainer.output_dir = workers, steps, str(out)
    cfg.trainer.max_staleness = k
    if mode == "stream":
        cfg.trainer.rollout_mode, cfg.trainer.max_staleness = "stream", 1
    if twin_profile is not None:
        cfg.twin.profile = str(twin_profile)
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
            events.append({"name": name, "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": dur * scale * 1e6,
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
    assert r.join_round_steps == 32  # the HF engine's request batcher: requests join between rounds of chunk_tokens
    assert "rollout.chunk_tokens=32" in p.source("rollout.join_round_steps")


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


def test_a_shared_devices_fit_keeps_the_costs_burns_the_export_and_says_what_it_is(tmp_path):
    from asyncrl.pipelines.twin.profile import Devices

    make_run(tmp_path / "one", workers=1)
    make_run(tmp_path / "two", workers=2)
    sep = fit_profile([tmp_path / "one", tmp_path / "two"], skip=1)
    p = fit_profile([tmp_path / "one", tmp_path / "two"], skip=1, devices="shared")
    assert p.devices == Devices(kind="shared", threads=1, work_per_s=1.0) and sep.devices == Devices()
    assert p.rollout == sep.rollout and p.lengths == sep.lengths and p.model == sep.model
    assert p.training.export_gb_per_s == pytest.approx(p.model.weight_gb / 0.004, rel=1e-9)  # the measured 4 ms
    assert sep.training.export_gb_per_s == 1e6  # separate: the twin's own export is the measured one
    assert "(1: model.num_threads resolved as the workers do)" in p.source("devices.threads")
    assert "not calibrated (no twin runs given)" in p.source("devices.work_per_s")
    assert "devices shared" in p.description


def test_twin_runs_of_the_calibration_runs_calibrate_the_work_in_each_measured_second(tmp_path, capsys):
    from asyncrl.pipelines.commands.cli import main

    runs = [tmp_path / "one", tmp_path / "two"]
    make_run(runs[0], workers=1)
    make_run(runs[1], workers=2)
    first = write_fitted(runs, tmp_path / "work1.yaml", skip=1, devices="shared")
    twins = [tmp_path / "twin_one", tmp_path / "twin_two"]
    # the twins burned the fitted costs on cores the run's own processes kept busy: every call took 1.25 times
    make_run(twins[0], workers=1, scale=1.25, twin_profile=Path(first.path))
    make_run(twins[1], workers=2, scale=1.25, twin_profile=Path(first.path))
    p = fit_profile(runs, skip=1, devices="shared", twins=twins)
    assert p.devices.work_per_s == pytest.approx(0.8, rel=1e-9)  # 1 x 1 / 1.25
    assert p.rollout == first.rollout and p.training == first.training  # the costs are the runs' own
    assert "calibrated by the twins twin_one, twin_two (work_per_s 1)" in p.source("devices.work_per_s")
    assert main(["profile", *map(str, runs), "--out", str(tmp_path / "q.yaml"), "--devices", "shared", "--twins",
                 *map(str, twins)]) == 0
    assert load_profile(str(tmp_path / "q.yaml")).devices.work_per_s == pytest.approx(0.8, rel=1e-9)
    capsys.readouterr()


def test_runs_a_shared_devices_fit_cannot_use_are_refused_naming_the_fix(tmp_path):
    make_run(tmp_path / "one", workers=1)
    make_run(tmp_path / "lagged", workers=1, k=1)
    with pytest.raises(FitError, match=r"lagged \(max_staleness=1\) overlaps them; fit runs made with "
                                       "trainer.max_staleness=0"):
        fit_profile([tmp_path / "one", tmp_path / "lagged"], devices="shared")
    fit_profile([tmp_path / "lagged"], skip=1)  # separate devices: any batch run
    with pytest.raises(FitError, match="devices='gpu': give 'separate'"):
        fit_profile([tmp_path / "one"], devices="gpu")
    with pytest.raises(FitError, match="twin runs calibrate the work per second of devices=shared"):
        fit_profile([tmp_path / "one"], twins=[tmp_path / "one"])
    with pytest.raises(FitError, match=r"give one twin run per run \(1 runs, 2 twins\)"):
        fit_profile([tmp_path / "one"], devices="shared", twins=[tmp_path / "one", tmp_path / "one"])
    with pytest.raises(FitError, match="is not a twin run"):
        fit_profile([tmp_path / "one"], devices="shared", twins=[tmp_path / "one"])
    sep = write_fitted([tmp_path / "one"], tmp_path / "sep.yaml", skip=1)
    make_run(tmp_path / "twin_sep", workers=1, twin_profile=Path(sep.path))
    with pytest.raises(FitError, match="made with separate devices"):
        fit_profile([tmp_path / "one"], devices="shared", twins=[tmp_path / "twin_sep"])
