#!/usr/bin/env bash
# Before/after of the core, side by side in one run: the dispatch and pipelining benchmarks,
# alternating two asyncrl source trees for ROUNDS rounds (the order flips every round).
# Each process imports asyncrl only from its tree (cwd and PYTHONPATH; the first line of each
# run says which file it imported).
#
#   bash benchmarks/ab_trees.sh BEFORE_COMMIT [ROUNDS] [OUT_DIR]
#
# BEFORE_COMMIT's asyncrl/ is `git archive`d; "after" is this working tree's asyncrl/.
set -euo pipefail
before=${1:?usage: ab_trees.sh BEFORE_COMMIT [ROUNDS] [OUT_DIR]}
rounds=${2:-2}
out=${3:-$(mktemp -d)}
root=$(git rev-parse --show-toplevel)
py=${PYTHON:-$root/.venv/bin/python}
tmp=$(mktemp -d)
mkdir -p "$tmp/before" "$tmp/after" "$out"
git -C "$root" archive "$before" asyncrl | tar -x -C "$tmp/before"
cp -r "$root/asyncrl" "$tmp/after/"
DISPATCH=(--workers 2 --cells tiny '1 MiB' --reps 5 --no-verl)
PIPE=(--mib 8 --workers 2 --reps 5)
run() {  # tree round
    local t=$tmp/$1
    (cd "$t" && PYTHONPATH=$t "$py" -c "import asyncrl; print('$1 imports', asyncrl.__file__)")
    (cd "$t" && PYTHONPATH=$t "$py" "$root/benchmarks/dispatch_overhead.py" "${DISPATCH[@]}" --out "$out/dispatch_$1_$2.md")
    (cd "$t" && PYTHONPATH=$t "$py" "$root/benchmarks/pipelining.py" "${PIPE[@]}" --out "$out/pipelining_$1_$2.md")
}
for r in $(seq 1 "$rounds"); do
    if (( r % 2 )); then run before "$r"; run after "$r"; else run after "$r"; run before "$r"; fi
done
echo "results in $out"
