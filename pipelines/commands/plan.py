"""``asyncrl plan``: which configuration to run on a GPU budget, from short twin runs of a profile.

::

    candidates: rollout/training split x max_staleness x rollout mode x concurrency
      │ estimate(profile, candidate)   the cost model's per-step generation G and training T, without running:
      │                                 the (G + T) / max(G, T) ceiling of overlapping them, and a time scale
      │                                 that makes a simulated step last about three seconds
      ▼ evaluate(candidate)             a short twin run (the real trainer, ``twin.profile``): generated tokens per
                                        simulated second, the trainer's idle fraction, the ledger checked

:func:`search` walks the space coordinate by coordinate -- the split (at ``batch``, ``max_staleness=1``), then
``max_staleness`` and the mode at the best split, then the concurrency, then the splits next to the best again --
and runs its best two twice more, ranking them by their medians (:func:`remeasure`): about 15 twin runs;
:func:`brute_force` runs every candidate (the check that the search's pick is within a few per cent of the best).
Tokens/s are the profile's (simulated) tokens per simulated second: a run's response tokens (ids times
``twin.tokens_per_id``) over its step time divided by ``twin.time_scale``. The controller's real overhead is not
scaled down, so a prediction can only be low.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from asyncrl.pipelines.twin.profile import Profile, load_profile
import asyncrl
from asyncrl.pipelines.job.presets import twin
from asyncrl.pipelines.journaling.ledger import check_ledger, read_ledger_rows
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from asyncrl.pipelines.twin.profile import tokens_per_id
from asyncrl.pipelines.twin.workers import train_costs
from asyncrl.roles.engines.sim import draw_length

__all__ = ["Candidate", "Outcome", "estimate", "evaluate", "search", "brute_force", "candidates", "splits", "render",
           "run_plan", "remeasure", "median_of", "SPLITS", "STALENESS", "CONFIRM", "REPEATS", "STEP_WALL_S"]

SPLITS = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875)
"""Fractions of the budget given to rollout."""
STALENESS = (0, 1, 2, 4)
"""``max_staleness`` values tried (streaming needs >= 1)."""
STEP_WALL_S = 3.0
"""Wall seconds a twin run's simulated step is scaled to last. The controller's real work per step (the weight sync,
the per-step calls: about half a second on a loaded 2-core machine) is not scaled down, and on a real cluster it is
a small part of a 30-60 s step; at 1 s a step it was half of it, and the ranking of configurations followed the
controller's overhead and the machine's load more than the cost model (one candidate measured 6,700-10,400
tokens/s over three runs)."""
CONCURRENCY = (None, 1)
"""Streaming ``max_groups_in_flight``, in steps' worth of groups (None: admission's own bound, ``(k + 1)`` steps)."""


@dataclass(frozen=True)
class Candidate:
    """One configuration: GPUs for rollout and training, the staleness bound, the rollout mode and (streaming)
    the groups in flight in steps' worth (None: admission's bound)."""

    rollout_gpus: int
    train_gpus: int
    max_staleness: int
    mode: str
    in_flight: int | None = None

    def label(self) -> str:
        conc = "" if self.mode == "batch" else f", in flight {self.in_flight or self.max_staleness + 1} steps"
        return f"{self.rollout_gpus}+{self.train_gpus} GPUs, {self.mode}, k={self.max_staleness}{conc}"


@dataclass
class Outcome:
    """A candidate's twin run."""

    candidate: Candidate
    tokens_per_s: float
    """Generated (response) tokens per simulated second, steady state."""
    idle: float
    """The trainer's idle fraction: time waiting for a batch over step time."""
    gen_s: float
    """The cost model's generation time per step (simulated seconds, :func:`estimate`)."""
    train_s: float
    """The cost model's training time per step (simulated seconds)."""
    step_s: float
    """Measured simulated seconds per step."""
    ledger_ok: bool
    wall_s: float
    runs: tuple[float, ...] = ()
    """Each run's tokens/s when the candidate was run more than once (:func:`remeasure`): then `tokens_per_s` and
    `idle` are their medians."""

    @property
    def ceiling(self) -> float:
        """``(G + T) / max(G, T)``: what overlapping generation and training can gain at most over the
        synchronous loop (2 when they are equal)."""
        return (self.gen_s + self.train_s) / max(self.gen_s, self.train_s)


