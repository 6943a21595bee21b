"""Loading keyword-only config dataclasses from YAML and ``key=value`` overrides.

Generic over any tree of dataclasses: unknown keys, wrong types and malformed
overrides raise :class:`ConfigError` with the dotted path and the valid keys, so a
typo fails before any worker starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import yaml

__all__ = ["ConfigError", "MAX_YAML_SIZE", "safe_yaml", "from_dict", "to_dict", "load", "parse_overrides", "apply_overrides", "check_types"]

T = TypeVar("T")


_EXPONENT = re.compile(r"[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+")
"""A number in exponent form without a dot (``2e-4``): YAML 1.2 and Python read a float, PyYAML (YAML 1.1) a string."""


class ConfigError(ValueError):
    """Raised when a config file, an override or a combination of values is invalid."""


MAX_YAML_SIZE = 1_000_000
"""Most values and characters a config file or an override may expand to, each alias counted every time it
is used (a file of a few hundred bytes can otherwise alias itself into gigabytes)."""


def safe_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)``, refusing with a :class:`ConfigError` that names `where` what ``safe_load`` lets
    through: a key given twice in one mapping (the last would silently win), a recursive alias, and aliases
    that expand beyond :data:`MAX_YAML_SIZE`."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None
        _YamlCheck(where).size(node)
        loader = yaml.SafeLoader("")
        try:
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ConfigError(f"{where} nests its values too deeply to be a config") from None


class _YamlCheck:
    """Walks a composed YAML node: its expanded size (values plus characters, aliases counted at each use),
    recursive aliases and duplicate keys."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.sizes: dict[int, int] = {}
        self.open: set[int] = set()

    def size(self, node: yaml.Node) -> int:
        key = id(node)
        if key in self.sizes:
            return self.sizes[key]
        if key in self.open:
            raise ConfigError(f"{self.where} holds a recursive alias (a value that contains itself, line "
                              f"{node.start_mark.line + 1}); write the value out")
        self.open.add(key)
        total = 1
        if isinstance(node, yaml.ScalarNode):
            total += len(node.value)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(self.size(v) for v in node.value)
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}  # key -> the line it is first given on
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    line = k.start_mark.line + 1
                    if (k.tag, k.value) in first:
                        where = (f"lines {first[k.tag, k.value]} and {line}" if first[k.tag, k.value] != line
                                 else f"line {line}")
                        raise ConfigError(f"{self.where} gives key {k.value!r} twice ({where}); keep one")
                    first[k.tag, k.value] = line
                total += self.size(k) + self.size(v)
        self.open.discard(key)
        if total > MAX_YAML_SIZE:
            raise ConfigError(f"{self.where} expands to more than {MAX_YAML_SIZE:,} values and characters through "
                              "its aliases; a config is smaller: write the values out")
        self.sizes[key] = total
        return total


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown(path: str, key: str, valid: Sequence[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    where = f"{path}.{key}" if path else key
    return ConfigError(f"unknown config key {where!r}{hint} (valid keys here: {', '.join(sorted(valid))})")


def _kinds(options: Sequence[Any]) -> str:
    """``"an integer, a string or null"``: what a union annotation accepts, in words."""
    words = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    names = []
    for o in options:
        if typing.get_origin(o) is typing.Literal:
            names.append("one of " + ", ".join(repr(a) for a in typing.get_args(o)))
        elif o in words:
            names.append(words[o])
        elif typing.get_origin(o) in (list, tuple, Sequence) or o in (list, tuple):
            names.append("a list")
        elif typing.get_origin(o) is dict or o is dict:
            names.append("a mapping")
        else:
            names.append(getattr(o, "__name__", str(o)))
    names = sorted(set(names), key=names.index)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _coerce(path: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(path, opt, value)
            except ConfigError as e:
                errors.append(str(e))
        inner = [e for e in errors if e.startswith((f"{path}.", f"{path}["))]
        if len(errors) == 1 and inner:  # a mapping or list of the right kind with one bad item: name the item
            raise ConfigError(inner[0])
        raise ConfigError(f"{path} must be {_kinds(options)}, got {value!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed):
            # YAML 1.1 reads off/on/yes/no as booleans: give back the one spelling this choice has
            words = {"off", "no", "false"} if not value else {"on", "yes", "true"}
            spelled = [a for a in allowed if isinstance(a, str) and a.lower() in words]
            if len(spelled) == 1:
                return spelled[0]
        if value not in allowed:
            raise ConfigError(f"{path} must be one of {list(allowed)}, got {value!r}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} is a section ({tp.__name__}); give a mapping, got {value!r}")
        return from_dict(tp, value, _path=path)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(f"{path}[{i}]", inner, v) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {_coerce(path, kt, k): _coerce(f"{path}.{k}", vt, v) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value):
            value = float(value.replace("_", ""))
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
            return float(value)
        raise ConfigError(f"{path} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path} must be a string, got {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path} must be a {tp.__name__}, got {value!r}")
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], *, _path: str = "") -> T:
    """Build dataclass `cls` from a nested mapping; missing keys keep their defaults."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_path or 'config'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown(_path, str(key), list(fields))
        kwargs[key] = _coerce(f"{_path}.{key}" if _path else key, hints[key], value)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a __post_init__ that checks its values: still one line, exit 2
        raise ConfigError(f"{_path or cls.__name__}: {e}") from e


def check_types(cfg: Any, _path: str = "") -> None:
    """Check every field of the dataclass tree `cfg` against its annotation, as a YAML file or an override
    would be (a value set in Python on a preset included), normalising in place what loading would (an int
    for a float, a list for a tuple); :class:`ConfigError` names the first field whose value cannot be."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        if not f.init:
            continue
        path = f"{_path}.{f.name}" if _path else f.name
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_types(value, path)
            continue
        coerced = _coerce(path, hints[f.name], value)
        if type(coerced) is not type(value) or coerced != value:  # an int for a float, a list for a tuple
            object.__setattr__(cfg, f.name, coerced)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, YAML-safe nested dict of a config dataclass (tuples become lists)."""

    def conv(x: Any) -> Any:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [conv(i) for i in x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    return conv(cfg)


def parse_overrides(items: Sequence[str]) -> list[tuple[list[str], Any]]:
    """Parse ``a.b=value`` strings; values are read as YAML scalars (``3``, ``0.5``, ``true``, ``[1, 2]``; a float
    field also takes ``1e-3``, which PyYAML reads as a string)."""
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. trainer.steps=20)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key part")
        value = safe_yaml(raw, f"override {item!r}") if raw.strip() else ""
        out.append((key.split("."), value))
    return out


def apply_overrides(cfg: T, overrides: Sequence[str]) -> T:
    """Return a copy of `cfg` with dotted ``key=value`` overrides applied and type-checked."""
    data = to_dict(cfg)
    for parts, value in parse_overrides(overrides):
        node: Any = data
        cls: Any = type(cfg)
        for depth, part in enumerate(parts):
            valid = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
            if part not in valid:
                raise _unknown(".".join(parts[:depth]), part, valid)
            if depth == len(parts) - 1:
                node[part] = value
            else:
                path = ".".join(parts[: depth + 1])
                cls = _section_type(cls, part, path)
                if not isinstance(node.get(part), dict):  # an earlier override replaced the section
                    raise ConfigError(f"{path} is a section ({cls.__name__}); give a mapping, got {node.get(part)!r}")
                node = node[part]
    return from_dict(type(cfg), data)


def _section_type(cls: type, name: str, path: str) -> type:
    tp = _hints(cls)[name]
    if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        raise ConfigError(f"{path} is a value, not a section; write {path}=VALUE")
    return tp


def load(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = (), *, base: T | None = None) -> T:
    """Config `cls` from defaults (or `base`), then the YAML file at `path`, then `overrides`."""
    cfg: Any = base if base is not None else cls()
    if path is not None:
        data = safe_yaml(_read_text(Path(path)), f"config file {str(path)!r}") or {}
        merged = _deep_merge(to_dict(cfg), data, "", cls)
        cfg = from_dict(cls, merged)
    return apply_overrides(cfg, overrides) if overrides else cfg


def _read_text(p: Path) -> str:
    """The UTF-8 text of config file `p`; :class:`ConfigError` for a file that is missing, unreadable or not UTF-8."""
    where = f"config file {str(p)!r}"
    if not p.is_file():
        raise ConfigError(f"{where} does not exist" + (" (it is a directory)" if p.is_dir() else ""))
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save it as "
                          "UTF-8") from None


def _deep_merge(base: dict[str, Any], new: Mapping[str, Any], path: str, cls: type) -> dict[str, Any]:
    """`new` (a config file's mapping for section `cls`) over `base`: a section is merged key by key, any other
    value -- a mapping-valued field such as ``reward.fn_kwargs`` included -- is replaced whole."""
    if not isinstance(new, Mapping):
        raise ConfigError(f"{path or 'the config file'} must be a mapping, got {new!r}")
    out = dict(base)
    hints = _hints(cls)
    for k, v in new.items():
        where = f"{path}.{k}" if path else str(k)
        if k not in base:
            raise _unknown(path, str(k), list(base))
        tp = hints[k]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):  # an optional section: `ModelConfig | None`
            tp = next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), tp)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(base[k], dict) \
                and isinstance(v, Mapping):
            out[k] = _deep_merge(base[k], v, where, tp)
        else:
            out[k] = v
    return out
