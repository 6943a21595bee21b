"""Atomic checkpoints of a training run.

A checkpoint is a directory ``<output_dir>/checkpoints/step_000010/`` holding::

    state.json       step, versions, data position, RNG states, config + fingerprint
    policy/          PolicyWorker.save: weights (safetensors), optimizer, version
    critic/          CriticWorker.save (PPO)
    buffer.pt        the batches generated but not yet trained on (tensors and strings)
    manifest.json    size and sha256 of every other file

It is written into ``step_000010.tmp-<pid>``, every file fsynced, then renamed into
place and the parent directory fsynced: a crash while writing leaves a ``.tmp``
directory that :func:`latest_checkpoint` ignores, so the previous checkpoint stays usable.
:func:`verify` (run on resume before any worker starts) checks every file against the
manifest, so a flipped byte that keeps the file's size is caught there, not later as NaNs.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase

from asyncrl.pipelines.configlib import ConfigError

__all__ = ["CheckpointError", "checkpoint_dir", "checkpoints", "latest_checkpoint", "resolve_resume", "check_own",
           "read_state", "verify", "fsync_tree", "file_sha256", "write_manifest", "commit", "prune", "batch_to_plain", "plain_to_batch", "rng_state", "set_rng_state"]

_PREFIX = "step_"
MANIFEST = "manifest.json"


class CheckpointError(ConfigError):
    """Raised when a resume path is missing, incomplete or from a different config."""


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """Where the checkpoint taken after `step` steps lives."""
    return Path(output_dir) / "checkpoints" / f"{_PREFIX}{step:06d}"


def _complete(p: Path) -> bool:
    return p.is_dir() and p.name.startswith(_PREFIX) and ".tmp" not in p.name and (p / "state.json").is_file()


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints under `output_dir`, oldest first (unfinished ``.tmp`` ones left out)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _complete(p))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `output_dir` (None when there is none)."""
    done = checkpoints(output_dir)
    return done[-1] if done else None


