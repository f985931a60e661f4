#!/usr/bin/env bash
# The fsdp.cpp demo (`make demo`): trains the small byte-level GPT (3.4 M parameters) with
# HYBRID_SHARD on 4 local processes, mesh (2, 2) = 2 replicas x 2-way sharding, on the license
# texts every Debian system has. Sized to finish in under 2 minutes on a 2-core machine; prints a
# live progress bar, a summary, and draws the loss curve.
#
#   scripts/demo.sh [BUILD_DIR]      (default: build)
#
# Writes BUILD_DIR/demo-metrics.jsonl (one JSON object per step) and BUILD_DIR/demo-loss.png.
set -euo pipefail

BUILD=${1:-build}
TRAIN="$BUILD/fsdp-train"
if [ ! -x "$TRAIN" ]; then
  echo "demo: $TRAIN not found; build first (make build, or cmake --build $BUILD)" >&2
  exit 1
fi
METRICS="$BUILD/demo-metrics.jsonl"
PLOT="$BUILD/demo-loss.png"

# 100 steps x 16 sequences x 128 bytes: about 0.5 s a step with 4 ranks on 2 idle cores.
FLAGS=(--devices 4 --strategy hybrid_shard --mesh 2,2 --model small
       --steps 100 --global-batch 16 --seq-len 128 --lr 1e-3 --warmup-steps 10 --seed 1234)

echo "demo: the plan (fsdp-train --dry-run prints it without starting anything):"
"$TRAIN" "${FLAGS[@]}" --dry-run
echo

start=$(date +%s)
"$TRAIN" "${FLAGS[@]}" --metrics "$METRICS" --plot "$PLOT"
end=$(date +%s)

echo
echo "demo: done in $((end - start)) s. Loss curve: $PLOT, per-step metrics: $METRICS"
echo "demo: compare strategies, e.g.:"
echo "  $TRAIN --devices 4 --strategy full_shard --model small --steps 100 --global-batch 16 \\"
echo "      --seq-len 128 --metrics $BUILD/full_shard.jsonl"
echo "  $BUILD/fsdp-plot -o $BUILD/compare.png $METRICS $BUILD/full_shard.jsonl"
