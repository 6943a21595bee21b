"""A twin profile fitted to real runs: the cost model's numbers read off a run's ``trace.json``, ``metrics.jsonl``,
journal and ``ledger.jsonl`` (``asyncrl profile RUN ... --out FILE.yaml``).

What each number is fitted from (every source line of the written profile says it, with the run)::

    rollout.decode_base_ms, decode_ms_per_seq   generate calls (exec, as the worker timed them): a call of n rows per
                                                rank whose longest row has L tokens costs L * (base + per_seq * n)
                                                + prefill; least squares over the calls (per_seq needs runs with
                                                different rows per rank, e.g. 1 and 2 rollout workers; else 0)
    rollout.prefill_ms_per_token                the calls' constant part over their prompt tokens
    rollout.join_round_steps                    the runs' engine: hf (the request-level batcher) joins requests
                                                between rounds of rollout.chunk_tokens; another, at every step (0)
    rollout.weight_pull_gb_per_s, _load_gb_per_s
    training.export_gb_per_s                    set high: a twin of the run moves the run's own weights for real
                                                (its training ranks export the run's model as their stand-in), so
                                                the measured sync time is what the twin runs itself; a simulated
                                                cost on top would count it twice (the measured times are in the
                                                sources)
    training.peak_tflops (mfu 1)                old_log_prob calls: 2 * params * tokens / time (a forward pass)
    training.hbm_gb_per_s                       actor_update calls less 3 forwards: the per-step rest, as the
                                                optimizer term (params * 16 bytes / (ranks * rate))
    lengths (histogram)                         every trained row's response tokens (ledger.jsonl)
    lengths.prompt_tokens                       the mean prompt length of the run's batches
    devices (``devices="shared"``)              the runs' workers' torch threads; the export's measured time;
                                                work_per_s from twins of the runs (``twins``), else 1

``devices="shared"`` (``asyncrl profile --devices shared``) fits a twin of CPU runs on this machine: the costs
are burned as CPU work on the cores the run shares (docs/scale.md), so they must be each stage's cost alone:
every run at ``trainer.max_staleness=0`` (the synchronous loop: no stage overlaps another), else
:class:`FitError`. The export's measured time is burned too (the twin's own export of its stand-in weights is
free once built); the weight load stays set high (its measured span waits for the export).

A measured cost is the time a call took, not the CPU work in it: the run's own processes (Ray, the controller,
the idle workers) and the machine's other jobs kept the cores partly busy meanwhile, and burning that time
again on the same cores would count them twice. ``twins`` calibrates it: twin runs of the same runs made with a
shared profile of them; ``devices.work_per_s`` becomes that profile's times the runs' generate, old_log_prob and
actor_update time over the twins' (medians per call, summed), so the twin of a calibration run takes as long as
the run.

Rollout costs are fitted from batch-mode runs only: a streaming run's group calls share the engine's decoding
rounds, so one call's time is not its own cost (:class:`FitError` says so). What the fit cannot see: the rule
reward's time (the twin's reward is free), and, with separate devices (the default), the CPU cores the real
workers share (the twin's simulated GPUs never contend) -- docs/scale.md says where that makes the twin miss.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from asyncrl.pipelines.configlib import ConfigError
from asyncrl.pipelines.journaling.journal import read_journal
from asyncrl.pipelines.journaling.ledger import LEDGER, read_ledger_rows
from asyncrl.pipelines.twin.profile import (Devices, LengthModel, ModelSize, Profile, RolloutCosts, TrainCosts,
                                            dump_profile, load_profile)
from asyncrl.pipelines.job.config import JobConfig
from asyncrl.pipelines.configlib import from_dict
from asyncrl.pipelines.run.build import build_data
from asyncrl.roles.modeling.models import meta_model, resolve_model_dir

__all__ = ["FitError", "RunCosts", "run_costs", "fit_profile", "write_fitted", "DEVICES"]

DEVICES = ("separate", "shared")
"""What ``devices`` of :func:`fit_profile` takes (``Devices.kind`` of the profile)."""

OPT_BYTES = 16.0
"""Bytes per parameter of the fitted optimizer term (its rate is fitted, so only their product matters)."""


class FitError(ConfigError):
    """Raised when runs cannot be fitted: no trace, no measured rows, a streaming run for the rollout costs."""


@dataclass
class RunCosts:
    """What one run's files say about its costs (seconds; per call)."""

    run: str
    mode: str
    rollout_ranks: int
    train_ranks: int
    params: int
    weight_bytes: int
    prompt_tokens: float
    max_new_tokens: int
    gen: list[tuple[float, int, int, float]] = field(default_factory=list)
    """Per generate call: ``(seconds, rows per rank, longest row's tokens, prompt tokens per rank)``."""
    forward: list[tuple[float, float]] = field(default_factory=list)
    """Per old_log_prob call: ``(seconds, tokens per rank)``."""
    update: list[tuple[float, float]] = field(default_factory=list)
    """Per actor_update call: ``(seconds, tokens per rank)``."""
    export: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    """Response tokens of every trained row."""
    max_staleness: int = 0
    join_round_steps: int = 0
    """The HF request batcher's rounds (``rollout.chunk_tokens``) when the run's engine is ``hf``, else 0."""
    threads: int = 1
    """Torch intra-op threads of the run's workers (``model.num_threads`` resolved as the workers do)."""


