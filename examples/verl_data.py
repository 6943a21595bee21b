"""Write a toy verl-format dataset and a tiny model directory, for the README's "your data" commands.

    .venv/bin/python examples/verl_data.py            # writes train.parquet and my_model/ here

The Parquet file has verl's columns (``data_source``, ``prompt`` as chat messages,
``reward_model.ground_truth``, ``extra_info``); the model directory is a tiny Qwen2 built from a
config, with a chat template, saved as a local Hugging Face directory. Use your own instead.
"""

from __future__ import annotations

import sys

import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.roles.modeling.models import ModelConfig, build_model, load_tokenizer, save_model_dir


def main(data: str = "train.parquet", model_dir: str = "my_model") -> None:
    """Write `data` (8 prompts "say <word>", answer <word>) and `model_dir`."""
    words = ["cat", "dog", "sun", "sea", "red", "blue", "tree", "bird"]
    rows = [{"data_source": "toy/echo", "prompt": [{"role": "user", "content": f"say {w}"}],
             "reward_model": {"style": "rule", "ground_truth": w}, "extra_info": {"index": i, "split": "train"}}
            for i, w in enumerate(words)]
    pq.write_table(pa.Table.from_pylist(rows), data)
    tok = load_tokenizer("tiny")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    save_model_dir(build_model(ModelConfig(seed=0), tok), tok, model_dir)
    print(f"wrote {data} and {model_dir}/")


if __name__ == "__main__":
    main(*sys.argv[1:3])
