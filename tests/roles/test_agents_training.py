"""Training on masked multi-turn trajectories: the policy update puts exactly zero gradient on the
environment tokens, and two policy ranks on real Ray train like one on unequal-length episodes."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

import asyncrl
from asyncrl import Dispatch, register
from asyncrl.pipelines.loop.stages import AdvantageWorker
from asyncrl.roles import OptimConfig, PolicyWorker, RolloutConfig, RolloutCorrectionConfig, RolloutWorker
from asyncrl.roles.agentic.episodes import LLM, Sample, Trajectory, register_episode


class GradProbe(PolicyWorker):
    """The policy plus ``update`` returning the summed gradient it applied (lr=0: weights stay)."""

    @register(Dispatch.DP_COMPUTE_METRIC)
    def update_and_grads(self, batch, loss_agg_mode: str) -> dict:
        self.optim_config.loss_agg_mode = loss_agg_mode
        metrics = self.update(batch)
        return {"metrics": metrics,
                "grads": {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}}


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this test module is not importable by workers

OPTIM = OptimConfig(lr=0.0, micro_batch_size=3, max_grad_norm=None, kl_coef=0.1, kl_loss_type="low_var_kl",
                    entropy_coef=0.01, rollout_correction=RolloutCorrectionConfig(mode="tis", rollout_is_threshold=1.5))


@register_episode("test_uneven_turns")
async def uneven_turns(llm: LLM, sample: Sample) -> Trajectory:
    """Rows 0-3: three turns of 4 tokens with feedback between; rows 4-7: one turn of 2 tokens."""
    traj = llm.start(sample)
    turns = 3 if sample.index < 4 else 1
    for k in range(turns):
        await llm.generate(traj, max_new_tokens=4 if turns == 3 else 2)
        if k + 1 < turns:
            traj.observe(llm.encode(f" try {k}:"))
    traj.reward = float(sum(t == llm.encode("1")[0] for t in traj.model_ids()))
    return traj


@pytest.fixture(scope="module")
async def episode_batch(model_config, prompt_batch):
    """8 episodes (4 samples x 2), the training fields filled in; rank 0 of two holds the long ones."""
    rollout = RolloutWorker(model_config, RolloutConfig(max_new_tokens=24, episode="test_uneven_turns"))
    b = (await rollout.generate(prompt_batch(n=4, repeat=2)[torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])], seed=3)).clone(False)
    b.update(PolicyWorker(model_config).compute_log_prob(b))
    g = torch.Generator().manual_seed(0)
    mask = b["response_mask"]
    b["ref_log_probs"] = b["old_log_probs"] + torch.randn(mask.shape, generator=g) * 0.3 * mask
    b["scores"] = b["episode_reward"] + torch.randn(8, generator=g)  # distinct scores: every group has signal
    b["advantages"] = AdvantageWorker().compute_advantages(
        b, b.select("scores"), b.select("old_log_probs"), algo={"name": "grpo", "norm_adv_by_std": True})["advantages"]
    env = (b["attention_mask"][:, -24:] == 1) & (mask == 0)
    tokens = mask.sum(1)
    assert env[:4].sum(1).min() > 0 and env[4:].sum() == 0 and tokens[:4].sum() == 6 * tokens[4:].sum()
    return b


def test_the_policy_update_puts_exactly_zero_gradient_on_environment_tokens(model_config, episode_batch):
    b = episode_batch
    policy = GradProbe(model_config, OptimConfig(lr=0.0, micro_batch_size=64, max_grad_norm=None, kl_coef=0.1,
                                                 kl_loss_type="low_var_kl", entropy_coef=0.01,
                                                 rollout_correction=OPTIM.rollout_correction))
    grads: list[torch.Tensor] = []
    head = policy.model.get_output_embeddings()

    def keep_grad(module, inputs, out):  # returns None: the output is unchanged
        if out.requires_grad:
            out.register_hook(grads.append)

    hook = head.register_forward_hook(keep_grad)
    try:
        base = policy.update_and_grads(b, "token-mean")
    finally:
        hook.remove()
    (g,) = grads  # [B, T or R + 1, V]: the gradient of the loss on the logits the head computed
    R = b["response_ids"].shape[1]
    mask = b["response_mask"].bool()
    env = (b["attention_mask"][:, -R:] == 1) & ~mask
    # the logits that predict response token j sit at T-R-1+j: the head's last R + 1 positions but the last
    # (it runs on those alone when the model takes `logits_to_keep`, roles/_util.py)
    per_token = g[:, -R - 1:-1].abs().amax(-1)
    assert env.sum() > 0 and (per_token[env] == 0).all() and (per_token[mask] > 0).all()
    # whatever the environment positions hold, the update is bit-identical
    junk = b.clone(False)
    for k in ("old_log_probs", "ref_log_probs", "rollout_log_probs", "advantages"):
        junk[k] = torch.where(env, torch.full_like(b[k], 123.0), b[k])
    other = policy.update_and_grads(junk, "token-mean")
    assert all(torch.equal(base["grads"][n], other["grads"][n]) for n in base["grads"])


@pytest.fixture(scope="module")
async def two_policy_ranks(ray_cluster, model_config):
    col = asyncrl.colocate({"policy": (GradProbe, (model_config, OPTIM), {})}, world_size=2, name="agents-two-ranks")
    await col.setup()
    try:
        yield col
    finally:
        await col.close()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
async def test_two_policy_ranks_train_like_one_on_unequal_masked_episodes(two_policy_ranks, model_config,
                                                                           episode_batch, mode):
    one = GradProbe(model_config, OPTIM).update_and_grads(episode_batch, mode)
    r0, r1 = await two_policy_ranks["policy"].update_and_grads(episode_batch, mode)
    for n, g in one["grads"].items():
        torch.testing.assert_close(r0["grads"][n], g, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r1["grads"][n], g, rtol=1e-5, atol=1e-7)
    assert r0["metrics"] == r1["metrics"]
    # the episode metrics are of the whole batch: rows 0-3 took 3 turns and filled their 24 tokens, rows 4-7 one
    m = one["metrics"]
    assert m["episode/turns_mean"] == 2.0 and m["episode/stop_max_length_frac"] == m["episode/stop_stop_frac"] == 0.5
    assert one["metrics"]["episode/model_tokens_mean"] == 7.0 and one["metrics"]["episode/tool_errors"] == 0.0
    for k, v in one["metrics"].items():
        if k.startswith(("row_staleness", "version")):
            continue  # the two-rank policy ran the other mode's update before (lr=0, its version moved)
        assert r0["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_gae_over_an_episode_is_gae_over_its_model_tokens_alone():
    """PPO on episodes: the terminal reward sits on the last model token and GAE skips environment
    tokens (verl's observation-token skipping), so the advantages equal those of the compacted row."""
    from asyncrl.pipelines.loop.stages import terminal_rewards
    from asyncrl.roles import functional as F

    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    values = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    rewards = terminal_rewards(torch.tensor([1.5, -0.5]), mask)
    assert rewards[0].tolist() == [0.0] * 6 + [1.5] + [0.0] * 3 and rewards[1, 2] == -0.5
    adv, ret = F.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    keep = mask[0].bool()
    adv_c, ret_c = F.gae(rewards[:1, keep], values[:1, keep], mask[:1, keep], gamma=0.9, lam=0.8)
    assert torch.equal(adv[:1, keep], adv_c) and torch.equal(ret[:1, keep], ret_c)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    # the row without environment tokens is what it always was: the last token's advantage is r - V
    assert adv[1, 2] == -0.5 - values[1, 2]
