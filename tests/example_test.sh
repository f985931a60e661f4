#!/bin/sh
# Installs fsdp into a temporary prefix, builds examples/ against it with find_package(fsdp), the
# way a user's project would, and runs the example (it launches its own 4 ranks).
# usage: example_test.sh BUILD_DIR SOURCE_DIR
set -eu
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" --component dev >/dev/null
cmake -S "$src/examples" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build"
timeout 120 "$work/build/hsdp_mlp"
