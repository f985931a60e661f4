#!/usr/bin/env bash
# fsdp-train under a real SLURM: Debian 12's slurmctld + two slurmd ("nodes" on this machine) and
# munge, started by this test with every file in a temporary directory and stopped at the end.
# Checks that srun, an sbatch script like docs/launching.md's, and --devices inside a batch script
# give the losses of `fsdp-train --devices 4`; that concurrent steps of one allocation get their own
# rendezvous; that --master-port works under srun; that uneven tasks per node fail at once on
# every rank; that a step on some of the job's nodes meets on its own first node; and that
# -m cyclic still keeps shard groups inside nodes; and that a batch job saved on SIGUSR1 requeues
# itself (--requeue) and the requeued job resumes with the uninterrupted losses.
#   usage: slurm_test.sh BUILD_DIR        (exit 77: skipped, with the reason)
set -u
BUILD=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
TEST_NAME=slurm
source "$HERE/common.sh"
source "$HERE/slurm_cluster.sh"

[ "$(id -u)" -eq 0 ] || skip "needs root to start munged, slurmctld and slurmd"
for tool in munged slurmctld slurmd srun sbatch salloc sinfo squeue scancel ss; do
  command -v "$tool" >/dev/null ||
    skip "$tool is not installed (scripts/setup.sh installs munge, slurmctld, slurmd, slurm-client)"
done

D=$(mktemp -d /tmp/fsdp-slurm.XXXXXX)
chmod 755 "$D"   # munged runs as user munge
cleanup() {
  if [ -n "${SLURM_CONF:-}" ]; then
    scancel --quiet --full --user=root 2>/dev/null
    for _ in $(seq 100); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.1; done
  fi
  slurm_cluster_stop
  rm -rf "$D"
}
trap cleanup EXIT
slurm_cluster_start "$D/cluster" || { echo "FAIL: could not start the SLURM cluster"; exit 1; }
A=$(hostname -s)   # the two emulated nodes: $A and localhost (the job's node list: localhost,$A)

TRAIN=("$BUILD/fsdp-train" --model tiny --steps 3 --quiet --timeout 60)
HSDP=(--strategy hybrid_shard --mesh 2,2)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE

# Reference: fsdp's own launcher.
"${TRAIN[@]}" --devices 4 "${HSDP[@]}" --metrics "$D/ref4.jsonl" >"$D/ref4.out" 2>&1 ||
  fail "reference run --devices 4: $(tail -n 3 "$D/ref4.out")"
"${TRAIN[@]}" --devices 2 --metrics "$D/ref2.jsonl" >"$D/ref2.out" 2>&1 ||
  fail "reference run --devices 2: $(tail -n 3 "$D/ref2.out")"

# srun -n 4 on one node.
timeout 120 srun -N1 -n4 "${TRAIN[@]}" "${HSDP[@]}" --metrics "$D/srun.jsonl" >"$D/srun.out" 2>&1 ||
  fail "srun -N1 -n4: $(tail -n 3 "$D/srun.out")"
expect_same_losses "srun -N1 -n4, HYBRID_SHARD (2, 2)" "$D/srun.jsonl" "$D/ref4.jsonl"

# docs/launching.md's sbatch script: srun inside a batch job.
cat >"$D/readme.sbatch" <<SCRIPT
#!/bin/bash
#SBATCH --nodes=1 --ntasks-per-node=4
srun ${TRAIN[*]} ${HSDP[*]} --metrics $D/sbatch.jsonl
SCRIPT
timeout 120 sbatch --wait -o "$D/sbatch.out" "$D/readme.sbatch" >/dev/null 2>&1 ||
  fail "sbatch with srun: $(tail -n 3 "$D/sbatch.out")"
expect_same_losses "sbatch script with srun" "$D/sbatch.jsonl" "$D/ref4.jsonl"

