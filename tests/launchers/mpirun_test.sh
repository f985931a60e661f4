#!/usr/bin/env bash
# fsdp-train under the real OpenMPI mpirun (Debian's openmpi-bin): HYBRID_SHARD (2, 2) on 4 ranks
# gives the losses of `fsdp-train --devices 4`; a mesh that does not fit fails at once on every
# rank; a killed rank ends the job with nothing left running.
#   usage: mpirun_test.sh BUILD_DIR        (exit 77: skipped, with the reason)
set -u
BUILD=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
TEST_NAME=mpirun
source "$HERE/common.sh"
command -v mpirun >/dev/null || skip "mpirun is not installed (scripts/setup.sh installs openmpi-bin)"
mpirun --version 2>/dev/null | grep -q "Open MPI" || skip "mpirun here is not OpenMPI's"

D=$(mktemp -d /tmp/fsdp-mpirun.XXXXXX)
trap 'rm -rf "$D"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE
# --allow-run-as-root: CI runs as root. No MPI communication is used; only the launcher.
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 -x OMP_NUM_THREADS
        -x OPENBLAS_NUM_THREADS)
TRAIN=("$BUILD/fsdp-train" --model tiny --steps 3 --quiet --timeout 60 --strategy hybrid_shard --mesh 2,2)

"${TRAIN[@]}" --devices 4 --metrics "$D/ref.jsonl" >"$D/ref.out" 2>&1 ||
  fail "reference run --devices 4: $(tail -n 3 "$D/ref.out")"

P=$(free_port)
timeout 120 "${MPIRUN[@]}" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$P" "${TRAIN[@]}" \
  --metrics "$D/mpi.jsonl" >"$D/mpi.out" 2>&1 || fail "mpirun -np 4: $(tail -n 5 "$D/mpi.out")"
expect_same_losses "mpirun -np 4, HYBRID_SHARD (2, 2)" "$D/mpi.jsonl" "$D/ref.jsonl"

# Without MASTER_PORT: one node, the default port 29500 (when it is free).
if port_is_free 29500; then
  timeout 120 "${MPIRUN[@]}" "${TRAIN[@]}" --metrics "$D/default-port.jsonl" \
    >"$D/default-port.out" 2>&1 || fail "mpirun without MASTER_PORT: $(tail -n 5 "$D/default-port.out")"
  expect_same_losses "mpirun -np 4 on the default port" "$D/default-port.jsonl" "$D/ref.jsonl"
fi

P=$(free_port)
start=$(date +%s)
timeout 120 "${MPIRUN[@]}" -x MASTER_PORT="$P" "$BUILD/fsdp-train" --model tiny --steps 3 --quiet \
  --strategy hybrid_shard --mesh 3,2 >"$D/bad.out" 2>&1 && fail "mpirun with --mesh 3,2 on 4 ranks succeeded"
expect_contains "mpirun, mesh (3, 2) on 4 ranks: named" "device_mesh (3, 2) has 6 ranks" "$D/bad.out"
took=$(($(date +%s) - start))
[ "$took" -lt 60 ] && pass "mpirun, bad mesh: failed in ${took} s" || fail "bad mesh took ${took} s"

# A rank killed mid-run: mpirun ends the job, no fsdp-train is left behind.
P=$(free_port)
RANKS="^$BUILD/fsdp-train .*--metrics $D/kill.jsonl"   # the ranks' command lines, not mpirun's
timeout 120 "${MPIRUN[@]}" -x MASTER_PORT="$P" "$BUILD/fsdp-train" --model tiny --steps 100000 \
  --quiet --timeout 30 --metrics "$D/kill.jsonl" >"$D/kill.out" 2>&1 &
job=$!
for _ in $(seq 600); do [ -s "$D/kill.jsonl" ] && break; sleep 0.1; done   # training has started
victim=$(pgrep -f "$RANKS" | tail -n 1)
if [ -z "$victim" ] || [ ! -s "$D/kill.jsonl" ]; then
  fail "mpirun kill test: the ranks did not start training: $(tail -n 3 "$D/kill.out")"
  kill $job 2>/dev/null
else
  kill -9 "$victim"
  start=$(date +%s)
  wait $job && fail "mpirun exited 0 after a rank was killed"
  took=$(($(date +%s) - start))
  sleep 1
  left=$(pgrep -f "$RANKS" | wc -l)
  [ "$left" -eq 0 ] && pass "mpirun, killed rank: the job ended in ${took} s, no rank left" ||
    fail "mpirun, killed rank: $left rank(s) left running"
fi
wait 2>/dev/null

finish
