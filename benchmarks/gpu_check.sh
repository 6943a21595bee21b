#!/usr/bin/env bash
# The GPU check: asyncrl's roles on CUDA and a GRPO run (sync vs async) on one GPU, in one go.
#
# Made for the offline GPU machine (../shared/device/README.md: one H200, no network, torch with
# CUDA preinstalled, 64 MiB carried, ~15 minutes in all). Before, on a machine with network, from
# the repository root:
#   bash benchmarks/gpu_check.sh --prepare-wheels   # runs ../shared/device/prepare_wheels.sh in a scratch
#                                                   # dir (it writes .git/info/exclude, which fails in a git
#                                                   # worktree) and moves .whl/ here (~43 MB, git-ignored)
# Then carry .whl along (run(..., carry=[".whl"])) and run from the repository root there:
#
#   bash benchmarks/gpu_check.sh              # installs .whl + asyncrl into $HOME/site, ~5-6 minutes
#   bash benchmarks/gpu_check.sh --dry-run    # every step on the CPU with tiny sizes, in this checkout's
#                                             # .venv (no install, no GPU): proves the script's logic
#
# Phases, each under its own time limit so a stuck one cannot eat the others' time (seconds,
# override with the env vars): install (INSTALL_S=90), roles tests on CUDA in-process
# (TESTS_S=150), roles on GPU pools through Ray (RAY_TESTS_S=90), GRPO sync vs async with a
# ~76 M-parameter model built from a config (GRPO_S=240; GRPO_STEPS=24). The whole script stays
# within TOTAL_S=570 (the device runs one command for at most 600 s): a phase gets what is left.
#
# Writes $OUT/gpu_check/ (without $OUT: benchmarks/results/gpu_check/; --dry-run: .../gpu_check_dry/):
#   results.md             summary: machine, command, test outcomes, the GRPO table, peak GPU memory
#   gpu_grpo.md/.json      step times, speedup, tokens/s, peak GPU memory per process, per-step history
#   tests_cuda.log, tests_ray_gpu.log, grpo.log, install.log, env.txt, gpu_memory.csv
# Exit status: 0 when every phase passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

if [ "${1:-}" = "--prepare-wheels" ]; then
  script="${PREPARE_WHEELS:-}"
  for c in "$ROOT/../shared/device/prepare_wheels.sh" "$ROOT/../../shared/device/prepare_wheels.sh"; do
    [ -z "$script" ] && [ -f "$c" ] && script=$c
  done
  [ -n "$script" ] && [ -f "$script" ] || { echo "prepare_wheels.sh not found; set PREPARE_WHEELS=/path/to/it"; exit 2; }
  scratch=$(mktemp -d)
  mkdir -p "$scratch/.git/info"
  ( cd "$scratch" && bash "$script" ) || { rm -rf "$scratch"; exit 1; }
  rm -rf "$ROOT/.whl" && mv "$scratch/.whl" "$ROOT/.whl" && rm -rf "$scratch"
  du -sh "$ROOT/.whl"; ls "$ROOT/.whl"
  exit 0
fi

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
START=$(date +%s)

if [ -n "${OUT:-}" ]; then R="$OUT/gpu_check"; else R="$ROOT/benchmarks/results/gpu_check"; fi
[ $DRY = 1 ] && R="${R}_dry"
mkdir -p "$R"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if [ $DRY = 1 ]; then
  PY="${PYTHON:-$ROOT/.venv/bin/python}"
  DEVICE=cpu
  GRPO_ARGS=(--dry-run)
else
  PY="${PYTHON:-python3}"
  DEVICE=cuda
  GRPO_ARGS=(--steps "${GRPO_STEPS:-24}")
fi

status=0
declare -A PHASE
note() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" | tee -a "$R/progress.log"; }

# ---- 0. the machine ------------------------------------------------------------------------------
{
  echo "date: $(date -Iseconds)"; echo "host: $(uname -a)"; echo "cpus: $(nproc)"
  echo "tree: $(du -sh --exclude=.git --exclude=.venv --exclude=.mypy_cache --exclude=.hypothesis --exclude=.whl . | cut -f1)," \
       "wheels: $(du -sh .whl 2>/dev/null | cut -f1 || true)$([ -d .whl ] || echo 'none (.whl missing)')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    || echo "nvidia-smi: not found"
  "$PY" - <<'PY' 2>&1
import torch, platform
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"GPU {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}, "
          f"bf16 {torch.cuda.is_bf16_supported()}, memory {torch.cuda.mem_get_info()[1] / 2**30:.1f} GiB")
PY
} > "$R/env.txt" 2>&1
cat "$R/env.txt"

# ---- 1. install (the device image lacks ray, tensordict, structlog, pytest-asyncio) ----------------
if [ $DRY = 1 ] || [ "${SKIP_INSTALL:-0}" = 1 ]; then
  note "install: skipped ($([ $DRY = 1 ] && echo dry run || echo SKIP_INSTALL=1)); python: $PY"
  PHASE[install]=skipped
