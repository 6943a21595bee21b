"""The configuration of a training run: keyword-only dataclasses, one per concern.

The worker sections (``model``, ``rollout``, ``actor``, ``critic``, ``reward``) are
the roles' own configs; the sections defined here belong to the trainer. A full run is
a function returning a :class:`JobConfig` (see :mod:`asyncrl.pipelines.job.presets`);
:func:`~asyncrl.pipelines.job.presets.load_config` applies a YAML file and dotted ``key=value`` overrides on top, and
:meth:`JobConfig.validate` rejects impossible combinations before any worker starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from asyncrl.pipelines import configlib
from asyncrl.pipelines.configlib import ConfigError
from asyncrl.pipelines.job.elastic import WorkerRange, parse_workers
from asyncrl.pipelines.job.modes import RolloutMode, rollout_mode, rollout_mode_names
from asyncrl.pipelines.datasets.evaluation import EvalConfig
from asyncrl.pipelines.twin.profile import TwinConfig, check_twin
from asyncrl.roles import ModelConfig, OptimConfig, RewardConfig, RolloutConfig
from asyncrl.roles.fields import MAX_ROWS, MAX_SEED, MAX_WORKERS, Range, Section, check_bounds
from asyncrl.pipelines.datasets.data import task_names, task_pairs
from asyncrl.pipelines.job.validation import check_worker_sections
from asyncrl.roles.modeling.models import meta_model
from asyncrl.roles.scoring.reward import RewardFnSpecError, is_reward_path, load_reward_fn
from asyncrl.roles.modeling.lora import check_targets
from asyncrl.runtime import loop_factory

LOGGERS = ("wandb",)
"""Names ``trainer.loggers`` accepts."""
MAX_BUFFERED = 1024
"""Most batches the rollout->train buffer may hold (``trainer.buffer_capacity``, ``max_staleness + 1`` by default):
each is a step's rows, held in memory."""
_PER_NODE = "a positive worker count (one per node)"
_AMOUNT = "a positive amount of the custom Ray resource (CPUs and GPUs: cpus_per_worker, gpus_per_worker)"

__all__ = [
    "AlgorithmConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FilterGroupsConfig",
    "JobConfig",
    "RestartConfig",
    "StreamConfig",
    "TrainerConfig",
    "TwinConfig",
    "WorkerRange",
    "config_fingerprint",
]


@dataclass(kw_only=True)
class DataConfig(Section):
    """Where prompts come from: a built-in task (deterministic, no files), or dataset files
    (``train_files``, verl's column names by default; see :mod:`asyncrl.pipelines.datasets.datafiles`)."""

    train_files: str | list[str] | None = None
    """Training prompts from files instead of `task`: one path or a list (JSONL, Parquet, or a directory saved
    with ``datasets.Dataset.save_to_disk``). Every row is used; `task`, `task_kwargs` and `num_prompts` are
    ignored."""
    val_files: str | list[str] | None = None
    """Evaluation prompts (``evaluation``) from files; None evaluates on `train_files`."""
    prompt_key: str = "prompt"
    """Column of the prompt: a list of chat messages (rendered with the tokenizer's chat template) or a string.
    A dotted key reads a nested field."""
    answer_key: str = "reward_model.ground_truth"
    """Column of the answer the reward gets (verl's ``reward_model.ground_truth``); non-strings are JSON-encoded."""
    max_prompt_length: Annotated[int, Range(ge=1, le=1 << 20)] | None = None
    """Longest prompt in tokens (after the chat template); a longer one is refused, or dropped with
    `filter_overlong_prompts`. None: no limit (the model's context still applies)."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than `max_prompt_length` (the count is logged) instead of refusing the data."""
    task: str = "char_class"
    """Name of a task in :mod:`asyncrl.pipelines.datasets.data` (``char_class``, ``echo_word``, ``echo_number``,
    ``arith``); its answers go with the reward function."""
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to the task's generator, e.g. ``{"levels": [1, 2], "ops": ["add", "mul"]}`` for ``arith``."""
    num_prompts: Annotated[int, Range(ge=1, le=MAX_ROWS)] = 64
    """Prompts in the dataset (``char_class`` and ``echo_word`` draw theirs from 2 and 8 distinct ones); the loader
    cycles through them in epochs."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (seeded by ``trainer.seed`` and the epoch)."""
    chat_template: bool = False
    """Wrap each prompt in the tokenizer's chat template (a user turn + the assistant generation prompt), as an
    instruct model expects."""
    system_prompt: str | None = None
    """System message of the chat template; None keeps the template's default."""


@dataclass(kw_only=True)
class FilterGroupsConfig(Section):
    """``algorithm.filter_groups`` (verl's name): dynamic sampling for GRPO."""

    enable: bool = False
    """Drop groups whose rewards are all equal and sample more prompts until the batch is full."""
    max_num_gen_batches: Annotated[int, Range(ge=1, le=1000)] = 10
    """Most generate calls per step (the first included); then the batch is filled with dropped groups."""


