#!/usr/bin/env bash
# GPU check of the vLLM engine (a GPU machine WITH network or a wheelhouse; the offline device machine
# cannot hold vLLM: use benchmarks/gpu_check.sh there): the same contract test as on CPU, then the throughput benchmark.
#
# On a machine with an NVIDIA GPU, from the repository root:
#   bash benchmarks/vllm_gpu_check.sh                      # makes .venv-vllm-gpu and pip-installs vllm (network)
#   WHEELHOUSE=/path/to/wheels bash benchmarks/vllm_gpu_check.sh   # offline: pip --no-index --find-links
#   VENV=/existing/venv SKIP_INSTALL=1 bash benchmarks/vllm_gpu_check.sh   # an environment that already has vllm
#
# Prints the measured log-prob differences (pytest -s) and writes
#   benchmarks/results/vllm_gpu_check.log, benchmarks/results/rollout_throughput_gpu.md
# (also copied to $OUT when it is set).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-vllm-gpu}
VLLM_SPEC=${VLLM_SPEC:-vllm>=0.33}
RESULTS=benchmarks/results
mkdir -p "$RESULTS"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi not found"

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  python3 -m venv "$VENV"
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  PIP=(pip install -q)
  if [ -n "${WHEELHOUSE:-}" ]; then PIP+=(--no-index --find-links "$WHEELHOUSE"); fi
  "${PIP[@]}" "$VLLM_SPEC"   # brings the CUDA torch and the transformers it pins
  "${PIP[@]}" tensordict ray anyio uvloop structlog numpy pyyaml tqdm safetensors pytest pytest-asyncio pytest-timeout
  "${PIP[@]}" --no-deps -e .
else
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
fi

python - <<'PY'
import torch, vllm, transformers
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, "
      f"transformers {transformers.__version__}, GPU {torch.cuda.get_device_name(0)}")
PY

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
python -m pytest -m slow tests/roles/test_vllm_engine.py -p no:cacheprovider -q -rA -s 2>&1 \
  | tee "$RESULTS/vllm_gpu_check.log" | grep -E "vllm log-probs|PASSED|FAILED|ERROR|passed|failed|error" || true
grep -qE "[0-9]+ passed" "$RESULTS/vllm_gpu_check.log" && ! grep -qE "[0-9]+ (failed|error)" "$RESULTS/vllm_gpu_check.log" || status=1

python benchmarks/rollout_throughput.py --batch-sizes 8 64 256 --out "$RESULTS/rollout_throughput_gpu.md" \
  > "$RESULTS/rollout_throughput_gpu.log" 2>&1 || status=1
cat "$RESULTS/rollout_throughput_gpu.md" 2>/dev/null || tail -20 "$RESULTS/rollout_throughput_gpu.log"

if [ -n "${OUT:-}" ]; then cp "$RESULTS"/vllm_gpu_check.log "$RESULTS"/rollout_throughput_gpu.* "$OUT"/ 2>/dev/null || true; fi
exit $status
