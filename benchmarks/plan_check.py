"""``asyncrl plan`` against a brute-force twin sweep: is the search's pick within 5 % of the best candidate?

Every candidate of the space (the rollout/training splits x ``max_staleness`` 0, 1, 2, 4 x batch/stream x the
concurrency) is run in the twin once (the brute force); then the coordinate search of ``asyncrl plan`` runs
with its own, fresh twin runs (its best two run three times each). One run is noisy (tens of per cent on a
shared machine), and the best of 30 single runs is biased up (the luckiest run wins), so the check measures
again: the brute force's best ``--finalists`` and the search's pick, each run until it has ``--repeats`` runs
(round-robin), and the pick's median is compared with the best median. The single runs are shown too.

    python benchmarks/plan_check.py --profile qwen2_7b_h100_vllm --gpus 4

Also writes the plans of the shipped profiles (``--plans``): ``asyncrl plan NAME --gpus G`` for each.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _common import load_note, run_header, write_result

from asyncrl.pipelines.commands.plan import (REPEATS, STEP_WALL_S, Candidate, Outcome, brute_force, evaluate, remeasure,
                                         render, run_plan, search)
from asyncrl.pipelines.twin.profile import PROFILES, load_profile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="qwen2_7b_h100_vllm")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=384, help="responses per step (default 384: 48 prompts, "
                   "divisible by 1, 2, 3, 4, 6 and 8 training ranks)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--plans", type=int, default=0, metavar="GPUS",
                   help="also plan every shipped profile on this many GPUs (0: not)")
    p.add_argument("--step-s", type=float, default=STEP_WALL_S, help="wall seconds per simulated step")
    p.add_argument("--finalists", type=int, default=3, help="the brute force's best N measured again (default 3)")
    p.add_argument("--repeats", type=int, default=REPEATS, help="runs of each finalist and of the pick, in all")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default="benchmarks/results/plan_check.md")
    a = p.parse_args()
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="plan_check_"))
    load0 = os.getloadavg()[0]
    prof = load_profile(a.profile)
    n = [0]

    def runner(tag: str):
        def run(c: Candidate) -> Outcome:
            n[0] += 1
            return evaluate(a.profile, c, batch_size=a.batch_size, group_size=a.group_size, steps=a.steps,
                            out=work / f"{tag}{n[0]:03d}", step_wall_s=a.step_s)
        return run

    say = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    prompts = a.batch_size // a.group_size
    brute = brute_force(prof, a.gpus, runner("brute"), prompts=prompts, say=say)
    t_brute = time.perf_counter() - t0
    t1 = time.perf_counter()
    found = search(prof, a.gpus, runner("search"), prompts=prompts, say=say)
    t_search = time.perf_counter() - t1
    pick = found[0].candidate
    in_brute = next(o for o in brute if o.candidate == pick)
    single = in_brute.tokens_per_s / brute[0].tokens_per_s
    t2 = time.perf_counter()
    say(f"finalists (the brute force's best {a.finalists} and the pick), {a.repeats} runs each:")
    finalists = brute[:a.finalists] + ([in_brute] if pick not in {o.candidate for o in brute[:a.finalists]} else [])
    final = remeasure(finalists, runner("final"), a.repeats, say)
    t_final = time.perf_counter() - t2
    best = final[0]
    picked = next(o for o in final if o.candidate == pick)
    ratio = picked.tokens_per_s / best.tokens_per_s
    lines = [f"{a.profile} on {a.gpus} GPUs, {a.batch_size} responses per step, {a.steps}-step twin runs, a "
             f"simulated step scaled to {a.step_s:g} s.", "",
             f"Brute force: {len(brute)} candidates in {t_brute:.0f} s; search: "
             f"{sum(len(o.runs) or 1 for o in found)} runs in {t_search:.0f} s; finalists: {len(final)} candidates to "
             f"{a.repeats} runs each in {t_final:.0f} s.",
             "", f"Best (the finalists' medians): **{best.candidate.label()}**, {best.tokens_per_s:,.0f} tokens/s.",
             f"Search's pick: **{pick.label()}**: {found[0].tokens_per_s:,.0f} tokens/s in its own runs, "
             f"{picked.tokens_per_s:,.0f} as a finalist = **{ratio:.1%} of the best** (target >= 95 %).",
             f"(By single runs, as this check scored before: the brute force's best "
             f"{brute[0].candidate.label()} at {brute[0].tokens_per_s:,.0f}, the pick at {in_brute.tokens_per_s:,.0f}"
             f" = {single:.1%}.)", "", "The finalists:", "", render(final, len(final)), "",
             "The brute force's best five (one run each):", "", render(brute, 5), "", "The search's best five:", "",
             render(found, 5), ""]
    if a.plans:
        for name in PROFILES:
            lines += [f"`asyncrl plan {name} --gpus {a.plans} --batch-size {a.batch_size}`:", "",
                      run_plan(name, a.plans, batch_size=a.batch_size, group_size=a.group_size, steps=a.steps,
                               out_dir=str(work / f"plan_{name}"), step_s=a.step_s, say=say), ""]
    write_result(a.out, "\n".join([run_header("plan_check.py", load_note(load0, os.getloadavg()[0])), "", *lines]))


if __name__ == "__main__":
    main()
