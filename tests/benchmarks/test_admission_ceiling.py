"""``benchmarks/admission_ceiling.py``: the twin's workload under the real admission rule, on a virtual clock.

Everything runs at the simulated time it is due, so its results are exact functions of the workload: a
training-bound run's step is exactly the cost model's training time."""

from __future__ import annotations

import asyncio

import pytest

import admission_ceiling as ac  # benchmarks/ is on sys.path (tests/benchmarks/conftest.py)
from asyncrl.pipelines.twin.profile import TwinConfig, load_profile, tokens_per_id
from asyncrl.pipelines.twin.workers import train_costs
from asyncrl.roles.engines import sim


def test_the_virtual_clock_jumps_to_the_next_timer_and_is_restored_after():
    real = sim.time

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600.0)
        async with asyncio.timeout(5.0):
            await asyncio.sleep(1.5)
        return loop.time(), sim.time.monotonic()

    assert ac.run_virtual(main()) == (3601.5, 3601.5)
    assert sim.time is real


def test_a_run_with_nothing_left_to_wake_it_is_a_clear_error_not_a_hang():
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(RuntimeError, match="nothing is scheduled and nothing can wake the loop"):
        ac.run_virtual(main())
    assert sim.time.__name__ == "time"  # the real module is back


@pytest.mark.parametrize("replicas", [1, 2])
def test_without_a_tail_a_step_takes_exactly_the_training_time_and_every_token_is_k_versions_old(replicas):
    prof = ac.fixed_lengths(load_profile("qwen2_7b_h100_vllm"))
    w = ac.Workload(prof, replicas, staleness=2, steps=6, warmup=1)
    r = ac.run_virtual(ac.simulate(w))
    per_id = tokens_per_id(prof, TwinConfig())
    ids = -(-int(prof.lengths.median) // per_id)  # every response: the median, in ids of per_id tokens
    share = w.groups_per_replica * w.group * (prof.lengths.prompt_tokens + ids * per_id) * replicas / w.ranks
    c = train_costs(prof, share, w.ranks)
    step = 2 * c["forward"] + c["backward"] + c["optimizer"] + prof.model.weight_gb / prof.training.export_gb_per_s
    assert r.step_s == pytest.approx(step, rel=1e-9)
    assert r.samples_s == pytest.approx(w.groups_per_step * w.group / step, rel=1e-9)
    assert r.idle == 0.0  # the rollout keeps ahead: admission holds k + 1 steps of groups
    assert r.staleness_hist == [0.0, 0.0, 1.0]


def test_with_the_tail_every_trained_token_is_within_the_bound_and_the_trainer_waits():
    prof = load_profile("qwen2_7b_h100_vllm")
    r = ac.run_virtual(ac.simulate(ac.Workload(prof, 4, staleness=1, steps=6, warmup=1)))
    assert len(r.staleness_hist) == 2 and sum(r.staleness_hist) == pytest.approx(1.0)  # 0 or 1 version old
    assert r.idle > 0.0  # a step waits for its slowest group admitted k versions back


def test_the_quick_run_prints_its_table(tmp_path):
    out = tmp_path / "ceiling.md"
    ac.main(["--quick", "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# The staleness rule's ceiling") and "virtual clock" in text
    rows = [line for line in text.splitlines() if line.startswith("| 2 |")]
    assert [r.split(" | ")[1] for r in rows] == ["1", "2"]  # max_staleness 2 at N = 1 and N = 2
    assert rows[0].split(" | ")[3] == "1.00"  # N = 1 is its own baseline


def test_the_admitted_bound_trains_past_the_tail_with_older_tokens():
    """The same draw of lengths under ``bound=admitted``: no step waits for its slowest group admitted k versions
    back, so the trainer waits less and trains more per second, and some tokens are older than k."""
    prof = load_profile("qwen2_7b_h100_vllm")
    trained, admitted = (ac.run_virtual(ac.simulate(ac.Workload(prof, 4, staleness=1, steps=12, warmup=1, bound=b)))
                         for b in ("trained", "admitted"))
    assert admitted.samples_s > 1.2 * trained.samples_s and admitted.idle < trained.idle
    assert len(trained.staleness_hist) == 2 and len(admitted.staleness_hist) > 2
    assert sum(admitted.staleness_hist) == pytest.approx(1.0) and sum(admitted.staleness_hist[2:]) > 0.0
