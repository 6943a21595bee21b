"""Every public exception of asyncrl.roles, one line each on when it is raised.

Raised inside a worker, they reach the controller as the ``cause`` of an
:class:`asyncrl.RemoteError` (which names the group, method and rank).
"""

from __future__ import annotations

from asyncrl.errors import AsyncRLError

__all__ = [
    "RolesError",
    "ModelNotFoundError",
    "TokenizerNotFoundError",
    "ModelFormatError",
    "MissingDependencyError",
    "PromptTooLongError",
    "StaleWeightsError",
    "StaleBatchError",
    "WeightSyncError",
    "WeightsLostError",
    "RewardFnError",
    "UnknownNameError",
    "DeviceError",
    "TrajectoryError",
    "EpisodeConfigError",
    "EpisodeError",
    "PauseDeadlineError",
    "CheckpointFormatError",
    "PreemptedError",
    "HandedOverError",
    "ReplicaLostError",
]


class RolesError(AsyncRLError):
    """Base class of every error asyncrl.roles raises on purpose."""


class ModelNotFoundError(RolesError, FileNotFoundError):
    """Raised when a model directory is missing or holds no loadable model config/weights."""


class TokenizerNotFoundError(RolesError, FileNotFoundError):
    """Raised when a tokenizer directory is missing or holds no tokenizer files."""


class ModelFormatError(RolesError, ValueError):
    """Raised when a model file exists but cannot be read (a corrupt or truncated GGUF, an unsupported format)."""


class MissingDependencyError(RolesError, ImportError):
    """Raised when a feature needs an optional package (an extra) that is not installed; names the install command."""


class PromptTooLongError(RolesError, ValueError):
    """Raised when prompt + max_new_tokens exceeds the model's context (prompts are never truncated silently)."""


class StaleWeightsError(RolesError, ValueError):
    """Raised when a weight update carries a version older than or equal to the one already loaded."""


class StaleBatchError(RolesError, ValueError):
    """Raised when a training batch holds rows generated more than ``max_staleness`` versions before
    the policy it would update (or by a version the policy has not reached); nothing is applied."""


class CheckpointFormatError(RolesError, ValueError):
    """Raised when a role's checkpoint was written by another training strategy (whole ``ddp`` weights
    against ``fsdp2`` shards) than the one loading it."""


class WeightSyncError(RolesError, RuntimeError):
    """Raised when a weight transfer is malformed (unknown/missing names, shapes, checksum mismatch)."""


class WeightsLostError(WeightSyncError):
    """Raised when the weights being loaded were lost with another process: the policy that owned the
    ``object_store`` copy died (its node lost), or a weight channel's member died or stalled mid-transfer.
    The rollout keeps its previous weights. A worker fault, not a bug: the trainer's restart policy handles
    it like the death it reports."""


class PauseDeadlineError(RolesError, TimeoutError):
    """Raised when a weight update's pause of the rollout engine does not take effect within
    ``RolloutConfig.pause_deadline_s`` (nothing is loaded; generation runs on under the old weights)."""


class DeviceError(RolesError, RuntimeError):
    """Raised at setup when a role's device or precision is unavailable (``cuda`` without a GPU, bf16
    without hardware support, a GPU with too little free memory)."""


class RewardFnError(RolesError, RuntimeError):
    """Raised when a reward function raises or returns the wrong type or shape; names the function."""


class UnknownNameError(RolesError, KeyError):
    """Raised when a registry (engines, reward functions, tokenizers) has no entry of that name."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class TrajectoryError(RolesError, ValueError):
    """Raised when an episode returns a malformed trajectory; names the episode and the field."""


class EpisodeConfigError(RolesError, ValueError):
    """Raised at configuration time for an unknown episode or environment, or a tool that is not async."""


class EpisodeError(RolesError, RuntimeError):
    """Raised when an episode (or its environment) raises; names the episode and the row."""


class PreemptedError(RolesError, RuntimeError):
    """Raised by a rollout worker's request-level generation when its process was told to stop (a SIGTERM, a
    preemption notice) or its rows were handed over (a resize): the rows in flight stopped at their next
    decoding step and are to be continued elsewhere with the same seeds. ``partial`` holds what the call's plain
    rows decoded, by request key (``{"ids", "log_probs", "versions", "finish"}``; a finished row's whole
    completion, an unfinished one's prefix), for ``generate_requests(..., resume=...)``. ``rounds``: on a
    SIGTERM's notice, the told-to-stop rank's round log since its last fetch (``round_log``; None when it records
    no rounds), which would otherwise exit with its process."""

    def __init__(self, message: str, partial: dict[str, dict] | None = None,
                 rounds: list[dict] | None = None) -> None:
        super().__init__(message)
        self.partial: dict[str, dict] = dict(partial or {})
        self.rounds: list[dict] | None = rounds


class HandedOverError(RolesError, RuntimeError):
    """Raised by a request's generation when the request batcher handed it over (``RequestBatcher.hand_over``):
    what it decoded went to the caller of the hand-over, to be continued elsewhere."""


class ReplicaLostError(RolesError, RuntimeError):
    """Raised by every call of a simulated rollout replica that died (the cluster twin's chaos,
    ``asyncrl.pipelines.commands.chaos``): its engine is gone while the process hosting it, and its other replicas,
    live on. The supervisor takes it for that rank's death (a worker fault of its group)."""
