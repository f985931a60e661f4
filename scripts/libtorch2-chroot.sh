#!/usr/bin/env bash
# A Debian 13 (trixie) chroot with libtorch 2.6 and python3-torch 2.6 (torchrun 2.6), for:
#   - building and testing the project against libtorch 2.x (Debian 12's own is 1.13);
#   - running PyTorch peers (DistributedDataParallel) and the real torchrun 2.6 launcher test
#     (tests/launchers/torchrun_test.sh; Debian 12's torchrun 1.13 crashes on Python 3.11).
#
# usage:
#   scripts/libtorch2-chroot.sh setup            create it (about 5 minutes, ~2 GB, idempotent)
#   scripts/libtorch2-chroot.sh run CMD [ARG..]  run CMD inside, in the current directory
#                                                (bind-mounted at the same path), e.g.
#                                                scripts/libtorch2-chroot.sh run make test
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
PKGS="python3-torch libtorch-dev libgloo-dev libopenblas0-pthread cmake make ninja-build g++ \
      libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev libfmt-dev \
      libspdlog-dev zlib1g-dev ca-certificates procps iproute2"

case "${1:-}" in
  setup)
    chroot_setup "$ROOT" main "$PKGS"
    chroot "$ROOT" python3 -c 'import torch; print("libtorch2 chroot ready: torch", torch.__version__)'
    ;;
  run)
    shift
    [ -x "$ROOT/usr/bin/python3" ] || { echo "run '$0 setup' first" >&2; exit 2; }
    chroot_run "$ROOT" "$@"
    ;;
  path) echo "$ROOT" ;;
  *) sed -n '2,22p' "$0"; exit 2 ;;
esac
