"""Does the twin agree with reality? Real runs on this machine, a profile fitted to two of them, and the twin's
prediction of six configurations, side by side.

1. Calibration: two real batch-mode runs at ``max_staleness=0`` (the synchronous loop: each stage runs alone,
   so its time is its cost), with 1 and 2 rollout workers (two rows-per-rank values separate a decoding step's
   fixed cost from its per-row cost). ``asyncrl profile`` fits the twin's cost model to them
   (:mod:`asyncrl.pipelines.commands.fit`), once per ``--devices`` kind: ``shared`` (the costs burned as CPU work on
   the cores the run shares: a twin of this machine) and ``separate`` (the costs slept: a device per simulated
   GPU).
2. Six configurations, each run for real and then in the twin of each kind, one after the other (the fitted
   profile, ``twin.time_scale=1``, the same batch, group size, steps and worker counts), the machine's 1-minute
   load read after each run: ``max_staleness`` 0, 1 and 4; batch and stream; 1 and 2 rollout workers.
3. The table: the median step time and the trainer's idle fraction (time waiting for rollout over step time)
   over the steps after the first ``--skip`` (steps stretched past twice the median by the shared machine left
   out), and the staleness histogram (trained samples by how many versions their
   oldest token is behind the step, from each run's ledger) with its total-variation distance. Within +-15 %
   is the target; where it misses, the reason is in docs/scale.md.

    python benchmarks/twin_vs_real.py --preset toy --steps 16 --devices shared,separate
    python benchmarks/twin_vs_real.py --preset smollm --steps 10      # needs the smollm extra
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import load_note, run_header, write_result

import asyncrl
from asyncrl.pipelines.job.config import JobConfig
from asyncrl.pipelines.job.presets import grpo_smollm_arith, grpo_toy
from asyncrl.pipelines.journaling.journal import read_journal
from asyncrl.pipelines.journaling.ledger import check_ledger
from asyncrl.pipelines.observe.metrics import read_jsonl
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.pipelines.commands.fit import write_fitted
from asyncrl.pipelines.twin.profile import TwinConfig
from asyncrl.pipelines.twin.workers import TwinPolicy


@dataclass(frozen=True)
class Case:
    mode: str
    k: int
    workers: int

    @property
    def name(self) -> str:
        return f"{self.mode} k={self.k} rollout x{self.workers}"


CASES = (Case("batch", 0, 1), Case("batch", 1, 1), Case("batch", 4, 1), Case("stream", 1, 1), Case("stream", 4, 1),
         Case("batch", 1, 2))
"""The six configurations (batch k=0 x1 is also a calibration run: its row is in-sample)."""
CALIBRATION = (Case("batch", 0, 1), Case("batch", 0, 2))


def base_config(preset: str, steps: int) -> JobConfig:
    cfg = grpo_toy() if preset == "toy" else grpo_smollm_arith()
    t = cfg.trainer
    t.steps, t.progress, t.plot, t.tensorboard, t.checkpoint_at_end = steps, False, False, False, False
    t.samples_per_step = 0
    cfg.evaluation.every, cfg.evaluation.at_start, cfg.evaluation.at_end = 0, False, False
    return cfg


def configure(cfg: JobConfig, case: Case, out: Path) -> JobConfig:
    t = cfg.trainer
    t.rollout_mode, t.max_staleness, t.rollout_workers, t.output_dir = case.mode, case.k, case.workers, str(out)
    t.rollout_weights = "auto"
    return cfg.validate()


def twin_of(cfg: JobConfig, profile: str | Path) -> JobConfig:
    """`cfg` in the twin: the fitted profile at time scale 1, the same model (its real weights are the stand-in the
    simulated ranks export and the replicas load: the fitted profile adds no simulated sync time), the same
    workers."""
    cfg.twin = TwinConfig(profile=str(profile), time_scale=1.0, tokens_per_id=1, replicas_per_process=1)
    return cfg.validate()


class EagerTwinPolicy(TwinPolicy):
    """The twin's training rank, its stand-in weights built when it starts (as a real policy builds its model), not
    in the first export: that first export would otherwise stall a step by the model's construction."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stand_in()


async def run(cfg: JobConfig) -> list[dict[str, Any]]:
    overrides = {"policy": (EagerTwinPolicy, {})} if cfg.twin.enabled else None
    async with GRPOTrainer(cfg, worker_overrides=overrides) as tr:
        return await tr.fit()


def summary(history: list[dict[str, Any]], out: Path, skip: int) -> dict[str, Any]:
    """Median step time and the idle fraction over the steady steps (after `skip`; a step the loaded machine
    stretched past twice the median is left out of both runs' idle alike), and the ledger's staleness."""
    h = history[skip:]
    step = statistics.median(x["time/step"] for x in h)
    h = [x for x in h if x["time/step"] <= 2 * step]
    idle = sum(x["time/wait_rollout"] for x in h) / sum(x["time/step"] for x in h)
    rep = check_ledger(out)
    assert rep.ok, rep.render()
    total = sum(rep.staleness.values()) or 1
    return {"step": step, "idle": idle, "hist": {d: n / total for d, n in sorted(rep.staleness.items())}}


