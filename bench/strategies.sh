#!/bin/sh
# Step time per sharding strategy, with prefetch on and off, on local ranks: runs fsdp-train for
# each combination and prints the median step time of the steps after the first two (warm-up).
# A benchmark, not a test: it prints numbers. Rerun it to check a performance claim.
#
# usage: bench/strategies.sh [BUILD_DIR] [DEVICES] [MODEL] [STEPS] [HYBRID_MESH] [BATCH] [SEQ]
#   e.g. bench/strategies.sh build 4 small 12 2,2 16 128
set -eu
build=${1:-build}
devices=${2:-4}
model=${3:-small}
steps=${4:-12}
mesh=${5:-2,$((devices / 2))}
batch=${6:-16}
seq=${7:-128}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

median_step_time() {  # median step_time_s of steps > 2 in a metrics file
  sed -n 's/.*"step":\([0-9]*\),.*"step_time_s":\([0-9.e-]*\),.*/\1 \2/p' "$1" |
    awk '$1 > 2 { print $2 }' | sort -g |
    awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2];
                              else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

echo "fsdp-train --devices $devices --model $model --steps $steps --global-batch $batch --seq-len $seq (hybrid mesh $mesh)"
echo "median s/step of steps 3..$steps; tokens/s = global batch x seq-len / that"
printf '%-20s %-8s %12s %12s\n' strategy prefetch s/step tokens/s
for strategy in full_shard shard_grad_op no_shard hybrid_shard hybrid_shard_zero2; do
  for prefetch in on off; do
    extra=""
    case $strategy in hybrid*) extra="--mesh $mesh" ;; esac
    metrics="$work/$strategy-$prefetch.jsonl"
    # shellcheck disable=SC2086
    "$build/fsdp-train" --devices "$devices" --model "$model" --steps "$steps" --strategy "$strategy" \
      --global-batch "$batch" --seq-len "$seq" --warmup-steps 1 \
      --prefetch "$prefetch" --quiet --metrics "$metrics" $extra >"$work/log" 2>&1 ||
      { echo "$strategy prefetch $prefetch failed:"; cat "$work/log"; exit 1; }
    t=$(median_step_time "$metrics")
    printf '%-20s %-8s %12.4f %12.0f\n' "$strategy" "$prefetch" "$t" "$(echo "$batch $seq $t" | awk '{ print $1 * $2 / $3 }')"
  done
done
