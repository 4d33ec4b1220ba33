#!/usr/bin/env bash
# The paper's evaluation at cpu-bench (docs/experiments.md), experiment after experiment: each
# one's cells split into SHARDS processes side by side (one per core), every cell resumable
# (rerun this script after an interruption: finished cells are skipped), then merged into
# benchmarks/results/NAME.{json,md}. The victims and captures are built once, under SHARED,
# for every experiment. A grid cut short by the end of a session is merged with
# --allow-partial by hand; a later session continues it with --import-cells (see the docs).
#
#   bash benchmarks/paper_experiments.sh [NAME ...]      # default: all, in the order below
#
# Environment: BUDGET (CPU minutes a cell, 6), SHARDS (2), OUT (runs/exp), SHARED
# (runs/exp/shared), RESULTS (benchmarks/results), EXTRA (more arguments for every command,
# e.g. "--plugin mymodule" for a user's own experiment), WHERE (a slice of each grid first,
# e.g. "defense=noise:0.01 window=1,8": its cells only, merged with --allow-partial). About 6.5 CPU minutes a learned cell at the default budget: table1 ~140
# CPU minutes, fewshot ~160, auxscale ~160, defense-figure ~130, context ~300.
set -euo pipefail
cd "$(dirname "$0")/.."

BUDGET=${BUDGET:-6}
SHARDS=${SHARDS:-2}
OUT=${OUT:-runs/exp}
SHARED=${SHARED:-runs/exp/shared}
RESULTS=${RESULTS:-benchmarks/results}
read -r -a EXTRA <<< "${EXTRA:-}"
read -r -a WHERE <<< "${WHERE:-}"
SLICE=() PARTIAL=()
for axis in "${WHERE[@]}"; do SLICE+=(--where "$axis"); done
[ ${#SLICE[@]} -eq 0 ] || PARTIAL=(--allow-partial)
declare -A SEEDS=([table1]=3)  # the paper's Table 1 at three seeds, the others at two

run() {
    local name=$1 seeds=${SEEDS[$1]:-2} folder="$OUT/$1-${BUDGET}m" pids=() shard
    local common=(--seeds "$seeds" --budget-minutes "$BUDGET" --out "$folder"
                  --shared "$SHARED" "${EXTRA[@]}")
    mkdir -p "$OUT"
    for ((shard = 0; shard < SHARDS; shard++)); do
        # one thread per shard: the shards, not torch's threads, share the cores
        OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 5 gradleak experiment "$name" \
            "${common[@]}" "${SLICE[@]}" --shard "$shard/$SHARDS" --resume --quiet \
            > "$folder.shard$shard.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || { echo "$name: a shard failed; the end of its log:" >&2
                         tail -n 3 "$folder".shard*.log >&2; exit 1; }
    done
    gradleak experiment "$name" "${common[@]}" --merge "${PARTIAL[@]}" --results "$RESULTS"
}

for name in "${@:-components losses table1 fewshot auxscale defense-figure context}"; do
    for one in $name; do
        run "$one"
    done
done
