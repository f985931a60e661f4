#!/usr/bin/env bash
# fsdp-train under the real torchrun (PyTorch 2.x), whose agent hosts the rendezvous store
# (TORCHELASTIC_USE_AGENT_STORE=True): static rendezvous, --standalone, --rdzv-backend c10d, and a
# rank killed in the first attempt with --max-restarts 1 (the restarted attempt meets under its
# own store prefix). Losses must equal `fsdp-train --devices 4`. Elastic (--nnodes 1:2): one of
# two agents dies, the other continues with a world of 2 from the last checkpoint, resharded.
# Bad input fails at once.
#
#   usage: torchrun_test.sh [--build-only] BUILD_DIR SOURCE_DIR
#          (exit 77: skipped, with the reason; --build-only: only build what the test runs)
#
# torchrun 2.x runs only where python3-torch is 2.x: inside the libtorch 2.6 chroot
# (scripts/libtorch2-chroot.sh; Debian 12's torchrun 1.13 crashes on Python 3.11 before starting
# a worker). Run on the host, this script builds fsdp-train against libtorch 2.6 inside the
# chroot (BUILD_DIR/libtorch2, incremental: ctest's real_torchrun_build does it first, on its
# own, so that real_torchrun, which runs alone, does not hold both cores while compiling) and
# runs itself there. Where the chroot cannot be entered it skips, saying why, except on CI,
# where it fails (scripts/libtorch2-chroot.sh check).
set -u
BUILD_ONLY=0
[ "${1:-}" = --build-only ] && { BUILD_ONLY=1; shift; }
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
HERE=$SRC/tests/launchers
TEST_NAME=torchrun
source "$HERE/common.sh"

torch_major() { python3 -c 'import torch; print(torch.__version__.split(".")[0])' 2>/dev/null; }

