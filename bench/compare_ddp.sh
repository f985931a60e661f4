#!/bin/sh
# fsdp-train against PyTorch's DistributedDataParallel on the same work: the same GPT, batch,
# optimizer and world size, with the same libtorch. Run it where python3-torch matches the
# libtorch fsdp was built with, e.g. in the libtorch 2.6 chroot:
#   scripts/libtorch2-chroot.sh run bench/compare_ddp.sh build-lt2
# A benchmark, not a test: it prints numbers.
# usage: bench/compare_ddp.sh BUILD_DIR [DEVICES] [MODEL] [STEPS] [GLOBAL_BATCH] [SEQ_LEN]
set -eu
build=$1
devices=${2:-4}
model=${3:-small}
steps=${4:-12}
batch=${5:-16}
seq=${6:-128}
here=$(dirname "$0")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}

echo "== PyTorch DDP (python)"
python3 "$here/ddp_peer.py" --nproc "$devices" --model "$model" --steps "$steps" \
  --global-batch "$batch" --seq-len "$seq" 2>&1 | grep ddp_peer:
for strategy in no_shard hybrid_shard full_shard; do
  extra=""
  case $strategy in hybrid*) extra="--mesh 2,$((devices / 2))" ;; esac
  # shellcheck disable=SC2086
  "$build/fsdp-train" --devices "$devices" --model "$model" --steps "$steps" --global-batch "$batch" \
    --seq-len "$seq" --warmup-steps 1 --strategy "$strategy" --quiet --metrics "$work/m.jsonl" $extra \
    >/dev/null
  t=$(sed -n 's/.*"step":\([0-9]*\),.*"step_time_s":\([0-9.e-]*\),.*/\1 \2/p' "$work/m.jsonl" |
      awk '$1 > 2 { print $2 }' | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
  echo "fsdp-train $strategy: median s/step of steps 3..$steps: $t"
done
