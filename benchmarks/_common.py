"""What every benchmark writes around its tables: the machine header and the results file."""

from __future__ import annotations

import datetime
import os
import platform
import sys


def run_header(script: str, machine_note: str = "shared with other jobs", extra: str = "") -> str:
    """'Run <date> on <machine> (...); versions.' then the exact command that made the table."""
    import ray
    import tensordict
    import torch

    return (
        f"Run {datetime.datetime.now().isoformat(timespec='seconds')} on {platform.machine()} "
        f"({os.cpu_count()} CPUs visible, no GPU; {machine_note}); python {platform.python_version()}, "
        f"ray {ray.__version__}, torch {torch.__version__}, tensordict {tensordict.__version__}{extra}.\n\n"
        f"Command: `python benchmarks/{script} {' '.join(sys.argv[1:])}`".rstrip()
    )


def write_result(path: str, text: str) -> None:
    """Write the markdown result (creating its folder) and print it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(text)


def load_note(start: float, end: float | None = None) -> str:
    """The machine's 1-minute load average around a run (the machine is shared: say how busy it was)."""
    cores = os.cpu_count() or 1
    tail = f" at the start, {end:.1f} at the end" if end is not None else " at the start"
    return f"shared with other jobs: 1-minute load average {start:.1f}{tail} on {cores} cores"
