"""Group methods are visible to type checkers (mypy over typing_check.py)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_group_methods_carry_the_worker_signature_and_collected_type():
    try:  # the test extra installs mypy: without it this test fails, it never skips silently
        import mypy  # noqa: F401
    except ImportError:
        pytest.fail("mypy is not installed: install the test extra (pip install -e '.[test]'), which pins mypy>=1.11")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--warn-unused-ignores", "--config-file",
         str(ROOT / "pyproject.toml"), str(ROOT / "tests" / "core" / "typing_check.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
