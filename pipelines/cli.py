"""``asyncrl train``: the main job.

::

    asyncrl train                                  # GRPO on the toy task, tiny model, local Ray, CPU
    asyncrl train --config run.yaml trainer.steps=60 actor.lr=1e-3
    asyncrl train --resume runs/grpo_toy           # continue from the newest checkpoint

Every setting is checked (unknown keys, impossible sizes, a resume from another
config) before Ray or any worker starts; the pools are checked against the cluster
right after Ray starts, before any worker does. The run writes ``metrics.jsonl``
(and TensorBoard scalars when installed), ``trace.json`` (open in ui.perfetto.dev),
``report.png`` (reward curve and overlap timeline; needs matplotlib) and checkpoints
under ``trainer.output_dir``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The ``asyncrl`` argument parser."""
    p = argparse.ArgumentParser(prog="asyncrl", description="asyncrl: async RL post-training on Ray")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run a training job (GRPO on a toy task by default)",
                       description="Run a training job. Settings: a preset, then --config YAML, then key=value.")
    t.add_argument("--config", metavar="FILE", help="YAML file with settings (sections as in JobConfig)")
    t.add_argument("--preset", default="grpo_toy", help="starting config (grpo_toy, ppo_toy, grpo_smollm_arith, "
                   "grpo_smollm_arith_vllm); default grpo_toy")
    t.add_argument("--resume", metavar="DIR", help="checkpoint directory or run directory to continue from")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.steps=20")
    return p


class _StderrLogger:
    """Writes each rendered line to the *current* ``sys.stderr`` (it may be swapped, e.g. by pytest)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def _configure_logging() -> None:
    import structlog

    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="%H:%M:%S"),
                    structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=lambda *args: _StderrLogger(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``asyncrl``; returns the exit status."""
    args = build_parser().parse_args(argv)
    _configure_logging()
    import structlog
    import yaml

    from asyncrl.pipelines import configlib
    from asyncrl.pipelines.config import ConfigError, load_config
    from asyncrl.pipelines.presets import PRESETS
    from asyncrl.pipelines.trainer import make_trainer
    from asyncrl.roles import RolesError

    log = structlog.get_logger("asyncrl.pipelines")
    try:
        if args.preset not in PRESETS:
            raise ConfigError(f"unknown preset {args.preset!r}; known: {sorted(PRESETS)}")
        cfg = load_config(args.config, args.overrides, base=PRESETS[args.preset]())
        if args.print_config:
            print(yaml.safe_dump(configlib.to_dict(cfg), sort_keys=False))
            return 0
        trainer = make_trainer(cfg, resume=args.resume)
    except ConfigError as e:
        print(f"asyncrl train: config error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        history = trainer.fit_sync()
    except KeyboardInterrupt:
        print("asyncrl train: interrupted; the workers were released", file=sys.stderr)
        return 130
    except ConfigError as e:
        print(f"asyncrl train: config error: {e}", file=sys.stderr)
        return 2
    except RolesError as e:  # a missing model extra, a corrupt model file, a prompt that cannot fit
        print(f"asyncrl train: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    if history:
        first, last = history[0]["reward/mean"], history[-1]["reward/mean"]
        k = min(5, len(history))
        head = sum(h["reward/mean"] for h in history[:k]) / k
        tail = sum(h["reward/mean"] for h in history[-k:]) / k
        log.info("train.done", steps=len(history), reward_first=round(first, 3), reward_last=round(last, 3),
                 reward_first5=round(head, 3), reward_last5=round(tail, 3), wall_s=round(wall, 1),
                 output=str(trainer.output_dir))
    evals = trainer.evaluator.records if trainer.evaluator is not None else []
    if evals:
        key = "eval/accuracy_flexible" if "eval/accuracy_flexible" in evals[0] else "eval/reward_mean"
        log.info("eval.done", metric=key.removeprefix("eval/"),
                 **{f"v{e['eval/version']}": round(e[key], 3) for e in evals})
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
