"""Held-out evaluation inside the trainer: greedy generation on a fixed evaluation set.

::

    rollout loop (after loading version v)            fit() after the last step
        │ due(v)?  (v = 0 with at_start; the next        │ at_end and the final version not evaluated:
        │  multiple of `every` reached)                  │ load the final weights into the rollout group
        ▼                                                ▼
    rollout.generate(eval prompts, temperature=0) ─► reward.compute_reward
        ─► controller: decode (thread) ─► task.eval_metrics(responses, answers)
        ─► metrics.jsonl row {"kind": "eval", "step": v, "eval/..."} + TensorBoard + report.png
           + eval_samples.jsonl (a few responses per evaluation)

The evaluation runs on the rollout workers with the weights they hold, so it measures
exactly version ``v`` (every generated row carries its version, and the evaluator checks
it). It takes the rollout workers for its duration (rollout of the next batch waits) and
uses its own sampling seed, so it never changes what training computes: a run with
evaluation ends with the same weights as one without.

Metrics (``eval/`` prefix): ``reward_mean`` (the task's reward function), the task's own
metrics (``arith``: ``accuracy_flexible``, ``accuracy_strict``, ``format``), ``response_length``
(mean tokens), ``truncated`` (fraction that hit ``max_new_tokens`` without EOS),
``version`` and ``time``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable

import anyio
import structlog

from asyncrl.roles.fields import MAX_ROWS, MAX_SEED, Range, Section
from asyncrl.pipelines.datasets.data import get_task, make_loader, task_pairs
from asyncrl.pipelines.configlib import ConfigError

__all__ = ["EvalConfig", "Evaluator"]

log = structlog.get_logger("asyncrl.pipelines")


@dataclass(kw_only=True)
class EvalConfig(Section):
    """Held-out evaluation (greedy decoding) of the policy during training."""

    every: Annotated[int, Range(ge=0, says=">= 0 (0 = off)")] = 0
    """Evaluate every this many steps (policy versions); 0 = no periodic evaluation."""
    at_start: bool = False
    """Evaluate the initial weights (version 0) before the first batch is generated."""
    at_end: bool = False
    """Evaluate the final weights after the last step."""
    num_prompts: Annotated[int, Range(ge=1, le=MAX_ROWS)] = 64
    """Prompts in the evaluation set (the task's held-out set when it has one)."""
    seed: Annotated[int, Range(ge=0, le=MAX_SEED)] = 0
    """Seed of the evaluation set (fixed across runs; independent of ``trainer.seed``)."""
    max_new_tokens: Annotated[int, Range(ge=1, le=1 << 20)] | None = None
    """Response length of an evaluation; None uses ``rollout.max_new_tokens``."""
    num_samples: Annotated[int, Range(ge=0, le=MAX_ROWS)] = 4
    """Responses per evaluation written to ``eval_samples.jsonl`` (0 = none)."""

    @property
    def enabled(self) -> bool:
        """True when any evaluation is scheduled."""
        return self.every > 0 or self.at_start or self.at_end

    def validate(self) -> None:
        """Raise ``ConfigError`` for impossible values."""
        if self.every < 0:
            raise ConfigError(f"evaluation.every must be >= 0 (0 = off), got {self.every}")
        if self.num_prompts < 1:
            raise ConfigError(f"evaluation.num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"evaluation.max_new_tokens must be >= 1 or null, got {self.max_new_tokens}")
        if self.num_samples < 0:
            raise ConfigError(f"evaluation.num_samples must be >= 0, got {self.num_samples}")


class Evaluator:
    """Runs and records the evaluations of one training run.

    Args:
        config: when and on how many prompts to evaluate.
        data: the run's ``DataConfig`` (task, task kwargs, chat template).
        tokenizer: the policy's tokenizer (prompts are tokenized and responses decoded on the controller).
        max_new_tokens: the rollout's response length (used when ``config.max_new_tokens`` is None).
        output_dir: the run directory (``eval_samples.jsonl`` goes there).
    """

    def __init__(self, config: EvalConfig, data: Any, tokenizer: Any, *, max_new_tokens: int,
                 output_dir: str | Path) -> None:
        self.config = config
        self.task = get_task(data.task)
        self.tokenizer = tokenizer
        self.pairs = task_pairs(data, config.seed, split="eval", num_prompts=config.num_prompts)
        self.loader = make_loader(data, tokenizer, self.pairs, prompts_per_step=len(self.pairs), group_size=1,
                                  seed=0, shuffle=False)
        self.max_new_tokens = config.max_new_tokens or max_new_tokens
        self.samples_path = Path(output_dir) / "eval_samples.jsonl"
        self.records: list[dict[str, Any]] = []
        """One row per evaluation: ``{"kind": "eval", "step": version, "eval/...": value}``."""

    def check_fits(self, context_length: int) -> None:
        """Raise ``PromptTooLongError`` when an evaluation prompt + response does not fit the context."""
        self.loader.check_fits(context_length, self.max_new_tokens, what="evaluation set")

    # ---- schedule --------------------------------------------------------------------------------

    def _evaluated(self) -> set[int]:
        return {int(r["eval/version"]) for r in self.records}

    def due(self, version: int) -> bool:
        """True when the rollout workers' `version` should be evaluated now: version 0 with
        ``at_start``, or the first loaded version at or past the next multiple of ``every``."""
        done = self._evaluated()
        if version in done:
            return False
        if version == 0:
            return self.config.at_start
        every = self.config.every
        if every <= 0:
            return False
        last = max((v for v in done if v > 0), default=0)
        return version // every > last // every

    def due_final(self, version: int) -> bool:
        """True when ``at_end`` asks for the final `version` and it has not been evaluated."""
        return self.config.at_end and version not in self._evaluated()

    def restore(self, records: list[dict[str, Any]], step: int) -> None:
        """Keep the evaluations of versions before `step` (a resumed or restarted run re-evaluates the rest)."""
        self.records = [r for r in records if int(r["eval/version"]) < step]

    # ---- one evaluation --------------------------------------------------------------------------

    async def run(self, groups: Any, version: int, *, watch: Callable[..., Any] | None = None) -> dict[str, Any]:
        """Evaluate the weights the rollout group holds (which must be `version`); returns the
        recorded row (also appended to :attr:`records`)."""
        t0 = time.perf_counter()
        batch = await anyio.to_thread.run_sync(self.loader.batch, 0)  # off the loop: evaluation.num_prompts rows
        gen = groups.rollout.generate(batch, max_new_tokens=self.max_new_tokens, temperature=0.0,
                                      seed=self.config.seed)
        if watch is not None:
            gen = watch(gen, "eval_generate", version=version)
        sc = groups.reward.compute_reward(gen)
        if watch is not None:
            sc = watch(sc, "eval_score", version=version)
        td = await gen
        scores = (await sc)["scores"]
        versions = sorted({int(v) for v in td["version"].tolist()})
        if versions != [version]:
            raise RuntimeError(f"evaluation of version {version} was generated with weights {versions}; the rollout "
                               "group must hold exactly the evaluated version")
        row, samples = await anyio.to_thread.run_sync(self._score, td, scores, version, time.perf_counter() - t0)
        self.records.append(row)
        if samples:
            await anyio.to_thread.run_sync(self._write_samples, samples)
        log.info("eval", version=version, **{k.removeprefix("eval/"): round(v, 4) for k, v in row.items()
                                             if k.startswith("eval/") and isinstance(v, float)})
        return row

    def _score(self, td: Any, scores: Any, version: int, seconds: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        ids, mask = td["response_ids"], td["response_mask"].bool()
        rows = [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]
        responses = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        answers = [a for _, a in self.pairs]
        eos = self.tokenizer.eos_token_id
        R = ids.shape[1]
        truncated = sum(1 for r in rows if len(r) >= R and (not r or r[-1] != eos))
        row: dict[str, Any] = {"kind": "eval", "eval/version": version,
                               "eval/reward_mean": float(scores.float().mean())}
        if self.task.eval_metrics is not None:
            row.update({f"eval/{k}": float(v) for k, v in self.task.eval_metrics(responses, answers).items()})
        n = max(1, len(rows))
        row.update({"eval/response_length": sum(len(r) for r in rows) / n, "eval/truncated": truncated / n,
                    "eval/num_prompts": len(rows), "eval/time": seconds})
        k = min(self.config.num_samples, len(rows))
        samples = [{"version": version, "prompt": self.pairs[i][0], "answer": answers[i], "response": responses[i],
                    "score": float(scores[i])} for i in range(k)]
        return row, samples

    def _write_samples(self, samples: list[dict[str, Any]]) -> None:
        self.samples_path.parent.mkdir(parents=True, exist_ok=True)
        with self.samples_path.open("a") as f:
            for s in samples:
                f.write(json.dumps(s) + "\n")