def tv(a: dict[int, float], b: dict[int, float]) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated runs of one configuration: the median of their step medians and idle fractions (the range of the
    step medians beside it when more than one), the staleness histograms averaged, the loads' range."""
    steps = [x["step"] for x in runs]
    loads = [x["load"] for x in runs]
    hist: dict[int, float] = {}
    for x in runs:
        for d, q in x["hist"].items():
            hist[d] = hist.get(d, 0.0) + q / len(runs)
    span = f" ({min(steps):.3f}-{max(steps):.3f})" if len(runs) > 1 else ""
    return {"step": statistics.median(steps), "steps": f"{statistics.median(steps):.3f}{span}",
            "idle": statistics.median(x["idle"] for x in runs), "hist": dict(sorted(hist.items())),
            "load": f"{min(loads):.1f}" + (f"-{max(loads):.1f}" if len(runs) > 1 else "")}


def fmt_hist(h: dict[int, float]) -> str:
    return " ".join(f"{d}:{p:.2f}" for d, p in h.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=("toy", "smollm"), default="toy")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the means (and the fit)")
    p.add_argument("--work-dir", default=None, help="where the runs go (default: a temporary directory)")
    p.add_argument("--reuse", action="store_true", help="reuse the finished real runs already in --work-dir")
    p.add_argument("--devices", default="shared,separate",
                   help="the twins to fit and run, comma-separated: shared (a twin of this machine: costs burned on "
                        "the cores the run shares), separate (a device per simulated GPU: costs slept)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each configuration (real and twin), in rounds")
    p.add_argument("--out", default=None, help="the result file (default benchmarks/results/twin_vs_real_<preset>.md)")
    a = p.parse_args()
    out_file = a.out or f"benchmarks/results/twin_vs_real_{a.preset}.md"
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="twin_vs_real_"))
    kinds = [k for k in a.devices.split(",") if k]
    load0 = os.getloadavg()[0]
    real: dict[Case, list[dict[str, Any]]] = {}
    twin: dict[tuple[str, Case], list[dict[str, Any]]] = {}

    def real_run(case: Case, r: int) -> None:
        out = work / "real" / f"{case.name.replace(' ', '_')}{f'_r{r}' if r else ''}"
        if a.reuse and (out / "journal.jsonl").is_file() and read_journal(out).end is not None:
            hist = read_jsonl(out / "metrics.jsonl")  # a finished run of an earlier call
        else:
            hist = asyncrl.run(run(configure(base_config(a.preset, a.steps), case, out)))
        s = {"out": out, **summary(hist, out, a.skip), "load": os.getloadavg()[0]}
        real.setdefault(case, []).append(s)
        print(f"real {case.name} #{r}: step {s['step']:.3f} s, idle {s['idle']:.2f}, load {s['load']:.1f}", flush=True)

    for case in CALIBRATION:
        real_run(case, 0)
    profiles = {k: work / f"fitted_{a.preset}_{k}.yaml" for k in kinds}
    calibration = [real[c][0]["out"] for c in CALIBRATION]
    for k, path in profiles.items():
        twins = None
        if k == "shared":  # the work in each measured second: the twins of the calibration runs, then the fit again
            first = write_fitted(calibration, work / f"fitted_{a.preset}_shared_work1.yaml", skip=a.skip,
                                 name=f"fitted_{a.preset}_shared_work1", devices=k)
            twins = [work / "twin_shared_calibration" / c.name.replace(" ", "_") for c in CALIBRATION]
            for case, out in zip(CALIBRATION, twins):
                asyncrl.run(run(twin_of(configure(base_config(a.preset, a.steps), case, out), first.path)))
        p = write_fitted(calibration, path, name=f"fitted_{a.preset}_{k}", skip=a.skip, devices=k, twins=twins)
        print(f"fitted {path}: devices {p.devices}", flush=True)
    for r in range(a.repeat):  # rounds over the configurations, each real then in each twin: alike loads
        for case in CASES:
            if len(real.get(case, ())) <= r:
                real_run(case, r)
            for k, path in profiles.items():
                out = work / f"twin_{k}" / f"{case.name.replace(' ', '_')}{f'_r{r}' if r else ''}"
                cfg = twin_of(configure(base_config(a.preset, a.steps), case, out), path)
                t = {**summary(asyncrl.run(run(cfg)), out, a.skip), "load": os.getloadavg()[0]}
                twin.setdefault((k, case), []).append(t)
                print(f"twin ({k}) {case.name} #{r}: step {t['step']:.3f} s, idle {t['idle']:.2f}, "
                      f"load {t['load']:.1f}", flush=True)
    tables = []
    for k in kinds:
        lines = [f"Twin with devices {k} ({profiles[k]}):", "",
                 "| configuration | step s real | twin | diff | idle real | twin | diff | staleness real | twin | TV "
                 "| load real / twin |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        for case in CASES:
            r, t = pooled(real[case][:a.repeat]), pooled(twin[k, case])
            d_step = (t["step"] - r["step"]) / r["step"]
            lines.append(f"| {case.name}{' (calibration)' if case in CALIBRATION else ''} | {r['steps']} | "
                         f"{t['steps']} | {d_step:+.0%} | {r['idle']:.2f} | {t['idle']:.2f} | "
                         f"{t['idle'] - r['idle']:+.2f} | {fmt_hist(r['hist'])} | {fmt_hist(t['hist'])} | "
                         f"{tv(r['hist'], t['hist']):.2f} | {r['load']} / {t['load']} |")
        tables += [*lines, ""]
    note = load_note(load0, os.getloadavg()[0])
    text = "\n".join([run_header("twin_vs_real.py", note), "",
                      f"Profiles fitted to {', '.join(c.name for c in CALIBRATION)}; medians over steps "
                      f"{a.skip}..{a.steps - 1}; {a.repeat} run(s) of each configuration (the median of their step "
                      "medians, their range in brackets); load: the 1-minute load average after each run.", "",
                      *tables])
    write_result(out_file, text)


if __name__ == "__main__":
    main()