else
  SITE="${SITE:-$HOME/site}"
  {
    set -e
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run ../shared/device/prepare_wheels.sh and carry .whl"; exit 3; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" . ; then
      # no setuptools/wheel there: lay the packages out as pyproject's package-dir does
      echo "pip install . failed: copying the packages into $SITE/asyncrl instead"
      rm -rf "$SITE/asyncrl" && cp -r asyncrl "$SITE/asyncrl" && cp -r roles "$SITE/asyncrl/roles" \
        && cp -r pipelines "$SITE/asyncrl/pipelines"
    fi
    "$PY" -c "import asyncrl, asyncrl.roles.engines.hf, asyncrl.pipelines, ray, tensordict; print('asyncrl', asyncrl.__version__, 'ray', ray.__version__)"
  } > "$R/install.log" 2>&1 &
  wait_pid=$!
  ( sleep "${INSTALL_S:-90}" && kill "$wait_pid" 2>/dev/null ) & guard=$!
  if wait "$wait_pid"; then PHASE[install]=ok; else PHASE[install]=FAILED; status=1; fi
  kill "$guard" 2>/dev/null
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  note "install: ${PHASE[install]} ($(tail -1 "$R/install.log"))"
fi

# ---- GPU memory, sampled device-wide every 0.5 s while the checks run -------------------------------
sampler=""
if [ $DRY = 0 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 > "$R/gpu_memory.csv" 2>/dev/null &
  sampler=$!
fi

run_phase() {  # name, limit_s, log, command...
  local name=$1 limit=$2 log=$3; shift 3
  local left=$(( ${TOTAL_S:-570} - ($(date +%s) - START) - 20 ))  # 20 s kept for the summary
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 20 ]; then PHASE[$name]="not run (time budget spent)"; status=1; note "$name: ${PHASE[$name]}"; return; fi
  note "$name: running (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$R/$log" 2>&1
  local rc=$?
  if [ $rc = 0 ]; then PHASE[$name]=ok
  elif [ $rc = 124 ] || [ $rc = 137 ]; then PHASE[$name]="TIMED OUT after ${limit}s"; status=1
  else PHASE[$name]="FAILED (exit $rc)"; status=1; fi
  note "$name: ${PHASE[$name]} -- $(grep -E '[0-9]+ (passed|failed)|^\[gpu_grpo\] .*ms/step|FAILED' "$R/$log" | tail -1)"
}

# ---- 2. the roles in-process on the device (fixture model_config -> device=cuda, fp32) ----------------
export ASYNCRL_TEST_DEVICE=$DEVICE
run_phase tests_cuda "${TESTS_S:-150}" tests_cuda.log "$PY" -m pytest -p no:cacheprovider -q -rfEs --timeout 120 \
  tests/roles/test_device.py tests/roles/test_workers.py tests/roles/test_functional.py \
  tests/roles/test_strategies.py::test_a_checkpoint_of_the_other_strategy_is_refused_naming_both \
  tests/roles/test_token_budget.py
unset ASYNCRL_TEST_DEVICE

# ---- 3. roles on GPU pools through Ray (half a GPU each: weight channel, bf16 rollout) ----------------
run_phase tests_ray_gpu "${RAY_TESTS_S:-90}" tests_ray_gpu.log "$PY" -m pytest -p no:cacheprovider -q -rfEs \
  --timeout 120 tests/roles/test_weight_transports.py -k "sharing_one_gpu or bit_identical"

# ---- 4. GRPO, sync vs async, a model built from a config ---------------------------------------------
run_phase grpo "${GRPO_S:-240}" grpo.log "$PY" benchmarks/gpu_grpo.py --out-dir "$R" "${GRPO_ARGS[@]}"

[ -n "$sampler" ] && kill "$sampler" 2>/dev/null

# ---- summary -----------------------------------------------------------------------------------------
{
  echo "# GPU check $([ $DRY = 1 ] && echo '(DRY RUN on the CPU: logic only, no GPU numbers)')"
  echo
  echo "Command: \`bash benchmarks/gpu_check.sh $*\` ($(( $(date +%s) - START )) s in all)"
  echo
  echo '```'; cat "$R/env.txt"; echo '```'
  echo
  echo "| phase | outcome | summary |"
  echo "|---|---|---|"
  for p in install tests_cuda tests_ray_gpu grpo; do
    log="$R/$p.log"; [ $p = install ] && log="$R/install.log"
    line=$(grep -E '[0-9]+ (passed|failed)|^\[gpu_grpo\] .*(ms/step|FAILED)|^asyncrl ' "$log" 2>/dev/null | tail -3 | tr '|\n' '/ ')
    echo "| $p | ${PHASE[$p]:-not run} | ${line:-} |"
  done
  echo
  if [ -s "$R/gpu_memory.csv" ]; then
    peak=$(awk -F', ' 'NR>0 && $2+0>m {m=$2+0} END {print m}' "$R/gpu_memory.csv")
    echo "Peak GPU memory used on the device (nvidia-smi, every 0.5 s, all processes): ${peak} MiB"
    echo
  fi
  grep -hE "^(FAILED|ERROR)" "$R"/tests_*.log 2>/dev/null | head -30 | sed 's/^/    /'
  echo
  [ -f "$R/gpu_grpo.md" ] && cat "$R/gpu_grpo.md" || echo "(no GRPO results: see grpo.log)"
  echo
  echo "Not checked here: NCCL (one GPU: every collective member shares it, so gloo is used), vLLM on a GPU"
  echo "(its wheel does not fit the 64 MiB carried; the vLLM path stays unverified)."
} > "$R/results.md"
cat "$R/results.md"
note "done: exit $status; results in $R"
exit $status
