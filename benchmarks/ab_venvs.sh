#!/usr/bin/env bash
# Before/after of the core, side by side in one run, each tree with a venv of its own (an editable
# install of that tree, `bash scripts/setup.sh test` there): the dispatch, pipelining and overlap
# benchmarks, then the SmolLM2 step beside TRL (TRL from this tree's .venv-trl: bash
# benchmarks/setup_trl.sh). The two trees alternate within each benchmark, the order flipping every
# round; the benchmark scripts are this tree's, and each run's first line says which asyncrl it imported.
#
#   bash benchmarks/ab_venvs.sh BEFORE_ROOT [ROUNDS] [OUT_DIR]
#
# BEFORE_ROOT: a checkout of the "before" code (e.g. `git worktree add ../base main`); "after" is this
# tree. ROUNDS (2) applies to dispatch and pipelining; overlap and the TRL step run one round.
# BENCHES="dispatch pipelining overlap trl" (the default) picks which run; overlap_real adds the real
# tiny presets (long on a loaded machine).
set -euo pipefail
before=$(cd "${1:?usage: ab_venvs.sh BEFORE_ROOT [ROUNDS] [OUT_DIR]}" && pwd)
rounds=${2:-2}
out=${3:-$(mktemp -d)}
root=$(git rev-parse --show-toplevel)
benches=${BENCHES:-dispatch pipelining overlap trl}
mkdir -p "$out"
declare -A TREE=([before]=$before [after]=$root)

run() {  # tree tag script args...
    local t=$1 tag=$2 script=$3
    shift 3
    (cd "${TREE[$t]}" && .venv/bin/python -c "import asyncrl; print('$t imports', asyncrl.__file__)")
    (cd "${TREE[$t]}" && .venv/bin/python "$root/benchmarks/$script" "$@" --out "$out/${tag}_$t.md") \
        > "$out/${tag}_$t.log" 2>&1 || echo "FAILED: $tag $t (see $out/${tag}_$t.log)"
    echo "done $tag $t $(date +%T)"
}

both() {  # round tag script args...: the two trees, the order flipping with the round
    local r=$1
    shift
    if (( r % 2 )); then run before "$@"; run after "$@"; else run after "$@"; run before "$@"; fi
}

for b in $benches; do
    case $b in
        dispatch)
            for r in $(seq 1 "$rounds"); do
                both "$r" "dispatch_r$r" dispatch_overhead.py --workers 4 --cells tiny 'tiny async' '1 MiB' --reps 5 --no-verl
            done ;;
        pipelining)
            for r in $(seq 1 "$rounds"); do
                both "$r" "pipelining_r$r" pipelining.py --mib 16 --workers 4 --reps 5
            done ;;
        overlap)
            both 1 overlap_sim overlap.py --train-ms 2000 --ratios 1 --steps 8 --no-real ;;
        overlap_real)
            both 2 overlap_real overlap.py --no-sweep --floor-rounds 0 ;;
        trl)  # TRL once, beside the "after" run (it imports no asyncrl)
            run after trl_r1 vs_trl.py --variants trl,bypass_follow --steps 4 --rounds 1 --held-out 0
            run before trl_r1 vs_trl.py --variants bypass_follow --steps 4 --rounds 1 --held-out 0 ;;
    esac
done
echo "results in $out"