def _split(profile: Profile, gpus: int, frac: float) -> tuple[int, int] | None:
    """``(rollout GPUs, training GPUs)`` nearest `frac` of `gpus`, in whole replicas and ranks."""
    per_r, per_t = profile.rollout.gpus, profile.training.gpus
    r = max(per_r, round(gpus * frac / per_r) * per_r)
    t = (gpus - r) // per_t * per_t
    return (r, t) if t >= per_t else None


def splits(profile: Profile, gpus: int, prompts: int | None = None) -> list[tuple[int, int]]:
    """The rollout/training splits tried (:data:`SPLITS`), those whose training ranks divide the `prompts` per step
    (a GRPO group stays on one rank) when given."""
    out = sorted({s for f in SPLITS if (s := _split(profile, gpus, f)) is not None})
    if prompts is not None:
        out = [(r, t) for r, t in out if prompts % (t // profile.training.gpus) == 0]
    return out


def batch_fits(profile: Profile, rollout_gpus: int, prompts: int | None) -> bool:
    """Whether batch mode can run on `rollout_gpus`: its rollout replicas divide the `prompts` per step (batch mode
    splits a step's prompts over them, a GRPO group whole on one; streaming routes each group to one replica)."""
    return prompts is None or prompts % (rollout_gpus // profile.rollout.gpus) == 0


def candidates(profile: Profile, gpus: int, prompts: int | None = None) -> list[Candidate]:
    """Every candidate of the space (the brute force's list)."""
    out = []
    for r, t in splits(profile, gpus, prompts):
        for k in STALENESS:
            if batch_fits(profile, r, prompts):
                out.append(Candidate(r, t, k, "batch"))
            if k >= 1:
                out += [Candidate(r, t, k, "stream", c) for c in CONCURRENCY]
    return out


def estimate(profile: Profile, cand: Candidate, *, batch_size: int, group_size: int) -> tuple[float, float]:
    """The cost model's ``(G, T)`` per step, in simulated seconds: G the time the rollout replicas take to
    generate one step's batch (each replica decodes its rows until its longest ends, at the step cost of its
    running rows; a weight load), T the training ranks' time for it (a forward pass, the update and the export).
    Lengths are drawn from the profile's model with a fixed seed."""
    r, lm = profile.rollout, profile.lengths
    replicas = cand.rollout_gpus // r.gpus
    ranks = cand.train_gpus // profile.training.gpus
    rows = math.ceil(batch_size / replicas)
    hist = (list(lm.edges), list(lm.counts)) if lm.kind == "histogram" else None
    rng = random.Random(0)
    gens = []
    lengths_all: list[int] = []
    for _ in range(8):  # replicas' longest rows, averaged over a few draws
        lengths = sorted(draw_length(rng.randrange(1 << 30), (), lm.max_new_tokens, median_tokens=max(1.0, lm.median),
                                     sigma=lm.sigma, histogram=hist) for _ in range(rows))
        lengths_all += lengths
        t, prev = 0.0, 0
        for j, L in enumerate(lengths):  # from the (j-1)-th shortest row's end to the j-th's: rows - j decode
            running = rows - j
            ctx = running * (lm.prompt_tokens + (prev + L) / 2)
            t += (L - prev) * (r.decode_base_ms + r.decode_ms_per_seq * running + r.decode_ms_per_1k_kv * ctx / 1000)
            prev = L
        t += r.prefill_ms_per_token * lm.prompt_tokens * rows
        gens.append(t / 1e3)
    weight = profile.model.weight_gb
    load = weight / r.weight_pull_gb_per_s + weight / r.weight_load_gb_per_s
    G = statistics.fmean(gens) + load
    tokens = batch_size * (lm.prompt_tokens + statistics.fmean(lengths_all)) / ranks
    c = train_costs(profile, tokens, ranks)
    T = 2 * c["forward"] + c["backward"] + c["optimizer"] + weight / profile.training.export_gb_per_s
    return G, T


def _config(profile: str, cand: Candidate, *, batch_size: int, group_size: int, steps: int, time_scale: float,
            out: Path, per_process: int) -> Any:
    p = load_profile(profile)
    cfg = twin()
    cfg.twin.profile, cfg.twin.time_scale, cfg.twin.replicas_per_process = profile, time_scale, per_process
    cfg.algorithm.group_size = group_size
    t = cfg.trainer
    t.steps, t.batch_size, t.output_dir = steps, batch_size, str(out)
    t.rollout_workers, t.train_workers = cand.rollout_gpus // p.rollout.gpus, cand.train_gpus // p.training.gpus
    t.max_staleness, t.rollout_mode, t.rollout_weights = cand.max_staleness, cand.mode, "auto"
    B = batch_size // group_size
    t.stream.max_groups_in_flight = cand.in_flight * B if cand.in_flight is not None else None
    t.checkpoint_at_end, t.trace = False, False
    t.num_cpus = max(t.num_cpus or 0, 4 + -(-t.rollout_workers // per_process) + -(-t.train_workers // per_process))
    return cfg.validate()


def evaluate(profile: str, cand: Candidate, *, batch_size: int, group_size: int, steps: int, out: Path,
             step_wall_s: float = STEP_WALL_S, per_process: int = 16, warmup: int = 2) -> Outcome:
    """One short twin run of `cand` (in-process: ``GRPOTrainer.fit()`` on the local Ray), its time scale set so
    that a simulated step lasts about `step_wall_s`; measured over the steps after `warmup`."""
    p = load_profile(profile)
    G, T = estimate(p, cand, batch_size=batch_size, group_size=group_size)
    ideal = max(G, T) if cand.max_staleness > 0 else G + T
    scale = step_wall_s / ideal
    cfg = _config(profile, cand, batch_size=batch_size, group_size=group_size, steps=steps, time_scale=scale,
                  out=out, per_process=per_process)

    async def fit() -> list[dict[str, Any]]:
        async with GRPOTrainer(cfg) as tr:
            return await tr.fit()

    t0 = time.perf_counter()
    history = asyncrl.run(fit())
    wall = time.perf_counter() - t0
    h = history[warmup:]
    rows = read_ledger_rows(out / "ledger.jsonl")
    ids = sum(sum(rows[x["step"]]["tokens"]) for x in h if "tokens" in rows.get(x["step"], {}))
    step_wall = sum(x["time/step"] for x in h)
    k = tokens_per_id(p, cfg.twin)
    return Outcome(cand, ids * k / (step_wall / scale), sum(x["time/wait_rollout"] for x in h) / step_wall, G, T,
                   step_wall / scale / len(h), check_ledger(out).ok, wall)


Runner = Callable[[Candidate], Outcome]

CONFIRM = 2
"""The search's best candidates run again at its end (:func:`remeasure`): a short twin run on a shared machine
varies by tens of per cent, so a single run's best is as likely the luckiest as the fastest."""
REPEATS = 3
"""Runs of each confirmed candidate in all (the first included); their median ranks it."""


def median_of(outcomes: list[Outcome]) -> Outcome:
    """One outcome for several runs of one candidate: the median tokens/s and idle fraction, every run's tokens/s
    in ``runs``, the ledger held only if it held in every run."""
    first = outcomes[0]
    assert all(o.candidate == first.candidate for o in outcomes)
    return replace(first, tokens_per_s=statistics.median(o.tokens_per_s for o in outcomes),
                   idle=statistics.median(o.idle for o in outcomes),
                   step_s=statistics.median(o.step_s for o in outcomes),
                   ledger_ok=all(o.ledger_ok for o in outcomes), wall_s=sum(o.wall_s for o in outcomes),
                   runs=tuple(r for o in outcomes for r in (o.runs or (o.tokens_per_s,))))


def remeasure(outcomes: list[Outcome], run: Runner, repeats: int = REPEATS,
              say: Callable[[str], None] = lambda s: None) -> list[Outcome]:
    """Run each of `outcomes`' candidates until it has `repeats` runs, round-robin (so that a spell of load on the
    machine falls on all of them alike), and return each as the :func:`median_of` its runs, best first."""
    have = {o.candidate: [o] for o in outcomes}
    for _ in range(repeats - 1):
        for c, got in have.items():
            if len(got) < repeats:
                got.append(o := run(c))
                say(f"  {c.label()} again: {o.tokens_per_s:,.0f} tokens/s, idle {o.idle:.2f} ({o.wall_s:.0f} s)")
    return sorted((median_of(got) for got in have.values()), key=lambda o: -o.tokens_per_s)


def search(profile: Profile, gpus: int, run: Runner, *, prompts: int | None = None, confirm: int = CONFIRM,
           repeats: int = REPEATS, say: Callable[[str], None] = lambda s: None) -> list[Outcome]:
    """The coordinate search of the module docstring, then its best `confirm` candidates run until each has
    `repeats` runs (:func:`remeasure`; ``confirm < 2``: not): every outcome, the confirmed ones first (by their
    medians), then the rest by their one run."""
    seen: dict[Candidate, Outcome] = {}

    def go(c: Candidate) -> Outcome:
        if c not in seen:
            seen[c] = run(c)
            o = seen[c]
            say(f"  {c.label()}: {o.tokens_per_s:,.0f} tokens/s, idle {o.idle:.2f} ({o.wall_s:.0f} s)")
        return seen[c]

    def best(cs: list[Candidate]) -> Candidate:
        return max((go(c) for c in cs), key=lambda o: o.tokens_per_s).candidate

    split = splits(profile, gpus, prompts)
    if not split:
        raise ValueError(f"{gpus} GPUs hold no split of a rollout replica ({profile.rollout.gpus} GPUs) and training "
                         f"ranks ({profile.training.gpus} GPUs each) that divide the {prompts} prompts of a step; "
                         "plan another budget or batch size")
    say("split (max_staleness=1; batch, or stream where batch mode cannot split a step over the replicas):")
    c = best([Candidate(r, t, 1, "batch") if batch_fits(profile, r, prompts) else Candidate(r, t, 1, "stream")
              for r, t in split])
    say("staleness and mode:")
    c = best([replace(c, max_staleness=k, mode=m, in_flight=None) for k in STALENESS for m in ("batch", "stream")
              if not (m == "stream" and k == 0) and (m == "stream" or batch_fits(profile, c.rollout_gpus, prompts))])
    if c.mode == "stream":
        say("concurrency:")
        c = best([replace(c, in_flight=x) for x in CONCURRENCY])
    say("splits next to the best:")
    i = split.index((c.rollout_gpus, c.train_gpus))
    best([replace(c, rollout_gpus=r, train_gpus=t) for r, t in split[max(0, i - 1):i + 2]
          if c.mode == "stream" or batch_fits(profile, r, prompts)])
    ranked = sorted(seen.values(), key=lambda o: -o.tokens_per_s)
    if confirm < 2:
        return ranked
    say(f"the best {confirm}, {repeats} runs each (their medians rank them):")
    confirmed = remeasure(ranked[:confirm], run, repeats, say)
    return confirmed + ranked[confirm:]


def brute_force(profile: Profile, gpus: int, run: Runner, *, prompts: int | None = None,
                say: Callable[[str], None] = lambda s: None) -> list[Outcome]:
    """Every candidate (:func:`candidates`) run; best first."""
    out = []
    for c in candidates(profile, gpus, prompts):
        o = run(c)
        say(f"  {c.label()}: {o.tokens_per_s:,.0f} tokens/s, idle {o.idle:.2f} ({o.wall_s:.0f} s)")
        out.append(o)
    return sorted(out, key=lambda o: -o.tokens_per_s)


def render(outcomes: list[Outcome], top: int = 5) -> str:
    """The best `top` as a table."""
    lines = ["| # | configuration | tokens/s (predicted) | trainer idle | G s/step | T s/step | (G+T)/max(G,T) | "
             "ledger |", "|---|---|---|---|---|---|---|---|"]
    for i, o in enumerate(outcomes[:top], 1):
        tps = f"{o.tokens_per_s:,.0f}" + (f" (median of {len(o.runs)}: {min(o.runs):,.0f}–{max(o.runs):,.0f})"
                                          if len(o.runs) > 1 else "")
        lines.append(f"| {i} | {o.candidate.label()} | {tps} | {o.idle:.2f} | {o.gen_s:.1f} | "
                     f"{o.train_s:.1f} | {o.ceiling:.2f} | {'holds' if o.ledger_ok else 'BROKEN'} |")
    return "\n".join(lines)


def run_plan(profile: str, gpus: int, *, batch_size: int = 1024, group_size: int = 8, steps: int = 5, top: int = 5,
             brute: bool = False, out_dir: str | None = None, step_s: float = STEP_WALL_S,
             say: Callable[[str], None] = lambda s: None) -> str:
    """``asyncrl plan``: search (or, `brute`, run every candidate) and return the table of the best `top`.
    Raises ``ValueError`` for a budget or sizes it cannot plan (and ``ProfileError`` for a bad profile)."""
    import tempfile

    p = load_profile(profile)
    if p.devices.shared:
        raise ValueError(f"{profile!r} is a twin of CPU workers sharing this machine's cores (devices.kind=shared): "
                         "its candidates would all burn the same cores, so GPU counts mean nothing; plan with a "
                         "profile of separate devices (fit it without --devices shared)")
    if isinstance(gpus, bool) or gpus < p.rollout.gpus + p.training.gpus:
        raise ValueError(f"--gpus {gpus} cannot hold a rollout replica ({p.rollout.gpus} GPUs) and a training rank "
                         f"({p.training.gpus}); give at least {p.rollout.gpus + p.training.gpus}")
    if group_size < 2 or batch_size % group_size:
        raise ValueError(f"--batch-size {batch_size} must be a multiple of --group-size {group_size} (>= 2)")
    if not step_s > 0 or math.isinf(step_s):
        raise ValueError(f"--step-s {step_s} must be a positive number of seconds (a simulated step's wall time)")
    if steps < 3:
        raise ValueError(f"--steps {steps} leaves no measured step after the 2 warm-up steps; give at least 3")
    root = Path(out_dir or tempfile.mkdtemp(prefix="asyncrl_plan_"))
    count = [0]

    def run(c: Candidate) -> Outcome:
        count[0] += 1
        return evaluate(profile, c, batch_size=batch_size, group_size=group_size, steps=steps,
                        out=root / f"run{count[0]:03d}", step_wall_s=step_s)

    t0 = time.perf_counter()
    say(f"planning {p.name} on {gpus} GPUs ({batch_size} responses per step, {group_size} per prompt); twin runs "
        f"in {root}")
    outcomes = (brute_force if brute else search)(p, gpus, run, prompts=batch_size // group_size, say=say)
    runs = sum(len(o.runs) or 1 for o in outcomes)
    head = (f"{p.name} on {gpus} GPUs, {batch_size} responses per step: {runs} twin runs of {steps} steps "
            f"in {time.perf_counter() - t0:.0f} s ({'every candidate' if brute else 'coordinate search'})")
    return head + "\n\n" + render(outcomes, top)
