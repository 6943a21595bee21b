"""asyncrl.pipelines: the async RL trainers, the synchronous baseline and the main job.

See docs/pipelines.md. ``asyncrl train`` runs :func:`asyncrl.pipelines.commands.cli.main`.
"""

from asyncrl.pipelines.loop.buffer import BufferStatistics, StaleSampleError, StalenessBuffer
from asyncrl.pipelines.job.config import (
    AlgorithmConfig,
    ConfigError,
    DataConfig,
    JobConfig,
    RestartConfig,
    TrainerConfig,
    config_fingerprint,
)
from asyncrl.pipelines.job import presets
from asyncrl.pipelines.job.presets import grpo_toy, load_config, ppo_toy, tiny_test
from asyncrl.pipelines.loop.stages import AdvantageWorker, Groups
from asyncrl.pipelines.trainers.sync import run_sequential, sequential_fit
from asyncrl.pipelines.observe.trace import Tracer
from asyncrl.pipelines.trainers.trainer import GRPOTrainer, PPOTrainer, RolloutBatch, Trainer, build_groups, make_trainer

__all__ = [
    "AdvantageWorker",
    "AlgorithmConfig",
    "BufferStatistics",
    "ConfigError",
    "DataConfig",
    "GRPOTrainer",
    "Groups",
    "JobConfig",
    "PPOTrainer",
    "RestartConfig",
    "RolloutBatch",
    "StaleSampleError",
    "StalenessBuffer",
    "Tracer",
    "Trainer",
    "TrainerConfig",
    "build_groups",
    "config_fingerprint",
    "grpo_toy",
    "load_config",
    "make_trainer",
    "ppo_toy",
    "presets",
    "run_sequential",
    "sequential_fit",
    "tiny_test",
]
