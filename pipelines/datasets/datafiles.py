"""Prompts from dataset files: ``data.train_files`` / ``data.val_files``.

Three formats, told apart by the path:

* ``*.jsonl`` (or ``*.json`` holding one JSON object per line);
* ``*.parquet`` (read with pyarrow: ``pip install 'asyncrl[data]'``);
* a directory written by Hugging Face ``datasets.Dataset.save_to_disk`` (its ``state.json`` names the
  Arrow stream files, read with pyarrow; the ``datasets`` package is not needed).

The columns are verl's by default: ``prompt`` (a list of chat messages ``{"role", "content"}`` or a plain
string), ``reward_model.ground_truth`` (the answer the reward sees; a dotted key reads a nested field),
``data_source`` and ``extra_info`` (optional; passed to a verl-style ``compute_score``).
``data.prompt_key`` and ``data.answer_key`` rename the first two.

Every error is a :class:`~asyncrl.pipelines.configlib.ConfigError` naming the key and the fix, raised
when the config is validated (before Ray starts). Files are read once per process (cached by path,
size and modification time).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from asyncrl.pipelines.configlib import ConfigError

__all__ = ["Record", "FORMATS", "file_format", "read_rows", "read_records", "file_records", "content_digest",
           "data_digests", "code_digests", "check_code_digests", "module_source"]

FORMATS = ("jsonl", "parquet", "hf_disk")
"""The formats a data file may have: JSON lines, Parquet, a ``datasets.save_to_disk`` directory."""


class Record(tuple):  # type: ignore[type-arg]
    """A ``(prompt, answer)`` pair read from a data file that also carries the row's other columns.

    It is a 2-tuple, so everything that handles a task's ``(prompt, answer)`` pairs handles it; the
    prompt loader also reads :attr:`messages`, :attr:`data_source` and :attr:`extra_info`."""

    messages: list[dict[str, str]] | None
    """The chat messages when the prompt column holds a list (``prompt`` is then the last user turn)."""
    data_source: str
    """The row's ``data_source`` (``""`` when the file has no such column)."""
    extra_info: dict[str, Any]
    """The row's ``extra_info`` (``{}`` when absent)."""
    row: int
    """Row number in its file (0-based; not ``index``, which is the tuple's method)."""
    source: str
    """The file it came from."""

    def __new__(cls, prompt: str, answer: str, *, messages: list[dict[str, str]] | None = None,
                data_source: str = "", extra_info: dict[str, Any] | None = None, row: int = 0,
                source: str = "") -> "Record":
        self = super().__new__(cls, (prompt, answer))
        self.messages = messages
        self.data_source = data_source
        self.extra_info = dict(extra_info or {})
        self.row = row
        self.source = source
        return self

    def __reduce__(self) -> Any:
        return (_make_record, (self[0], self[1], self.messages, self.data_source, self.extra_info, self.row,
                               self.source))


def _make_record(prompt: str, answer: str, messages: Any, data_source: str, extra_info: dict[str, Any],
                 row: int, source: str) -> Record:
    return Record(prompt, answer, messages=messages, data_source=data_source, extra_info=extra_info, row=row,
                  source=source)


