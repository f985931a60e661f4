#!/usr/bin/env bash
# Runs every libFuzzer target of a fuzz build for a bounded time (`make fuzz`: 20 s each, 100 s in
# all), starting from the seed corpus in tests/fuzz/corpus/<target>/. New inputs go to a temporary
# directory, never into the repository; a crash leaves its input in the current directory
# (crash-<sha1>) and fails the run: turn it into a regression test (docs/testing.md).
# usage: run_fuzz.sh BUILD_DIR [SECONDS_PER_TARGET] [EXTRA libFuzzer FLAGS...]
#   e.g. run_fuzz.sh build-fuzz 0 -runs=1000000     (a fixed number of executions instead)
#   FUZZ_TARGETS="fuzz_train_options" run_fuzz.sh ...  (some targets only; default: all six)
set -uo pipefail
build=$1
seconds=${2:-20}
shift $(( $# < 2 ? $# : 2 ))
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# ASan: libtorch and Gloo are not instrumented, and their process-lifetime allocations are not our
# leaks; the parsers allocate nothing that outlives a call, so leaks are checked by libFuzzer
# itself (-detect_leaks) only for what the target's own code allocated.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
for target in ${FUZZ_TARGETS:-fuzz_mesh_strategy fuzz_cluster_env fuzz_train_options fuzz_checkpoint_meta fuzz_trace fuzz_dcp_metadata}; do
  bin=$build/tests/fuzz/$target
  [ -x "$bin" ] || { echo "run_fuzz: $bin is not built"; exit 1; }
  mkdir -p "$work/$target"
  limit=()
  [ "$seconds" != 0 ] && limit=(-max_total_time="$seconds")
  # meta.json of even a one-block model is kilobytes, a trace of one step tens of them; the other
  # inputs are command lines.
  max_len=512
  timeout=10
  # ...and an input in fuzz_checkpoint_meta's mutation mode runs its ~940 mutations: seconds.
  [ "$target" = fuzz_checkpoint_meta ] && max_len=32768 && timeout=120
  [ "$target" = fuzz_trace ] && max_len=32768
  [ "$target" = fuzz_dcp_metadata ] && max_len=16384
  "$bin" "$work/$target" "$here/corpus/$target" "${limit[@]}" -max_len=$max_len -timeout=$timeout \
    -rss_limit_mb=4096 -print_final_stats=1 "$@" >"$work/$target.log" 2>&1
  rc=$?
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/$target.log" | grep -o '[0-9]*$')
  secs=$(grep -o 'Done [0-9]* runs in [0-9]* second' "$work/$target.log" | grep -o 'in [0-9]*' | grep -o '[0-9]*')
  cov=$(grep -o 'cov: [0-9]*' "$work/$target.log" | tail -1)
  echo "$target: exit $rc, ${runs:-?} executions in ${secs:-?} s, $cov"
  if [ "$rc" -ne 0 ]; then
    grep -E 'ERROR|threw|SUMMARY|Test unit written|runtime error' "$work/$target.log" | head -20
    status=1
  fi
done
exit $status