def resolve_resume(path: str | Path) -> Path:
    """A checkpoint directory from `path`: the checkpoint itself or a run directory holding checkpoints;
    :class:`CheckpointError` when there is none, or when it is not its run's own (:func:`check_own`)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"resume path {str(p)!r} does not exist")
    if _complete(p):
        return check_own(p)
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(
            f"resume path {str(p)!r} holds no complete checkpoint (a directory step_NNNNNN with state.json, "
            "or a run directory with checkpoints/step_NNNNNN); unfinished *.tmp-* directories are ignored"
        )
    return check_own(latest)


def check_own(ckpt: Path) -> Path:
    """`ckpt` when it is the checkpoint its run wrote: a directory inside the run's ``checkpoints/`` (not a
    link leading elsewhere), its name the step its ``state.json`` records, and its fingerprint the one the
    run's journal records (when there is one). A resume continues in the run's directory, so another run's
    checkpoint put there would be adopted in silence."""
    root = ckpt.parent
    target = ckpt.resolve()
    if ckpt.is_symlink() or target.parent != root.resolve():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} leads to {str(target)!r}, outside {str(root)!r}: a run "
                              "resumes from its own checkpoints only; resume the run that wrote it, or remove the link")
    named = ckpt.name[len(_PREFIX):]
    state = read_state(ckpt)
    if not named.isdigit() or state.get("step") != int(named):
        raise CheckpointError(f"checkpoint {str(ckpt)!r} is named for step {named.lstrip('0') or named} but its "
                              f"state.json is at step {state.get('step')!r}: a renamed or copied checkpoint; give it "
                              "back its name (step_NNNNNN of its step), or resume from another one")
    header = _journal_header(root.parent)
    if header is not None and header.get("fingerprint") != state.get("fingerprint"):
        raise CheckpointError(f"checkpoint {str(ckpt)!r} was written by another run: its fingerprint "
                              f"{state.get('fingerprint')!r} is not {header.get('fingerprint')!r}, the one "
                              f"{str(root.parent / 'journal.jsonl')!r} records; resume the run that wrote it")
    return ckpt


def _journal_header(run: Path) -> dict[str, Any] | None:
    """The first record of `run`'s ``journal.jsonl`` when it is the run's header, else None."""
    try:
        with open(run / "journal.jsonl", encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return first if isinstance(first, dict) and first.get("kind") == "run" else None


_STATE_KEYS = ("step", "policy_version", "next_gen", "rng", "config", "fingerprint")


def read_state(ckpt: Path) -> dict[str, Any]:
    """The ``state.json`` of a checkpoint (:class:`CheckpointError` when it is unreadable)."""
    path = Path(ckpt) / "state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} is unreadable or corrupt ({type(e).__name__}: {e}); "
                              "resume from an older checkpoint") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt: not a JSON object")
    return state


def verify(ckpt: Path, *, hashes: bool = True) -> dict[str, Any]:
    """Check every file of a checkpoint in the controller, without starting a worker.

    With a ``manifest.json`` (every checkpoint written by this version): each listed file
    must exist with its recorded size and (when `hashes`) sha256 -- `hashes=False` is the
    quick structural check. Without one (older checkpoints): every file is read through a
    loader that cannot run code (``json``, ``safetensors``, ``torch.load(weights_only=True)``).
    Returns the state; raises :class:`CheckpointError` naming the first missing, truncated
    or corrupt file."""
    ckpt = Path(ckpt)
    state = read_state(ckpt)
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing or not isinstance(state.get("step"), int) or isinstance(state.get("step"), bool):
        raise CheckpointError(f"checkpoint {str(ckpt)!r} has a corrupt state.json (missing or bad {missing or ['step']})")
    config = state.get("config", {})
    actor = config.get("actor", {})
    files = [ckpt / "buffer.pt", *role_files(ckpt / "policy", actor.get("strategy", "ddp"),
                                             lora=bool(actor.get("lora", {}).get("rank", 0)))]
    if (ckpt / "critic").exists() or config.get("algorithm", {}).get("name") == "ppo":
        files += role_files(ckpt / "critic", config.get("critic", {}).get("strategy", "ddp"))
    if (ckpt / MANIFEST).exists():
        _verify_manifest(ckpt, files, hashes)
        return state
    from safetensors.torch import load_file

    for f in files:
        try:
            if f.name == ".metadata" or f.suffix == ".distcp":
                f.stat()
            elif f.suffix == ".safetensors":
                load_file(str(f))
            elif f.suffix == ".pt":
                torch.load(f, weights_only=True)
            else:
                json.loads(f.read_text())
        except Exception as e:  # every loader has its own error types; all mean "corrupt"
            raise CheckpointError(f"checkpoint file {str(f)!r} is missing, truncated or corrupt "
                                  f"({type(e).__name__}: {str(e)[:200]}); resume from an older checkpoint") from None
    return state


def role_files(role_dir: Path, strategy: str, *, lora: bool = False) -> list[Path]:
    """The files a trained role's ``save`` writes: whole weights (``ddp``) or the index of its
    ``torch.distributed.checkpoint`` shards (``fsdp2``; the shard files are listed in the manifest);
    with `lora` also the peft adapter (``adapter_model.safetensors``, ``adapter_config.json``; ``fsdp2`` then also
    the merged ``model.safetensors``, its shards holding the adapters and their optimizer state alone)."""
    adapter = [role_dir / "adapter_model.safetensors", role_dir / "adapter_config.json"] if lora else []
    if strategy == "fsdp2":
        merged = [role_dir / "model.safetensors"] if lora else []
        return [role_dir / "dcp" / ".metadata", *merged, *adapter, role_dir / "meta.json"]
    return [role_dir / "model.safetensors", role_dir / "optimizer.pt", *adapter, role_dir / "meta.json"]


def _corrupt(f: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {str(f)!r} is {why}; the checkpoint is damaged: resume from an older "
                           "checkpoint (or from the run directory after deleting this one)")


def _verify_manifest(ckpt: Path, required: list[Path], hashes: bool) -> None:
    path = ckpt / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        entries = {str(k): (int(v["size"]), str(v["sha256"])) for k, v in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _corrupt(path, f"unreadable or corrupt ({type(e).__name__})") from None
    listed = {ckpt / k for k in entries}
    for f in required:
        if f not in listed:
            raise _corrupt(f, "not listed in manifest.json")
    for rel, (size, digest) in entries.items():
        f = ckpt / rel
        try:
            actual = f.stat().st_size
        except OSError:
            raise _corrupt(f, "missing") from None
        if actual != size:
            raise _corrupt(f, f"truncated or overwritten ({actual} bytes, the manifest says {size})")
        if hashes and file_sha256(f) != digest:
            raise _corrupt(f, "corrupt (its sha256 differs from the one recorded in manifest.json)")


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(root: Path) -> Path:
    """Write ``manifest.json`` in `root`: the size and sha256 of every other file under it."""
    root = Path(root)
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            f = Path(dirpath) / name
            rel = f.relative_to(root).as_posix()
            if rel == MANIFEST:
                continue
            files[rel] = {"size": f.stat().st_size, "sha256": file_sha256(f)}
    out = root / MANIFEST
    out.write_text(json.dumps({"files": dict(sorted(files.items()))}, indent=1))
    return out


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (files written by workers included)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> Path:
    """Write `tmp`'s manifest, fsync `tmp`, rename it to `final` (replacing an older one of the same
    step), fsync the parent."""
    write_manifest(tmp)
    fsync_tree(tmp)
    if final.exists():
        old = final.with_name(final.name + f".old-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def prune(output_dir: str | Path, keep: int) -> None:
    """Remove all but the `keep` newest complete checkpoints, and stale temp directories."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return
    done = sorted(p for p in root.iterdir() if _complete(p))
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        if ".tmp-" in p.name and not p.name.endswith(f".tmp-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)


def batch_to_plain(td: TensorDictBase) -> dict[str, Any]:
    """A TensorDict as a dict ``torch.load(weights_only=True)`` can read back."""
    out: dict[str, Any] = {"__batch_size__": list(td.batch_size)}
    for k in td.keys():
        v = td.get(k)
        if isinstance(v, torch.Tensor):
            out[k] = v.clone()
        else:
            out[k] = {"__strings__": [str(x) for x in v.tolist()]}
    return out


def plain_to_batch(d: dict[str, Any]) -> TensorDict:
    """Inverse of :func:`batch_to_plain`."""
    fields: dict[str, Any] = {}
    for k, v in d.items():
        if k == "__batch_size__":
            continue
        fields[k] = NonTensorStack(*v["__strings__"]) if isinstance(v, dict) else v
    return TensorDict(fields, batch_size=d["__batch_size__"])


def rng_state() -> dict[str, Any]:
    """The controller's RNG states (JSON-safe)."""
    py = random.getstate()
    return {"python": [py[0], list(py[1]), py[2]], "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