def file_format(path: str, key: str = "data.train_files") -> str:
    """The format of `path` (one of :data:`FORMATS`); :class:`ConfigError` when it does not exist or
    is none of them."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{key}: {path!r} does not exist; give a .jsonl or .parquet file or a directory saved "
                          "with datasets.Dataset.save_to_disk")
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            raise ConfigError(f"{key}: {path!r} is a DatasetDict with splits {splits}; point {key} at one split's "
                              f"directory, e.g. {str(p / (splits[0] if splits else 'train'))!r}")
        if (p / "state.json").is_file():
            return "hf_disk"
        raise ConfigError(f"{key}: directory {path!r} has no state.json, so it is not a dataset saved with "
                          "datasets.Dataset.save_to_disk; give that directory, a .jsonl or a .parquet file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ConfigError(f"{key}: {path!r} has an unknown format ({suffix or 'no suffix'}); use .jsonl (one JSON "
                      "object per line), .parquet, or a directory saved with datasets.Dataset.save_to_disk")


def _pyarrow(key: str, path: str) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ConfigError(f"{key}: reading {path!r} needs pyarrow; install it with pip install 'asyncrl[data]' "
                          "(or pip install pyarrow), or convert the file to .jsonl") from None
    return pyarrow


def read_rows(path: str, key: str = "data.train_files") -> list[dict[str, Any]]:
    """Every row of the data file `path` as a dict (nested columns stay nested)."""
    fmt = file_format(path, key)
    try:
        if fmt == "jsonl":
            rows = []
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ConfigError(f"{key}: line {n} of {path!r} is a JSON {type(row).__name__}, not an "
                                          "object; write one {\"prompt\": ..., ...} object per line")
                    rows.append(row)
            return rows
        pa = _pyarrow(key, path)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return list(pq.read_table(path).to_pylist())
        state = json.loads((Path(path) / "state.json").read_text())
        files = [d["filename"] for d in state.get("_data_files", [])]
        if not files:
            raise ConfigError(f"{key}: {path!r}/state.json lists no data files (_data_files); save the dataset "
                              "again with datasets.Dataset.save_to_disk")
        out: list[dict[str, Any]] = []
        for name in files:
            with pa.memory_map(str(Path(path) / name)) as src:
                out.extend(pa.ipc.open_stream(src).read_all().to_pylist())
        return out
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{key}: cannot read {path!r} as {fmt}: {type(e).__name__}: {e}") from None


def _columns(row: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in row.items():
        out.append(prefix + str(k))
        if isinstance(v, dict):
            out.extend(_columns(v, f"{prefix}{k}."))
    return out


_MISSING = object()


def _get(row: dict[str, Any], dotted: str) -> Any:
    if dotted in row:
        return row[dotted]
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _answer_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _messages(v: Any, where: str, key: str) -> list[dict[str, str]]:
    ok = isinstance(v, list) and v and all(isinstance(m, dict) and "role" in m and "content" in m for m in v)
    if not ok:
        raise ConfigError(f"{key}: {where} is neither a string nor a list of chat messages "
                          "[{\"role\": ..., \"content\": ...}]; fix the row or point data.prompt_key at another "
                          "column")
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in v]


_CACHE: dict[tuple[Any, ...], list[Record]] = {}


def read_records(path: str, *, prompt_key: str = "prompt", answer_key: str = "reward_model.ground_truth",
                 key: str = "data.train_files") -> list[Record]:
    """The :class:`Record` of every row of `path` (cached per process by path, size and mtime)."""
    st = os.stat(path) if os.path.isfile(path) else None
    cache_key = (os.path.abspath(path), st.st_size if st else None, st.st_mtime_ns if st else None, prompt_key,
                 answer_key)
    if st is not None and cache_key in _CACHE:
        return _CACHE[cache_key]
    rows = read_rows(path, key)
    if not rows:
        raise ConfigError(f"{key}: {path!r} holds no rows; give a file with at least one prompt")
    out = []
    for i, row in enumerate(rows):
        prompt, answer = _get(row, prompt_key), _get(row, answer_key)
        for name, what, v in (("data.prompt_key", prompt_key, prompt), ("data.answer_key", answer_key, answer)):
            if v is _MISSING:
                raise ConfigError(f"{name}: row {i} of {path!r} has no column {what!r}; the columns found are "
                                  f"{_columns(row)}; set {name} to the column that holds it (a dotted key reads "
                                  "a nested field, e.g. reward_model.ground_truth)")
        msgs = None
        if not isinstance(prompt, str):
            msgs = _messages(prompt, f"row {i} of {path!r} column {prompt_key!r}", "data.prompt_key")
            users = [m["content"] for m in msgs if m["role"] == "user"]
            prompt = users[-1] if users else msgs[-1]["content"]
        source = _get(row, "data_source")
        extra = _get(row, "extra_info")
        out.append(Record(prompt, _answer_text(answer), messages=msgs,
                          data_source="" if source is _MISSING or source is None else str(source),
                          extra_info=extra if isinstance(extra, dict) else {}, row=i, source=path))
    if st is not None:
        _CACHE[cache_key] = out
    return out


def _paths(files: str | Sequence[str]) -> list[str]:
    return [files] if isinstance(files, str) else list(files)


def file_records(data: Any, *, split: str = "train") -> list[Record]:
    """The records of `data`'s (a ``DataConfig``) ``train_files``, or of its ``val_files`` when `split`
    is ``"eval"`` (the training files when no ``val_files`` are given), in file order."""
    files, key = data.train_files, "data.train_files"
    if split == "eval" and data.val_files is not None:
        files, key = data.val_files, "data.val_files"
    paths = _paths(files)
    if not paths:
        raise ConfigError(f"{key} is an empty list; give one path or a list of paths")
    out: list[Record] = []
    for p in paths:
        out.extend(read_records(p, prompt_key=data.prompt_key, answer_key=data.answer_key, key=key))
    return out


FULL_HASH_BYTES = 8 << 20
"""Files up to this size are hashed whole by :func:`content_digest`; larger ones by size, first and last MiB."""
_EDGE = 1 << 20


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256()
    with path.open("rb") as f:
        if size <= FULL_HASH_BYTES:
            h.update(f.read())
            return f"sha256:{h.hexdigest()[:32]}"
        h.update(f.read(_EDGE))
        f.seek(size - _EDGE)
        h.update(f.read(_EDGE))
    return f"size={size},edges-sha256:{h.hexdigest()[:32]}"


def content_digest(path: str) -> str:
    """A digest of the data file (or ``save_to_disk`` directory) `path`'s contents, not of its name or
    modification time (a copied file keeps it): the sha256 of the whole file up to
    :data:`FULL_HASH_BYTES` (8 MiB), above that its size and the sha256 of its first and last MiB (an edit
    in the middle of a large file that keeps its size is not seen). A directory: the digests of its files."""
    p = Path(path)
    if p.is_dir():
        parts = [f"{c.name}={_file_digest(c)}" for c in sorted(p.iterdir()) if c.is_file()]
        return "dir:" + hashlib.sha256(";".join(parts).encode()).hexdigest()[:32]
    return _file_digest(p)


def data_digests(data: Any) -> dict[str, str]:
    """``{"<key>:<path>": content_digest(path)}`` for every file of `data`'s (a ``DataConfig``)
    ``train_files`` and ``val_files`` (empty for a built-in task). A checkpoint records it; a resume
    compares it (:meth:`~asyncrl.pipelines.checkpoints.checkpointing.Checkpointer`) so that an edited data file is refused
    instead of continuing at the same position on different data."""
    out: dict[str, str] = {}
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        if files is None:
            continue
        for path in _paths(files):
            if os.path.exists(path):
                out[f"{key}:{path}"] = content_digest(path)
    return out


CODE_KEYS = (("reward", "fn"), ("rollout", "episode"), ("rollout", "agent"))
"""The settings that may name Python code a run imports and runs: a file (``path/to/file.py:function``) or a
module (``package.module:function``); a registered name (no ``:``) names code of the installed packages."""


def _is_file_spec(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def module_source(name: str) -> str | None:
    """The source file of module `name` (a package's ``__init__.py``), found as ``import`` would find it but
    without running any of it: no parent package is imported, each finder on ``sys.meta_path`` is asked with
    the parent's search locations. None when there is no such module (or it has no file)."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    spec: Any = None
    locations: Any = None
    for i in range(len(parts)):
        full = ".".join(parts[:i + 1])
        loaded = sys.modules.get(full)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else None
        for finder in [] if spec is not None else sys.meta_path:
            find = getattr(finder, "find_spec", None)
            try:
                spec = find(full, locations) if find is not None else None
            except (ImportError, ValueError):
                spec = None
            if spec is not None:
                break
        if spec is None:
            return None
        locations = spec.submodule_search_locations
        if locations is None and i < len(parts) - 1:
            return None
    origin = getattr(spec, "origin", None)
    return origin if isinstance(origin, str) and os.path.isfile(origin) else None


def _code(name: str) -> tuple[str, str | None]:
    """``(what the error calls it, its file now or None)`` of a :func:`code_digests` entry's target."""
    if _is_file_spec(name):
        return repr(name), name if os.path.isfile(name) else None
    path = module_source(name)
    return f"module {name!r} ({path or 'not found'})", path


def code_digests(config: Mapping[str, Any]) -> dict[str, str]:
    """``{"<key>:<target>": content_digest(file)}`` for the code the run's config (a ``to_dict`` of a
    ``JobConfig``) names in ``reward.fn``, ``rollout.episode`` or ``rollout.agent``: a file by its path, a
    module by its name (its source file found without importing it, :func:`module_source`). A checkpoint and
    the journal record it; a resume and a replay compare it before anything imports that code
    (:func:`check_code_digests`): a run directory's code is what the run ran, or nothing runs."""
    out: dict[str, str] = {}
    for section, key in CODE_KEYS:
        spec = (config.get(section) or {}).get(key)
        if not isinstance(spec, str) or ":" not in spec:
            continue
        target = spec.rpartition(":")[0] if _is_file_spec(spec.rpartition(":")[0]) else spec.partition(":")[0]
        _, path = _code(target)
        if path is not None:
            out[f"{section}.{key}:{target}"] = content_digest(path)
    return out


def check_code_digests(saved: Any, config: Mapping[str, Any], where: str) -> None:
    """ConfigError when code that `saved` (a :func:`code_digests` record; None: a record without one) lists
    now has other contents, or is gone, or when `config` names code that `saved` holds no digest of (a
    record written without it, or edited to name other code); `where` names the record (the checkpoint,
    the journal). Call it before anything imports the code `config` names."""
    saved = saved if isinstance(saved, dict) else {}
    now = code_digests(config)
    for name in sorted(set(saved) | set(now)):
        if now.get(name) != saved.get(name):
            key, _, target = name.partition(":")
            what, path = _code(target)
            if name not in saved:
                raise ConfigError(
                    f"{key}: {what} is code the run's config names to import and run, but {where} records no "
                    "digest of it (written without one, or edited), so it is refused: start a new run (asyncrl "
                    "export gives its weights)")
            state = "is gone" if path is None else "changed"
            raise ConfigError(
                f"{key}: {what} {state} since {where} was written (content digest {saved[name]} then, "
                f"{now.get(name, 'none')} now); the run directory names this code to import and run, so "
                "it is refused: put the original file back, or start a new run")
