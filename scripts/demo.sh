#!/usr/bin/env bash
# The fsdp.cpp demo (`make demo`): the path from text to a trained GPT-2. fsdp-tokenize turns
# English text (Debian's fortunes, ~2.5 MB) into GPT-2 token files in llm.c's format (train and
# validation); fsdp-train trains a small GPT-2 (4 layers, width 128, GPT-2's full vocabulary:
# 7.2 M parameters) with HYBRID_SHARD on 4 local processes, mesh (2, 2) = 2 replicas x 2-way
# sharding, measuring validation loss at step 0, every 20 steps and at the end, and exports the
# model for llm.c. Prints a live progress bar, a summary, and draws the loss curves.
#
#   scripts/demo.sh [BUILD_DIR]      (default: build)
#
# Writes BUILD_DIR/demo-data/fortunes_{train,val}.bin, BUILD_DIR/demo-metrics.jsonl (one JSON
# object per step and per validation), BUILD_DIR/demo-loss.png and BUILD_DIR/demo-gpt2.bin.
set -euo pipefail

BUILD=${1:-build}
TRAIN="$BUILD/fsdp-train"
TOKENIZE="$BUILD/fsdp-tokenize"
for tool in "$TRAIN" "$TOKENIZE"; do
  if [ ! -x "$tool" ]; then
    echo "demo: $tool not found; build first (make build; fsdp-tokenize needs libpcre2-dev: make setup)" >&2
    exit 1
  fi
done
FORTUNES=/usr/share/games/fortunes
if [ ! -d "$FORTUNES" ]; then
  echo "demo: $FORTUNES not found; install Debian's fortunes (make setup)" >&2
  exit 1
fi
DATA="$BUILD/demo-data"
METRICS="$BUILD/demo-metrics.jsonl"
PLOT="$BUILD/demo-loss.png"
MODEL="$BUILD/demo-gpt2.bin"
mkdir -p "$DATA"

# Every fortune file is one document (the .dat indexes and .u8 links left out).
mapfile -t TEXTS < <(find "$FORTUNES" -maxdepth 1 -type f ! -name '*.dat' | sort)
"$TOKENIZE" -o "$DATA/fortunes" "${TEXTS[@]}"
echo

# 60 steps x 8 sequences x 64 tokens, about 1-2 s a step with 4 ranks on 2 idle cores (the
# 50257-way softmax dominates at this width).
FLAGS=(--devices 4 --strategy hybrid_shard --mesh 2,2 --model gpt2 --layers 4 --d-model 128 --heads 4
       --data "$DATA/fortunes_train.bin" --val-data "$DATA/fortunes_val.bin"
       --eval-every 20 --eval-batches 4
       --steps 60 --global-batch 8 --seq-len 64 --lr 3e-3 --warmup-steps 5 --seed 1234)

echo "demo: the plan (fsdp-train --dry-run prints it without starting anything):"
"$TRAIN" "${FLAGS[@]}" --dry-run
echo

start=$(date +%s)
"$TRAIN" "${FLAGS[@]}" --metrics "$METRICS" --plot "$PLOT" --export-llmc "$MODEL"
end=$(date +%s)

echo
echo "demo: done in $((end - start)) s. Loss curves: $PLOT, metrics: $METRICS, llm.c model: $MODEL"
echo "demo: continue from the exported model with llm.c's optimizer settings, e.g.:"
echo "  $TRAIN --model gpt2 --layers 4 --d-model 128 --heads 4 --init-from $MODEL \\"
echo "      --data $DATA/fortunes_train.bin --val-data $DATA/fortunes_val.bin --eval-batches 4 \\"
echo "      --global-batch 8 --seq-len 64 --steps 20 --lr 1e-4 --warmup-steps 0 --lr-schedule constant \\"
echo "      --beta2 0.999 --weight-decay 0 --clip-grad 0 --data-order sequential"