def _params(cfg: Any) -> tuple[int, int]:
    """``(parameters, bytes of the weights as trained)`` of the run's model (built on the meta device)."""
    from dataclasses import replace

    import torch


    model_cfg = cfg.model
    if model_cfg.gguf is not None:
        model_cfg = replace(model_cfg, gguf=None, path=resolve_model_dir(model_cfg))
    model = meta_model(model_cfg)
    assert model is not None
    n = sum(p.numel() for p in model.parameters())
    size = {"bfloat16": 2, "float16": 2}.get(model_cfg.dtype, torch.finfo(torch.float32).bits // 8)
    return n, n * size


def _threads(num_threads: int | str | None, cpus_per_worker: float) -> int:
    """The torch threads a worker of the run used (``set_torch_threads``: None and ``follow`` start at the CPU
    share, 0 is every core)."""
    import os

    if isinstance(num_threads, int) and num_threads > 0:
        return num_threads
    if num_threads == 0:
        return os.cpu_count() or 1
    return max(1, int(cpus_per_worker))


def _spans(run: Path) -> dict[str, list[dict[str, Any]]]:
    path = run / "trace.json"
    if not path.is_file():
        raise FitError(f"no trace.json in {str(run)!r}; fit a run made with trainer.trace=true (the default)")
    out: dict[str, list[dict[str, Any]]] = {}
    for e in json.loads(path.read_text())["traceEvents"]:
        if e.get("ph") != "X":
            continue
        part = (e.get("args") or {}).get("part")
        if part in (None, "exec", "call"):
            out.setdefault(e["name"], []).append(e)
    return out


def run_costs(run: str | Path, *, skip: int = 1) -> RunCosts:
    """Read one run's costs (its first `skip` steps are warm-up: left out)."""
    path = Path(run)
    data = read_journal(path)
    if data.header is None or "config" not in data.header:
        raise FitError(f"{str(path)!r} has no run journal with its config; fit a run directory")
    cfg = from_dict(JobConfig, data.header["config"])
    rows = read_ledger_rows(path / LEDGER)
    if not rows:
        raise FitError(f"{str(path)!r} has no {LEDGER} (the measured rows); fit a run made by this version")
    t = cfg.trainer
    params, weight_bytes = _params(cfg)
    loader, _ = build_data(cfg, path / "_fit")
    assert loader is not None
    steps = sorted(s for s in data.steps if s >= skip)
    prompt = statistics.fmean(float(loader.batch(s)["prompt_mask"].sum(1).float().mean()) for s in steps[:8] or [0])
    n_roll = int(t.rollout_start)
    n_train = int(t.train_workers)
    rc = RunCosts(str(path), t.rollout_mode, n_roll, n_train, params, weight_bytes, prompt,
                  int(cfg.rollout.max_new_tokens), max_staleness=int(t.max_staleness),
                  join_round_steps=int(cfg.rollout.chunk_tokens) if cfg.rollout.engine == "hf" else 0,
                  threads=_threads(cfg.model.num_threads, t.cpus_per_worker))
    by_batch = {int(st["batch"]): s for s, st in data.steps.items()}
    tokens_of = {s: r["tokens"] for s, r in rows.items() if "tokens" in r}
    for s in steps:
        rc.lengths += list(tokens_of.get(s, []))
    spans = _spans(path)
    dur = lambda e: float(e["dur"]) / 1e6  # noqa: E731 - microseconds in trace.json
    if t.rollout_mode == "batch":
        for e in spans.get("generate", []):
            b = int(e["args"].get("step", -1))
            s = by_batch.get(b)
            if s is None or s < skip or s not in tokens_of or e["args"].get("call"):
                continue
            toks = tokens_of[s]
            per_rank = -(-len(toks) // n_roll)
            rc.gen.append((dur(e), per_rank, max(toks), per_rank * prompt))
    for name, into in (("old_log_prob", rc.forward), ("actor_update", rc.update)):
        for e in spans.get(name, []):
            s = int(e["args"].get("step", -1))
            if s >= skip and s in tokens_of:
                toks = tokens_of[s]
                into.append((dur(e), (len(toks) * prompt + sum(toks)) / n_train))
    rc.export = [dur(e) for e in spans.get("export_weights", []) if int(e["args"].get("step", -1)) >= skip]
    rc.load = [dur(e) for e in spans.get("weight_sync", []) if int(e["args"].get("version", 0)) > skip]
    return rc


def _lstsq(xs: list[list[float]], ys: list[float]) -> list[float] | None:
    """Non-negative least squares by elimination of negative terms (small problems); None when nothing fits.

    Solved in exact rational arithmetic (the normal equations over `fractions.Fraction`), so one set of calls
    always fits to the same bits: LAPACK's least squares may round differently from one call to the next (its
    blocking follows the arrays' memory alignment), and two fits of the same runs must be equal."""
    cols = list(range(len(xs[0])))
    while cols:
        sol = _normal_solve(xs, ys, cols)
        if sol is None:  # the last column is (nearly) a combination of the others: not separable
            cols = cols[:-1]
            continue
        if all(v >= 0 for v in sol):
            out = [0.0] * len(xs[0])
            for c, v in zip(cols, sol):
                out[c] = v
            return out
        cols = [c for c, v in zip(cols, sol) if v >= 0]
    return None


def _normal_solve(xs: list[list[float]], ys: list[float], cols: list[int]) -> list[float] | None:
    """The least-squares solution over `cols` from the exact normal equations; None when a column's part not
    explained by the ones before it is under 1e-12 of its own size (rank deficient, as a rank test with a
    tolerance would say)."""
    X = [[Fraction(x[c]) for c in cols] for x in xs]
    Y = [Fraction(y) for y in ys]
    k = len(cols)
    M = [[sum((r[i] * r[j] for r in X), Fraction(0)) for j in range(k)] for i in range(k)]
    v = [sum((r[i] * y for r, y in zip(X, Y)), Fraction(0)) for i in range(k)]
    diag = [M[i][i] for i in range(k)]
    for i in range(k):  # elimination in column order: a Gram matrix's pivots are the unexplained parts
        if M[i][i] <= diag[i] * Fraction(1, 10**12):  # (diag >= 0: a zero column is refused too)
            return None
        for j in range(i + 1, k):
            f = M[j][i] / M[i][i]
            M[j] = [a - f * b for a, b in zip(M[j], M[i])]
            v[j] -= f * v[i]
    sol = [Fraction(0)] * k
    for i in reversed(range(k)):
        sol[i] = (v[i] - sum((M[i][j] * sol[j] for j in range(i + 1, k)), Fraction(0))) / M[i][i]
    return [float(s) for s in sol]


def _work_per_s(runs: list[RunCosts], twins: list[str | Path], skip: int) -> tuple[float, str]:
    """``devices.work_per_s`` calibrated by `twins` (twin runs of `runs`, in order, on a shared profile) and what
    it was computed from (module docstring)."""
    if len(twins) != len(runs):
        raise FitError(f"give one twin run per run ({len(runs)} runs, {len(twins)} twins), in the same order")
    real_s = twin_s = 0.0
    prior: set[float] = set()
    for rc, path in zip(runs, twins):
        data = read_journal(Path(path))
        if data.header is None or "config" not in data.header:
            raise FitError(f"{str(path)!r} has no run journal with its config; give the twin runs' directories")
        profile = data.header["config"].get("twin", {}).get("profile")
        if profile is None:
            raise FitError(f"{str(path)!r} is not a twin run (no twin.profile); give twin runs of the runs")
        try:
            p = load_profile(str(profile))
        except ConfigError as e:
            raise FitError(f"the twin run {str(path)!r} was made with {profile!r}, which cannot be read ({e}); "
                           "keep the profile a twin run was made with until it is fitted again") from None
        if not p.devices.shared:
            raise FitError(f"the twin run {str(path)!r} was made with separate devices ({profile!r}); calibrate "
                           "with twin runs made on a devices.kind=shared profile")
        prior.add(p.devices.work_per_s)
        tc = run_costs(path, skip=skip)
        for a, b in ((rc.gen, tc.gen), (rc.forward, tc.forward), (rc.update, tc.update)):
            if a and b:
                real_s += statistics.median(x[0] for x in a)
                twin_s += statistics.median(x[0] for x in b)
    if len(prior) != 1 or not twin_s > 0:
        raise FitError("the twin runs were made with different devices.work_per_s values, or time no call; make "
                       "them with one shared profile of these runs")
    (w,) = prior
    names = ", ".join(Path(t).name for t in twins)
    how = (f"calibrated by the twins {names} (work_per_s {w:g}): the runs' generate, old_log_prob and actor_update "
           f"calls took {real_s * 1e3:.2f} ms where the twins' took {twin_s * 1e3:.2f} ms (medians per call, "
           f"summed): {w:g} x {real_s / twin_s:.4f}")
    return w * real_s / twin_s, how


def fit_profile(runs: list[str | Path], *, name: str | None = None, skip: int = 1,
                devices: str = "separate", twins: list[str | Path] | None = None) -> Profile:
    """A profile fitted to `runs` (see the module), every number's source naming the runs and the fit; `devices`
    ``shared`` fits a twin of CPU runs on this machine, `twins` (twin runs of `runs` on a shared profile of them)
    calibrates its work per second (module docstring)."""
    if devices not in DEVICES:
        raise FitError(f"devices={devices!r}: give 'separate' (a device per simulated GPU) or 'shared' (the run's "
                       "CPU cores, a twin of CPU runs on this machine)")
    if twins and devices != "shared":
        raise FitError("twin runs calibrate the work per second of devices=shared; fit with devices=shared")
    costs = [run_costs(r, skip=skip) for r in runs]
    base = costs[0]
    if any(c.params != base.params for c in costs):
        raise FitError("the runs train different models; fit one model's runs together")
    shared = devices == "shared"
    if shared:
        lagged = [f"{Path(c.run).name} (max_staleness={c.max_staleness})" for c in costs if c.max_staleness != 0]
        if lagged:
            raise FitError(f"devices=shared burns each stage's cost alone on the shared cores, so it is fitted to "
                           f"runs whose stages never overlap: {', '.join(lagged)} overlaps them; fit runs made "
                           "with trainer.max_staleness=0")
        if len({c.threads for c in costs}) > 1:
            raise FitError(f"devices=shared: the runs' workers used different torch threads "
                           f"({sorted({c.threads for c in costs})}); fit runs of one thread count")
    gen = [g for c in costs for g in c.gen]
    if not gen:
        raise FitError("no batch-mode generate call to fit the rollout costs from (a streaming run's group calls "
                       "share the engine's rounds); add a run with trainer.rollout_mode=batch")
    names = ", ".join(Path(c.run).name for c in costs)
    work, how_work = _work_per_s(costs, twins, skip) if twins else (
        1.0, "not calibrated (no twin runs given): every measured second taken as a second of work alone")
    # generate: seconds = L * base + prompt_tokens * prefill + L * n * per_seq (the last term goes first when the
    # calls cannot tell it apart: one rows-per-rank value); calls a loaded machine stretched (residual over 3 median
    # absolute deviations) are left out and the rest fitted again
    sol = _lstsq([[L, p, L * n] for _, n, L, p in gen], [d for d, *_ in gen])
    if sol is not None:
        res = [abs(d - (L * sol[0] + p * sol[1] + L * n * sol[2])) for d, n, L, p in gen]
        mad = statistics.median(res)
        kept = [g for g, r in zip(gen, res) if r <= 3 * mad] if mad > 0 else gen
        if len(kept) >= 3 and len(kept) < len(gen):
            gen = kept
            sol = _lstsq([[L, p, L * n] for _, n, L, p in gen], [d for d, *_ in gen])
    if sol is None or sol[0] + sol[2] <= 0:
        sol = [statistics.fmean(d / L for d, _, L, _ in gen), 0.0, 0.0]
    step_s, prefill_s, seq_s = sol
    rows_seen = sorted({n for _, n, _, _ in gen})
    fwd = [f for c in costs for f in c.forward]
    upd = [u for c in costs for u in c.update]
    if not upd:
        raise FitError("no actor_update call in the runs' traces; fit runs that trained at least skip + 1 steps")
    if fwd:  # medians: a loaded machine stretches some calls
        per_token = statistics.median(d / t for d, t in fwd)
        how_fwd = f"old_log_prob calls: {len(fwd)}, median {per_token * 1e6:.3f} us per token"
    else:  # the bypass: no forward pass of its own; the update is 3 forwards and the rest
        per_token = statistics.median(d / (3 * t) for d, t in upd)
        how_fwd = f"actor_update calls / 3 (no old_log_prob pass: bypass): median {per_token * 1e6:.3f} us per token"
    opt_s = max(1e-6, statistics.median(d - 3 * per_token * t for d, t in upd))
    params = base.params
    weight_gb = base.weight_bytes / 1e9
    export_s = statistics.fmean([e for c in costs for e in c.export] or [1e-3])
    exports = [e for c in costs for e in c.export]
    load_s = statistics.fmean([x for c in costs for x in c.load] or [1e-3])
    lengths = [x for c in costs for x in c.lengths]
    cap = base.max_new_tokens
    counts = [0.0] * cap
    for x in lengths:
        counts[min(max(int(x), 1), cap) - 1] += 1
    src = f"fitted (asyncrl profile) from the runs {names}, steps >= {skip}"
    sources = {
        "model.params_b": f"{src}: the run's model built on the meta device, {params} parameters",
        "model.weight_gb": f"{src}: {params} parameters x {base.weight_bytes // params} bytes",
        "rollout.gpus": f"{src}: one rollout worker per replica",
        "rollout.max_num_seqs": f"{src}: no bound on this machine (a batch's rows decode together)",
        "rollout.kv_cache_tokens": f"{src}: no bound on this machine",
        "rollout.decode_base_ms": f"{src}: least squares over {len(gen)} generate calls (exec; calls stretched past 3 "
                                  "median absolute deviations left out): seconds = L x base + "
                                  f"L x rows x per_seq + prompt tokens x prefill; rows per rank seen {rows_seen}",
        "rollout.decode_ms_per_seq": f"{src}: the same fit" + ("" if len(rows_seen) > 1 else
                                                               " (one rows-per-rank value seen: not separable, 0)"),
        "rollout.decode_ms_per_1k_kv": f"{src}: not separable from the step cost on this machine (0)",
        "rollout.prefill_ms_per_token": f"{src}: the same fit (the calls' constant part per prompt token)",
        "rollout.join_round_steps": (f"{src}: the runs' rollout.engine=hf: its request-level batcher runs rounds of "
                                     f"rollout.chunk_tokens={base.join_round_steps} tokens and requests join "
                                     "between them" if base.join_round_steps else
                                     f"{src}: the runs' engine batches continuously (0: a request joins at the "
                                     "next step)"),
        "rollout.weight_pull_gb_per_s": f"{src}: one machine, no network hop (set high)",
        "rollout.weight_load_gb_per_s": f"{src}: set high: the twin loads the run's own weights for real (mean "
                                        f"weight_sync span measured {load_s * 1e3:.1f} ms for {weight_gb:.4f} GB)",
        "training.gpus": f"{src}: one training worker per rank",
        "training.peak_tflops": f"{src}: 2 x params x tokens / seconds of a forward pass ({how_fwd}), mfu folded in",
        "training.mfu": f"{src}: folded into peak_tflops (1)",
        "training.hbm_gb_per_s": f"{src}: actor_update calls less 3 forward passes (median): {opt_s * 1e3:.2f} ms "
                                 "per step "
                                 f"= params x {OPT_BYTES:g} bytes / (ranks x rate)",
        "training.optimizer_bytes_per_param": f"{src}: nominal (the rate is fitted)",
        "training.export_gb_per_s": (f"{src}: weight_gb / the median export_weights call ({len(exports)} calls, "
                                     f"{statistics.median(exports or [1e-3]) * 1e3:.2f} ms), burned on the shared "
                                     "cores (the twin's export of its stand-in weights is free once built)")
                                    if shared else
                                    f"{src}: set high: the twin exports the run's own weights for real (mean "
                                    f"export_weights call measured {export_s * 1e3:.1f} ms for {weight_gb:.4f} GB)",
        "lengths.prompt_tokens": f"{src}: mean prompt tokens of the run's batches",
        "lengths.max_new_tokens": f"{src}: the run's rollout.max_new_tokens",
        "lengths.edges": f"{src}: one bin per response length 1 .. rollout.max_new_tokens (k - 0.5 .. k + 0.5: a "
                         "draw rounds to k)",
        "lengths.counts": f"{src}: {len(lengths)} trained rows' response tokens (ledger.jsonl)",
    }
    if shared:
        sources["devices.work_per_s"] = f"{src}: {how_work}"
        sources["devices.threads"] = (f"{src}: the torch threads of the runs' workers ({base.threads}: "
                                      "model.num_threads resolved as the workers do); every "
                                      "cost above was measured at max_staleness=0 (each stage alone) and is burned "
                                      "as CPU work on these threads, sharing the cores with the rest of the run")
    return Profile(
        name=name or f"fitted_{Path(base.run).name}",
        description=f"fitted from the runs {names} on this machine (CPU workers)" + (
            "; devices shared: the costs are burned on this machine's cores, as the runs' workers shared them"
            if shared else ""),
        model=ModelSize(params_b=params / 1e9, weight_gb=weight_gb),
        rollout=RolloutCosts(gpus=1, max_num_seqs=max(1024, max(n for _, n, _, _ in gen)), kv_cache_tokens=10**9,
                             decode_base_ms=step_s * 1e3, decode_ms_per_seq=seq_s * 1e3, decode_ms_per_1k_kv=0.0,
                             prefill_ms_per_token=prefill_s * 1e3, weight_pull_gb_per_s=1e6,
                             weight_load_gb_per_s=1e6, join_round_steps=base.join_round_steps),
        training=TrainCosts(gpus=1, peak_tflops=2 * params / per_token / 1e12, mfu=1.0,
                            hbm_gb_per_s=params * OPT_BYTES / (base.train_ranks * opt_s) / 1e9,
                            optimizer_bytes_per_param=OPT_BYTES,
                            export_gb_per_s=weight_gb / statistics.median(exports or [1e-3]) if shared else 1e6),
        lengths=LengthModel(kind="histogram", prompt_tokens=max(1, round(base.prompt_tokens)), max_new_tokens=cap,
                            edges=(1.0, *(k + 0.5 for k in range(1, cap + 1))), counts=tuple(counts)),
        devices=Devices(kind="shared", threads=base.threads, work_per_s=work) if shared else Devices(),
        sources=sources,
    )


def write_fitted(runs: list[str | Path], out: str | Path, *, name: str | None = None, skip: int = 1,
                 devices: str = "separate", twins: list[str | Path] | None = None) -> Profile:
    """Fit `runs` (:func:`fit_profile`), write the profile to `out` and return it as loaded back (checked)."""
    profile = fit_profile(runs, name=name, skip=skip, devices=devices, twins=twins)
    dump_profile(profile, out)
    return load_profile(str(out))
