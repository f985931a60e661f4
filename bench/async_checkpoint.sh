#!/usr/bin/env bash
# Asynchronous checkpoints (fsdp-train --checkpoint-async, fsdp::AsyncCheckpointer): how long a
# save blocks training against a plain memory copy of the same bytes, and the step time while a
# save is written in the background against a run without checkpoints. A benchmark, not a test.
#
#   bench/async_checkpoint.sh [BUILD=build] [DEVICES=4] [MODEL=medium] [STEPS=13] [EVERY=4]
#
# Prints: the blocked seconds per save (rank 0, checkpoint_blocked_s in the
# metrics) and its staging bytes; a memcpy of that many bytes into a touched buffer (Python's
# slice assignment, best of 5); the median step
# time of the steps that follow a save (the background write runs during them) and of all steps
# after the first two, with and without checkpoints; then the same steps while dd writes the same
# bytes at the moments the saves would start (the disk alone).
set -euo pipefail
BUILD=${1:-build}
DEVICES=${2:-4}
MODEL=${3:-medium}
STEPS=${4:-13}
EVERY=${5:-4}
TRAIN="$BUILD/fsdp-train"
work=$(mktemp -d /tmp/fsdp-async-bench.XXXXXX)
trap 'rm -rf "$work"' EXIT

common=(--devices "$DEVICES" --model "$MODEL" --strategy full_shard --steps "$STEPS"
        --global-batch "$DEVICES" --seq-len 128 --warmup-steps 1 --quiet)

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
step_times() {  # "step seconds" per line of a metrics file
  sed -n 's/.*"step":\([0-9]*\),.*"step_time_s":\([0-9.e-]*\),.*/\1 \2/p' "$1"
}

echo "== fsdp-train ${common[*]}"
"$TRAIN" "${common[@]}" --metrics "$work/none.jsonl" >"$work/none.log" 2>&1 ||
  { cat "$work/none.log"; exit 1; }
"$TRAIN" "${common[@]}" --metrics "$work/async.jsonl" --checkpoint-dir "$work/ck" \
  --checkpoint-every "$EVERY" --checkpoint-async >"$work/async.log" 2>&1 ||
  { cat "$work/async.log"; exit 1; }
grep -E "checkpoints" "$work/async.log"

# Every save: fsdp-train reserves the staging buffer in the background after the first step,
# so the first save does not allocate it either.
blocked=$(sed -n 's/.*"step":\([0-9]*\),.*"checkpoint_blocked_s":\([0-9.e-]*\).*/\1 \2/p' \
          "$work/async.jsonl" | awk -v e="$EVERY" '$1 >= e { print $2 }' | median)
line=$(grep "async checkpoints" "$work/async.log")
staging=$(echo "$line" | sed -n 's/.*staging buffer \([0-9.]*\) \([KMG]\)iB.*/\1 \2/p' |
          awk '{ m = $2 == "K" ? 1024 : $2 == "M" ? 1048576 : 1073741824; printf "%d", $1 * m }')
# The same bytes copied into a buffer already touched, as the staging buffer is after one save.
copy=$(/usr/bin/python3 -c "
import time
src = bytearray(b'x') * $staging
dst = bytearray(b'y') * $staging
best = 1e9
for _ in range(5):
    t = time.perf_counter(); dst[:] = src; best = min(best, time.perf_counter() - t)
print('%.4f' % best)")
echo "blocked per save (rank 0, median): $blocked s; memcpy of its $staging" \
     "staging bytes into a touched buffer: $copy s; ratio" \
     "$(awk -v a="$blocked" -v b="$copy" 'BEGIN { printf "%.2f", a / b }')"

after=$(step_times "$work/async.jsonl" | awk -v e="$EVERY" '$1 > e && ($1 - 1) % e == 0 { print $2 }' | median)
all_async=$(step_times "$work/async.jsonl" | awk '$1 > 2 { print $2 }' | median)
all_none=$(step_times "$work/none.jsonl" | awk '$1 > 2 { print $2 }' | median)
echo "median s/step: no checkpoints $all_none; with async saves $all_async;" \
     "steps right after a save (background write) $after;" \
     "slowdown $(awk -v a="$after" -v b="$all_none" 'BEGIN { printf "%+.1f%%", 100 * (a / b - 1) }')"

# The disk alone: a run without checkpoints while, after each step an async save would follow,
# one `dd oflag=direct conv=fsync` per rank writes the staging bytes (almost no guest CPU).
"$TRAIN" "${common[@]}" --metrics "$work/disk.jsonl" >"$work/disk.log" 2>&1 &
train=$!
seen=0
while kill -0 "$train" 2>/dev/null; do
  n=$( (step_times "$work/disk.jsonl" 2>/dev/null || true) | wc -l)
  while [ "$seen" -lt "$n" ]; do
    seen=$((seen + 1))
    if [ $((seen % EVERY)) -eq 0 ]; then
      for i in $(seq "$DEVICES"); do
        dd if=/dev/zero of="$work/disk-$i.bin" bs=1M count=$((staging / 1048576)) oflag=direct \
          conv=fsync status=none &
      done
      wait $(jobs -p | grep -v "^$train$")
    fi
  done
  sleep 0.005
done
wait "$train" || { cat "$work/disk.log"; exit 1; }
disk=$(step_times "$work/disk.jsonl" | awk -v e="$EVERY" '$1 > e && ($1 - 1) % e == 0 { print $2 }' | median)
echo "the disk alone (dd of the same bytes when each save would start): steps right after $disk;" \
     "slowdown $(awk -v a="$disk" -v b="$all_none" 'BEGIN { printf "%+.1f%%", 100 * (a / b - 1) }')"
