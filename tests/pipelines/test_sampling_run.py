"""Dynamic sampling on a real run (local Ray): with a reward that is constant for half the prompts,
every trained group has reward variance > 0 and the metrics count the groups that were dropped."""

from __future__ import annotations

import pytest

from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.pipelines.trainers.trainer import GRPOTrainer
from tests.pipelines.datafiles_util import write_jsonl

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "const":
        return 0.5  # the same for every response: such a group carries no signal
    return float(len(solution_str) % 3)
'''

STEPS = 3


@pytest.mark.slow  # ~40 s on a loaded 2-core machine; tests/pipelines/test_sampling.py covers the parts fast
async def test_every_trained_group_has_reward_variance_and_the_dropped_groups_are_counted(ray_cluster, tmp_path):
    rows = [{"prompt": f"say {w}", "reward_model": {"ground_truth": w}, "data_source": "const" if i % 2 else "vary"}
            for i, w in enumerate(["cat", "dog", "sun", "sea", "red", "blue", "tree", "bird"])]
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = tiny_test()
    cfg.data.train_files = str(write_jsonl(tmp_path / "train.jsonl", rows))
    cfg.reward.fn = f"{tmp_path / 'reward.py'}:compute_score"
    cfg.algorithm.filter_groups.enable = True
    t = cfg.trainer
    t.steps, t.colocated, t.output_dir = STEPS, True, str(tmp_path / "run")
    async with GRPOTrainer(cfg.validate()) as trainer:
        history = await trainer.fit()
    assert [h["step"] for h in history] == list(range(STEPS))
    assert all(h["sampling/min_group_std"] > 0 and h["sampling/padded_groups"] == 0 for h in history), history
    filtered = [h["sampling/filtered_groups"] for h in history]
    calls = [h["sampling/gen_batches"] for h in history]
    # each call draws 2 prompts; a "const" prompt's group is always dropped (so is an unlucky "vary" one)
    assert (filtered, calls) == ([2.0, 2.0, 4.0], [2.0, 2.0, 3.0])
    assert all(2 * c - f == 2 for f, c in zip(filtered, calls))  # no surplus group here: generated = dropped + trained
