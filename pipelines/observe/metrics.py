"""Metric sinks: JSON lines always, TensorBoard when it is installed, Weights & Biases when asked
(``trainer.loggers=["wandb"]``, offline unless ``WANDB_MODE`` says otherwise)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import structlog

__all__ = ["MetricsWriter", "jsonl_lines", "read_jsonl", "step_of"]

log = structlog.get_logger("asyncrl.pipelines")


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` (and TensorBoard scalars).

    Args:
        output_dir: the run directory.
        tensorboard: also write TensorBoard event files when ``torch.utils.tensorboard`` imports.
        start_step: on resume, lines of steps at or after it are dropped from an existing file
            so the file reads as one run.
        history: on resume, the rows of the steps before `start_step` (the checkpoint's); one the file lost
            (a process killed mid-write tore its last line) is written back in its place.
        evals: on resume, the evaluation rows before `start_step` (the checkpoint's), restored the same way.
        loggers: more sinks (``"wandb"``).
        wandb_project: the W&B project.
        config: the run's config as a dict (W&B shows it with the run).
        wandb_id: the W&B run to continue (after a restart), else a new one.
    """

    def __init__(self, output_dir: str | Path, *, tensorboard: bool = True, start_step: int = 0,
                 loggers: Sequence[str] = (), wandb_project: str = "asyncrl",
                 config: Mapping[str, Any] | None = None, wandb_id: str | None = None,
                 history: Sequence[Mapping[str, Any]] = (), evals: Sequence[Mapping[str, Any]] = ()) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        if self.path.exists() or history or evals:
            text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
            kept = _restored([line for line in jsonl_lines(text) if step_of(line) < start_step], start_step,
                             history, evals)
            self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        self._f = self.path.open("a", encoding="utf-8")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tensorboard"))
            except Exception:  # tensorboard is optional
                self._tb = None
        self._wandb: Any = None
        if "wandb" in loggers:
            import wandb

            # offline unless the user's environment says otherwise: a run never reaches the network unasked
            mode: Any = os.environ.get("WANDB_MODE", "offline")
            self._wandb = wandb.init(project=wandb_project, name=self.dir.resolve().name, dir=str(self.dir),
                                     mode=mode, config=dict(config or {}), id=wandb_id, resume="allow",
                                     settings=wandb.Settings(silent=True, console="off"))
        self.wandb_id: str | None = self._wandb.id if self._wandb is not None else None
        """The W&B run's id (a restart reopens the sinks and continues that run)."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` of `step`."""
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        scalars = {k: v for k, v in row.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close the sinks."""
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _restored(kept: list[str], start_step: int, history: Sequence[Mapping[str, Any]],
              evals: Sequence[Mapping[str, Any]]) -> list[str]:
    """`kept` (the file's lines before `start_step`) with the rows of `history` (training) and `evals`
    (evaluation) it lacks put back, in step order; `kept` itself when it lacks none."""
    def key(row: Mapping[str, Any]) -> tuple[int, bool]:
        return int(row["step"]), row.get("kind") == "eval"

    have = {key(r) for r in map(json.loads, kept)}
    rows = [dict(h) for h in history] + [{"step": e["eval/version"], **e} for e in evals]
    lost = [r for r in rows if int(r["step"]) < start_step and key(r) not in have]
    if not lost:
        return kept
    lines = kept + [json.dumps(r) for r in lost]
    return sorted(lines, key=lambda line: (int(json.loads(line)["step"]), json.loads(line).get("kind") != "eval"))


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON-lines text, split at ``\\n`` only: a JSON string escapes its newlines, but written
    with ``ensure_ascii=False`` it keeps U+2028, U+2029 and U+0085 raw, where ``str.splitlines`` would also
    break (and a resume would drop both halves as torn)."""
    lines = text.split("\n")
    return lines[:-1] if lines and not lines[-1] else lines


def step_of(line: str) -> float:
    """The step of one line; a blank or torn line (a process killed mid-write) sorts last and is dropped."""
    try:
        row = json.loads(line)
    except ValueError:
        return math.inf
    return row.get("step", 0) if isinstance(row, dict) else math.inf


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return v


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in jsonl_lines(Path(path).read_text(encoding="utf-8")) if line.strip()]