if [ "$(torch_major)" != 2 ] || ! command -v torchrun >/dev/null; then
  [ "${FSDP_IN_LIBTORCH2_CHROOT:-}" = 1 ] && { echo "FAIL: no torchrun 2.x inside the chroot"; exit 1; }
  "$SRC/scripts/libtorch2-chroot.sh" check || exit $?
  case "$BUILD/" in "$SRC"/*) ;; *) skip "the build directory $BUILD is outside $SRC, which the chroot sees";; esac
  CHROOT=$("$SRC/scripts/libtorch2-chroot.sh" path)
  echo "building fsdp-train against libtorch 2.6 in $BUILD/libtorch2 (inside $CHROOT)"
  "$SRC/scripts/libtorch2-chroot.sh" build "$BUILD/libtorch2" fsdp-train ||
    { echo "FAIL: could not build fsdp-train against libtorch 2.6 in the chroot"; exit 1; }
  [ "$BUILD_ONLY" = 1 ] && exit 0
  exec "$SRC/scripts/libtorch2-chroot.sh" run env FSDP_IN_LIBTORCH2_CHROOT=1 \
    bash "$HERE/torchrun_test.sh" "$BUILD/libtorch2" "$SRC"
fi
[ "$BUILD_ONLY" = 1 ] && { echo "torchrun 2.x is here: the test runs $BUILD/fsdp-train, nothing to build"; exit 0; }

echo "torchrun $(python3 -c 'import torch; print(torch.__version__)'), fsdp-train from $BUILD"
export PYTHONPATH="$HERE/torchrun_py${PYTHONPATH:+:$PYTHONPATH}" USE_LIBUV=0
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE
D=$(mktemp -d /tmp/fsdp-torchrun.XXXXXX)
trap 'rm -rf "$D"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Every run but the killed attempt adds --steps 3.
TRAIN=("$BUILD/fsdp-train" --model tiny --quiet --timeout 60 --strategy hybrid_shard --mesh 2,2)
"${TRAIN[@]}" --steps 3 --devices 4 --metrics "$D/ref.jsonl" >"$D/ref.out" 2>&1 ||
  fail "reference run --devices 4: $(tail -n 3 "$D/ref.out")"

# docs/launching.md's form: static rendezvous on --master-port, hosted by torchrun's agent.
P=$(free_port)
timeout 120 torchrun --nnodes 1 --nproc-per-node 4 --node-rank 0 --master-addr 127.0.0.1 \
  --master-port "$P" --no-python "${TRAIN[@]}" --steps 3 --metrics "$D/static.jsonl" >"$D/static.out" 2>&1 ||
  fail "torchrun (static rendezvous): $(tail -n 5 "$D/static.out")"
expect_same_losses "torchrun --master-port (static rendezvous, agent store)" "$D/static.jsonl" "$D/ref.jsonl"

timeout 120 torchrun --standalone --nproc-per-node 4 --no-python "${TRAIN[@]}" \
  --steps 3 --metrics "$D/standalone.jsonl" >"$D/standalone.out" 2>&1 ||
  fail "torchrun --standalone: $(tail -n 5 "$D/standalone.out")"
expect_same_losses "torchrun --standalone" "$D/standalone.jsonl" "$D/ref.jsonl"

P=$(free_port)
timeout 120 torchrun --nnodes 1 --nproc-per-node 4 --rdzv-backend c10d \
  --rdzv-endpoint "127.0.0.1:$P" --no-python "${TRAIN[@]}" --steps 3 --metrics "$D/c10d.jsonl" \
  >"$D/c10d.out" 2>&1 || fail "torchrun --rdzv-backend c10d: $(tail -n 5 "$D/c10d.out")"
expect_same_losses "torchrun --rdzv-backend c10d" "$D/c10d.jsonl" "$D/ref.jsonl"

# Elastic restart: in attempt 0, rank 3 is SIGKILLed while the others train; torchrun restarts
# every worker, and attempt 1 meets under its own prefix of the agent's store.
cat >"$D/worker.sh" <<W
#!/bin/bash
if [ "\$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
  ${TRAIN[*]} --steps 100000 --metrics /dev/null &
  [ "\$RANK" = 3 ] && { sleep 4; kill -9 \$!; }
  wait \$!
  exit
fi
exec ${TRAIN[*]} --steps 3 --metrics $D/restart.jsonl
W
chmod +x "$D/worker.sh"
P=$(free_port)
timeout 180 torchrun --nnodes 1 --nproc-per-node 4 --master-addr 127.0.0.1 --master-port "$P" \
  --max-restarts 1 --no-python "$D/worker.sh" \
  >"$D/restart.out" 2>&1 || fail "torchrun --max-restarts 1: $(tail -n 5 "$D/restart.out")"
expect_same_losses "torchrun --max-restarts 1 after a rank was killed" "$D/restart.jsonl" "$D/ref.jsonl"

# Elastic: two agents on this host (--nnodes 1:2, c10d rendezvous, 2 ranks each) train a world of
# 4 with sharded checkpoints; after the step-100 checkpoint, agent B dies with its workers (SIGKILL:
# a lost node). Agent A's workers then fail on the lost connections, A restarts them, the
# rendezvous closes with A alone (after B's heartbeats stop and last_call_timeout), and fsdp-train
# resumes the latest checkpoint resharded from mesh (1, 4) to (1, 2). A hosts both stores: the
# rendezvous endpoint (the first agent binds it) and the workers' store (the rendezvous' rank 0,
# the smaller pid), and torchrun keeps that worker store for the agent's lifetime: the survivor
# must be that agent (see docs/launching.md, "torchrun").
E=$D/elastic
ETRAIN=("$BUILD/fsdp-train" --model tiny --quiet --timeout 60 --strategy full_shard --steps 300)
"${ETRAIN[@]}" --devices 4 --metrics "$D/elastic_ref.jsonl" >"$D/elastic_ref.out" 2>&1 ||
  fail "elastic reference run --devices 4: $(tail -n 3 "$D/elastic_ref.out")"
P=$(free_port)
RDZV=(--nnodes 1:2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$P"
      --rdzv-id fsdp-elastic --rdzv-conf last_call_timeout=3 --max-restarts 2 --monitor-interval 0.5)
ELASTIC=(--no-python "${ETRAIN[@]}" --checkpoint-dir "$E/ckpt" --checkpoint-every 50 --resume
         --metrics "$E/run.jsonl")
mkdir -p "$E"
# Each agent and its workers (which torchrun starts in sessions of their own) in a session, so
# that the trap can kill everything that is left.
setsid timeout -k 5 240 torchrun "${RDZV[@]}" "${ELASTIC[@]}" >"$E/a.out" 2>&1 &
A=$!
sleep 1
setsid timeout -k 5 240 torchrun "${RDZV[@]}" "${ELASTIC[@]}" >"$E/b.out" 2>&1 &
B=$!
descendants() { local p; for p in $(cat /proc/"$1"/task/*/children 2>/dev/null); do echo "$p"; descendants "$p"; done; }
trap 'kill -9 $A $B $(descendants $A) $(descendants $B) 2>/dev/null; rm -rf "$D"' EXIT
for _ in $(seq 900); do [ -e "$E/ckpt/step-00000100" ] && break; sleep 0.2; done
victims=$(descendants "$B")
group_rank_of_b=$(for v in $victims; do tr '\0' '\n' </proc/"$v"/environ 2>/dev/null; done |
                  sed -n 's/^GROUP_RANK=//p' | head -n 1)