@dataclass(kw_only=True)
class AlgorithmConfig(Section):
    """The RL algorithm: advantage estimator and loss settings."""

    name: Literal["grpo", "ppo"] = "grpo"
    """``grpo`` (group-relative advantages, no critic) or ``ppo`` (critic + GAE)."""
    group_size: Annotated[int, Range(ge=1, le=MAX_ROWS)] = 8
    """GRPO: responses sampled per prompt (n). PPO uses 1 unless set otherwise."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred scores by the group's std."""
    gamma: Annotated[float, Range(ge=0, le=1)] = 1.0
    """PPO: discount of the GAE."""
    lam: Annotated[float, Range(ge=0, le=1)] = 0.95
    """PPO: lambda of the GAE."""
    kl_in_reward_coef: Annotated[float, Range(ge=0)] = 0.0
    """PPO: per-token KL(policy || reference) penalty subtracted from the reward (0 = off)."""
    kl_penalty: Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"] = "k1"
    """Estimator of the in-reward KL penalty (verl's ``algorithm.kl_penalty``)."""
    whiten_advantages: bool = True
    """PPO: whiten advantages over the batch."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """GRPO: dynamic sampling (DAPO; verl's ``algorithm.filter_groups``): drop groups whose rewards are all
    equal and sample more prompts until the batch is full (:mod:`asyncrl.pipelines.rollout.sampling`)."""


@dataclass(kw_only=True)
class RestartConfig(Section):
    """Supervision: what the trainer does when a worker dies or a stage misses its deadline
    (see docs/reliability.md)."""

    max_restarts: Annotated[int, Range(ge=0, le=1000)] = 3
    """How many times a run may recover, replacements and restarts together (0 = fail fast: raise
    the typed error and release every worker). A restart closes every group, starts new actors in
    the same placement groups, restores the last checkpoint this run wrote (or the run's start) and
    recomputes the steps after it. The default (3) replaces a dead rollout-pool worker in place and
    restarts a run whose training worker died from its newest checkpoint (at most
    ``trainer.checkpoint_every_s`` old), so a long run survives them without being asked to."""
    on_timeout: bool = True
    """Also recover when a stage misses ``trainer.stage_timeout_s`` (a hung worker); False fails fast."""
    replace_stateless: bool = True
    """Recover a dead or hung rollout-pool worker (rollout engine, rule reward: no training state)
    by replacing that pool's processes in place and re-issuing the lost batch with the same prompts,
    seed and weight version, while training goes on -- no checkpoint restored. False: a full
    restart. Needs two pools (``colocated=false``)."""
    placement_wait_s: Annotated[float, Range(gt=0, says="a positive number of seconds")] = 60.0
    """With pools of their own (``trainer.rollout_placement``/``train_placement``): how long a pool whose node
    was lost waits for the cluster to hold it again (a node that comes back, an autoscaler) before the run
    fails with ``asyncrl.PlacementError`` naming the resources it misses."""


@dataclass(kw_only=True)
class StreamConfig(Section):
    """``trainer.stream``: streaming rollout (``trainer.rollout_mode=stream``)."""

    max_groups_in_flight: Annotated[int, Range(ge=1, le=MAX_ROWS)] | None = None
    """Most prompt groups generating at once (a memory bound; with `drop_stale`, generating or waiting
    for a step); None: ``(max_staleness + 1) * groups per step``, what admission control allows anyway.
    Must be at least one step's groups."""
    drop_stale: bool = False
    """Keep the staleness bound by dropping finished groups that are too old (counted in
    ``stream/dropped_groups``) instead of pausing the sampler. Off: nothing is ever dropped."""
    bound: Literal["trained", "admitted"] = "trained"
    """What ``trainer.max_staleness`` bounds. ``trained``: every trained group was admitted at most ``k`` versions
    before its step (a step waits for the groups that would pass it; docs/streaming.md). ``admitted``: AReaL's bound
    (its ``max_head_offpolicyness``): at most ``(k + 1)`` steps of groups are admitted and untrained, and a step
    trains the ``B`` finished groups admitted earliest without waiting for a long one, which is trained when it
    finishes, possibly more than ``k`` versions old (the per-token correction weights it). More samples per second
    under a long-tailed length distribution (docs/scale.md), older tokens."""


@dataclass(kw_only=True)
class TrainerConfig(Section):
    """The controller: how many steps, how much data per step, staleness and placement."""

    steps: Annotated[int, Range(ge=1, le=1 << 31)] = 40
    """Training steps (one actor update and one weight version each)."""
    batch_size: Annotated[int, Range(ge=1, le=MAX_ROWS)] = 64
    """Responses per step (prompts per step = batch_size / algorithm.group_size)."""
    max_staleness: Annotated[int, Range(ge=0, le=MAX_BUFFERED - 1)] = 1
    """How many versions rollout may run ahead: 0 is on-policy (the synchronous loop); k lets the
    batch of step t be generated with weights t-k."""
    rollout_weights: Literal["auto", "fixed_lag", "latest"] = "auto"
    """``fixed_lag``: batch t is always generated with version max(0, t - max_staleness), so a run
    is reproducible and equals the k-step-off-policy loop; ``latest``: the newest version
    available when the batch starts (never older than that). ``auto`` follows the mode (its
    ``RolloutMode.weights``): ``latest`` with ``rollout_mode=stream`` (its only choice), ``fixed_lag``
    with ``batch`` (:meth:`weights_choice`)."""
    buffer_capacity: Annotated[int, Range(ge=1, le=MAX_BUFFERED)] | None = None
    """Batches the rollout→train buffer holds; None = max_staleness + 1."""
    rollout_mode: str = "batch"
    """A registered rollout mode (:mod:`asyncrl.pipelines.job.modes`; docs/rollout_modes.md shows how to
    add one). ``batch``: each step's prompts are generated as one batch; ``stream``: prompt groups are kept in
    flight, and a step trains the first finished groups that fill it, within ``max_staleness`` per
    trajectory (docs/streaming.md; loads the newest weights: ``rollout_weights`` ``auto`` or ``latest``)."""
    stream: StreamConfig = field(default_factory=StreamConfig)
    """Settings of ``rollout_mode=stream``."""
    seed: Annotated[int, Range(ge=0, le=MAX_SEED)] = 0
    """Seed of the data order and of every sampling call (step t samples with seed + t)."""
    colocated: bool = False
    """Put rollout and training in the same worker processes (no overlap) instead of two pools."""
    rollout_workers: Annotated[int, Range(ge=1, le=MAX_WORKERS)] | WorkerRange | str = 1
    """Processes of the rollout pool (rollout engine and rule reward): a count, or a range ``min..max``
    (``"1..3"``, or ``WorkerRange(1, 3)`` in Python) within which ``scale_rollout`` and the autoscaler resize
    the pool; the run starts at ``min``. A range needs a rollout pool of its own (``rollout_placement``,
    adding up to ``min``); docs/nodes.md, "Elastic rollout"."""
    rollout_autoscale: bool = False
    """Streaming (``rollout_mode=stream``) with a ``rollout_workers`` range: grow the rollout pool by one worker
    while admission waits on generation, shrink it by one when its engines idle, within the range and the
    cluster's capacity (:mod:`asyncrl.pipelines.rollout.stream_scale`)."""
    rollout_drain_s: Annotated[float, Range(ge=0, says=">= 0 seconds")] = 30.0
    """Streaming: how long a rollout pool being replaced by a resize (or a preemption) lets its groups in
    flight finish; past it they are handed over (cancelled at a decoding-step boundary and issued again on
    the new pool with the same prompts and seeds). 0: hand over at once."""
    train_workers: Annotated[int, Range(ge=1, le=MAX_WORKERS)] = 1
    """Processes of the training pool (policy, reference and critic)."""
    rollout_placement: Annotated[list[int], Range(ge=1, says=_PER_NODE)] | None = None
    """The rollout pool's workers per node, e.g. ``[1]`` or ``[2, 2]`` (two nodes with two each; they add up
    to ``rollout_workers``). Setting this or ``train_placement`` gives each pool placement groups of its own,
    so rollout and training can sit on different nodes of a Ray cluster, and a rollout pool whose node was
    lost is placed again on the capacity left (``restart.placement_wait_s``). None for both: today's single
    placement group on one node, shared by the two pools. Not with ``colocated``."""
    train_placement: Annotated[list[int], Range(ge=1, says=_PER_NODE)] | None = None
    """The training pool's workers per node (they add up to ``train_workers``), e.g. ``[2]`` or ``[1, 1]``
    (two ranks on two nodes); see ``rollout_placement``. None with ``rollout_placement`` set: ``[train_workers]``."""
    rollout_resources: Annotated[dict[str, float], Range(gt=0, says=_AMOUNT)] | None = None
    """Custom Ray resources each rollout worker reserves besides its CPUs and GPUs, e.g. ``{rollout_node: 1}``,
    so that the pool goes only to nodes that advertise them (``ray start --resources='{"rollout_node": 4}'``).
    Needs ``rollout_placement`` or ``train_placement``. None: none."""
    train_resources: Annotated[dict[str, float], Range(gt=0, says=_AMOUNT)] | None = None
    """Custom Ray resources each training worker reserves (see ``rollout_resources``)."""
    cpus_per_worker: Annotated[float, Range(gt=0, le=1 << 16)] = 1.0
    """CPUs each worker process reserves in Ray."""
    gpus_per_worker: Annotated[float, Range(ge=0, le=1024)] = 0.0
    """GPUs each worker process reserves (0: CPU-only pools). A fraction shares a GPU: 0.5 with one
    rollout and one training worker puts both pools on one GPU. Roles with ``model.device="auto"``
    compute on the GPU their bundle reserves."""
    weight_sync: Literal["auto", "object_store", "local", "collective", "adapter"] = "auto"
    """How policy weights reach the rollout (asyncrl.roles.weights.sync): ``local`` (colocated, in-process
    snapshot), ``collective`` (two pools, a process group: NCCL on distinct GPUs, else gloo),
    ``object_store``; ``adapter`` (``actor.lora.rank > 0``): only the LoRA factors travel (through the object
    store); the HF rollout merges them into its copy of the base weights, the vLLM rollout serves them as a
    LoRA adapter (``enable_lora``, a ``LoRARequest`` per version) on its base weights. ``auto``: local when
    colocated, collective when the pools have GPUs, else object_store."""
    weight_sync_timeout_s: Annotated[float, Range(gt=0)] = 120.0
    """Deadline of the collective weight channel's rendezvous and of each transfer over it."""
    num_cpus: Annotated[int, Range(ge=1, le=1 << 20)] | None = None
    """CPUs of the embedded Ray the job starts (None: Ray counts the machine's)."""
    output_dir: str = "runs/grpo_toy"
    """Where metrics, traces, plots and checkpoints go."""
    checkpoint_every: Annotated[int, Range(ge=0)] = 0
    """Save a checkpoint every this many steps (0 = only at the end when checkpoint_at_end)."""
    checkpoint_every_s: Annotated[float, Range(gt=0, says="a positive number of seconds or null (off)")] | None = 600.0
    """Also save a checkpoint after the first step that ends at least this many seconds after the last one
    (or the start), so that a killed controller or training worker loses at most about this much work.
    None: only `checkpoint_every` (and the end)."""
    checkpoint_at_end: bool = True
    """Save a checkpoint after the last step."""
    keep_checkpoints: Annotated[int, Range(ge=1, le=1 << 16)] = 2
    """Most recent checkpoints kept on disk."""
    trace: bool = True
    """Record stage spans and write ``trace.json`` (Perfetto)."""
    plot: bool = True
    """Write ``report.png`` (reward curve and overlap timeline) when matplotlib is installed."""
    progress: bool = True
    """Show a progress bar."""
    tensorboard: bool = True
    """Also write TensorBoard scalars when ``torch.utils.tensorboard`` works."""
    loggers: list[str] = field(default_factory=list)
    """More metric sinks beside ``metrics.jsonl`` (and TensorBoard, ``tensorboard``): ``"wandb"`` logs every
    step and evaluation row to Weights & Biases (needs the ``wandb`` package), project ``wandb_project``, run
    name the output directory's, files under ``<output_dir>/wandb``. Offline unless ``WANDB_MODE`` says
    otherwise (``WANDB_MODE=online`` and a login upload it; ``wandb sync`` uploads an offline run later)."""
    wandb_project: str = "asyncrl"
    """The W&B project of ``loggers=["wandb"]``."""
    samples_per_step: Annotated[int, Range(ge=0, le=MAX_ROWS, says=">= 0 (0 writes no samples.jsonl)")] = 4
    """Trajectories of each step's training batch written to ``samples.jsonl`` (whole prompt groups, drawn
    at random; per token the id, text, mask, version, log-probs and advantage; ``asyncrl view`` shows
    them). 0 = none."""
    stage_timeout_s: Annotated[float, Range(gt=0, says="a positive number of seconds or null")] | None = None
    """Deadline of every stage call (generate, score, log-probs, updates, weight sync, checkpoint
    save/load), counted from when the call is issued; a stage past it fails with
    ``asyncrl.CallTimeoutError`` and its remote work is cancelled. None = no deadline."""
    rollout_timeout_s: Annotated[float, Range(gt=0, says="a positive number of seconds or null (none)")] | None = 600.0
    """Deadline of the rollout pool's stateless stages (``generate``, ``generate_episodes``, the reward's
    ``compute_reward``), counted from when the call is issued, with two pools; so a hung rollout or reward
    worker misses it and is replaced (``restart``) instead of hanging the run. The smaller of this and
    ``stage_timeout_s`` applies. None = none. Raise it when one generate call of your batch can take longer
    (a large batch of long responses on CPU): a false deadline replaces the pool and generates again."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """What to do when a worker dies or hangs (default: replace a dead rollout-pool worker, restart the
    run from its newest checkpoint when a training worker dies; up to 3 times)."""
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """The controller's event loop when the trainer runs its own (``fit_sync()``, so ``asyncrl train``):
    ``uvloop`` (libuv's loop: cheaper wake-ups and scheduling for the controller), ``asyncio`` (the standard
    library's), or ``auto`` (uvloop when it can be imported, else asyncio). An app that calls
    ``await trainer.fit()`` runs it on its own loop and this setting does not apply."""
    balance_batch: bool = True
    """verl's ``trainer.balance_batch``: give each training rank about the same number of tokens, so that no
    data-parallel rank waits for one that drew the long responses. Streaming: a step's prompt groups (whole: a
    GRPO group stays on one rank) are partitioned over the training ranks by their response tokens, the ranks
    keeping equal group counts (the longest-processing-time rule); the journal keeps the groups as admitted.
    Needs the reward's ``response_length`` (``RewardWorker`` returns it); without it, or in batch mode, rows
    keep their order."""
    precompute_log_probs: bool = False
    """Issue the next step's ``old_log_prob``, ``ref_log_prob`` and ``values`` as soon as its batch is
    generated (or being generated) and the weights it trains from are final -- right after this step's
    ``export_weights`` on the training workers -- instead of after its scores reached the controller.
    Same numbers (the same weights, the same calls in the same order on each training worker); the
    training workers no longer wait for the score and the controller's hand-over. Only with two pools
    and ``max_staleness >= 1`` (``max_staleness=0`` keeps the canonical stage order). The precomputed
    calls carry no ``stage_timeout_s`` of their own (they may wait a whole step for their turn); the
    step's ``advantages`` call, which waits for them, does. Off by default: measured no faster on the
    2-core development machine; off keeps the canonical per-batch
    stage order and a deadline on every stage."""

    @property
    def own_pools(self) -> bool:
        """True when each pool has placement groups of its own (``rollout_placement`` or ``train_placement`` set)."""
        return self.rollout_placement is not None or self.train_placement is not None

    def placements(self) -> tuple[list[int], list[int]]:
        """``(rollout, training)`` workers per node, the unset one on one node."""
        return (list(self.rollout_placement or [self.rollout_start]),
                list(self.train_placement or [self.train_workers]))

    @property
    def rollout_range(self) -> WorkerRange:
        """``rollout_workers`` as a range (a count ``n`` is ``n..n``); ``ValueError`` for a bad value."""
        return parse_workers(self.rollout_workers)

    @property
    def rollout_start(self) -> int:
        """The rollout pool's size at the start: ``rollout_workers``, or its range's minimum."""
        return self.rollout_range.min

    def mode(self) -> RolloutMode:
        """The rollout mode registered as ``rollout_mode``; :class:`ConfigError` listing the registered ones when
        there is none."""
        return rollout_mode(self.rollout_mode)

    def weights_choice(self) -> Literal["fixed_lag", "latest"]:
        """The resolved ``rollout_weights``: ``auto`` is the mode's choice (``latest`` in stream mode, ``fixed_lag``
        in batch mode)."""
        if self.rollout_weights == "auto":
            return self.mode().weights
        return self.rollout_weights


@dataclass(kw_only=True)
class JobConfig(Section):
    """Everything a training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (the reference and critic start from it)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling settings of the rollout workers."""
    actor: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and loss settings of the policy."""
    critic: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer settings of the critic (PPO only)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward function."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """GRPO or PPO settings."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The controller settings."""
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (greedy) before, during and after training (off by default)."""
    twin: TwinConfig = field(default_factory=TwinConfig)
    """The cluster twin: the real trainer against simulated GPU workers (off unless ``twin.profile`` is set;
    docs/scale.md)."""

    @property
    def group_size(self) -> int:
        """Responses per prompt."""
        return self.algorithm.group_size

    @property
    def prompts_per_step(self) -> int:
        """Distinct prompts per step."""
        return self.trainer.batch_size // self.algorithm.group_size

    @property
    def correction(self) -> str:
        """The actor's effective off-policy correction: ``none``, ``tis`` or ``decoupled``
        (``auto`` is ``tis`` when ``trainer.max_staleness >= 1``)."""
        return self.actor.rollout_correction.resolve(self.trainer.max_staleness)

    def worker_actor(self) -> OptimConfig:
        """The actor config the workers get: ``temperature`` taken from the rollout (one temperature
        for sampling, the recomputed log-probs and the reference)."""
        return replace(self.actor, temperature=self.rollout.temperature)

    def worker_reward(self) -> RewardConfig:
        """The reward config the workers get: ``tokenizer`` None (the default) becomes the policy's
        (``model.tokenizer``, else ``model.path`` or ``model.gguf``, else ``"tiny"``), so responses are
        decoded with the tokenizer that encoded them."""
        w, m = self.reward, self.model
        if w.tokenizer is not None:
            return w
        return replace(w, tokenizer=m.tokenizer or m.path or m.gguf or "tiny")

    @property
    def buffer_capacity(self) -> int:
        """Batches the rollout→train buffer holds."""
        t = self.trainer
        return t.buffer_capacity if t.buffer_capacity is not None else t.max_staleness + 1

    def pool_sizes(self) -> dict[str, int]:
        """Worker processes per pool (one pool when colocated)."""
        t = self.trainer
        if t.colocated:
            return {"colocated": t.train_workers}
        return {"rollout": t.rollout_start, "train": t.train_workers}

    def weight_transport(self) -> str:
        """The resolved ``trainer.weight_sync``."""
        t = self.trainer
        if t.weight_sync != "auto":
            return t.weight_sync
        if t.colocated:
            return "local"
        return "collective" if t.gpus_per_worker > 0 else "object_store"

    def validate(self, cluster_cpus: float | None = None, cluster_gpus: float | None = None, *,
                 simulated_policy: bool = False) -> "JobConfig":
        """Raise :class:`ConfigError` for impossible values; `cluster_cpus`/`cluster_gpus` also check the pools fit.
        `simulated_policy`: the run's policy is not a ``PolicyWorker`` (a benchmark's simulated workers, which
        the trainer sees in its ``worker_overrides`` or groups), so ``rollout.engine=sim`` may feed it."""
        configlib.check_types(self)  # every key has its annotated type, however it was set
        try:
            check_bounds(self)  # and every number is within the Range declared next to its field
        except ValueError as e:
            raise ConfigError(str(e)) from None
        t, a = self.trainer, self.algorithm
        if t.batch_size % a.group_size:
            raise ConfigError(
                f"trainer.batch_size={t.batch_size} is not divisible by algorithm.group_size={a.group_size}; "
                f"use a multiple such as {a.group_size * max(1, t.batch_size // a.group_size)}"
            )
        if a.filter_groups.enable and a.name != "grpo":
            raise ConfigError("algorithm.filter_groups.enable=true drops GRPO groups with equal rewards: it needs "
                              "algorithm.name=grpo (set it to false for PPO)")
        if a.name == "grpo" and a.group_size < 2:
            raise ConfigError("GRPO needs algorithm.group_size >= 2 (advantages are relative within a group)")
        mode = t.mode()  # first: the checks below ask it
        if t.rollout_weights not in ("auto", "fixed_lag", "latest"):
            raise ConfigError("trainer.rollout_weights must be 'auto', 'fixed_lag' or 'latest', "
                              f"got {t.rollout_weights!r}")
        try:
            r = t.rollout_range
        except ValueError as e:
            raise ConfigError(str(e)) from None
        t.rollout_workers = str(r) if r.elastic else r.min  # one spelling per meaning (the config's fingerprint)
        self._validate_placement()
        self._validate_elastic()
        if t.weight_sync == "adapter":
            vllm = self.rollout.engine == "vllm"  # serves the factors as a LoRA adapter beside its base weights
            needs = ((self.actor.lora.enabled, "actor.lora.rank > 0 (a LoRA policy)"),
                     (self.rollout.engine in ("hf", "vllm"),
                      f"the hf or vllm rollout engine (not {self.rollout.engine!r})"),
                     (not self.rollout.sleep_level, "rollout.sleep_level=0 (the rollout keeps its base)"),
                     (not (vllm and self.rollout.partial_rollout != "off"),
                      "rollout.partial_rollout=off for vllm (an adapter reaches new requests only)"),
                     (not (vllm and self.rollout.verify_checksums),
                      "rollout.verify_checksums=false for vllm (vLLM holds the base and the adapter, not merged "
                      "weights to checksum)"),
                     (not (vllm and self.actor.lora.rank > 512), "actor.lora.rank <= 512 for vllm (its largest)"))
            why = [w for ok, w in needs if not ok]
            if why:
                raise ConfigError(f"trainer.weight_sync=adapter sends only the LoRA factors, which needs "
                                  f"{' and '.join(why)}; or use trainer.weight_sync=auto")
        if t.event_loop == "uvloop":
            try:
                loop_factory("uvloop")
            except ValueError as e:
                raise ConfigError(f"trainer.event_loop: {e}") from None
        if t.weight_sync == "local" and not t.colocated:
            raise ConfigError("trainer.weight_sync=local hands weights over inside one process: it needs "
                              "trainer.colocated=true (two pools: use collective or object_store)")
        if t.weight_sync == "collective" and t.colocated:
            raise ConfigError("trainer.weight_sync=collective needs two pools; colocated roles share a process "
                              "(use local, or auto)")
        try:
            self.rollout.validate("rollout")
        except ValueError as e:  # EpisodeConfigError too: the message names the rollout.* key
            raise ConfigError(str(e)) from e
        twin = getattr(getattr(self, "twin", None), "profile", None)  # a simulated training run
        if self.rollout.engine == "sim" and twin is None and not simulated_policy:
            raise ConfigError("rollout.engine=sim is the benchmarks' simulated engine: its tokens and log-probs come "
                              "from a cost model, not from the policy, so a policy trained on them learns nothing; "
                              "use rollout.engine=hf or vllm (sim serves simulated runs: twin.profile, or a "
                              "benchmark whose worker_overrides replace the policy)")
        if self.rollout.sleep_level and not t.colocated:
            raise ConfigError(f"rollout.sleep_level={self.rollout.sleep_level} releases the rollout's memory while "
                              "the policy trains on the same GPU: it needs trainer.colocated=true (set it to 0)")
        for name, n in self.pool_sizes().items():
            if name == "rollout" and not mode.splits_batches:
                continue  # each group is routed whole to one replica (a stream): any number of replicas serves it
            if self.prompts_per_step % n:
                raise ConfigError(
                    f"the {name} pool has {n} workers but a step has {self.prompts_per_step} prompts; "
                    "prompts per step must divide evenly so every GRPO group stays on one worker"
                )
        unknown = [x for x in t.loggers if x not in LOGGERS]
        if unknown:
            raise ConfigError(f"trainer.loggers: unknown logger {unknown[0]!r}; choose from {list(LOGGERS)} "
                              "(metrics.jsonl is always written; TensorBoard is trainer.tensorboard)")
        if "wandb" in t.loggers and importlib.util.find_spec("wandb") is None:
            raise ConfigError("trainer.loggers=['wandb'] needs the wandb package: pip install wandb "
                              "(or drop it from trainer.loggers)")
        mode.check(self)
        check_twin(self)
        self._validate_loss()
        self._validate_data()
        self.evaluation.validate()
        if self.model.path is not None and self.model.gguf is not None:
            raise ConfigError(f"model.path={self.model.path!r} and model.gguf={self.model.gguf!r} are both set; "
                              "set one of them")
        if t.gpus_per_worker > 0:
            self._check_capacity("GPUs", t.gpus_per_worker, cluster_gpus,
                                 "lower trainer.gpus_per_worker (0.5 shares a GPU between two workers), the worker "
                                 "counts, or set trainer.colocated=true")
        if not t.output_dir.strip():
            raise ConfigError("trainer.output_dir is empty, which would write the run into the current directory; "
                              "name the run's directory (e.g. trainer.output_dir=runs/my_run)")
        out = Path(t.output_dir)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"trainer.output_dir={t.output_dir!r} is a file; give a directory for the run's outputs")
        above = next(p for p in out.absolute().parents if p.exists())  # the directory mkdir would start in
        if not out.exists() and not above.is_dir():
            raise ConfigError(f"trainer.output_dir={t.output_dir!r} cannot be created: {str(above)!r} is a file; give "
                              "a directory for the run's outputs")
        self._validate_reward()
        check_worker_sections(self)
        self._check_capacity("CPUs", t.cpus_per_worker, cluster_cpus,
                             "lower trainer.rollout_workers/train_workers/cpus_per_worker or set trainer.colocated=true")
        return self

    def _validate_placement(self) -> None:
        """``trainer.*_placement`` add up to their pool's workers, with two pools; custom resources need them."""
        t = self.trainer
        for pool, workers in (("rollout", t.rollout_start), ("train", t.train_workers)):
            key, placement = f"trainer.{pool}_placement", getattr(t, f"{pool}_placement")
            if placement is not None:
                if not placement:
                    raise ConfigError(f"{key} must be a non-empty list of positive worker counts per node, "
                                      f"got {placement!r}")
                if sum(placement) != workers:
                    start = " (a range starts at its minimum)" if pool == "rollout" and t.rollout_range.elastic else ""
                    given = getattr(t, f"{pool}_workers")
                    raise ConfigError(f"{key}={placement} places {sum(placement)} workers but "
                                      f"trainer.{pool}_workers={given}{start}; make them add up")
                if t.colocated:
                    raise ConfigError(f"{key} places a pool of its own, but trainer.colocated=true puts both roles "
                                      "in one pool: unset the placement or set trainer.colocated=false")
            res_key, resources = f"trainer.{pool}_resources", getattr(t, f"{pool}_resources")
            if resources is not None:
                if not t.own_pools or t.colocated:
                    raise ConfigError(f"{res_key} needs pools of their own: set trainer.rollout_placement or "
                                      "trainer.train_placement too (not with trainer.colocated=true)")
                bad = {k: v for k, v in resources.items()
                       if k in ("CPU", "GPU") or isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0}
                if bad:
                    raise ConfigError(f"{res_key} gives each worker custom Ray resources as positive amounts "
                                      f"(CPUs and GPUs: cpus_per_worker, gpus_per_worker), got {bad}")

    def _validate_elastic(self) -> None:
        """A ``rollout_workers`` range: a rollout pool of its own, every size dividing a step's prompts (a mode that
        splits batches), the autoscaler only in a mode that hands generations over, a drain deadline >= 0."""
        t = self.trainer
        r, mode = t.rollout_range, t.mode()
        if t.rollout_autoscale and not mode.hands_over:
            raise ConfigError("trainer.rollout_autoscale=true grows the rollout pool while streaming admission waits "
                              "on generation: it needs trainer.rollout_mode=stream (or another mode that hands "
                              f"generations over; in {t.rollout_mode} mode resize with scale_rollout, or set "
                              "rollout_autoscale=false)")
        if t.rollout_autoscale and not r.elastic:
            raise ConfigError(f"trainer.rollout_autoscale=true needs a range to scale within: set "
                              f"trainer.rollout_workers=min..max (e.g. {r.min}..{r.min + 1}), not {r.min}")
        if not r.elastic:
            return
        if t.colocated or not t.own_pools:
            raise ConfigError(f"trainer.rollout_workers={r} resizes the rollout pool, which needs placement groups of "
                              f"its own: set trainer.rollout_placement=[{r.min}] (and trainer.colocated=false)")
        if mode.hands_over and self.weight_transport() == "collective":
            raise ConfigError(f"trainer.rollout_workers={r} in streaming mode starts each new pool beside the old one, "
                              "which the collective weight channel does not reach yet: set "
                              "trainer.weight_sync=object_store (or a fixed rollout_workers)")
        if mode.splits_batches:
            bad = [n for n in r.sizes() if self.prompts_per_step % n]
            if bad:
                raise ConfigError(f"trainer.rollout_workers={r} includes {bad[0]} workers, which does not divide a "
                                  f"step's {self.prompts_per_step} prompts ({t.rollout_mode} mode splits a step's "
                                  "prompts over the pool, each GRPO group on one worker); narrow the range or change "
                                  "trainer.batch_size")

    def _check_capacity(self, unit: str, per_worker: float, available: float | None, fix: str) -> None:
        """ConfigError when the pools need more `unit` than the cluster has (`available`; None: unknown)."""
        if available is None:
            return
        k = self.twin.replicas_per_process if self.twin.enabled else 1  # the twin hosts k simulated ranks per process
        need = sum(-(-n // k) for n in self.pool_sizes().values()) * per_worker
        if need > available + 1e-9:
            r = self.trainer.rollout_range
            start = f" (trainer.rollout_workers={r} starts at {r.min})" if r.elastic else ""
            raise ConfigError(f"the pools need {need:g} {unit} ({self.pool_sizes()} workers x {per_worker:g}){start} "
                              f"but the cluster has {available:g}; {fix}")


    def _validate_reward(self) -> None:
        """A reward function named by path is loaded here, in the controller, and its signature checked
        (the workers load it again by path); a relative file path is made absolute."""
        w = self.reward
        if w.model is not None or not is_reward_path(w.fn):
            return
        target, _, attr = w.fn.rpartition(":")
        if target.endswith(".py") or "/" in target:
            w.fn = f"{Path(target).absolute()}:{attr}"  # the workers may start in another directory
        try:
            load_reward_fn(w.fn, w.fn_kwargs)
        except RewardFnSpecError as e:
            raise ConfigError(str(e)) from None

    def _validate_data(self) -> None:
        """The prompts: a known task, or data files that exist, have a known format and the columns."""
        d = self.data
        if d.max_prompt_length is not None and d.max_prompt_length < 1:
            raise ConfigError(f"data.max_prompt_length must be >= 1 or null, got {d.max_prompt_length}")
        if d.filter_overlong_prompts and d.max_prompt_length is None:
            raise ConfigError("data.filter_overlong_prompts=true needs data.max_prompt_length (the limit in tokens)")
        if d.train_files is None:
            if d.val_files is not None:
                raise ConfigError("data.val_files is set but data.train_files is not; give data.train_files too (or "
                                  "drop data.val_files to evaluate on the task)")
            if d.num_prompts < 1:
                raise ConfigError(f"data.num_prompts must be >= 1, got {d.num_prompts}")
            if d.task not in task_names():
                raise ConfigError(f"data.task {d.task!r} is unknown; known tasks: {task_names()}")
        try:
            task_pairs(d, self.trainer.seed, num_prompts=None if d.train_files is not None else 1)
            if d.val_files is not None:
                task_pairs(d, self.trainer.seed, split="eval")
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"data: {e}") from None

    def _validate_loss(self) -> None:
        """Sampling temperature, loss and off-policy settings (docs: README "Correctness")."""
        r, a, t = self.rollout, self.actor, self.trainer
        if not r.temperature > 0:
            raise ConfigError(
                f"rollout.temperature={r.temperature}: training needs a sampling temperature > 0 (greedy samples "
                "have no log-probability to train on or to correct with); use e.g. 1.0"
            )
        if a.temperature is not None and a.temperature != r.temperature:
            raise ConfigError(
                f"actor.temperature={a.temperature} differs from rollout.temperature={r.temperature}: the policy's "
                "log-probs must use the temperature the rollout sampled with. Leave actor.temperature unset (null): "
                "it is taken from rollout.temperature"
            )
        self._validate_bypass()
        sections = [("actor", a)] + ([("critic", self.critic)] if self.algorithm.name == "ppo" else [])
        for name, optim in sections:
            try:
                optim.validate(t.train_workers)
            except ValueError as e:
                raise ConfigError(f"{name}: {e}") from None
        self._validate_lora()

    def _validate_lora(self) -> None:
        """``actor.lora``: the policy only, and every named target module is a linear layer of the model (read
        from a weightless skeleton of it, before any worker starts)."""
        if self.algorithm.name == "ppo" and self.critic.lora.enabled:
            raise ConfigError(f"critic.lora.rank={self.critic.lora.rank}: LoRA adapts the policy only (actor.lora); "
                              "set critic.lora.rank=0")
        lora = self.actor.lora
        if lora.enabled and importlib.util.find_spec("peft") is None:
            raise ConfigError(f"actor.lora.rank={lora.rank} needs the peft package: pip install 'asyncrl[lora]' "
                              "(or bash scripts/setup.sh lora), or set actor.lora.rank=0")
        if not lora.enabled or lora.target_modules == "all-linear":
            return
        try:
            skeleton = meta_model(self.model)
        except Exception:  # a model that cannot be read here: the worker checks the targets when it loads it
            return
        if skeleton is not None:
            try:
                check_targets(skeleton, lora)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def _validate_bypass(self) -> None:
        """``actor.rollout_correction.bypass_mode='on_policy'`` only where the rollout's log-probs are the
        policy's own (pi_rollout = pi_old): else a ConfigError naming the condition that fails."""
        rc, r, t, m = self.actor.rollout_correction, self.rollout, self.trainer, self.model
        if rc.bypass_mode != "on_policy":
            return
        why = []
        if t.max_staleness != 0:
            why.append(f"trainer.max_staleness={t.max_staleness} lets a batch come from older weights than the "
                       "policy's (pi_rollout != pi_old)")
        if r.engine != "hf" or not r.engine_kwargs.get("exact_log_probs"):
            why.append(f"the {r.engine!r} engine's log-probs are not exact (only the HF engine with "
                       "rollout.engine_kwargs.exact_log_probs=true recomputes them as the policy does)")
        if r.top_k > 0 or r.top_p < 1.0:
            why.append("top-k/top-p sampling draws from a filtered distribution, not the policy's")
        if t.gpus_per_worker > 0 and not (m.dtype == "float32" and m.autocast == "off"):
            why.append("on a GPU the rollout and the policy compute in different precisions (set model.dtype=float32 "
                       "and model.autocast=off)")
        if why:
            raise ConfigError(
                "actor.rollout_correction.bypass_mode=on_policy uses the rollout's log-probs as old_log_probs, which "
                f"is exact only when they are the policy's own, but {'; and '.join(why)}. Use bypass_mode=behaviour "
                "to take the PPO ratio against the behaviour policy (verl's bypass mode), or bypass_mode=off"
            )


_RESUME_FREE = {"trainer.steps", "trainer.output_dir", "trainer.checkpoint_every", "trainer.checkpoint_at_end",
                "trainer.checkpoint_every_s",
                "trainer.keep_checkpoints", "trainer.trace", "trainer.plot", "trainer.progress", "trainer.tensorboard",
                "trainer.samples_per_step", "trainer.loggers", "trainer.wandb_project", "trainer.num_cpus", "trainer.stage_timeout_s", "trainer.rollout_timeout_s", "trainer.restart.max_restarts",
                "trainer.restart.on_timeout", "trainer.restart.replace_stateless", "evaluation.every",
                "evaluation.at_start", "evaluation.at_end",
                "evaluation.num_prompts", "evaluation.seed", "evaluation.max_new_tokens", "evaluation.num_samples",
                "trainer.weight_sync", "trainer.weight_sync_timeout_s", "trainer.precompute_log_probs",
                "trainer.event_loop", "trainer.train_workers", "trainer.rollout_placement",
                "trainer.train_placement", "trainer.rollout_resources", "trainer.train_resources",
                "trainer.restart.placement_wait_s", "trainer.rollout_autoscale", "trainer.rollout_drain_s"}
"""Settings a resumed run may change: they do not alter what the first steps compute (evaluation uses its
own sampling seeds and never touches the training RNG). ``trainer.train_workers``: training ranks train
like one (both strategies' checkpoints load at any rank count); with ``colocated`` it is the rollout pool's
size too, and the resume check refuses a change there. Where the workers sit (``*_placement``,
``*_resources``) does not change what they compute."""


def config_fingerprint(cfg: JobConfig) -> str:
    """A hash of every setting that changes what a step computes (a resume must match it)."""
    flat = _resolved(_flatten(configlib.to_dict(cfg)))
    kept = {k: v for k, v in flat.items() if not _resume_free(k)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config dicts (ignoring resume-free keys)."""
    fa, fb = _resolved(_flatten(a)), _resolved(_flatten(b))
    return sorted(k for k in set(fa) | set(fb) if not _resume_free(k) and fa.get(k) != fb.get(k))


def _resume_free(key: str) -> bool:
    """`key` (dotted) is in :data:`_RESUME_FREE`, or inside a mapping there (``trainer.rollout_resources.x``)."""
    return key in _RESUME_FREE or key.rpartition(".")[0] in _RESUME_FREE


def _resolved(flat: dict[str, Any]) -> dict[str, Any]:
    """`flat` with ``auto`` choices that follow the mode written as what they resolve to, so a run saved
    with ``rollout_weights: fixed_lag`` (the default before ``auto``) keeps its fingerprint."""
    if flat.get("trainer.rollout_weights") == "auto":
        name = flat.get("trainer.rollout_mode", "batch")
        weights = rollout_mode(name).weights if name in rollout_mode_names() else "fixed_lag"
        flat = {**flat, "trainer.rollout_weights": weights}
    return flat


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
