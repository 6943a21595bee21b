"""``actor.rollout_correction.bypass_mode`` (verl's bypass mode of rollout correction): the rollout's
log-probs are the ``old_log_probs`` and the policy's ``old_log_prob`` forward pass is not issued.

The mechanism runs on the in-process fakes of fakes.py (the trainer's real scheduling, no model);
the settings are checked by ``JobConfig.validate``: ``on_policy`` only where the rollout's
log-probs are the policy's own, ``behaviour`` as the opt-in that takes the PPO ratio against the
behaviour policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from asyncrl import Dispatch, LocalWorkerGroup, register
from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import load_config
from asyncrl.pipelines.job.presets import grpo_toy, tiny_test
from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.loop.stages import AdvantageWorker, Groups
from asyncrl.pipelines.trainers.trainer import GRPOTrainer

from .fakes import R, FakePolicy, FakeReward, FakeRollout, Recorder, _step


class LoggingRollout(FakeRollout):
    """Adds distinct behaviour log-probs per row (seeded by the step) and keeps a copy of each batch's."""

    sent: dict[int, torch.Tensor] = {}

    @register(Dispatch.DP_COMPUTE, concurrent=True)
    async def generate(self, batch, seed: int | None = None):
        out = await super().generate(batch, seed=seed)
        step = _step(batch, self.pps)
        g = torch.Generator().manual_seed(1000 + step)
        lp = -torch.rand(out.batch_size[0], R, generator=g)
        out.set("rollout_log_probs", lp)
        LoggingRollout.sent[step] = lp.clone()
        return out


class NoOldLogProbPolicy(FakePolicy):
    """Fails a step that calls compute_log_prob; records the old_log_probs each update trained on."""

    trained: dict[int, torch.Tensor] = {}

    @register(Dispatch.DP_COMPUTE)
    async def compute_log_prob(self, batch):
        raise AssertionError("the bypass must not issue old_log_prob")

    @register(Dispatch.DP_COMPUTE_METRIC)
    async def update(self, batch):
        NoOldLogProbPolicy.trained[_step(batch, self.pps)] = batch["old_log_probs"].clone()
        return await super().update(batch)


async def _run(tmp_path: Path, bypass: str, k: int, steps: int = 4) -> tuple[list[tuple[str, int, int]], Any]:
    cfg = tiny_test()
    cfg.trainer.steps, cfg.trainer.max_staleness, cfg.trainer.checkpoint_at_end = steps, k, False
    cfg.trainer.output_dir = str(tmp_path / f"bypass-{bypass}")
    cfg.rollout.engine_kwargs = {"exact_log_probs": True}
    cfg.actor.rollout_correction.bypass_mode = bypass  # type: ignore[assignment]
    cfg.validate()
    rec = Recorder()
    args = (rec, 0, cfg.prompts_per_step, 0.002)
    groups = Groups(rollout=LocalWorkerGroup(LoggingRollout, world_size=1, args=args),
                    reward=LocalWorkerGroup(FakeReward, world_size=1, args=args),
                    policy=LocalWorkerGroup(NoOldLogProbPolicy, world_size=1, args=(*args, k)),
                    advantage=LocalWorkerGroup(AdvantageWorker, world_size=1))
    members = (groups.rollout, groups.reward, groups.policy, groups.advantage)
    for g in members:
        await g.setup()
    LoggingRollout.sent.clear()
    NoOldLogProbPolicy.trained.clear()
    trainer = GRPOTrainer(cfg, groups=groups)
    try:
        async with trainer:
            await trainer.fit()
    finally:
        for g in members:
            await g.close()
    return rec.events, trainer


@pytest.mark.parametrize("bypass,k", [("on_policy", 0), ("behaviour", 1)])
async def test_the_bypass_trains_on_exactly_the_rollouts_log_probs_and_skips_old_log_prob(tmp_path, bypass, k):
    events, trainer = await _run(tmp_path, bypass, k)
    assert [e for e in events if e[0] == "old_log_prob"] == []  # never issued (the fake would fail the step)
    assert [e[1] for e in events if e[0] == "actor_update"] == [0, 1, 2, 3]
    assert sorted(NoOldLogProbPolicy.trained) == [0, 1, 2, 3]
    for step, lp in NoOldLogProbPolicy.trained.items():  # bit for bit what the rollout returned for that batch
        assert torch.equal(lp, LoggingRollout.sent[step]), step
    names = {s.name for s in trainer.tracer.spans}
    assert "old_log_prob" not in names and "actor_update" in names


async def test_the_advantage_stage_takes_the_rollouts_log_probs_as_old_log_probs():
    n = 4
    lp = -torch.rand(n, R, generator=torch.Generator().manual_seed(3))
    batch = TensorDict({"rollout_log_probs": lp, "response_mask": torch.ones(n, R, dtype=torch.long),
                        "uid": torch.tensor([0, 0, 1, 1])}, batch_size=[n])
    scores = TensorDict({"scores": torch.tensor([1.0, 0.0, 0.0, 1.0])}, batch_size=[n])
    algo = {"name": "grpo", "norm_adv_by_std": True}
    async with LocalWorkerGroup(AdvantageWorker, world_size=1) as adv:
        g = Groups(rollout=None, reward=None, policy=None, advantage=adv)  # type: ignore[arg-type]
        assert stages.old_log_prob(g, batch, bypass=True) is None  # no call: the policy is not even there
        out = await stages.advantages(g, batch, scores, None, None, None, algo)
        assert torch.equal(out["old_log_probs"], lp) and out["old_log_probs"].tolist() == lp.tolist()
        assert out["advantages"][:, 0].tolist() == pytest.approx([0.7071, -0.7071, -0.7071, 0.7071], abs=1e-4)
        with pytest.raises(Exception, match="takes old_log_probs from the rollout's rollout_log_probs"):
            await stages.advantages(g, batch.exclude("rollout_log_probs"), scores, None, None, None, algo)


@pytest.mark.parametrize("overrides,message", [
    (["actor.rollout_correction.bypass_mode=on_policy", "trainer.max_staleness=1",
      "rollout.engine_kwargs={exact_log_probs: true}"],
     "bypass_mode=on_policy uses the rollout's log-probs .* but trainer.max_staleness=1 lets a batch come from older "
     "weights"),
    (["actor.rollout_correction.bypass_mode=on_policy", "trainer.max_staleness=0"],
     "but the 'hf' engine's log-probs are not exact .*Use bypass_mode=behaviour"),
    (["actor.rollout_correction.bypass_mode=behaviour", "actor.rollout_correction.mode=tis"],
     "bypass_mode='behaviour' takes the rollout's log-probs as old_log_probs .* 'tis' importance weights"),
    (["actor.rollout_correction.bypass_mode=always"], "bypass_mode must be"),
])
def test_a_bypass_where_it_is_not_sound_is_a_config_error_naming_why(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_sound_bypass_settings_validate_and_drop_the_importance_weights():
    cfg = grpo_toy()
    cfg.trainer.max_staleness = 1
    cfg.actor.rollout_correction.bypass_mode = "behaviour"
    assert cfg.validate().correction == "none"  # pi_old is pi_rollout: no weights
    cfg = grpo_toy()
    cfg.trainer.max_staleness = 0
    cfg.rollout.engine_kwargs = {"exact_log_probs": True}
    cfg.actor.rollout_correction.bypass_mode = "on_policy"
    assert cfg.validate().correction == "none"
