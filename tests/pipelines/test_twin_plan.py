"""``asyncrl plan`` (pipelines/commands/plan.py): the candidate space, the cost model's G and T, the coordinate search
against every candidate on a known landscape, and the command's refusals. One real twin run of a candidate at the
smallest budget checks what a run reports (slow); the plans of the shipped profiles are in docs/scale.md."""

from __future__ import annotations

from collections import Counter

import pytest

from asyncrl.pipelines.commands.plan import (Candidate, Outcome, brute_force, candidates, estimate, evaluate,
                                         median_of, remeasure, render, search)
from asyncrl.pipelines.twin.profile import load_profile

P = load_profile("qwen2_7b_h100_vllm")


def test_the_space_holds_every_split_staleness_mode_and_concurrency():
    cs = candidates(P, 16)
    splits = sorted({(c.rollout_gpus, c.train_gpus) for c in cs})
    assert splits == [(4, 12), (6, 10), (8, 8), (10, 6), (12, 4), (14, 2)]
    # a GRPO group stays on one training rank: 32 prompts a step leave the splits with 8, 4 and 2 ranks
    assert sorted({(c.rollout_gpus, c.train_gpus) for c in candidates(P, 16, prompts=32)}) == [(8, 8), (12, 4),
                                                                                             (14, 2)]
    # batch mode splits a step's prompts over the rollout replicas too; streaming routes each group to one
    at_32 = candidates(P, 16, prompts=32)
    assert {(c.rollout_gpus, c.mode) for c in at_32 if c.max_staleness == 1} == {
        (8, "batch"), (8, "stream"), (12, "stream"), (14, "stream")}
    per_split = [c for c in cs if (c.rollout_gpus, c.train_gpus) == (8, 8)]
    # batch at k = 0, 1, 2, 4; stream at k = 1, 2, 4 with admission's bound and one step in flight
    assert len(per_split) == 4 + 3 * 2 and not any(c.mode == "stream" and c.max_staleness == 0 for c in cs)


def test_more_rollout_gpus_shorten_generation_and_fewer_training_gpus_lengthen_training():
    g1, t1 = estimate(P, Candidate(4, 12, 1, "batch"), batch_size=512, group_size=8)
    g2, t2 = estimate(P, Candidate(12, 4, 1, "batch"), batch_size=512, group_size=8)
    assert g2 < g1 and t2 > t1
    o = Outcome(Candidate(8, 8, 1, "batch"), 1.0, 0.0, gen_s=3.0, train_s=1.0, step_s=3.0, ledger_ok=True, wall_s=0)
    assert o.ceiling == pytest.approx(4 / 3)


def landscape(c: Candidate) -> Outcome:
    """A known landscape: throughput peaks at 12 rollout GPUs, streaming with k=2 and one step in flight."""
    tps = 1000.0 - 40 * abs(c.rollout_gpus - 12) + (60 if c.mode == "stream" else 0) - 15 * abs(c.max_staleness - 2)
    tps += 20 if c.in_flight == 1 else 0
    return Outcome(c, tps, 0.1, 2.0, 1.0, 2.0, True, 1.0)


def test_the_coordinate_search_finds_the_best_of_every_candidate_in_far_fewer_runs():
    runs: list[Candidate] = []

    def run(c: Candidate) -> Outcome:
        runs.append(c)
        return landscape(c)

    found = search(P, 16, run)
    everything = brute_force(P, 16, landscape)
    assert found[0].candidate == everything[0].candidate == Candidate(12, 4, 2, "stream", 1)
    assert len(set(runs)) <= 16 < len(everything)
    # the search's best two, and only they, run three times each (the first run and two more at the end)
    assert sorted(Counter(runs).values(), reverse=True)[:3] == [3, 3, 1]
    assert {c for c, n in Counter(runs).items() if n == 3} == {o.candidate for o in found[:2]}
    assert runs[-4:] == [found[0].candidate, found[1].candidate] * 2 or \
        runs[-4:] == [found[1].candidate, found[0].candidate] * 2  # round-robin
    table = render(found, top=2)
    assert "| 1 | 12+4 GPUs, stream, k=2, in flight 1 steps | 1,080 (median of 3: 1,080–1,080) |" in table
    assert "| 3 |" not in table