# A batch script without srun: SLURM_PROCID=0 but no step; --devices 4 launches 4 local ranks.
cat >"$D/devices.sbatch" <<SCRIPT
#!/bin/bash
#SBATCH -N1 -c 4
${TRAIN[*]} --devices 4 ${HSDP[*]} --metrics $D/batch-devices.jsonl
SCRIPT
timeout 120 sbatch --wait -o "$D/batch-devices.out" "$D/devices.sbatch" >/dev/null 2>&1 ||
  fail "sbatch running --devices 4: $(tail -n 3 "$D/batch-devices.out")"
expect_same_losses "batch script with --devices 4 (no srun)" "$D/batch-devices.jsonl" "$D/ref4.jsonl"

# Two job steps at once in one allocation: each is its own world of 2 (own port, own store).
timeout 150 salloc -N1 -n4 bash -c "
  srun --exact -n2 ${TRAIN[*]} --metrics $D/step-a.jsonl >$D/step-a.out 2>&1 & a=\$!
  srun --exact -n2 ${TRAIN[*]} --metrics $D/step-b.jsonl >$D/step-b.out 2>&1 & b=\$!
  wait \$a && wait \$b" >"$D/steps.out" 2>&1 ||
  fail "two concurrent steps: $(tail -n 2 "$D/step-a.out" "$D/step-b.out" "$D/steps.out")"
expect_same_losses "concurrent step A (2 of salloc -n 4)" "$D/step-a.jsonl" "$D/ref2.jsonl"
expect_same_losses "concurrent step B (2 of salloc -n 4)" "$D/step-b.jsonl" "$D/ref2.jsonl"

# --master-port under srun, which sets neither MASTER_ADDR nor MASTER_PORT.
PORT=$(free_port)
timeout 120 srun -N1 -n2 "${TRAIN[@]}" --master-port "$PORT" --metrics "$D/port.jsonl" \
  >"$D/port.out" 2>&1 || fail "srun with --master-port $PORT: $(tail -n 3 "$D/port.out")"
expect_same_losses "srun -n2 with --master-port" "$D/port.jsonl" "$D/ref2.jsonl"

# Uneven tasks per node (srun -N2 -n3 places 2 + 1): every rank fails at once, naming the layout.
start=$(date +%s)
timeout 120 srun -N2 -n3 "${TRAIN[@]}" >"$D/uneven.out" 2>&1 && fail "uneven tasks per node ran"
took=$(($(date +%s) - start))
expect_contains "uneven tasks per node: named" "SLURM_STEP_TASKS_PER_NODE=2,1" "$D/uneven.out"
[ "$took" -lt 45 ] && pass "uneven tasks per node: failed in ${took} s" ||
  fail "uneven tasks per node: took ${took} s (the timeout is 60 s)"

# A step on the second of the job's two nodes: SLURM_STEP_NODELIST (its first host, where rank 0
# runs) differs from the job's list; the step trains.
timeout 150 salloc -N2 --ntasks-per-node=2 bash -c "
  srun -N1 -n1 -w $A printenv SLURM_STEP_NODELIST SLURM_NODELIST >$D/subset-env.out
  srun -N1 -n2 -w $A ${TRAIN[*]} --metrics $D/subset.jsonl >$D/subset.out 2>&1" \
  >"$D/subset-salloc.out" 2>&1 || fail "step on a subset of the nodes: $(tail -n 3 "$D/subset.out")"
if [ "$(head -n 1 "$D/subset-env.out")" = "$A" ] && [ "$(sed -n 2p "$D/subset-env.out")" != "$A" ]; then
  pass "a step's node list differs from the job's ($(echo $(cat "$D/subset-env.out")))"
else
  fail "step node list: $(cat "$D/subset-env.out")"
fi
expect_same_losses "step on a subset of the job's nodes" "$D/subset.jsonl" "$D/ref2.jsonl"

# -m cyclic over two nodes: task ids alternate between the nodes, fsdp numbers ranks node by node,
# so HYBRID_SHARD (2, 2) shards inside each node: no warning, the same losses.
timeout 120 srun -N2 --ntasks-per-node=2 -m cyclic "${TRAIN[@]}" "${HSDP[@]}" \
  --metrics "$D/cyclic.jsonl" >"$D/cyclic.out" 2>&1 || fail "srun -m cyclic: $(tail -n 3 "$D/cyclic.out")"
