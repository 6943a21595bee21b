"""Small dataset files, a verl-style reward file and a tiny model directory with a chat template,
written by the tests themselves (no hub, no network)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
"""A minimal chat template: ``<role>content`` lines, then ``<assistant>``."""

ROWS: list[dict[str, Any]] = [
    {"data_source": "toy/add" if i % 2 == 0 else "toy/mul",
     "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"what is {i} + {i}?"}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
     "extra_info": {"index": i, "split": "train"}}
    for i in range(6)
]
"""Six verl-format rows (prompt as chat messages, the answer in ``reward_model.ground_truth``)."""


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_hf_disk(path: Path, rows: list[dict[str, Any]]) -> Path:
    """The layout ``datasets.Dataset.save_to_disk`` writes: Arrow stream shards named in state.json."""
    import pyarrow as pa

    path.mkdir()
    table = pa.Table.from_pylist(rows)
    half = len(rows) // 2  # two shards, read back in order
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, part in zip(names, (table.slice(0, half), table.slice(half))):
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(part)
    (path / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": "train"}))
    (path / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    return path


WRITERS = {"jsonl": ("train.jsonl", write_jsonl), "parquet": ("train.parquet", write_parquet),
           "hf_disk": ("train_ds", write_hf_disk)}


def write(fmt: str, directory: Path, rows: list[dict[str, Any]] = ROWS) -> Path:
    """`rows` written in format `fmt` (``jsonl``, ``parquet``, ``hf_disk``) under `directory`."""
    name, writer = WRITERS[fmt]
    return writer(directory / name, rows)


VERL_REWARD = '''
import json
import os


def compute_score(data_source, solution_str, ground_truth, extra_info=None, log=None, bonus=0.0):
    """verl's custom reward signature: one row per call."""
    if log is not None:
        with open(log, "a") as f:
            f.write(json.dumps({"data_source": data_source, "solution_str": solution_str,
                                "ground_truth": ground_truth, "extra_info": extra_info}) + "\\n")
    return {"score": float(ground_truth) / 8.0 + bonus, "acc": True}


def explodes(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "toy/mul":
        raise ValueError("cannot score this")
    return 1.0


def batch_reward(x):
    """asyncrl's batch signature."""
    return [float(len(a)) for a in x.answers]


def two_args(a, b):
    return 0.0


NOT_A_FUNCTION = 3
'''


def write_reward_file(path: Path) -> Path:
    path.write_text(VERL_REWARD)
    return path


def write_model_dir(path: Path) -> Path:
    """A tiny Qwen2 saved as a Hugging Face directory with the tiny tokenizer and :data:`TEMPLATE`."""
    from asyncrl.roles.modeling.models import ModelConfig, build_model, save_model_dir, tiny_tokenizer

    tok = copy.deepcopy(tiny_tokenizer())  # the tiny tokenizer is cached: never change the shared one
    tok.chat_template = TEMPLATE
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    intermediate_size=64, seed=0), tok)
    save_model_dir(model, tok, str(path))
    return path
