"""What a config section accepts, declared once next to its fields.

:class:`Section` is the base of every config dataclass (the roles' and the trainer's): an attribute that is
not one of its fields cannot be set, so ``cfg.trainer.stpes = 3`` fails where it is written instead of
training with the default.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

__all__ = ["Section"]


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
