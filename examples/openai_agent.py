"""Bring your own agent: a calculator-tool agent on the ``openai`` client, trained with GRPO on arithmetic.

The agent below is ordinary OpenAI-client code: it never imports asyncrl. The trainer runs it once per row
(``rollout.agent=examples/openai_agent.py:solve``) against the OpenAI-compatible gateway on its rollout
worker; the gateway keeps the exact sampled token ids, log-probs and weight versions of every answer, and the
tokens of what the agent sends back (the tool's results) with ``response_mask`` 0, so only the model's tokens
are trained. The agent's return value is the row's reward.

::

    agent turn:  POST /v1/chat/completions  ─► the rollout engine samples (ids, log-probs, versions kept)
                 "<calc>17*23</calc>"        ◄─
    tool:        the agent evaluates it and sends "<result>391</result>" (mask 0: never trained on)
    answer:      POST /v1/chat/completions  ─► "391"  ─► reward 1.0 when the last number is right

After training, the example reads ``samples.jsonl`` (the trajectories the trainer wrote, see
``asyncrl view``) and prints how often the model called its tool, step by step.

Run (SmolLM2-135M-Instruct, CPU, ``bash scripts/setup.sh smollm`` and ``pip install -e '.[gateway]'`` first)::

    python examples/openai_agent.py                 # 10 steps of 8 rows
    python examples/openai_agent.py --tiny          # a tiny model from a config: the mechanism in ~1 minute
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from openai import AsyncOpenAI

SYSTEM = ("Solve the arithmetic problem. To compute, write <calc>expression</calc> and wait for "
          "<result>value</result>. Then give the answer as a number.")
CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The tool: + - * / and parentheses on numbers, nothing else (never ``eval``)."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only + - * / on numbers")
    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


async def solve(sample, base_url) -> float:
    """The agent: up to 3 turns; a turn with ``<calc>`` gets the tool's result, a turn without one is the answer."""
    client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)  # any key: the URL is the session's
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sample.prompt}]
    text = ""
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        call = CALL.search(text)
        if call is None:
            break
        messages.append({"role": "user", "content": f"<result>{calculate(call.group(1))}</result>"})
    numbers = NUMBER.findall(text)
    return float(bool(numbers) and sample.answer is not None and float(numbers[-1]) == float(sample.answer))


@dataclass
class Args:
    """What one run trains."""

    steps: int = 10
    """Policy updates."""
    tiny: bool = False
    """A tiny Qwen2 from a config (with the Qwen2 tokenizer's chat template) instead of SmolLM2."""
    output_dir: str = "runs/openai_agent"
    """Where the run writes its outputs (``samples.jsonl`` among them)."""


def tool_use(output_dir: str) -> dict[int, float]:
    """``{step: fraction of sampled trajectories that called the tool}`` from the run's ``samples.jsonl``."""
    calls: dict[int, list[bool]] = defaultdict(list)
    path = Path(output_dir) / "samples.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        row = json.loads(line)
        calls[int(row["step"])].append("<calc>" in (row.get("response") or ""))
    return {step: sum(c) / len(c) for step, c in sorted(calls.items())}


def main(args: Args) -> dict[int, float]:
    from asyncrl.pipelines import GRPOTrainer
    from asyncrl.pipelines.job import presets

    cfg = presets.tiny_test() if args.tiny else presets.grpo_smollm_arith()
    if args.tiny:
        cfg.model.tokenizer = "qwen2"  # a tokenizer with a chat template
        cfg.data.task, cfg.data.task_kwargs = "arith", {"levels": [1]}
    cfg.rollout.max_new_tokens = 80  # three turns of at most 24 tokens, plus the tool's results
    # agent rows are padded to the model's context (every rank's batch one width); a token budget cuts each
    # micro-batch to its own rows' width, so the update computes on the conversation, not on the padding
    cfg.actor.max_tokens_per_micro_batch = 1024
    cfg.rollout.agent = f"{Path(__file__).resolve()}:solve"
    cfg.evaluation.every, cfg.evaluation.at_start, cfg.evaluation.at_end = 0, False, False
    cfg.trainer.steps, cfg.trainer.output_dir, cfg.trainer.samples_per_step = args.steps, args.output_dir, 8
    cfg.trainer.progress = False
    history = GRPOTrainer(cfg.validate()).fit_sync()
    used = tool_use(args.output_dir)
    for h in history:
        step = int(h["step"])
        print(f"step {step:3d}  reward {h['reward/mean']:.3f}  tool calls {used.get(step, float('nan')):.2f}")
    return used


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=Args.steps)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--output-dir", default=Args.output_dir)
    a = p.parse_args()
    main(Args(steps=a.steps, tiny=a.tiny, output_dir=a.output_dir))
