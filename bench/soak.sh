#!/usr/bin/env bash
# Soak: trains fsdp-train's tiny GPT under HYBRID_SHARD (2, 2) on 4 ranks for 2,000 steps and
# samples every rank's resident memory, open file descriptors and threads (from /proc) after
# step 200 and after step 2,000. A leak in the engine, the collectives or their worker threads
# shows as growth between the two. Prints one line per rank and a verdict; not a ctest (minutes).
# usage: bench/soak.sh BUILD_DIR [STEPS (2000)] [FIRST_SAMPLE (200)]
set -uo pipefail
build=${1:-build}
steps=${2:-2000}
first=${3:-200}
work=$(mktemp -d)
trap 'kill -9 $sup 2>/dev/null; rm -rf "$work"' EXIT
# A few steps past the last sample, so the ranks are still alive when it is taken.
"$build/fsdp-train" --devices 4 --mesh 2,2 --strategy hybrid_shard --model tiny --threads 1 \
  --steps $((steps + 50)) --global-batch 8 --seq-len 32 --quiet --metrics "$work/m.jsonl" \
  >"$work/log" 2>&1 &
sup=$!
ranks() { pgrep -P "$sup" | sort -n; }
sample() {  # prints "pid rss_kib fds threads" per rank
  for p in $(ranks); do
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$p/status" 2>/dev/null)
    thr=$(awk '/^Threads:/ {print $2}' "/proc/$p/status" 2>/dev/null)
    fds=$(ls "/proc/$p/fd" 2>/dev/null | wc -l)
    echo "$p $rss $fds $thr"
  done
}
wait_step() {
  while [ "$(cat "$work/m.jsonl" 2>/dev/null | wc -l)" -lt "$1" ]; do
    kill -0 "$sup" 2>/dev/null || { cat "$work/log"; echo "soak: fsdp-train ended early"; exit 1; }
    sleep 0.2
  done
}
start=$(date +%s)
wait_step "$first"; sample >"$work/a"
wait_step "$steps"; sample >"$work/b"
elapsed=$(( $(date +%s) - start ))
wait "$sup"; rc=$?
echo "soak: HYBRID_SHARD (2, 2), tiny model, 4 ranks, samples after step $first and step $steps" \
     "($elapsed s between them plus startup; fsdp-train exit $rc)"
join "$work/a" "$work/b" | awk -v s1="$first" -v s2="$steps" '
  { n++; d = ($5 - $2) / $2 * 100; if (d > worst) worst = d
    if ($6 != $3 || $7 != $4) grew = 1
    printf "rank pid %d: RSS %.1f -> %.1f MiB (%+.2f%%), fds %d -> %d, threads %d -> %d\n",
           $1, $2 / 1024, $5 / 1024, d, $3, $6, $4, $7 }
  END { printf "soak: largest RSS growth %+.2f%% (limit 2%%); fds and threads %s\n", worst,
        grew ? "CHANGED" : "unchanged"; exit (n != 4 || worst > 2 || grew) }'