if [ ! -e "$E/ckpt/step-00000100" ]; then
  fail "elastic: no step-100 checkpoint within 180 s: $(tail -n 5 "$E/a.out")"
elif [ "$group_rank_of_b" != 1 ]; then
  fail "elastic: the second agent is rendezvous rank '$group_rank_of_b', not 1 (pid order); its death would take the workers' store"
else
  killed_at=$(date +%s)
  kill -9 "$B" $victims 2>/dev/null
  wait "$A"
  rc=$?
  took=$(($(date +%s) - killed_at))
  if [ "$rc" -ne 0 ]; then
    fail "elastic: agent A exited $rc after agent B was killed: $(grep -v '^$' "$E/a.out" | tail -n 8)"
  else
    pass "elastic: agent A finished ${took} s after agent B was killed"
  fi
  expect_contains "elastic: the restarted world of 2 resumed from a checkpoint" \
    "fsdp-train: resumed from $E/ckpt/step-" "$E/a.out"
  expect_contains "elastic: the resumed run trained on mesh (1, 2), world 2" \
    "FULL_SHARD on mesh (1, 2), world 2" "$E/a.out"
  # The resumed run rewrites the metrics from its checkpoint's step on: every step after it is
  # there, within fp32 tolerance of the uninterrupted world of 4 (resharding changes the order of
  # the reductions; measured: relative 2e-7 at most).
  verdict=$(python3 - "$E/run.jsonl" "$D/elastic_ref.jsonl" <<'PY'
import json, sys
def losses(path):
    with open(path) as f:
        return {j["step"]: j["loss"] for j in map(json.loads, filter(str.strip, f))}
got, want = losses(sys.argv[1]), losses(sys.argv[2])
if not got or max(got) != 300 or len(want) != 300:
    print(f"steps: got {min(got, default=0)}..{max(got, default=0)}, reference {len(want)}"); sys.exit()
worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
missing = [s for s in range(min(got), 301) if s not in got]
print(f"ok {min(got)} {worst:.1e}" if worst <= 1e-5 and not missing and min(got) > 100
      else f"steps {min(got)}..300, missing {missing[:5]}, max relative difference {worst:.1e}")
PY
)
  case "$verdict" in
    ok*) pass "elastic: steps $(echo "$verdict" | cut -d' ' -f2)..300 of the world of 2 match the world of 4 (max relative difference $(echo "$verdict" | cut -d' ' -f3))" ;;
    *) fail "elastic: losses after the restart: $verdict" ;;
  esac
fi
kill -9 $(descendants "$A") $(descendants "$B") 2>/dev/null
trap 'rm -rf "$D"' EXIT

# Bad input under torchrun: a mesh that does not fit the world fails at once, nothing hangs.
P=$(free_port)
start=$(date +%s)
timeout 120 torchrun --nnodes 1 --nproc-per-node 4 --master-addr 127.0.0.1 --master-port "$P" \
  --no-python "$BUILD/fsdp-train" --model tiny --steps 3 --quiet --strategy hybrid_shard \
  --mesh 3,2 >"$D/bad.out" 2>&1 && fail "torchrun with --mesh 3,2 on 4 ranks succeeded"
expect_contains "torchrun, mesh (3, 2) on 4 ranks: named" "device_mesh (3, 2) has 6 ranks" "$D/bad.out"
took=$(($(date +%s) - start))
[ "$took" -lt 60 ] && pass "torchrun, bad mesh: failed in ${took} s" || fail "bad mesh took ${took} s"

finish
