"""The cluster twin's settings (``JobConfig.twin``) and its cost profiles: what one GPU replica of a public setup costs.

A profile is a YAML file. Every number is a mapping ``{value: ..., source: "..."}``: the value, and the public
page or paper it was read from (and what was read there), or ``derived: <formula>`` naming the numbers it
comes from. Text fields (``name``, ``description``, ``lengths.kind``) are plain. The sections::

    name: qwen2_7b_h100_vllm
    description: ...
    model:      params_b, weight_gb                          (the policy: parameters, bytes of its bf16 weights)
    rollout:    gpus, max_num_seqs, kv_cache_tokens,          (one vLLM replica)
                decode_base_ms, decode_ms_per_seq, decode_ms_per_1k_kv, prefill_ms_per_token,
                weight_pull_gb_per_s, weight_load_gb_per_s
    training:   gpus, peak_tflops, mfu, hbm_gb_per_s,        (one training rank)
                optimizer_bytes_per_param, export_gb_per_s
    lengths:    kind (lognormal | histogram), prompt_tokens, max_new_tokens,
                median, sigma, prompt_sigma                   (lognormal)
                edges, counts                                 (histogram: tokens, a count per bin)
    devices:    kind (separate | shared), threads, work_per_s (optional; absent: separate)

What the twin makes of them (docs/scale.md, "What is real, what is simulated"):

* a decoding step of R running requests holding C context tokens costs
  ``decode_base_ms + decode_ms_per_seq * R + decode_ms_per_1k_kv * C / 1000``; admitting a request costs
  ``prefill_ms_per_token`` per prompt token; at most ``max_num_seqs`` requests run and their context fits
  ``kv_cache_tokens`` (else the newest is preempted and recomputed, as vLLM does);
* a weight version costs a replica ``weight_gb / weight_pull_gb_per_s + weight_gb / weight_load_gb_per_s``;
* a training rank's forward over n tokens costs ``2 * params * n / (peak_tflops * mfu)``, backward twice that,
  the optimizer ``params * optimizer_bytes_per_param / (ranks * hbm_gb_per_s)``, an export
  ``weight_gb / export_gb_per_s``;
* a response's length is drawn from ``lengths`` by the request's seed; ``prompt_sigma`` spreads each prompt's
  median (a prompt's responses share its difficulty);
* ``devices.kind`` says where those costs run. ``separate`` (the default, every shipped profile): each simulated
  GPU is a device of its own, a cost is slept and simulated work never contends. ``shared``: the simulated
  workers share this machine's CPU cores with each other and with the rest of the run, as CPU workers do; a cost
  is burned as real CPU work on ``devices.threads`` torch threads, ``devices.work_per_s`` seconds of work alone
  per second of cost (:class:`~asyncrl.roles.engines.sim.Burner`), so contention shows as it does for real. A
  profile fitted to CPU runs on one machine (``asyncrl profile --devices shared``) is a twin of that machine.

Profiles ship in ``profiles/`` (:data:`PROFILES`); a user's own is a path. :func:`load_profile` reads and checks
one; :func:`dump_profile` writes one (a profile fitted from a run writes the same schema).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml

from asyncrl.pipelines.configlib import ConfigError
from asyncrl.roles.fields import MAX_SEED, MAX_WORKERS, Range, Section

__all__ = ["TwinConfig", "Profile", "ModelSize", "RolloutCosts", "TrainCosts", "LengthModel", "Devices", "ProfileError",
           "PROFILES", "load_profile", "dump_profile", "profile_names", "check_twin"]

HERE = Path(__file__).resolve().parent / "profiles"


@dataclass(kw_only=True)
class TwinConfig(Section):
    """``JobConfig.twin``: run the real trainer against simulated GPU workers (docs/scale.md).

    With `profile` set, the rollout workers run the cost-model engine (``rollout.engine`` becomes ``sim``, its
    costs from the profile), the reward is a free stand-in and the training workers are simulated ranks;
    ``trainer.rollout_workers`` is the number of replicas and ``trainer.train_workers`` the number of training
    ranks. Everything else (controller, loops, admission, weight sync, supervision, journal) is the real code."""

    profile: str | None = None
    """A shipped profile's name (``asyncrl.pipelines.twin.PROFILES``, e.g. ``qwen2_7b_h100_vllm``) or the path of a
    profile YAML file; None: no twin (the normal trainer)."""
    time_scale: Annotated[float, Range(gt=0, le=1000)] = 0.01
    """Simulated costs are multiplied by this, so a run takes minutes (0.01: a GPU second is 10 ms). Shrinking
    the simulated work leaves the controller's real work as it is, so its share only looks larger: figures stay
    conservative. Every reported figure states it."""
    replicas_per_process: Annotated[int, Range(ge=1, le=MAX_WORKERS)] = 16
    """How many simulated replicas (rollout ranks) one rollout process hosts; the training ranks are hosted the
    same way. Each rank keeps its own worker object and ordered lane: the controller schedules, syncs and
    supervises each as a replica of its own; a lost process loses its ranks together."""
    tokens_per_id: Annotated[int | None, Range(ge=1, le=1 << 20)] = None
    """Simulated tokens each response token id stands for: the cost model counts tokens, the batches carry
    ``ceil(tokens / tokens_per_id)`` ids per row, so the data plane moves that much less. None: the smallest
    that keeps a capped response within 128 ids (1 for a profile whose ``max_new_tokens`` is at most 128)."""
    seed: Annotated[int, Range(ge=0, le=MAX_SEED)] = 0
    """Seed of the stand-in rewards (the response lengths follow each request's sampling seed)."""

    @property
    def enabled(self) -> bool:
        """True when a profile is set."""
        return self.profile is not None


class ProfileError(ConfigError):
    """Raised when a profile file is missing, malformed, or a number in it has no source or a bad value."""


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    """The policy model's size."""

    params_b: float
    """Parameters, billions."""
    weight_gb: float
    """Bytes of the weights a sync moves (bf16: 2 bytes per parameter), GB (1e9 bytes)."""


@dataclass(frozen=True, kw_only=True)
class RolloutCosts:
    """One rollout replica (an inference engine on `gpus` GPUs)."""

    gpus: int
    """GPUs per replica (tensor parallel size)."""
    max_num_seqs: int
    """Most requests decoding at once (vLLM's ``max_num_seqs``)."""
    kv_cache_tokens: int
    """Tokens the KV cache holds (prompt + response of every running request)."""
    decode_base_ms: float
    """A decoding step's fixed cost (reading the weights), ms."""
    decode_ms_per_seq: float
    """A decoding step's cost per running request, ms."""
    decode_ms_per_1k_kv: float
    """A decoding step's cost per 1000 context tokens of the running requests (attention reads the KV cache), ms."""
    prefill_ms_per_token: float
    """Prefill cost per prompt token, ms (added to the step that admits the request)."""
    weight_pull_gb_per_s: float
    """Rate at which a replica pulls a weight version from the trainer's copy, GB/s."""
    weight_load_gb_per_s: float
    """Rate at which a replica loads pulled weights into its engine, GB/s."""
    join_round_steps: int = 0
    """0 (vLLM's continuous batching, the default): a request joins at the next decoding step. n > 0: requests
    join only when the running round ends (every request in it finished or n steps run), as in the request-level
    HF engine (``rollout.chunk_tokens``); a load then waits for the round's end too."""


@dataclass(frozen=True, kw_only=True)
class TrainCosts:
    """One training rank (one GPU of data-parallel training)."""

    gpus: int
    """GPUs per rank."""
    peak_tflops: float
    """Dense bf16 peak, TFLOP/s."""
    mfu: float
    """Model FLOPs utilisation reached by RL training (0..1)."""
    hbm_gb_per_s: float
    """Memory bandwidth, GB/s (the optimizer step is memory-bound)."""
    optimizer_bytes_per_param: float
    """Bytes AdamW reads and writes per parameter and step (fp32 master weight, gradient, two moments)."""
    export_gb_per_s: float
    """Rate at which the trainer gathers and publishes a weight version, GB/s."""


@dataclass(frozen=True, kw_only=True)
class LengthModel:
    """Prompt and response lengths, in tokens."""

    kind: Literal["lognormal", "histogram"]
    """``lognormal`` (`median`, `sigma`) or ``histogram`` (`edges`, `counts`)."""
    prompt_tokens: int
    """Prompt length of every request."""
    max_new_tokens: int
    """Response cap (a response that reaches it ends with ``length``)."""
    median: float = 0.0
    """lognormal: median response length."""
    sigma: float = 0.0
    """lognormal: log-space standard deviation (p99/p50 = exp(2.326 sigma))."""
    prompt_sigma: float = 0.0
    """Log-space standard deviation of each prompt's own median around `median` (0: every prompt alike)."""
    edges: tuple[float, ...] = ()
    """histogram: bin edges (tokens, increasing; one more than `counts`)."""
    counts: tuple[float, ...] = ()
    """histogram: weight of each bin (a length is uniform within its bin)."""


@dataclass(frozen=True, kw_only=True)
class Devices:
    """Where the simulated work runs (module docstring); the section is optional."""

    kind: Literal["separate", "shared"] = "separate"
    """``separate``: a device per simulated GPU, costs slept (a GPU cluster). ``shared``: the workers share this
    machine's CPU cores with the rest of the run, costs burned as CPU work (a twin of CPU workers here)."""
    threads: int = 0
    """shared: torch intra-op threads each simulated worker burns on (the real workers' count); separate: unset."""
    work_per_s: float = 1.0
    """shared: seconds of work alone in each second of a cost (a cost measured in a run holds the contention of the
    run's own processes and the machine's other jobs: burned on the same cores it would count them twice; the fit
    calibrates it from a twin of the calibration runs); separate: unset."""

    @property
    def shared(self) -> bool:
        """True when the costs are burned on shared cores."""
        return self.kind == "shared"


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What one GPU replica of a public setup costs (module docstring); :func:`load_profile` builds it."""

    name: str
    """Short name (a shipped profile's file name)."""
    description: str
    """What setup it is: model, GPUs, engine."""
    model: ModelSize
    rollout: RolloutCosts
    training: TrainCosts
    lengths: LengthModel
    devices: Devices = field(default_factory=Devices)
    """Where the costs run (absent from a file: separate devices)."""
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    """``{dotted key: where the number comes from}`` for every number."""
    path: str = field(default="", compare=False)
    """The file it was read from."""

    def source(self, key: str) -> str:
        """Where the number at dotted `key` (``rollout.decode_base_ms``) comes from."""
        return self.sources[key]


_SECTIONS: dict[str, type] = {"model": ModelSize, "rollout": RolloutCosts, "training": TrainCosts,
                              "lengths": LengthModel, "devices": Devices}
_OPTIONAL = {"devices"}
_TEXT = {"lengths.kind", "devices.kind"}


def profile_names() -> list[str]:
    """The shipped profiles' names."""
    return sorted(p.stem for p in HERE.glob("*.yaml"))


PROFILES: tuple[str, ...] = tuple(profile_names())
"""The shipped profiles (``twin.profile`` takes one of these names, or a path)."""


def _resolve(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists() or "/" in name_or_path:
        if not p.is_file():
            raise ProfileError(f"twin.profile={name_or_path!r}: no such file; give a profile YAML file or one of the "
                               f"shipped profiles {list(profile_names())}")
        return p
    shipped = HERE / f"{name_or_path}.yaml"
    if not shipped.is_file():
        raise ProfileError(f"twin.profile={name_or_path!r} is not a shipped profile ({list(profile_names())}) nor a "
                           "file; give one of those names or the path of a profile YAML file")
    return shipped


def load_profile(name_or_path: str) -> Profile:
    """The profile `name_or_path` (a shipped profile's name or a YAML file), checked: every section and number
    present, each number with its source, values in range. Raises :class:`ProfileError` naming the key."""
    path = _resolve(name_or_path)
    key = (str(path.resolve()), path.stat().st_mtime_ns)
    cached = _LOADED.get(key)
    if cached is not None:  # (a config is validated several times: read each file once while it is unchanged)
        return cached
    _LOADED[key] = profile = _load(path)
    return profile


_LOADED: dict[tuple[str, int], Profile] = {}


def _load(path: Path) -> Profile:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"profile {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"profile {str(path)!r} must be a mapping with name, description, "
                           f"{', '.join(_SECTIONS)}")
    where = f"profile {str(path)!r}"
    unknown = sorted(set(data) - {"name", "description", *_SECTIONS})
    if unknown:
        raise ProfileError(f"{where}: unknown key {unknown[0]!r}; the keys are name, description, "
                           f"{', '.join(_SECTIONS)}")
    for key in ("name", "description"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise ProfileError(f"{where}: {key} must be a non-empty string")
    sources: dict[str, str] = {}
    sections = {name: _section(where, name, cls, data.get(name), sources) for name, cls in _SECTIONS.items()
                if name not in _OPTIONAL or name in data}
    profile = Profile(name=data["name"], description=data["description"], sources=sources, path=str(path),
                      **sections)
    _check_values(where, profile)
    return profile


def _section(where: str, name: str, cls: type, raw: Any, sources: dict[str, str]) -> Any:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: section {name!r} is missing or not a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ProfileError(f"{where}: unknown key {name}.{unknown[0]}; {name} has {sorted(fields)}")
    out: dict[str, Any] = {}
    for key, f in fields.items():
        dotted = f"{name}.{key}"
        if key not in raw:
            if f.default is dataclasses.MISSING:
                raise ProfileError(f"{where}: {dotted} is missing")
            continue
        entry = raw[key]
        if dotted in _TEXT:
            if not isinstance(entry, str):
                raise ProfileError(f"{where}: {dotted} must be a string, got {entry!r}")
            out[key] = entry
            continue
        if not isinstance(entry, dict) or set(entry) != {"value", "source"}:
            raise ProfileError(f"{where}: {dotted} must be a mapping {{value: ..., source: '...'}} (every number "
                               f"names its public source), got {entry!r}")
        source = entry["source"]
        if not isinstance(source, str) or not source.strip():
            raise ProfileError(f"{where}: {dotted}.source must say where the number comes from (a public URL or "
                               "paper and what was read there, or 'derived: ...')")
        out[key] = _number(where, dotted, entry["value"], f.type)
        sources[dotted] = source.strip()
    return cls(**out)


def _number(where: str, dotted: str, value: Any, annotation: Any) -> Any:
    text = str(annotation)
    if text.startswith("tuple"):
        if not isinstance(value, list) or not all(_is_num(v) for v in value):
            raise ProfileError(f"{where}: {dotted}.value must be a list of numbers, got {value!r}")
        return tuple(float(v) for v in value)
    if not _is_num(value):
        raise ProfileError(f"{where}: {dotted}.value must be a number, got {value!r}")
    if text == "int":
        if float(value) != int(value):
            raise ProfileError(f"{where}: {dotted}.value must be a whole number, got {value!r}")
        return int(value)
    return float(value)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_values(where: str, p: Profile) -> None:
    positive = {"model.params_b": p.model.params_b, "model.weight_gb": p.model.weight_gb,
                "rollout.gpus": p.rollout.gpus, "rollout.max_num_seqs": p.rollout.max_num_seqs,
                "rollout.kv_cache_tokens": p.rollout.kv_cache_tokens,
                "rollout.weight_pull_gb_per_s": p.rollout.weight_pull_gb_per_s,
                "rollout.weight_load_gb_per_s": p.rollout.weight_load_gb_per_s,
                "training.gpus": p.training.gpus, "training.peak_tflops": p.training.peak_tflops,
                "training.hbm_gb_per_s": p.training.hbm_gb_per_s,
                "training.export_gb_per_s": p.training.export_gb_per_s,
                "lengths.prompt_tokens": p.lengths.prompt_tokens, "lengths.max_new_tokens": p.lengths.max_new_tokens}
    for key, v in positive.items():
        if not v > 0:
            raise ProfileError(f"{where}: {key} must be > 0, got {v}")
    non_negative = {"rollout.join_round_steps": p.rollout.join_round_steps,
                    "rollout.decode_base_ms": p.rollout.decode_base_ms,
                    "rollout.decode_ms_per_seq": p.rollout.decode_ms_per_seq,
                    "rollout.decode_ms_per_1k_kv": p.rollout.decode_ms_per_1k_kv,
                    "rollout.prefill_ms_per_token": p.rollout.prefill_ms_per_token,
                    "training.optimizer_bytes_per_param": p.training.optimizer_bytes_per_param,
                    "lengths.prompt_sigma": p.lengths.prompt_sigma}
    for key, v in non_negative.items():
        if not v >= 0:
            raise ProfileError(f"{where}: {key} must be >= 0, got {v}")
    r = p.rollout
    if r.decode_base_ms + r.decode_ms_per_seq <= 0:
        raise ProfileError(f"{where}: a decoding step must cost something: rollout.decode_base_ms + "
                           "rollout.decode_ms_per_seq must be > 0")
    if not 0 < p.training.mfu <= 1:
        raise ProfileError(f"{where}: training.mfu must be in (0, 1], got {p.training.mfu}")
    if r.kv_cache_tokens < p.lengths.prompt_tokens + p.lengths.max_new_tokens:
        raise ProfileError(f"{where}: rollout.kv_cache_tokens={r.kv_cache_tokens} cannot hold one request of "
                           f"lengths.prompt_tokens + lengths.max_new_tokens = "
                           f"{p.lengths.prompt_tokens + p.lengths.max_new_tokens} tokens")
    lm = p.lengths
    if lm.kind == "lognormal":
        if not (lm.median >= 1 and lm.sigma >= 0):
            raise ProfileError(f"{where}: lengths.kind=lognormal needs lengths.median >= 1 and lengths.sigma >= 0, "
                               f"got {lm.median} and {lm.sigma}")
    elif lm.kind == "histogram":
        if len(lm.edges) != len(lm.counts) + 1 or not lm.counts:
            raise ProfileError(f"{where}: lengths.kind=histogram needs lengths.edges with one more entry than "
                               f"lengths.counts, got {len(lm.edges)} and {len(lm.counts)}")
        if any(b <= a for a, b in zip(lm.edges, lm.edges[1:])) or lm.edges[0] < 1:
            raise ProfileError(f"{where}: lengths.edges must increase from at least 1, got {list(lm.edges)}")
        if any(c < 0 for c in lm.counts) or not sum(lm.counts) > 0:
            raise ProfileError(f"{where}: lengths.counts must be >= 0 and not all 0, got {list(lm.counts)}")
    else:
        raise ProfileError(f"{where}: lengths.kind must be 'lognormal' or 'histogram', got {lm.kind!r}")
    d = p.devices
    if d.kind == "shared":
        if d.threads < 1:
            raise ProfileError(f"{where}: devices.kind=shared needs devices.threads >= 1 (the torch threads each "
                               f"simulated worker burns its costs on: the real workers' count), got {d.threads}")
        if not 0 < d.work_per_s <= 10:
            raise ProfileError(f"{where}: devices.work_per_s must be in (0, 10] (seconds of work alone per second "
                               f"of cost), got {d.work_per_s}")
    elif d.kind == "separate":
        if d != Devices():
            raise ProfileError(f"{where}: devices.threads and devices.work_per_s are for devices.kind=shared "
                               "(separate devices sleep their costs); remove them or set devices.kind: shared")
    else:
        raise ProfileError(f"{where}: devices.kind must be 'separate' (a device per simulated GPU: costs slept) or "
                           f"'shared' (the run's CPU cores: costs burned), got {d.kind!r}")


def dump_profile(profile: Profile, path: str | Path) -> Path:
    """Write `profile` as YAML in the schema :func:`load_profile` reads (every number with its source)."""
    out: dict[str, Any] = {"name": profile.name, "description": profile.description}
    for name in _SECTIONS:
        section = getattr(profile, name)
        if name in _OPTIONAL and section == _SECTIONS[name]():
            continue  # (the defaults: files without the section read the same)
        entries: dict[str, Any] = {}
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            dotted = f"{name}.{f.name}"
            if dotted in _TEXT:
                entries[f.name] = value
            elif dotted in profile.sources:
                entries[f.name] = {"value": list(value) if isinstance(value, tuple) else value,
                                   "source": profile.sources[dotted]}
        out[name] = entries
    p = Path(path)
    p.write_text(yaml.safe_dump(out, sort_keys=False, width=120))
    return p


def check_twin(job: Any) -> None:
    """Raise :class:`ConfigError` for a ``twin`` section of `job` (a ``JobConfig``) that cannot run: an unknown or
    bad profile, settings the twin cannot simulate."""
    tw: TwinConfig = job.twin
    # (its numbers are checked against the Range declared next to each field by JobConfig.validate)
    if not tw.enabled:
        return
    load_profile(str(tw.profile))  # (ProfileError is a ConfigError: one line naming the key)
    t, r = job.trainer, job.rollout
    why = [(t.colocated, "trainer.colocated=true (the twin simulates separate rollout and training GPUs)"),
           (r.episode is not None or r.agent is not None, "rollout.episode / rollout.agent (multi-turn rows)"),
           (job.algorithm.name != "grpo", f"algorithm.name={job.algorithm.name!r} (the twin simulates GRPO)"),
           (t.weight_sync not in ("auto", "object_store"),
            f"trainer.weight_sync={t.weight_sync!r} (replicas pull a versioned copy: auto or object_store)")]
    bad = [w for cond, w in why if cond]
    if bad:
        raise ConfigError(f"twin.profile={tw.profile!r} cannot simulate {bad[0]}; change it or unset twin.profile")


def engine_kwargs(profile: Profile, tw: TwinConfig) -> dict[str, Any]:
    """The simulated engine's settings (``rollout.engine_kwargs`` of ``engine=sim``) for `profile`, every cost
    multiplied by ``tw.time_scale`` (ms)."""
    r, lm, s = profile.rollout, profile.lengths, tw.time_scale
    k = tokens_per_id(profile, tw)
    weight_s = profile.model.weight_gb / r.weight_pull_gb_per_s + profile.model.weight_gb / r.weight_load_gb_per_s
    out: dict[str, Any] = {
        "step_ms": r.decode_base_ms * s, "step_ms_per_seq": r.decode_ms_per_seq * s,
        "step_ms_per_1k_kv": r.decode_ms_per_1k_kv * s, "prefill_ms_per_token": r.prefill_ms_per_token * s,
        "max_batch_size": r.max_num_seqs, "kv_capacity_tokens": r.kv_cache_tokens, "tokens_per_step": k,
        "prompt_tokens": lm.prompt_tokens, "load_ms": weight_s * 1e3 * s, "prefill_ms": 0.0,
        "median_tokens": lm.median if lm.kind == "lognormal" else 16.0, "sigma": lm.sigma,
        "prompt_sigma": lm.prompt_sigma,
        "burn_threads": profile.devices.threads if profile.devices.shared else None,
        "burn_work": profile.devices.work_per_s,
        "join_rounds": r.join_round_steps > 0,
        "catchup_ms": 500.0,  # a loaded machine's late wake-ups are caught up, not added to the run
    }
    if lm.kind == "histogram":
        out["length_histogram"] = (list(lm.edges), list(lm.counts))
    return out


def tokens_per_id(profile: Profile, tw: TwinConfig) -> int:
    """``twin.tokens_per_id``, or (None) the smallest that keeps a capped response within 128 ids."""
    if tw.tokens_per_id is not None:
        return tw.tokens_per_id
    return max(1, math.ceil(profile.lengths.max_new_tokens / 128))


def max_new_ids(profile: Profile, tw: TwinConfig) -> int:
    """The response cap in ids (``rollout.max_new_tokens`` of a twin run)."""
    return math.ceil(profile.lengths.max_new_tokens / tokens_per_id(profile, tw))
