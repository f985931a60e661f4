#!/usr/bin/env bash
# fsdp-train under the real torchrun (PyTorch 2.x), whose agent hosts the rendezvous store
# (TORCHELASTIC_USE_AGENT_STORE=True): static rendezvous, --standalone, --rdzv-backend c10d, and a
# rank killed in the first attempt with --max-restarts 1 (the restarted attempt meets under its
# own store prefix). Losses must equal `fsdp-train --devices 4`. Bad input fails at once.
#
#   usage: torchrun_test.sh BUILD_DIR SOURCE_DIR      (exit 77: skipped, with the reason)
#
# torchrun 2.x runs only where python3-torch is 2.x: inside the libtorch 2.6 chroot
# (scripts/libtorch2-chroot.sh; Debian 12's torchrun 1.13 crashes on Python 3.11 before starting
# a worker). Run on the host, this script builds fsdp-train against libtorch 2.6 inside the
# chroot (BUILD_DIR/libtorch2, incremental) and runs itself there; it skips when there is no
# chroot.
set -u
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
HERE=$SRC/tests/launchers
TEST_NAME=torchrun
source "$HERE/common.sh"

torch_major() { python3 -c 'import torch; print(torch.__version__.split(".")[0])' 2>/dev/null; }

if [ "$(torch_major)" != 2 ] || ! command -v torchrun >/dev/null; then
  [ "${FSDP_IN_LIBTORCH2_CHROOT:-}" = 1 ] && { echo "FAIL: no torchrun 2.x inside the chroot"; exit 1; }
  CHROOT=$("$SRC/scripts/libtorch2-chroot.sh" path)
  [ -x "$CHROOT/usr/bin/torchrun" ] && [ -x "$CHROOT/usr/bin/python3" ] ||
    skip "torchrun 2.x is not installed here (Debian 12's torchrun 1.13 cannot start workers on" \
         "Python 3.11) and the libtorch 2.6 chroot does not exist at $CHROOT; create it with" \
         "'make libtorch2-chroot' (root, Debian mirror)"
  [ "$(id -u)" -eq 0 ] || skip "entering the libtorch 2.6 chroot at $CHROOT needs root"
  case "$BUILD/" in "$SRC"/*) ;; *) skip "the build directory $BUILD is outside $SRC, which the chroot sees";; esac
  cd "$SRC" || exit 1
  echo "building fsdp-train against libtorch 2.6 in $BUILD/libtorch2 (inside $CHROOT)"
  "$SRC/scripts/libtorch2-chroot.sh" run bash -c '
    set -e
    [ -f "$1/CMakeCache.txt" ] || cmake -S "$2" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$1" --target fsdp-train >/dev/null' _ "$BUILD/libtorch2" "$SRC" ||
    { echo "FAIL: could not build fsdp-train against libtorch 2.6 in the chroot"; exit 1; }
  exec "$SRC/scripts/libtorch2-chroot.sh" run env FSDP_IN_LIBTORCH2_CHROOT=1 \
    bash "$HERE/torchrun_test.sh" "$BUILD/libtorch2" "$SRC"
fi

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

# The README's form: static rendezvous on --master-port, hosted by torchrun's agent.
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
