"""asyncrl.roles: the RL workers (rollout, policy, reference, critic, reward), their
configs, models/tokenizers, generation engines and the pure RL math.

The contract with the trainers is docs/roles_api.md; how to bring your own model,
tokenizer, reward function or worker class is docs/roles.md.
"""

from asyncrl.roles.agentic.environments import Environment, StepResult, register_environment
from asyncrl.roles.agentic.episodes import LLM, Sample, Trajectory, register_episode
from asyncrl.roles.agentic.tools import Tool, tool
from asyncrl.roles.scoring import arithmetic
from asyncrl.roles import functional
from asyncrl.roles.training.critic import CriticWorker
from asyncrl.roles.engines import Completion, GenerationEngine, SamplingParams, make_engine, register_engine
from asyncrl.roles.errors import (
    CheckpointFormatError,
    DeviceError,
    EpisodeConfigError,
    EpisodeError,
    HandedOverError,
    ReplicaLostError,
    MissingDependencyError,
    ModelFormatError,
    ModelNotFoundError,
    PauseDeadlineError,
    PreemptedError,
    PromptTooLongError,
    RewardFnError,
    RolesError,
    StaleBatchError,
    StaleWeightsError,
    TokenizerNotFoundError,
    TrajectoryError,
    UnknownNameError,
    WeightsLostError,
    WeightSyncError,
)
from asyncrl.roles.modeling.gguf import SMOLLM2_135M_INSTRUCT
from asyncrl.roles.modeling.models import ModelConfig, load_model, load_tokenizer, save_model_dir, tiny_tokenizer
from asyncrl.roles.training.policy import LoraConfig, OptimConfig, PolicyWorker, ReferenceWorker, RolloutCorrectionConfig
from asyncrl.roles.scoring.reward import RewardConfig, RewardInput, RewardWorker, register_reward_fn, toy_dataset
from asyncrl.roles.generation.rollout import RolloutConfig, RolloutWorker
from asyncrl.roles.weights.sync import open_weight_channel, sync_weights
from asyncrl.roles.weights.transfer import WeightHandle

__all__ = [
    "Environment",
    "LLM",
    "Sample",
    "StepResult",
    "Tool",
    "Trajectory",
    "register_environment",
    "register_episode",
    "tool",
    "SMOLLM2_135M_INSTRUCT",
    "CheckpointFormatError",
    "Completion",
    "CriticWorker",
    "DeviceError",
    "EpisodeConfigError",
    "EpisodeError",
    "GenerationEngine",
    "LoraConfig",
    "MissingDependencyError",
    "ModelFormatError",
    "ModelConfig",
    "ModelNotFoundError",
    "PauseDeadlineError",
    "PreemptedError",
    "HandedOverError",
    "ReplicaLostError",
    "OptimConfig",
    "PolicyWorker",
    "PromptTooLongError",
    "ReferenceWorker",
    "RewardConfig",
    "RewardFnError",
    "RewardInput",
    "RewardWorker",
    "RolesError",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RolloutWorker",
    "SamplingParams",
    "StaleBatchError",
    "StaleWeightsError",
    "TokenizerNotFoundError",
    "TrajectoryError",
    "UnknownNameError",
    "WeightHandle",
    "WeightSyncError",
    "WeightsLostError",
    "arithmetic",
    "functional",
    "load_model",
    "load_tokenizer",
    "make_engine",
    "open_weight_channel",
    "register_engine",
    "register_reward_fn",
    "save_model_dir",
    "sync_weights",
    "tiny_tokenizer",
    "toy_dataset",
]
