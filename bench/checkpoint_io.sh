#!/usr/bin/env bash
# Sharded checkpoint speed against the disk: `dd` sequential write and read of a file the size of
# the checkpoint, then fsdp-train saving (one step, then the end-of-run checkpoint) and loading
# (--resume with nothing left to train) the same model with AdamW, in the same run.
#
#   bench/checkpoint_io.sh [BUILD=build] [DEVICES=4] [MODEL=medium] [DIR=/tmp/fsdp-ckpt-bench]
#
# Also every shard file written at once with O_DIRECT from touched memory (bench.py's
# write_direct: the disk without the page cache). Prints MiB/s for each. Page cache: the script drops it before each read where it may
# (root, /proc/sys/vm/drop_caches writable), and says so; otherwise reads may come from memory.
set -euo pipefail
BUILD=${1:-build}
DEVICES=${2:-4}
MODEL=${3:-medium}
DIR=${4:-/tmp/fsdp-ckpt-bench}
TRAIN="$BUILD/fsdp-train"
rm -rf "$DIR"
mkdir -p "$DIR"
trap 'rm -rf "$DIR"' EXIT

drop_caches() {
  sync
  if [ -w /proc/sys/vm/drop_caches ] && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then
    echo "(page cache dropped)"
  else
    echo "(page cache NOT dropped: reads may come from memory)"
  fi
}

common=(--model "$MODEL" --global-batch "$DEVICES" --seq-len 64 --steps 1 --quiet
        --checkpoint-dir "$DIR/ck")
echo "== fsdp-train save: $MODEL, AdamW, $DEVICES ranks, full_shard"
out=$("$TRAIN" --devices "$DEVICES" --strategy full_shard "${common[@]}")
echo "$out" | grep -E "checkpoints"
bytes=$(du -sb "$DIR/ck/step-00000001" | cut -f1)
mib=$((bytes / 1048576 + 1))
echo "checkpoint: $bytes bytes"

echo "== dd sequential write, $mib MiB (fdatasync)"
dd if=/dev/zero of="$DIR/dd.bin" bs=1M count="$mib" conv=fdatasync 2>&1 | tail -1
drop_caches
echo "== dd sequential read, $mib MiB"
dd if="$DIR/dd.bin" of=/dev/null bs=1M 2>&1 | tail -1
rm -f "$DIR/dd.bin"
echo "== every shard file written at once, a process each: one O_DIRECT write from touched memory, fsync"
/usr/bin/python3 -c "
import sys; sys.path.insert(0, '$(dirname "$0")')
import bench
s = bench.write_direct(sys.argv[2:], sys.argv[1])
print(f'{$bytes / 2**20 / s:.0f} MiB/s ({s:.3f} s)')" "$DIR" "$DIR"/ck/step-00000001/shard-*
drop_caches
echo "== the checkpoint's files read at once, each into one new buffer (as the ranks load)"
start=$(date +%s.%N)
for f in "$DIR"/ck/step-00000001/*; do
  dd if="$f" of=/dev/null bs="$(stat -c %s "$f")" count=1 iflag=fullblock status=none &
done
wait
echo "$(echo "$bytes / 1048576 / ($(date +%s.%N) - $start)" | bc) MiB/s"

drop_caches
echo "== fsdp-train load (--resume, nothing left to train)"
"$TRAIN" --devices "$DEVICES" --strategy full_shard "${common[@]}" --resume | grep -E "resumed from"
