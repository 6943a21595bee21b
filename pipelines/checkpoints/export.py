"""``asyncrl export``: a run's trained policy as a Hugging Face model directory.

::

    checkpoint (newest complete one, or step N) -> verify against manifest.json
        -> ModelConfig from state.json's config -> tokenizer + model skeleton
        -> the checkpoint's policy weights loaded in (read_policy_state), cast to the dtype asked
        -> OUT.tmp-<pid>/ (config.json, generation_config.json, model.safetensors, tokenizer files)
        -> renamed to OUT

A LoRA run's checkpoint holds the merged weights under the base model's names, so the export is the
merged model; ``adapter=True`` (``--adapter``) writes the peft adapter instead (``adapter_config.json``,
``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, OUT)``).

The result loads with ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)``, offline, and that tokenizer gives the training tokenizer's ids:
transformers 5 loads the tokenizer of a model type it knows (``qwen2``) with that type's class, which rebuilds
its normalizer and pre-tokenizer from its own defaults (Qwen2's splits digits one per token) instead of reading
``tokenizer.json``; where that would tokenize otherwise than training did (the toy's byte-level BPE), the export
names in ``tokenizer_config.json`` a tokenizer class that keeps ``tokenizer.json`` as written
(:func:`pin_tokenizer`), and checks the result. Every check (the run directory, the step,
the manifest, the output directory) runs before anything is written; a failed check raises
:class:`CheckpointError` or :class:`ConfigError` with the fix, which the command line prints
as one line with exit status 2. Nothing here starts Ray or a worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from asyncrl.pipelines import configlib
from asyncrl.pipelines.checkpoints.checkpoint import CheckpointError, checkpoint_dir, checkpoints, verify
from asyncrl.pipelines.configlib import ConfigError
from asyncrl.roles.modeling.models import ModelConfig, build_model, tokenizer_for

__all__ = ["DTYPES", "ExportResult", "export_policy", "find_checkpoint", "pin_tokenizer", "read_policy_state"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes ``--dtype`` may name."""


@dataclass(frozen=True, kw_only=True)
class ExportResult:
    """What :func:`export_policy` wrote."""

    out: Path
    """The Hugging Face model directory."""
    checkpoint: Path
    """The checkpoint its weights came from."""
    step: int
    """The training steps done when that checkpoint was taken."""
    dtype: str
    """The dtype of the exported floating-point weights (``float32``, ``bfloat16``, ``float16``)."""
    adapter: bool = False
    """Whether it is a LoRA run's peft adapter directory rather than a whole model."""


