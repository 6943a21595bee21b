"""TRL's side of benchmarks/vs_trl.py: GRPO with TRL's ``GRPOTrainer``, run in TRL's own venv.

    .venv-trl/bin/python benchmarks/_trl_grpo.py SPEC.json OUT.json

SPEC (written by vs_trl.py from asyncrl's own data loader) holds the model directory, the
training prompts in asyncrl's order (text, answer and asyncrl's chat-template token ids), the
held-out prompts and the settings. TRL gets the prompts as chat messages in that order
(``shuffle_dataset=False``) and applies the same chat template; this script checks that TRL's
token ids are asyncrl's before it trains. The reward is asyncrl's ``arith`` (its pure module
``roles/scoring/arithmetic.py``, loaded by path: asyncrl itself is not installed here). OUT gets the
seconds of each step (a callback's wall clock from one step's end to the next), the mean reward
per step and the held-out greedy accuracy at the end, with the wall clock it was reached at.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("asyncrl_arithmetic", ROOT / "roles" / "scoring" / "arithmetic.py")
arithmetic = importlib.util.module_from_spec(_spec)
sys.modules["asyncrl_arithmetic"] = arithmetic  # dataclasses look their module up
_spec.loader.exec_module(arithmetic)


class StepClock(TrainerCallback):
    """Wall-clock time at the end of each optimizer step."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
        self.ends.append(time.perf_counter())


def held_out_accuracy(model, tok, prompts: list[dict], max_new_tokens: int) -> float:  # noqa: ANN001
    """Greedy, one response per held-out prompt; the fraction whose last number is the answer."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p["ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            correct += arithmetic.compute_score(text, p["answer"], method="flexible", format_score=0.0) == 1.0
    model.train()
    return correct / len(prompts)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    torch.manual_seed(spec["seed"])
    torch.set_num_threads(spec["threads"])
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    for p in spec["train"] + spec["held_out"]:  # the same chat-template token ids as asyncrl's
        ids = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                      tokenize=False)
        mine = tok(ids, add_special_tokens=False)["input_ids"]
        if mine != p["ids"]:
            raise SystemExit(f"TRL's chat-template token ids differ from asyncrl's for {p['prompt'][:60]!r}: "
                             f"{mine[:12]}... vs {p['ids'][:12]}...")
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p["prompt"]}], "answer": p["answer"]}
                            for p in spec["train"]])

    def arith(completions, answer, **kwargs):  # noqa: ANN001, ANN003
        """asyncrl's ``arith`` reward (flexible: the last number; no format reward)."""
        return [arithmetic.compute_score(c[0]["content"], a, method="flexible", format_score=0.0)
                for c, a in zip(completions, answer)]

    s = spec["settings"]
    cfg = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=s["steps"], per_device_train_batch_size=s["prompts"] * s["group"],
        num_generations=s["group"], max_completion_length=s["max_new_tokens"], temperature=s["temperature"],
        top_k=0, top_p=1.0, learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, beta=0.0,
        num_iterations=1, loss_type="dapo",  # dapo = verl's token-mean, asyncrl's default loss_agg_mode
        max_grad_norm=s["max_grad_norm"], gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        shuffle_dataset=False, seed=spec["seed"], logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=arith, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[clock])
    clock.t0 = time.perf_counter()
    trainer.train()
    t_train = time.perf_counter()
    acc = held_out_accuracy(trainer.model, tok, spec["held_out"], s["max_new_tokens"]) if spec["held_out"] else None
    ends = [clock.t0, *clock.ends]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    out_path.write_text(json.dumps({
        "step_s": [b - a for a, b in zip(ends, ends[1:])], "reward": rewards,
        "train_s": t_train - clock.t0, "accuracy": acc, "eval_s": time.perf_counter() - t_train,
        "torch_threads": torch.get_num_threads(), "trl": __import__("trl").__version__,
    }))


if __name__ == "__main__":
    main()
