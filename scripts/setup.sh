#!/usr/bin/env bash
# Installs everything fsdp.cpp needs from Debian 12's repositories. Idempotent: installs only what
# is missing, so `make test` and `make demo` can call it every time. Needs root or sudo.
set -euo pipefail

PACKAGES=(
  g++ make cmake ninja-build      # toolchain
  libtorch-dev                    # libtorch 1.13.1 (CPU, with c10d + Gloo)
  libgloo-dev                     # c10d's ProcessGroupGloo.hpp includes <gloo/...>
  libopenblas0-pthread            # without it libtorch matmuls use reference BLAS (~10x slower)
  libgtest-dev                    # tests
  libcli11-dev                    # command-line parsing for the tools
  nlohmann-json3-dev              # JSON for --json reports and metrics
  zlib1g-dev                      # CRC-32 of checkpoint files
  python3-torch                   # tests: Python reads our full checkpoints (torch.load)
  gnuplot-nox                     # loss-curve plots (fsdp-plot, fsdp-train --plot)
  iproute2                        # ip netns / veth / tc netem: the two-hosts test
  nftables                        # packet loss on that test's link where the kernel lacks netem
  openmpi-bin                     # the real mpirun test (tests/launchers)
  slurmctld slurmd slurm-client munge  # the real SLURM test: a cluster the test starts itself
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists yet; update only when the install cannot find a package.
if ! $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