def read_policy_state(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The policy's weights in checkpoint `ckpt_dir`, by ``state_dict`` name, as stored.

    Names that share one tensor (tied weights) are stored once, so all but one of them may be
    absent. The one place that knows the stored formats: ``policy/model.safetensors`` (``ddp``)
    and ``policy/dcp/`` (``fsdp2``: torch.distributed.checkpoint shards, read whole here, in one
    process). Raises :class:`CheckpointError` when it finds no format it reads."""
    policy = Path(ckpt_dir) / "policy"
    single = policy / "model.safetensors"
    if single.is_file():
        from safetensors.torch import load_file

        return load_file(str(single))
    sharded = policy / "dcp"
    if (sharded / ".metadata").is_file():
        return _read_dcp_model(sharded)
    raise CheckpointError(f"checkpoint {str(ckpt_dir)!r} holds no policy weights in a format this version reads: "
                          f"no {str(single)!r} (safetensors, written by PolicyWorker.save) and no "
                          f"{str(sharded)!r} (sharded, torch.distributed.checkpoint)")


def _read_dcp_model(path: Path) -> dict[str, torch.Tensor]:
    """The ``model`` part of a torch.distributed.checkpoint directory, each tensor whole, in this process."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    model = {k.removeprefix("model."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is not initialized: loading in one process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, storage_reader=reader)
    return model


def find_checkpoint(run: str | Path, step: int | None = None) -> Path:
    """The checkpoint of run directory `run` taken after `step` steps (None: the newest complete one)."""
    run = Path(run)
    if run.parent.name == "checkpoints" and run.name.removeprefix("step_").isdigit():
        raise CheckpointError(f"{str(run)!r} is a checkpoint, not a run directory: pass its run and step, "
                              f"asyncrl export {run.parent.parent} --step {int(run.name.removeprefix('step_'))}")
    if not run.is_dir() or not any((run / n).exists() for n in ("checkpoints", "metrics.jsonl", "journal.jsonl")):
        why = "does not exist" if not run.exists() else "is not a run directory"
        raise CheckpointError(f"{str(run)!r} {why}: pass a run's trainer.output_dir (it holds checkpoints/ and "
                              "metrics.jsonl), e.g. runs/grpo_toy")
    done = checkpoints(run)
    if not done:
        raise CheckpointError(f"run {str(run)!r} has no complete checkpoint to export; train with one written at the "
                              "end: asyncrl train ... trainer.checkpoint_at_end=true (or trainer.checkpoint_every=N)")
    if step is None:
        return done[-1]
    want = checkpoint_dir(run, step)
    if want not in done:
        steps = ", ".join(str(int(p.name.removeprefix("step_"))) for p in done)
        raise CheckpointError(f"run {str(run)!r} has no complete checkpoint of step {step} "
                              f"({want.name}); its checkpoints are of steps: {steps}")
    return want


def export_policy(run: str | Path, out: str | Path, *, step: int | None = None, dtype: str | None = None,
                  force: bool = False, adapter: bool = False) -> ExportResult:
    """Write the policy of `run`'s checkpoint (`step`, default the newest) as a Hugging Face model
    directory `out`, in `dtype` (default: as stored; float32 stays bit for bit); a LoRA run's merged model,
    or with `adapter` its peft adapter directory.

    `out` must not exist or be empty, unless `force` (then it is replaced once the export is written)."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ckpt = find_checkpoint(run, step)
    state = verify(ckpt)
    model_cfg = _model_config(ckpt, state.get("config"))
    if adapter and not (ckpt / "policy" / "adapter_model.safetensors").is_file():
        raise ConfigError(f"--adapter: the policy of checkpoint {str(ckpt)!r} has no LoRA adapter (the run trained "
                          "with actor.lora.rank=0); export the whole model without --adapter")
    out = _check_out(Path(out), force=force, keep=ckpt)
    if adapter:
        return _export_adapter(ckpt, out, int(state["step"]), dtype)
    weights = read_policy_state(ckpt)
    target = DTYPES[dtype] if dtype is not None else _stored_dtype(weights)

    tokenizer = tokenizer_for(model_cfg)
    model = build_model(replace(model_cfg, dtype="float32"), tokenizer).to(target)
    _load_exactly(model, weights, ckpt)
    dest = out.resolve()
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    with _writing(out, tmp):
        dest.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        pin_tokenizer(tmp, tokenizer)
        _replace(tmp, dest)
    name = next(k for k, v in DTYPES.items() if v == target)
    return ExportResult(out=out, checkpoint=ckpt, step=int(state["step"]), dtype=name)


_TOKENIZER_MODULE = "tokenization_asyncrl"
_TOKENIZER_SOURCE = '''"""The tokenizer of an asyncrl export: tokenizer.json as written.

transformers loads it by itself, without running this file; this class is what
AutoTokenizer.from_pretrained(..., trust_remote_code=True) asks for instead."""

try:
    from transformers import TokenizersBackend as _Backend
except ImportError:  # transformers 4
    from transformers import PreTrainedTokenizerFast as _Backend


class AsyncrlTokenizer(_Backend):
    """tokenizer.json, unchanged."""
'''


def pin_tokenizer(out: str | Path, trained: Any) -> None:
    """Make ``AutoTokenizer.from_pretrained(out)`` tokenize as `trained` (the training tokenizer, saved in model
    directory `out`) does. When transformers would load `out`'s tokenizer with a class that rebuilds another
    pipeline, ``tokenizer_config.json`` gets an ``auto_map`` naming a class that keeps ``tokenizer.json`` as
    written: without ``trust_remote_code`` transformers then loads ``tokenizer.json`` itself (its
    ``TokenizersBackend``); with it, the 5-line module written beside it (a subclass of that backend). Raises
    :class:`CheckpointError` if the loaded tokenizer still differs."""
    from transformers import AutoTokenizer

    out = Path(out)
    if _pipeline(AutoTokenizer.from_pretrained(out, local_files_only=True)) == _pipeline(trained):
        return
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, f"{_TOKENIZER_MODULE}.AsyncrlTokenizer"]}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / f"{_TOKENIZER_MODULE}.py").write_text(_TOKENIZER_SOURCE)
    loaded = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if _pipeline(loaded) != _pipeline(trained):
        raise CheckpointError(f"the exported tokenizer loads in transformers as {type(loaded).__name__}, which "
                              f"tokenizes otherwise than the training tokenizer ({type(trained).__name__}); this "
                              "transformers version cannot load it as trained")


def _pipeline(tok: Any) -> dict[str, Any]:
    """What decides a tokenizer's ids: its backend's normalizer, pre-tokenizer, model, post-processor, added tokens
    and decoder (``tokenizer.json``'s sections)."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    return {k: spec.get(k) for k in ("normalizer", "pre_tokenizer", "model", "post_processor", "added_tokens",
                                     "decoder")}


