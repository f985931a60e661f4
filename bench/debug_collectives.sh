#!/usr/bin/env bash
# What --debug-collectives costs (NOTE [collective check], docs/concepts.md "Desynchronised ranks"):
# fsdp-train's median step time with and without it, in alternating runs (ROUNDS rounds of off,
# on), for the tiny and the medium GPT on DEVICES ranks (FULL_SHARD). Prints one line per run and
# the ratio of the medians per model; the first STEPS/4 steps of each run are left out (warm-up).
# usage: bench/debug_collectives.sh BUILD_DIR [DEVICES (2)] [ROUNDS (3)]
set -uo pipefail
build=${1:-build}
devices=${2:-2}
rounds=${3:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# median of step_time_s over the steps after the warm-up
median() {
  python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "step_time_s" in l]
skip = max(1, len(rows) // 4)
print("%.4f" % statistics.median(r["step_time_s"] for r in rows[skip:]))' "$1"
}

for model in "tiny 40" "medium 8"; do
  set -- $model
  name=$1 steps=$2
  offs=() ons=()
  for ((r = 1; r <= rounds; r++)); do
    for debug in off on; do
      flag=()
      [ "$debug" = on ] && flag=(--debug-collectives)
      m=$work/$name.$debug.$r.jsonl
      if ! "$build/fsdp-train" --devices "$devices" --model "$name" --steps "$steps" --quiet \
          --metrics "$m" "${flag[@]}" >"$work/log" 2>&1; then
        cat "$work/log"; echo "debug_collectives: fsdp-train failed"; exit 1
      fi
      t=$(median "$m")
      echo "$name round $r debug $debug: median step $t s"
      if [ "$debug" = on ]; then ons+=("$t"); else offs+=("$t"); fi
    done
  done
  python3 -c '
import statistics, sys
n = int(sys.argv[1]); v = [float(x) for x in sys.argv[3:]]
off, on = statistics.median(v[:n]), statistics.median(v[n:])
print("%s: median of medians off %.4f s, on %.4f s per step: %+.1f%% (%+.1f ms)" %
      (sys.argv[2], off, on, 100 * (on / off - 1), 1000 * (on - off)))' \
    "${#offs[@]}" "$name" "${offs[@]}" "${ons[@]}"
done