def test_remeasuring_ranks_candidates_by_their_medians_not_by_a_lucky_first_run():
    a, b = Candidate(8, 8, 1, "batch"), Candidate(8, 8, 2, "stream")
    later = {a: [900.0, 910.0], b: [1010.0, 990.0]}  # a's first run (1,200) was its luckiest
    order: list[Candidate] = []

    def run(c: Candidate) -> Outcome:
        order.append(c)
        return Outcome(c, later[c].pop(0), 0.2, 2.0, 1.0, 2.0, c != a or len(later[a]) > 0, 1.0)

    first = [Outcome(a, 1200.0, 0.1, 2.0, 1.0, 2.0, True, 1.0), Outcome(b, 1000.0, 0.3, 2.0, 1.0, 2.0, True, 1.0)]
    ranked = remeasure(first, run, repeats=3)
    assert order == [a, b, a, b]  # round-robin: a spell of load falls on both alike
    assert [(o.candidate, o.tokens_per_s, o.runs) for o in ranked] == [(b, 1000.0, (1000.0, 1010.0, 990.0)),
                                                                     (a, 910.0, (1200.0, 900.0, 910.0))]
    assert (ranked[0].idle, ranked[0].wall_s, ranked[0].ledger_ok) == (0.2, 3.0, True)  # medians; the walls summed
    assert ranked[1].ledger_ok is False  # a's last run broke its ledger: the candidate's does not hold
    assert median_of([first[1]]).runs == (1000.0,)


def test_bad_budgets_and_sizes_are_one_line_errors(capsys, tmp_path):
    from pathlib import Path

    import yaml

    from asyncrl.pipelines.commands.cli import main
    from asyncrl.pipelines.twin.profile import load_profile

    assert main(["plan", "qwen2_7b_h100_vllm", "--gpus", "1"]) == 2
    assert "--gpus 1 cannot hold a rollout replica (1 GPUs) and a training rank (1); give at least 2" in \
        capsys.readouterr().err
    assert main(["plan", "qwen2_7b_h100_vllm", "--gpus", "8", "--batch-size", "100"]) == 2
    assert "must be a multiple of --group-size 8" in capsys.readouterr().err
    assert main(["plan", "qwen2_7b_h100_vllm", "--gpus", "8", "--step-s", "0"]) == 2
    assert "--step-s 0.0 must be a positive number of seconds" in capsys.readouterr().err
    assert main(["plan", "nope", "--gpus", "8"]) == 2
    assert "not a shipped profile" in capsys.readouterr().err
    raw = yaml.safe_load(Path(load_profile("qwen2_7b_h100_vllm").path).read_text())
    raw["devices"] = {"kind": "shared", "threads": {"value": 1, "source": "derived: a test"}}
    (tmp_path / "shared.yaml").write_text(yaml.safe_dump(raw))
    assert main(["plan", str(tmp_path / "shared.yaml"), "--gpus", "8"]) == 2
    assert "is a twin of CPU workers sharing this machine's cores (devices.kind=shared)" in capsys.readouterr().err


@pytest.mark.slow  # one twin run: ~30 s here (its parts are fast tests above; the plans are benchmarks/plan_check.py)
async def test_a_candidate_runs_in_the_twin_and_reports_its_throughput_idle_time_and_ledger(ray_cluster, tmp_path):
    import asyncio

    o = await asyncio.to_thread(evaluate, "qwen2_7b_h100_vllm", Candidate(2, 2, 1, "stream"), batch_size=32,
                                group_size=8, steps=4, out=tmp_path / "run", step_wall_s=0.5)
    assert o.ledger_ok and o.tokens_per_s > 0 and 0 <= o.idle <= 1 and o.step_s > 0
    g, t = estimate(P, Candidate(2, 2, 1, "stream"), batch_size=32, group_size=8)
    assert (o.gen_s, o.train_s) == (g, t)


def test_a_stream_needs_no_rollout_replica_count_that_divides_the_prompts():
    from asyncrl.pipelines.configlib import ConfigError
    from asyncrl.pipelines.job.presets import twin

    cfg = twin()
    cfg.trainer.rollout_workers, cfg.trainer.train_workers, cfg.trainer.batch_size = 12, 4, 1024  # 128 prompts
    assert cfg.validate().trainer.rollout_workers == 12  # each group goes whole to one of the 12 replicas
    cfg.trainer.rollout_mode = "batch"
    with pytest.raises(ConfigError, match="^the rollout pool has 12 workers but a step has 128 prompts"):
        cfg.validate()