def _export_adapter(ckpt: Path, out: Path, step: int, dtype: str | None) -> ExportResult:
    """The checkpoint's peft adapter files, its floating tensors cast to `dtype` when given."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(ckpt / "policy" / "adapter_model.safetensors"))
    target = DTYPES[dtype] if dtype is not None else _stored_dtype(weights)
    dest = out.resolve()
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    with _writing(out, tmp):
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        save_file({k: v.to(target) if v.is_floating_point() else v for k, v in weights.items()},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(ckpt / "policy" / "adapter_config.json", tmp / "adapter_config.json")
        _replace(tmp, dest)
    name = next(k for k, v in DTYPES.items() if v == target)
    return ExportResult(out=out, checkpoint=ckpt, step=step, dtype=name, adapter=True)


def _model_config(ckpt: Path, config: object) -> ModelConfig:
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"checkpoint {str(ckpt)!r} holds no model config in state.json, so the policy's "
                              "architecture is unknown; it was written by an older asyncrl")
    return configlib.from_dict(ModelConfig, config["model"], _path="model")


@contextlib.contextmanager
def _writing(out: Path, tmp: Path) -> Iterator[None]:
    """Write the export into `tmp` (removed on every path); an ``OSError`` is a :class:`ConfigError` naming
    ``--out`` (a directory that cannot be made or written, a full disk)."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r} cannot be written: {e.strerror or e}; pick another directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_out(out: Path, *, force: bool, keep: Path) -> Path:
    above = next(p for p in out.absolute().parents if p.exists())  # where mkdir would start
    if not out.exists() and not above.is_dir():
        raise ConfigError(f"--out {str(out)!r} cannot be created: {str(above)!r} is a file; pick another directory")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not force:
            raise ConfigError(f"--out {str(out)!r} exists and is not empty; pick another directory, or pass --force "
                              "to overwrite it")
        if keep.resolve().is_relative_to(out.resolve()):
            raise ConfigError(f"--out {str(out)!r} holds the checkpoint being exported ({keep}); --force would "
                              "delete it: pick another directory")
    return out


def _stored_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype:
    """The one floating dtype of the stored weights (float32 when they mix dtypes: every one fits)."""
    found = {t.dtype for t in weights.values() if t.is_floating_point()}
    if len(found) == 1 and (only := found.pop()) in DTYPES.values():
        return only
    return torch.float32


def _load_exactly(model: nn.Module, weights: dict[str, torch.Tensor], ckpt: Path) -> None:
    """Copy `weights` into `model`; every name of the model must be filled (a tied one through its twin)."""
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # a shape that differs
        raise CheckpointError(f"the policy weights of checkpoint {str(ckpt)!r} do not fit the model its config "
                              f"describes: {str(e).strip().splitlines()[-1].strip()}") from None
    slots = model.state_dict(keep_vars=True)
    filled = {id(slots[k]) for k in weights if k in slots}
    missing = [k for k in missing if id(slots[k]) not in filled]
    if missing or unexpected:
        raise CheckpointError(f"the policy weights of checkpoint {str(ckpt)!r} do not fit the model its config "
                              f"describes: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")


def _replace(tmp: Path, out: Path) -> None:
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    os.rename(tmp, out)