expect_same_losses "srun -N2 --ntasks-per-node=2 -m cyclic" "$D/cyclic.jsonl" "$D/ref4.jsonl"
if grep -q "spans" "$D/cyclic.out"; then
  fail "-m cyclic: a shard group spans nodes: $(grep spans "$D/cyclic.out" | head -n 1)"
else
  pass "-m cyclic: no shard group spans nodes"
fi

# Preemption (docs/launching.md, "Preemption and requeue"): its requeue script. SIGUSR1 to the batch
# shell (scancel --signal=USR1 --batch, what --signal=B:USR1@T sends) saves the current step;
# --requeue puts the job back in the queue; the requeued job resumes and finishes, and the two
# runs' losses together equal one uninterrupted run's.
RQ=("$BUILD/fsdp-train" --model tiny --steps 40 --quiet --timeout 60 --devices 4)
"${RQ[@]}" --metrics "$D/rq-ref.jsonl" >"$D/rq-ref.out" 2>&1 ||
  fail "reference run for requeue: $(tail -n 3 "$D/rq-ref.out")"
cat >"$D/requeue.sbatch" <<SCRIPT
#!/bin/bash
#SBATCH -N1 -c 4 --requeue --open-mode=append
exec ${RQ[*]} --checkpoint-dir $D/rq --resume --requeue --metrics $D/rq-\${SLURM_RESTART_COUNT:-0}.jsonl
SCRIPT
job=$(sbatch --parsable -o "$D/requeue.out" "$D/requeue.sbatch" 2>"$D/requeue-submit.err")
[ -n "$job" ] || fail "sbatch of the requeue script: $(cat "$D/requeue-submit.err")"
for _ in $(seq 600); do
  [ -f "$D/rq-0.jsonl" ] && [ "$(wc -l <"$D/rq-0.jsonl")" -ge 3 ] && break
  sleep 0.1
done
scancel --signal=USR1 --batch "$job"
# slurmctld gives a requeued batch job a begin time about two minutes ahead; as the cluster's
# admin (root) the test moves it to now once the job is back in the queue, which saves CI those
# two idle minutes. Nothing of fsdp-train's requeue path is skipped: it still ran scontrol requeue.
for _ in $(seq 300); do
  [ "$(squeue -h -j "$job" -o %T 2>/dev/null)" = PENDING ] &&
    grep -q "fsdp-train: requeued SLURM job" "$D/requeue.out" 2>/dev/null && break
  sleep 0.1
done
scontrol update JobId="$job" StartTime=now >/dev/null 2>&1 ||
  echo "note: scontrol update StartTime=now failed: the requeued job waits for its begin time"
for i in $(seq 900); do  # the requeued job runs to the end
  [ -f "$D/rq-1.jsonl" ] && [ "$(wc -l <"$D/rq-1.jsonl")" -ge 1 ] &&
    [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && break
  # An update that lands while slurmctld is still requeueing the job can be overtaken by the
  # requeue's own begin time (seen once: the job had not started 180 s later): while it is
  # pending, move it to now again every 10 s.
  if [ $((i % 50)) -eq 0 ] && [ "$(squeue -h -j "$job" -o %T 2>/dev/null)" = PENDING ]; then
    scontrol update JobId="$job" StartTime=now >/dev/null 2>&1 || true
  fi
  sleep 0.2
done
expect_contains "requeue: saved on SIGUSR1" "fsdp-train: SIGUSR1: saved step" "$D/requeue.out"
expect_contains "requeue: requeued" "fsdp-train: requeued SLURM job $job" "$D/requeue.out"
expect_contains "requeue: resumed" "fsdp-train: resumed from $D/rq/step-" "$D/requeue.out"
cat "$D/rq-0.jsonl" "$D/rq-1.jsonl" >"$D/rq-both.jsonl" 2>/dev/null
expect_same_losses "requeued job (saved on SIGUSR1, resumed)" "$D/rq-both.jsonl" "$D/rq-ref.jsonl"

finish
