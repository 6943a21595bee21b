"""The ``asyncrl`` console script: a thin shim that imports the pipelines lazily."""

from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``asyncrl <command>`` (see :mod:`asyncrl.pipelines.cli`)."""
    from asyncrl.pipelines.cli import main as _main

    return _main(argv)
