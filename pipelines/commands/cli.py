"""``asyncrl train`` (the main job), ``asyncrl replay`` (re-run a run from its journal), ``asyncrl export``
(a run's policy as a Hugging Face model directory) and ``asyncrl view`` (a page of a run's curves, timeline
and sampled trajectories).

::

    asyncrl train                                  # GRPO on the toy task, tiny model, local Ray, CPU
    asyncrl train --config run.yaml trainer.steps=60 actor.lr=1e-3
    asyncrl train --resume runs/grpo_toy           # continue that run, in that directory
    asyncrl replay runs/grpo_toy                   # the same run again from its journal, bit for bit
    asyncrl export runs/grpo_toy --out policy_hf   # the trained policy as a Hugging Face model directory
    asyncrl view runs/grpo_toy                     # its curves, timeline and trajectories at http://127.0.0.1:8765/
    asyncrl ledger runs/grpo_toy                   # every sample trained once or dropped with a reason, in the bound
    asyncrl profile runs/a runs/b --out mine.yaml  # a twin profile fitted to real runs (docs/scale.md)
    asyncrl plan qwen2_7b_h100_vllm --gpus 64      # the best configurations on 64 GPUs, from short twin runs

Every setting is checked (unknown keys, impossible values, unregistered reward functions
and engines, missing paths, a resume from another config, corrupt checkpoint files)
before Ray or any worker starts; the pools are checked against the cluster right after
Ray starts, before any worker does. The run writes ``metrics.jsonl`` (and TensorBoard
scalars when installed), ``journal.jsonl``, ``trace.json`` (open in ui.perfetto.dev),
``report.png`` and checkpoints under ``trainer.output_dir``.

Failures end the process with a one-line message that names the problem and what to do,
and a non-zero status: 2 for a config or checkpoint error, 1 when the run failed (the full
traceback goes to ``<output_dir>/error.log``), 130/143 when SIGINT/SIGTERM stopped it (the
first signal finishes the step in progress and writes a checkpoint; the message gives the
command that resumes it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

import asyncrl
from asyncrl.pipelines.checkpoints import checkpoint as ckpt
from asyncrl.pipelines.checkpoints.export import export_policy
from asyncrl.pipelines.datasets.datafiles import check_code_digests
from asyncrl.pipelines import configlib
from asyncrl.pipelines.job.config import ConfigError, JobConfig, config_fingerprint
from asyncrl.pipelines.job.presets import PRESETS, load_config
from asyncrl.pipelines.journaling.journal import JournalError
from asyncrl.pipelines.journaling.ledger import check_ledger, read_samples
from asyncrl.pipelines.commands.replay import replay
from asyncrl.pipelines.trainers.trainer import make_trainer
from asyncrl.pipelines.observe import viewer
from asyncrl.pipelines.supervision.interrupt import RunAbandoned
from asyncrl.pipelines.supervision.recovery import describe, is_worker_fault
from asyncrl.pipelines.commands.fit import write_fitted
from asyncrl.pipelines.commands.plan import STEP_WALL_S, run_plan
from asyncrl.roles import RolesError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The ``asyncrl`` argument parser."""
    p = argparse.ArgumentParser(prog="asyncrl", description="asyncrl: async RL post-training on Ray")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run a training job (GRPO on a toy task by default)",
                       description="Run a training job. Settings: a preset (or, with --resume, the run's own "
                                   "config), then --config YAML, then key=value.")
    t.add_argument("--config", metavar="FILE", help="YAML file with settings (sections as in JobConfig)")
    t.add_argument("--preset", default=None, help="starting config (grpo_toy, ppo_toy, grpo_smollm_arith, "
                   "grpo_smollm_arith_vllm); default grpo_toy")
    t.add_argument("--resume", metavar="RUN", help="continue RUN (a run directory, or one of its checkpoints) "
                                                   "with its own config, writing into RUN")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.steps=20")
    r = sub.add_parser("replay", help="re-run a run from its journal and check it reaches the same weights",
                       description="Re-run RUN from RUN/journal.jsonl: every batch is generated with the weight "
                                   "version the original run used, and the final weights and per-step metrics "
                                   "are compared with the original's. Exit 0 when identical, 1 when not.")
    r.add_argument("run", metavar="RUN", help="the run directory (holding journal.jsonl and metrics.jsonl)")
    r.add_argument("--output-dir", metavar="DIR", help="where the replay writes its outputs (default RUN/replay)")
    r.add_argument("--progress", action="store_true", help="show a progress bar")
    e = sub.add_parser("export", help="write a run's trained policy as a Hugging Face model directory",
                       description="Write the policy of one of RUN's checkpoints (verified against its manifest) as "
                                   "a Hugging Face model directory: config.json, generation_config.json, "
                                   "model.safetensors and the tokenizer files, for AutoModelForCausalLM / "
                                   "AutoTokenizer.from_pretrained(DIR).")
    e.add_argument("run", metavar="RUN", help="the run directory (its trainer.output_dir, holding checkpoints/)")
    e.add_argument("--step", type=int, metavar="N", help="export the checkpoint taken after N steps "
                                                         "(default: the newest complete one)")
    e.add_argument("--out", required=True, metavar="DIR", help="the directory to write (must not exist or be empty)")
    e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the exported weights (default: as stored in the checkpoint)")
    e.add_argument("--force", action="store_true", help="overwrite DIR when it exists and is not empty")
    e.add_argument("--adapter", action="store_true", help="a LoRA run: write its peft adapter (adapter_config.json, "
                                                          "adapter_model.safetensors) instead of the merged model")
    v = sub.add_parser("view", help="look at runs: metric curves, the overlap timeline and sampled trajectories",
                       description="Serve a page of one or more runs on this machine (it updates while a run "
                                   "trains), or write it as one self-contained HTML file with --out.")
    v.add_argument("runs", nargs="+", metavar="RUN", help="run directories (their trainer.output_dir)")
    v.add_argument("--out", metavar="FILE.html", help="write the page to FILE.html (works offline) instead of serving")
    v.add_argument("--port", type=int, default=8765, help="port to serve on (default 8765; 0 picks a free one)")
    v.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; the page shows model output)")
    g = sub.add_parser("ledger", help="check a run's per-sample ledger: nothing lost, nothing trained twice, "
                                      "every trained token within the staleness bound",
                       description="Read RUN's journal and ledger.jsonl and check every sample: admitted, then "
                                   "trained once or dropped with its reason. Exit 0 when the ledger holds, 1 "
                                   "when not (the offending samples are named), 2 when RUN has no journal.")
    g.add_argument("run", metavar="RUN", help="the run directory (holding journal.jsonl)")
    g.add_argument("--samples", metavar="FILE.jsonl", help="also write one line per sample to FILE.jsonl")
    g.add_argument("--unfinished", action="store_true", help="check a run that has not ended (no end record)")
    f = sub.add_parser("profile", help="fit a cluster-twin profile to real runs (their trace.json and ledger)",
                       description="Fit the twin's cost model (docs/scale.md) to real runs and write it as a profile "
                                   "YAML with the source of every number; batch-mode runs give the rollout costs. "
                                   "Exit 2 when a run cannot be fitted.")
    f.add_argument("runs", nargs="+", metavar="RUN", help="run directories (holding journal.jsonl, trace.json, "
                                                           "ledger.jsonl)")
    f.add_argument("--out", required=True, metavar="FILE.yaml", help="the profile to write")
    f.add_argument("--name", help="the profile's name (default fitted_<first run>)")
    f.add_argument("--skip", type=int, default=1, metavar="N", help="warm-up steps left out (default 1)")
    f.add_argument("--devices", choices=("separate", "shared"), default="separate",
                   help="separate (default): a device per simulated GPU, costs slept; shared: a twin of CPU runs on "
                        "this machine, costs burned on its shared cores (fit runs at trainer.max_staleness=0)")
    f.add_argument("--twins", nargs="+", metavar="TWIN_RUN", default=None,
                   help="devices shared: twin runs of the RUNs (in order) made with a shared profile of them, to "
                        "calibrate devices.work_per_s (the work in each measured second)")
    n = sub.add_parser("plan", help="the best configurations for a GPU budget, from short cluster-twin runs",
                       description="Search the rollout/training split, max_staleness, the rollout mode and the "
                                   "concurrency with short twin runs of PROFILE (docs/scale.md) and print the best "
                                   "few: predicted tokens/s, the trainer's idle fraction and the (G+T)/max(G,T) "
                                   "ceiling.")
    n.add_argument("profile", metavar="PROFILE", help="a shipped profile name or a profile YAML file")
    n.add_argument("--gpus", type=int, required=True, help="the GPU budget (rollout + training)")
    n.add_argument("--batch-size", type=int, default=1024, help="responses per step (default 1024)")
    n.add_argument("--group-size", type=int, default=8, help="responses per prompt (default 8)")
    n.add_argument("--steps", type=int, default=5, help="steps per twin run, 2 of them warm-up (default 5)")
    n.add_argument("--top", type=int, default=5, help="configurations printed (default 5)")
    n.add_argument("--step-s", type=float, default=STEP_WALL_S, metavar="S",
                   help=f"wall seconds a simulated step is scaled to last (default {STEP_WALL_S:g}; longer: the "
                        "controller's own overhead and the machine's load weigh less, each run takes longer)")
    n.add_argument("--brute-force", action="store_true", help="run every candidate instead of the search")
    n.add_argument("--out-dir", metavar="DIR", help="where the twin runs go (default: a temporary directory)")
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


