#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU and a pip-installed PyTorch with CUDA: builds
# fsdp.cpp against that PyTorch's libtorch (torch.utils.cmake_prefix_path), runs the GPU tests
# (tests/test_gpu.cpp) and the backend tests, then compares fsdp-train's single-GPU step time
# with PyTorch FSDP2 (fully_shard, bench/fsdp2_peer.py) on the same GPT, fp32 and bf16-mixed,
# and prints a table. A benchmark and a check, not part of `make test`.
#
# usage: scripts/gpu-check.sh [BUILD_DIR]      (default build-gpu)
#   PYTHON=python3           the Python whose torch to build against and to compare with
#   GPU_CHECK_MODEL=small    fsdp-train preset (tiny, small, medium)
#   GPU_CHECK_STEPS=20 GPU_CHECK_BATCH=16 GPU_CHECK_SEQ=256
#
# Needs: the GPU's driver, the CUDA toolkit (nvcc) of torch.version.cuda's major version (libtorch's
# CMake config looks for it), cmake, ninja, g++, and the headers of GoogleTest, nlohmann-json and
# CLI11 and zlib (Debian/Ubuntu: cmake ninja-build g++ libgtest-dev nlohmann-json3-dev
# libcli11-dev zlib1g-dev). PyTorch wheels before 2.7 use the pre-C++11 string ABI: then
# GoogleTest is built here from /usr/src/googletest with that ABI.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
PYTHON=${PYTHON:-python3}
MODEL=${GPU_CHECK_MODEL:-small}
STEPS=${GPU_CHECK_STEPS:-20}
BATCH=${GPU_CHECK_BATCH:-16}
SEQ=${GPU_CHECK_SEQ:-256}
say() { echo "gpu-check: $*"; }

read -r torch_version cuda_version abi torch_dir prefix < <("$PYTHON" -c '
import os, torch, torch.utils
print(torch.__version__, torch.version.cuda or "none", int(torch.compiled_with_cxx11_abi()),
      os.path.dirname(torch.__file__), torch.utils.cmake_prefix_path)')
[ "$cuda_version" != none ] || { say "$PYTHON's torch $torch_version has no CUDA"; exit 1; }
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() else 1)' ||
  { say "torch $torch_version (CUDA $cuda_version) sees no GPU"; exit 1; }
say "torch $torch_version, CUDA $cuda_version, C++11 ABI $abi"
command -v nvidia-smi >/dev/null && nvidia-smi -L

prefix_path="$prefix;$torch_dir"
if [ "$abi" = 0 ]; then
  gtest="$PWD/$BUILD/googletest-abi0"
  if [ ! -e "$gtest/lib/cmake/GTest/GTestConfig.cmake" ]; then
    [ -d /usr/src/googletest ] || { say "install libgtest-dev (needs /usr/src/googletest)"; exit 1; }
    cmake -S /usr/src/googletest -B "$BUILD/googletest-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI=0 -DCMAKE_INSTALL_PREFIX="$gtest" >/dev/null
    cmake --build "$BUILD/googletest-build" --target install >/dev/null
  fi
  prefix_path="$gtest;$prefix_path"
fi

start=$SECONDS
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix_path" \
  -DFSDP_REQUIRE_CUDA=ON -DFSDP_BUILD_BENCH=OFF
cmake --build "$BUILD"
say "build took $((SECONDS - start)) s"

# torch's libraries, for the binaries and for the CUDA runtime libraries pip installs beside it.
export LD_LIBRARY_PATH="$torch_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
tests_rc=0
"$BUILD/tests/test_backend" || tests_rc=$?
"$BUILD/tests/test_gpu" || tests_rc=$?

# Single-GPU step time: median s/step of steps 3..N, fsdp-train's from its metrics file.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
median_of_metrics() {
  sed -n 's/.*"step":\([0-9]*\),.*"step_time_s":\([0-9.e-]*\),.*/\1 \2/p' "$1" |
    awk '$1 > 2 { print $2 }' | sort -g |
    awk '{ v[NR] = $1 } END { if (NR == 0) print "failed"; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
rows=()
for precision in fp32 bf16-mixed; do
  ours=failed
  if "$BUILD/fsdp-train" --devices 1 --model "$MODEL" --steps "$STEPS" --global-batch "$BATCH" \
       --seq-len "$SEQ" --warmup-steps 1 --precision "$precision" --quiet \
       --metrics "$work/m-$precision.jsonl" > "$work/fsdp-train-$precision.log" 2>&1; then
    ours=$(median_of_metrics "$work/m-$precision.jsonl")
  else
    say "fsdp-train $precision failed:"; tail -n 5 "$work/fsdp-train-$precision.log"
  fi
  theirs=$("$PYTHON" bench/fsdp2_peer.py --model "$MODEL" --steps "$STEPS" --global-batch "$BATCH" \
             --seq-len "$SEQ" --precision "$precision" 2>"$work/peer-$precision.log" |
           sed -n 's/.*: \([0-9.]*\)$/\1/p') || true
  [ -n "$theirs" ] || { theirs=failed; say "fsdp2_peer $precision failed:"; tail -n 5 "$work/peer-$precision.log"; }
  rows+=("$precision $ours $theirs")
done

echo
echo "single GPU, model $MODEL, global batch $BATCH x $SEQ tokens, median s/step of steps 3..$STEPS"
printf '| %-10s | %-16s | %-22s | %-10s |\n' precision "fsdp-train" "PyTorch FSDP2 $torch_version" \
  "ours/FSDP2"
printf '|%s|%s|%s|%s|\n' ------------ ------------------ ------------------------ ------------
for row in "${rows[@]}"; do
  read -r precision ours theirs <<< "$row"
  ratio=$(awk -v a="$ours" -v b="$theirs" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b; else print "-" }')
  printf '| %-10s | %-16s | %-22s | %-10s |\n' "$precision" "$ours" "$theirs" "$ratio"
done
[ "$tests_rc" = 0 ] || { say "GPU tests failed (exit $tests_rc)"; exit "$tests_rc"; }
