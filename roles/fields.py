"""What a config section accepts, declared once next to its fields.

:class:`Section` is the base of every config dataclass (the roles' and the trainer's): an attribute that is
not one of its fields cannot be set, so ``cfg.trainer.stpes = 3`` fails where it is written instead of
training with the default.

:class:`Range` declares a number's bounds in its annotation, next to the field::

    batch_size: Annotated[int, Range(ge=1, le=MAX_ROWS)] = 64

:func:`check_bounds` reads those declarations to refuse a value out of bounds (``JobConfig.validate`` and
the roles' own ``validate`` call it), and the config fuzz reads them to produce values out of bounds
(:meth:`Range.outside`). Every number in a config must also be finite, declared or not: ``inf`` is never a
setting (None, null in YAML, turns off a limit that can be off).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_ROWS", "MAX_SEED", "MAX_WORKERS", "Range", "Section", "check_bounds", "range_of"]

MAX_ROWS = 1 << 20
"""Most rows any per-step size may name (responses per step, micro- and mini-batches, groups in flight): a
million responses a step is far beyond any job here, and a size above it only makes the controller and the
workers build batches that no machine holds."""
MAX_WORKERS = 4096
"""Most worker processes one pool may have."""
MAX_SEED = 2**32 - 1
"""Largest seed (numpy's; the seeds derived from it stay within torch's 64 bits)."""


class Section:
    """Base of the keyword-only config dataclasses: setting a name that is not a field raises
    ``AttributeError`` naming the nearest field (a typo would otherwise be ignored in silence)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        cls = type(self)
        fields = getattr(cls, "__dataclass_fields__", {})
        if name not in fields and not isinstance(getattr(cls, name, None), property):
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            valid = ", ".join(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]
            raise AttributeError(f"{cls.__name__} has no field {name!r}{hint} (its fields: {valid})")
        object.__setattr__(self, name, value)


@dataclass(frozen=True)
class Range:
    """The bounds of a number (of each item of a list, of each value of a mapping), in the field's annotation:
    ``Annotated[int, Range(ge=1)]``. None bounds are open; `also` lists values accepted outside them (``-1``
    for "off"); `says` replaces the words after "must be" in the error."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple[Any, ...] = ()
    says: str | None = None

    def accepts(self, x: float) -> bool:
        """Whether `x` (a finite number) is within the bounds or one of `also`."""
        if x in self.also:
            return True
        return ((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt))

    def describe(self, x: float | None = None) -> str:
        """What the error says the value must be: the side `x` falls out of (``">= 1"``, ``"<= 1048576"``,
        ``"-1 or >= 1"``), or with no `x` the whole range (``"in (0, 1]"``); `says` when given."""
        if self.says is not None:
            return self.says
        low = (f">= {self.ge}" if self.ge is not None else f"> {self.gt}" if self.gt is not None else None)
        high = (f"<= {self.le}" if self.le is not None else f"< {self.lt}" if self.lt is not None else None)
        if x is not None and not ((self.le is None or x <= self.le) and (self.lt is None or x < self.lt)):
            return high or ""
        if x is not None or high is None:
            text = low or "a finite number"
        elif low is None:
            text = high
        else:
            text = (f"in {'[' if self.ge is not None else '('}{low.split()[1]}, {high.split()[1]}"
                    f"{']' if self.le is not None else ')'}")
        return " or ".join([*(repr(a) for a in self.also), text])

    def outside(self, integer: bool) -> list[float]:
        """Values just out of bounds (below and above), none of them in `also`: what the config fuzz sets."""
        step = 1 if integer else 0.5
        out: list[float] = []
        if self.ge is not None:
            low = self.ge - step
            while low in self.also:
                low -= step
            out.append(low)
        elif self.gt is not None:
            out.append(self.gt)
        if self.le is not None:
            out.append(self.le + step)
        elif self.lt is not None:
            out.append(self.lt)
        return [int(v) if integer else float(v) for v in out]


@functools.cache
def _declared(cls: type) -> dict[str, Range | None]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: range_of(hints[f.name]) for f in dataclasses.fields(cls)}


def range_of(annotation: Any) -> Range | None:
    """The :class:`Range` declared in `annotation` (``Annotated[int, Range(...)]``, also inside ``X | None``)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return next((m for m in annotation.__metadata__ if isinstance(m, Range)), None)
    for arg in typing.get_args(annotation):
        found = range_of(arg)
        if found is not None:
            return found
    return None


def check_bounds(section: Any, path: str = "") -> None:
    """Raise ``ValueError`` naming the first field of the config dataclass `section` (sections inside it
    included, named from `path`) that holds a number out of its declared :class:`Range`, or one that is not
    finite (NaN, inf), also inside a list or a mapping."""
    for name, bound in _declared(type(section)).items():
        key = f"{path}.{name}" if path else name
        value = getattr(section, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_bounds(value, key)
        else:
            _check_value(key, value, bound, 0)


def _check_value(key: str, value: Any, bound: Range | None, depth: int) -> None:
    if depth > 32:
        raise ValueError(f"{key} nests its values too deeply to be a setting")
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            what = ("a finite number" if bound is None else bound.says if bound.says is not None
                    else f"a finite number {bound.describe()}")
            raise ValueError(f"{key} must be {what}, got {value!r}")
        if bound is not None and not bound.accepts(value):
            raise ValueError(f"{key} must be {bound.describe(value)}, got {value!r}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_value(f"{key}[{i}]", item, bound, depth + 1)
    elif isinstance(value, dict):
        for k, item in value.items():
            _check_value(f"{key}.{k}", item, bound, depth + 1)