def _say(prog: str, text: str) -> None:
    print(f"{prog}: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``asyncrl``; returns the exit status."""
    args = build_parser().parse_args(argv)
    _configure_logging()
    if args.command == "replay":
        return _replay(args)
    if args.command == "export":
        return _export(args)
    if args.command == "view":
        return _view(args)
    if args.command == "ledger":
        return _ledger(args)
    if args.command == "profile":
        return _profile(args)
    if args.command == "plan":
        return _plan(args)
    return _train(args)


def _plan(args: argparse.Namespace) -> int:
    """``asyncrl plan``: exit 0 with the table printed, 2 on a bad profile or budget."""
    try:
        print(run_plan(args.profile, args.gpus, batch_size=args.batch_size, group_size=args.group_size,
                       steps=args.steps, top=args.top, brute=args.brute_force, out_dir=args.out_dir,
                       step_s=args.step_s,
                       say=lambda line: print(line, file=sys.stderr, flush=True)))
    except (ConfigError, ValueError) as e:
        _say("asyncrl plan", str(e))
        return 2
    return 0


def _profile(args: argparse.Namespace) -> int:
    """``asyncrl profile``: exit 0 with the profile written, 2 when the runs cannot be fitted."""
    try:
        p = write_fitted(args.runs, args.out, name=args.name, skip=args.skip, devices=args.devices, twins=args.twins)
    except (ConfigError, OSError) as e:
        _say("asyncrl profile", str(e))
        return 2
    r, t = p.rollout, p.training
    print(f"wrote {args.out}: decoding step {r.decode_base_ms:.3f} ms + {r.decode_ms_per_seq:.4f} ms per row, "
          f"forward {2 * p.model.params_b * 1e9 / (t.peak_tflops * t.mfu * 1e12) * 1e6:.3f} us per token, "
          f"{int(sum(p.lengths.counts))} response lengths; run it with twin.profile={args.out}")
    return 0


def _ledger(args: argparse.Namespace) -> int:
    """``asyncrl ledger``: exit 0 when the ledger holds, 1 when not, 2 when RUN has no readable journal."""
    import json


    try:
        report = check_ledger(args.run, finished=not args.unfinished)
        if args.samples:
            samples = read_samples(args.run)[0]
            Path(args.samples).write_text("".join(json.dumps(s.as_dict()) + "\n" for _, s in sorted(samples.items())))
    except (JournalError, OSError) as e:
        _say("asyncrl ledger", str(e))
        return 2
    print(report.render())
    return 0 if report.ok else 1


def _view(args: argparse.Namespace) -> int:
    """``asyncrl view``: exit 0 after writing --out or when the server is stopped; 2 on a path that is not
    a run, or a port that is taken."""
    import errno


    try:
        data = viewer.load_runs(args.runs)
    except viewer.RunError as e:
        _say("asyncrl view", str(e))
        return 2
    for path, run in zip(args.runs, data["runs"]):
        st = run["status"]
        if not st["complete"] or st["skipped_metrics"] or st["skipped_samples"]:
            state = "is still being written" if not st["complete"] else "has unreadable lines"
            _say("asyncrl view", f"{path} {state}; showing what exists: {viewer.describe(run)}")
    if args.out is not None:
        out = Path(args.out)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(viewer.render_html(data), encoding="utf-8")  # then renamed: never a half-written page
            os.replace(tmp, out)
        except OSError as e:
            if tmp.parent.is_dir():
                tmp.unlink(missing_ok=True)
            _say("asyncrl view", f"cannot write {out}: {e.strerror or e}; pass another --out")
            return 2
        print(f"asyncrl view: wrote {out} ({out.stat().st_size / 1e6:.1f} MB); open it in a browser", file=sys.stderr)
        return 0
    try:
        viewer.serve(args.runs, host=args.host, port=args.port)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            _say("asyncrl view", f"cannot listen on {args.host}:{args.port} ({e.strerror}); "
                                 "pass another port with --port N (0 picks a free one)")
            return 2
        raise
    return 0


def _resolve(args: argparse.Namespace) -> tuple[Any, Path | None]:
    """The run's config and the checkpoint to resume from. With ``--resume RUN`` the base is the
    config saved in RUN's checkpoint and the outputs go to RUN (unless an override says otherwise)."""
    if args.resume is None:
        preset = args.preset or "grpo_toy"
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
        return load_config(args.config, args.overrides, base=PRESETS[preset]()), None
    if args.preset is not None:
        raise ConfigError("--preset does not apply to --resume: the run's checkpoint holds its config; drop "
                          "--preset (settings that may change on resume, like trainer.steps, go as key=value)")
    point = ckpt.resolve_resume(args.resume)
    saved = ckpt.read_state(point).get("config")
    if not isinstance(saved, dict):
        raise ckpt.CheckpointError(f"checkpoint {str(point)!r} holds no config; resume with --config and the "
                                   "run's settings instead")
    # before anything imports the reward/episode/agent files the run names: they must be the ones it ran
    check_code_digests(ckpt.read_state(point).get("code_digests"), saved, f"checkpoint {str(point)!r}")
    base = configlib.from_dict(JobConfig, saved)
    if ckpt.read_state(point).get("fingerprint") != config_fingerprint(base):
        raise ckpt.CheckpointError(f"checkpoint {str(point)!r} was edited: its config does not hash to the fingerprint "
                                   "it records, so it is refused; resume from another checkpoint of the run")
    base.trainer.output_dir = str(point.parent.parent)  # continue in the run's own directory
    return load_config(args.config, args.overrides, base=base), point


def _train(args: argparse.Namespace) -> int:
    import structlog
    import yaml


    prog = "asyncrl train"
    log = structlog.get_logger("asyncrl.pipelines")
    try:
        cfg, point = _resolve(args)
        if args.print_config:
            print(yaml.safe_dump(configlib.to_dict(cfg), sort_keys=False))
            return 0
        trainer = make_trainer(cfg, resume=point)
    except ConfigError as e:
        _say(prog, f"config error: {e}")
        return 2
    t0 = time.perf_counter()
    try:
        history = trainer.fit_sync()
    except RunAbandoned as e:
        if not trainer.history and e.last_checkpoint is None:
            _say(prog, f"interrupted by {e.reason} before the first step finished; every worker was released, "
                       "nothing to resume")
        else:
            _say(prog, f"{e.reason}: the step in progress was abandoned and every worker released. "
                       + _resume_hint(trainer, e.last_checkpoint))
        return 128 + _signum(e.reason)
    except KeyboardInterrupt:
        _say(prog, "interrupted before training started; every worker was released, nothing to resume")
        return 130
    except ConfigError as e:
        _say(prog, f"config error: {e}")
        return 2
    except RolesError as e:  # a missing model extra, a corrupt model file, a prompt that cannot fit
        _say(prog, f"error: {type(e).__name__}: {e}")
        return 2
    except Exception as e:  # the run failed: one line here, the whole story in error.log
        _report_failure(prog, trainer, e)
        return 1
    stop = trainer.interrupted
    if stop is not None:
        _say(prog, f"stopped by {stop.reason} after step {stop.steps_done} of {stop.steps}; checkpoint written to "
                   f"{stop.checkpoint}; every worker released.\n  resume with: asyncrl train --resume "
                   f"{trainer.output_dir}")
        return 128 + _signum(stop.reason)
    wall = time.perf_counter() - t0
    if history:
        first, last = history[0]["reward/mean"], history[-1]["reward/mean"]
        k = min(5, len(history))
        head = sum(h["reward/mean"] for h in history[:k]) / k
        tail = sum(h["reward/mean"] for h in history[-k:]) / k
        log.info("train.done", steps=len(history), reward_first=round(first, 3), reward_last=round(last, 3),
                 reward_first5=round(head, 3), reward_last5=round(tail, 3), wall_s=round(wall, 1),
                 output=str(trainer.output_dir), loop=trainer.event_loop)
    evals = trainer.evaluator.records if trainer.evaluator is not None else []
    if evals:
        key = "eval/accuracy_flexible" if "eval/accuracy_flexible" in evals[0] else "eval/reward_mean"
        log.info("eval.done", metric=key.removeprefix("eval/"),
                 **{f"v{e['eval/version']}": round(e[key], 3) for e in evals})
    return 0


def _signum(name: str) -> int:
    try:
        return int(signal.Signals[name])
    except KeyError:
        return int(signal.SIGINT)


def _resume_hint(trainer: Any, point: Path | None) -> str:
    if point is None:
        return ("No checkpoint was written yet, so the progress of this run is lost (one is written every "
                "trainer.checkpoint_every_s seconds and trainer.checkpoint_every steps; a single Ctrl-C also writes "
                "one).")
    return f"The last checkpoint is {point}.\n  resume with: asyncrl train --resume {trainer.output_dir}"


def _report_failure(prog: str, trainer: Any, error: BaseException) -> None:
    out = Path(trainer.output_dir)
    where = out / "error.log"
    try:
        out.mkdir(parents=True, exist_ok=True)
        where.write_text("".join(traceback.format_exception(error)))
    except OSError:
        where = None  # type: ignore[assignment]
    done = len(trainer.history)
    steps = trainer.config.trainer.steps
    _say(prog, f"error: {describe(error)}")
    lines = [f"the run stopped after {done} of {steps} steps; every worker was released."]
    point = trainer.last_checkpoint
    if point is not None:
        lines.append(f"resume from {point} with: asyncrl train --resume {out}")
    if is_worker_fault(error):
        policy = trainer.config.trainer.restart
        if policy.max_restarts == 0:
            lines.append("a worker process died or hung and this run asked to fail fast "
                         "(trainer.restart.max_restarts=0); leave it at its default (3) to recover from this")
        else:
            lines.append(f"a worker process died or hung after the run had recovered {len(trainer.restarts)} times "
                         f"(trainer.restart.max_restarts={policy.max_restarts}); raise it, or find why workers die "
                         "(the log below)")
    if where is not None:
        lines.append(f"full traceback (with the worker's): {where}")
    print("\n".join("  " + x for x in lines), file=sys.stderr, flush=True)


def _replay(args: argparse.Namespace) -> int:
    prog = "asyncrl replay"
    try:
        result = asyncrl.run(replay(args.run, output_dir=args.output_dir, reporting={"progress": args.progress}))
    except ConfigError as e:
        _say(prog, f"error: {e}")
        return 2
    except KeyboardInterrupt:
        _say(prog, "interrupted")
        return 130
    except Exception as e:
        _say(prog, f"error: {describe(e)}")
        return 1
    if result.identical:
        weights = ("final weights identical (sha256 " + (result.weights_sha256 or "")[:16] + ")"
                   if result.original_weights_sha256 else "the original run recorded no final weights")
        _say(prog, f"replayed {result.steps} steps of {args.run}: same weight version for every batch, "
                   f"every per-step metric identical, {weights}; outputs in {result.output_dir}")
        return 0
    diffs = result.metric_differences
    first = f"; first metric difference at step {diffs[0][0]}: {diffs[0][1]} {diffs[0][2]!r} != {diffs[0][3]!r}" \
        if diffs else ""
    _say(prog, f"replay of {args.run} DIFFERS from the original: weights "
               f"{'identical' if result.weights_sha256 == result.original_weights_sha256 else 'differ'}, "
               f"{len(diffs)} metric differences{first}"
               + ("" if result.versions == result.original_versions else "; batch versions differ"))
    return 1


def _export(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    prog = "asyncrl export"
    hf_logging.disable_progress_bar()  # one line on success, not a bar per file loaded and written
    try:
        result = export_policy(args.run, args.out, step=args.step, dtype=args.dtype, force=args.force,
                               adapter=args.adapter)
    except ConfigError as e:  # CheckpointError included: no run, no such step, a corrupt checkpoint, --out taken
        _say(prog, f"error: {e}")
        return 2
    except RolesError as e:  # the model's tokenizer or files are missing here
        _say(prog, f"error: {type(e).__name__}: {e}")
        return 2
    if result.adapter:
        _say(prog, f"wrote the LoRA adapter of {result.checkpoint} (step {result.step}, {result.dtype}) to "
                   f"{result.out}; load it with peft.PeftModel.from_pretrained(base_model, {str(result.out)!r})")
        return 0
    _say(prog, f"wrote the policy of {result.checkpoint} (step {result.step}, {result.dtype}) to {result.out}; "
               f"load it with AutoModelForCausalLM.from_pretrained({str(result.out)!r})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
