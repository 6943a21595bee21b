"""Dynamic sampling (``algorithm.filter_groups``) in stream mode: a finished group whose rewards are all
equal is rejected (never trained) and its room admitted again; admission's rule for it (pure), and a real
run where half the prompts have a constant reward."""

from __future__ import annotations

import json

import pytest
from asyncrl.pipelines.rollout.admission import Admission

from tests.pipelines.datafiles_util import write_jsonl
from tests.pipelines.test_sampling_run import REWARD
from tests.pipelines.test_stream import journal, stream_config


def test_a_rejected_group_leaves_untrained_and_frees_its_room():
    adm = Admission(groups_per_step=2, max_staleness=1, max_in_flight=4)
    for g in range(4):
        adm.admit(g, 0)
    assert not adm.can_admit(0)  # (k + 1) * B groups admitted at version 0
    for g in (0, 1, 2):
        adm.finish(g)
    adm.reject(1)
    st = adm.statistics()
    assert (st.rejected, st.admitted, st.buffered, st.in_flight) == (1, 4, 2, 1) and adm.can_admit(0)
    assert adm.take() == ([0, 2], []) and adm.pending() == {3: 0}
    adm.reject(3)  # also before it finished (nothing is left of it)
    assert adm.pending() == {} and adm.statistics().rejected == 2
    with pytest.raises(ValueError, match="group 0 is not admitted"):
        adm.reject(0)  # already trained


@pytest.mark.parametrize("mode", ["batch", "stream"])
async def test_out_of_budget_groups_with_equal_rewards_are_trained_as_padding(tmp_path, mode):
    """``max_num_gen_batches`` spent with no informative group (every reward is 0.5, fakes.ConstantReward):
    batch mode (pipelines/rollout/sampling.py) makes its 2 generate calls and pads the whole step with call 0's
    groups; stream mode (pipelines/rollout/stream_rollout.py) rejects one step's worth of groups, (2 - 1) * B, and
    then trains the equal-reward groups, every one of them counted as padding."""
    import anyio
    from asyncrl.pipelines.job.presets import tiny_test
    from asyncrl.pipelines.trainers.trainer import GRPOTrainer

    from asyncrl.pipelines.journaling.ledger import check_ledger

    from .fakes import ConstantReward, Recorder, fake_groups

    cfg = tiny_test()
    cfg.algorithm.filter_groups.enable, cfg.algorithm.filter_groups.max_num_gen_batches = True, 2
    t = cfg.trainer
    t.steps, t.max_staleness, t.rollout_weights, t.rollout_mode = 3, 1, "latest", mode
    t.checkpoint_at_end, t.output_dir = False, str(tmp_path)
    cfg.validate()
    B = cfg.prompts_per_step
    rec = Recorder()
    with anyio.fail_after(120):  # a run that keeps rejecting past the budget never ends: fail, do not hang
        async with fake_groups(rec, 0, B, 0.004, 1, reward=ConstantReward) as groups, \
                GRPOTrainer(cfg, groups=groups) as trainer:
            history = await trainer.fit()
    assert [h["step"] for h in history] == [0, 1, 2]
    assert all(h["sampling/padded_groups"] == B and h["sampling/min_group_std"] == 0.0 for h in history), history
    recs = journal(tmp_path)
    rep = check_ledger(tmp_path)  # rejected groups are dropped as filtered, every trained one once
    assert rep.ok, rep.render()
    assert rep.trained == 3 * B * cfg.group_size
    if mode == "batch":
        assert rep.dropped == {"filtered": 3 * B * cfg.group_size}  # each step's extra call
        assert [(h["sampling/gen_batches"], h["sampling/filtered_groups"]) for h in history] == [(2.0, 2.0 * B)] * 3
        assert [r["batch"] for r in recs if r["kind"] == "step"] == [0, 1, 2]
        # the padding is the step's own prompt groups (call 0), in order: one generate call of extra prompts each
        assert sorted(s for name, s, _ in rec.events if name == "generate") == [0, 0, 1, 1, 2, 2]
        return
    filtered = sorted(r["index"] for r in recs if r["kind"] == "group_filter")
    trained = sorted(g for r in recs if r["kind"] == "step" for g in r["groups"])
    admitted = sorted(r["index"] for r in recs if r["kind"] == "group")
    # every group accepted before step 0's take came after the budget (B rejections) was spent
    assert history[0]["sampling/filtered_groups"] == B
    assert all(h["sampling/filtered_groups"] <= B for h in history)
    assert len(trained) == 3 * B and admitted == sorted(trained + filtered) == list(range(len(admitted)))
    assert sum(h["sampling/filtered_groups"] for h in history) == len(filtered) == history[-1]["stream/rejected_groups"]
    assert rep.dropped.get("filtered", 0) == len(filtered) * cfg.group_size


@pytest.mark.slow  # a real run, ~20 s on a loaded 2-core machine
async def test_stream_mode_trains_only_groups_with_reward_variance(ray_cluster, tmp_path):
    from asyncrl.pipelines.trainers.trainer import GRPOTrainer

    rows = [{"prompt": f"say {w}", "reward_model": {"ground_truth": w}, "data_source": "const" if i % 2 else "vary"}
            for i, w in enumerate(["cat", "dog", "sun", "sea", "red", "blue", "tree", "bird"])]
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = stream_config(tmp_path / "run", steps=3)
    cfg.data.train_files = str(write_jsonl(tmp_path / "train.jsonl", rows))
    cfg.reward.fn = f"{tmp_path / 'reward.py'}:compute_score"
    cfg.algorithm.filter_groups.enable = True
    B = cfg.prompts_per_step
    async with GRPOTrainer(cfg.validate()) as trainer:
        history = await trainer.fit()
    assert [h["step"] for h in history] == [0, 1, 2]
    assert all(h["sampling/min_group_std"] > 0 and h["sampling/padded_groups"] == 0 for h in history), history
    recs = journal(tmp_path / "run")
    admitted = sorted(r["index"] for r in recs if r["kind"] == "group")
    filtered = sorted(r["index"] for r in recs if r["kind"] == "group_filter")
    trained = sorted(g for r in recs if r["kind"] == "step" for g in r["groups"])
    assert len(trained) == 3 * B and filtered and not set(filtered) & set(trained)
    assert admitted == sorted(trained + filtered) == list(range(len(admitted)))  # each group once
    assert sum(h["sampling/filtered_groups"] for h in history) == len(filtered)
    assert history[-1]["stream/rejected_groups"] == len(filtered)
    assert all(0 <= h["staleness/max"] <= 1 for h in history)
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_000003" / "state.json").read_text())["stream"][
        "pending"] == []
