#!/bin/sh
# Installs fsdp into a temporary prefix, builds examples/ against it with find_package(fsdp), the
# way a user's project would, and runs the examples (each launches its own 4 ranks): hsdp_mlp,
# then lora_finetune (a base model's full checkpoint, adapters trained with the base frozen, the
# adapters exported), whose export Python's torch.load must read as exactly the trainable tensors.
# usage: example_test.sh BUILD_DIR SOURCE_DIR
set -eu
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" --component dev >/dev/null
# With the compiler the package was built with (CXX, when set, wins): a user's project usually
# does, and a sanitizer build's libfsdp.a links only into programs compiled alike.
cxx=${CXX:-$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")}
cmake -S "$src/examples" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
cmake --build "$work/build"
timeout 120 "$work/build/hsdp_mlp"
timeout 60 "$work/build/lora_finetune" --make-base "$work/base.pt"
timeout 180 "$work/build/lora_finetune" --base "$work/base.pt" --out "$work/lora.pt"
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "example_test: /usr/bin/python3 has no torch (make setup installs python3-torch)" >&2
  exit 1
fi
/usr/bin/python3 - "$work/lora.pt" <<'EOF'
import sys, torch
d = torch.load(sys.argv[1])
names = sorted(d)
want = sorted([f"block{b}.{fc}.{ab}" for b in range(4) for fc in ("fc1", "fc2")
               for ab in ("lora_a", "lora_b")] + ["head.weight", "head.bias"])
assert names == want, f"adapter export holds {names}, expected {want}"
assert d["block0.fc1.lora_b"].abs().sum() > 0, "lora_b never trained (still zero)"
print(f"example_test: the adapters export holds the {len(names)} trainable tensors "
      f"(torch {torch.__version__} read it)")
EOF
