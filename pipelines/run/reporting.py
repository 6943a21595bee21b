"""Where a run's results go: the metrics sinks, the sampled trajectories, the progress bar and the
log line of each step, and, when the run ends, the trace and the plot (an observer of the train loop)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable

import anyio.to_thread
import structlog

from asyncrl.pipelines.loop import stages
from asyncrl.pipelines.configlib import to_dict
from asyncrl.pipelines.observe.metrics import MetricsWriter
from asyncrl.pipelines.observe.samples import SamplesWriter
from asyncrl.pipelines.observe.report import draw_report
from asyncrl.roles.modeling.models import tokenizer_for

if TYPE_CHECKING:
    from asyncrl.pipelines.loop.stages import Groups
    from asyncrl.pipelines.job.config import JobConfig
    from asyncrl.pipelines.datasets.evaluation import Evaluator
    from asyncrl.pipelines.observe.trace import Tracer

__all__ = ["RunReport"]


log = structlog.get_logger("asyncrl.pipelines")


class RunReport:
    """Writes each step's metrics (``metrics.jsonl``, TensorBoard) and sampled trajectories
    (``samples.jsonl``), shows progress, and writes ``trace.json`` and ``report.png`` at the end;
    never changes what the loops do.

    Args:
        config: the run's configuration (its ``trainer`` section says what to write, and where).
        tracer: the run's tracer (its spans go to ``trace.json`` and ``report.png``; sampling calls are watched).
    """

    def __init__(self, config: JobConfig, tracer: Tracer) -> None:
        self._config, self._tracer = config, tracer
        self._out = Path(config.trainer.output_dir)
        self.metrics: MetricsWriter | None = None
        """The open metrics sinks (between setup and close)."""
        self.sampler: SamplesWriter | None = None
        """The open ``samples.jsonl`` (``trainer.samples_per_step`` > 0)."""
        self._wandb_id: str | None = None
        self._warned_no_sampler = False
        self.bar: Any = None
        """The progress bar of the ``fit`` in progress (``trainer.progress``)."""

    async def open(self, start_step: int, history: list[dict[str, Any]], evaluator: Evaluator | None) -> None:
        """(Re)open the metrics sinks at `start_step`, the loop state's first step (a restored run rewrites what
        follows), after the steps of `history` and the evaluations of `evaluator`."""
        await anyio.to_thread.run_sync(self.close)
        cfg = self._config
        t = cfg.trainer
        evals = list(evaluator.records) if evaluator is not None else []
        self.metrics = await anyio.to_thread.run_sync(lambda: MetricsWriter(
            self._out, tensorboard=t.tensorboard, start_step=start_step, loggers=t.loggers,
            wandb_project=t.wandb_project, config=to_dict(cfg), wandb_id=self._wandb_id,
            history=list(history), evals=evals))
        self._wandb_id = self.metrics.wandb_id if self.metrics is not None else None
        if t.samples_per_step > 0:
            self.sampler = await anyio.to_thread.run_sync(
                lambda: SamplesWriter(self._out, tokenizer_for(cfg.model), start_step=start_step))

    def start(self, start_step: int) -> None:
        """A progress bar for the steps ``fit`` is about to run, from `start_step` (when ``trainer.progress``)."""
        t = self._config.trainer
        if t.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=t.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def rewind(self, start_step: int) -> None:
        """Show the restored state's first step `start_step` (after a restart)."""
        if self.bar is not None:
            self.bar.n = start_step
            self.bar.refresh()

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        """Step `step` finished with `metrics`."""
        if self.metrics is not None:
            self.metrics.write(step, metrics)
        bar = self.bar
        if bar is not None:
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", stale=metrics["staleness/max"],
                            step_s=f"{metrics['time/step']:.2f}", refresh=False)
            bar.update(1)
        if bar is not None and step % 10 and step + 1 != self._config.trainer.steps:
            return  # the bar shows every step; the log gets every 10th
        log.info("train.step", step=step, reward=round(metrics["reward/mean"], 4),
                 staleness=metrics["staleness/max"], step_s=round(metrics["time/step"], 3),
                 pg_loss=round(metrics.get("actor/pg_loss", math.nan), 4))

    def sample(self, g: "Groups", train_batch: Any, step: int, policy_version: int) -> Any:
        """Issue the cut of step `step`'s ``trainer.samples_per_step`` trajectories from its merged training
        batch (a call on the advantage worker, traced); None when the run samples none."""
        n = self._config.trainer.samples_per_step
        if n == 0:
            return None
        if not hasattr(g.advantage, "sample_trajectories"):  # an advantage class of one's own without the cut
            if not self._warned_no_sampler:
                log.warning("samples.skipped", reason=f"the advantage worker ({getattr(g.advantage, 'cls', '?')}) "
                            "has no sample_trajectories method; subclass asyncrl.pipelines.AdvantageWorker to get "
                            "samples.jsonl, or set trainer.samples_per_step=0")
                self._warned_no_sampler = True
            return None
        call = stages.sample_trajectories(g, train_batch, n=n, seed=self._config.trainer.seed * 1_000_003 + step,
                                          policy_version=policy_version)
        return self._tracer.watch(call, "sample_trajectories", step=step)

    async def samples(self, step: int, rows: Awaitable[list[dict[str, Any]]] | None) -> dict[str, float]:
        """Write step `step`'s sampled trajectories (awaited here, decoded and written in a thread); returns
        ``{"time/samples": seconds the train loop spent on them}`` ({} when the step samples none)."""
        if rows is None:
            return {}
        return {"time/samples": await self._write_samples(step, rows)}

    async def _write_samples(self, step: int, rows: Awaitable[list[dict[str, Any]]]) -> float:
        t0 = time.perf_counter()
        try:
            got = await rows
            if self.sampler is not None:
                await anyio.to_thread.run_sync(self.sampler.write, step, got)
        except Exception as e:  # an observation: a failure to record samples never stops the run
            log.warning("samples.failed", step=step, error=repr(e))
            return math.nan
        return time.perf_counter() - t0

    def evaluation(self, version: int, row: dict[str, Any]) -> None:
        """An evaluation of `version` (its step: steps done = version)."""
        if self.metrics is not None:
            self.metrics.write(version, row)

    async def finish(self, history: list[dict[str, Any]], evaluator: Evaluator | None) -> None:
        """Close the bar; write the trace and the plot of `history` and `evaluator`'s evaluations (failures are
        logged: reports never hide the run's own outcome)."""
        cfg = self._config.trainer
        if self.bar is not None:
            self.bar.close()
        try:
            if cfg.trace:
                await anyio.to_thread.run_sync(self._tracer.write, self._out / "trace.json")
            if cfg.plot and history:
                evals = list(evaluator.records) if evaluator is not None else None
                # in a child process: matplotlib holds the GIL for long stretches (see report.py)
                await draw_report(list(history), list(self._tracer.spans), self._out / "report.png", evals=evals)
        except Exception as e:
            log.warning("report.failed", error=repr(e))

    def close(self) -> None:
        """Close the metrics sinks (idempotent; with W&B, blocks while it finishes its run: the trainer's
        ``close`` calls it once, at the end, where every path must reach it)."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
