#!/usr/bin/env bash
# PyTorch Distributed Checkpoint (DCP) interchange with PyTorch 2.6 itself (issue 40, item 4).
#
#   usage: dcp_pytorch_test.sh BUILD_DIR SOURCE_DIR   (exit 77: skipped without root or the
#                                                      chroot, saying why; on CI it fails instead)
#
# tests/python/gpt2_dcp.py (a PyTorch GPT-2 with nanoGPT's names, run by the Debian 13 chroot's
# python3-torch 2.6: scripts/libtorch2-chroot.sh) trains 3 AdamW steps on a token file and saves
# with torch.distributed.checkpoint: in one process with the unpadded vocabulary (50257 rows),
# and in 2 Gloo processes whose DTensors are Shard(0) on a CPU mesh (two .distcp files with the
# halves of every tensor), saved as bf16. Into:
#   - fsdp-train --init-from DIR --init-from-optimizer on NO_SHARD, FULL_SHARD (--devices 3) and
#     HYBRID_SHARD (--mesh 2,2, --devices 4): its steps 4..6 have PyTorch's losses for the same
#     steps (gpt2_dcp.py's "continued") within 1e-5 relative;
#   - the other way, fsdp-train HYBRID_SHARD (2, 2) trains 3 steps from its own init and writes
#     --export-dcp and --export-logits; torch.distributed.checkpoint.load reads the export into
#     the PyTorch model in 1 and 2 processes (resharding), whose logits of window 0 equal
#     fsdp-train's within 1e-6 (max|diff| / max|ref|), and which, continuing from the exported
#     AdamW state, has the losses of fsdp-train's own steps 4 and 5 within 1e-5 relative;
#     format_utils.dcp_to_torch_save reads the export too.
# The Python side also checks what it wrote: the 2-process .metadata has two chunks per tensor in
# two files, and dcp_to_torch_save gives dcp.load's tensors. (gpt2_dcp.py train-save --init-llmc
# and load-logits on PyTorch's own checkpoints check the Python model itself by hand.)
#
# FSDP_DCP_PYTHON_ONLY=1 stops there (for a build whose fsdp-train has no DCP flags yet);
# otherwise an fsdp-train without --export-dcp is a failure.
set -u
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
TEST_NAME=dcp_pytorch
source "$SRC/tests/launchers/common.sh"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

# PyTorch 2.6: this machine's python3 if it has torch.distributed.checkpoint's state_dict API,
# else the libtorch 2.6 chroot's, which sees only the directory it is run in (bind-mounted).
D=$(mktemp -d /tmp/fsdp-dcp.XXXXXX)
CHROOT=
cleanup() {
  if [ -n "$CHROOT" ] && mountpoint -q "$CHROOT$D" 2>/dev/null; then
    umount -l "$CHROOT$D" && rmdir "$CHROOT$D" 2>/dev/null
  fi
  rm -rf "$D"
}
trap cleanup EXIT
cp "$SRC/tests/python/gpt2_dcp.py" "$D/"
if python3 -c 'import torch.distributed.checkpoint.state_dict' 2>/dev/null; then
  py() { (cd "$D" && timeout 300 python3 gpt2_dcp.py "$@"); }
else
  CHROOT=$("$SRC/scripts/libtorch2-chroot.sh" path)
  # Skips (77) without root or the chroot, saying why; fails instead on CI (CI set).
  "$SRC/scripts/libtorch2-chroot.sh" check || exit $?
  py() { (cd "$D" && timeout 300 "$SRC/scripts/libtorch2-chroot.sh" run python3 gpt2_dcp.py "$@"); }
fi
cd "$D" || exit 1

# Tokens as tests/test_train_tokens.cpp's make_tokens(4000, 7) makes them (llm.c format).
python3 - <<'EOF' || { echo "FAIL: could not write the token file"; exit 1; }
import struct
n, seed, t = 4000, 7, []
x = (seed * 2654435761 + 1) & 0xFFFFFFFF
for i in range(n):
    x = (x * 1664525 + 1013904223) & 0xFFFFFFFF
    t.append((x >> 8) % 50257 if (x >> 28) == 0 else (i % 37) * 1357 % 50257)
t[n // 2] = 50256
with open("train.bin", "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack(f"<{n}H", *t))
EOF

# The model and optimizer on both sides: 2 blocks of width 64, 4 heads, context 64, B 12, T 16
# (12: it splits evenly over 3 ranks and over 4),
# AdamW lr 1e-3 (constant, no warm-up, no clipping), betas (0.9, 0.999), eps 1e-8, wd 0.1.
SHAPE=(--layers 2 --d-model 64 --heads 4 --context 64)
PYFLAGS=("${SHAPE[@]}" --batch 12 --seq-len 16 --lr 1e-3 --beta1 0.9 --beta2 0.999 --eps 1e-8
         --weight-decay 0.1 --tokens train.bin --timeout 240)
TRAIN=("$BUILD/fsdp-train" --model gpt2 "${SHAPE[@]}" --global-batch 12 --seq-len 16 --lr 1e-3
       --warmup-steps 0 --lr-schedule constant --clip-grad 0 --beta1 0.9 --beta2 0.999
       --adam-eps 1e-8 --weight-decay 0.1 --data "$D/train.bin" --data-format llmc
       --data-order sequential --timeout 60 --quiet)
K=3  # steps PyTorch trains before saving
M=3  # steps each side trains after

# json_get FILE EXPR: a Python expression over the JSON object j of FILE's last line.
json_get() { python3 -c 'import json,sys; j=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print(eval(sys.argv[2]))' "$1" "$2"; }

# close NAME GOT WANT: two JSON lists of losses equal within 1e-5 relative.
close() {
  local msg
  if msg=$(python3 -c '
import json, sys
got, want = json.loads(sys.argv[1]), json.loads(sys.argv[2])
if len(got) != len(want) or not got:
    sys.exit(f"{len(got)} losses, expected {len(want)}: got {got} want {want}")
rel = max(abs(g - w) / abs(w) for g, w in zip(got, want))
print(f"max relative difference {rel:.2e}: got {got} want {want}")
sys.exit(0 if rel <= 1e-5 else 1)' "$2" "$3" 2>&1); then
    pass "$1: $msg"
  else
    fail "$1: $msg"
  fi
}

# losses_of FILE FIRST LAST: the --metrics losses of steps FIRST..LAST as a JSON list.
losses_of() {
  python3 -c '
import json, sys
m = {}
for line in open(sys.argv[1]):
    j = json.loads(line)
    if "loss" in j and "val_loss" not in j:
        m[j["step"]] = j["loss"]
print(json.dumps([m[s] for s in range(int(sys.argv[2]), int(sys.argv[3]) + 1) if s in m]))' "$@" 2>/dev/null
}

# --- PyTorch saves, and reads its own checkpoints back ----------------------------------------
for spec in "ck1 1 50257 fp32" "ck2 2 50304 bf16"; do
  set -- $spec
  if py train-save --out "$1" --procs "$2" --vocab-rows "$3" --dtype "$4" --steps $K \
      --continue $M --write-logits "$1.npy" "${PYFLAGS[@]}" >"$1.json" 2>"$1.err"; then
    pass "PyTorch trains $K steps and saves $1 (procs $2, vocab $3, $4): $(cat "$1.json")"
  else
    fail "gpt2_dcp.py train-save $1: $(tail -n 5 "$1.err")"
  fi
done
if py metadata --dir ck2 >ck2.md.json 2>ck2.md.err; then
  if msg=$(python3 -c '
import json, sys
md = json.load(open("ck2.md.json"))
bad = [k for k, v in md.items() if "chunks" in v and v["size"] and
       (len(v["chunks"]) != 2 or len({c["file"] for c in v["chunks"]}) != 2)]
w = md["model.transformer.wte.weight"]["chunks"]
print(f"{len(md)} keys, model.transformer.wte.weight chunks",
      [(c["file"], c["offsets"], c["sizes"]) for c in w])
sys.exit(f"tensors not split in two files: {bad}" if bad else 0)' 2>&1); then
    pass "2 processes saved every tensor as 2 chunks in 2 .distcp files: $msg"
  else
    fail "ck2/.metadata: $msg"
  fi
else
  fail "gpt2_dcp.py metadata ck2: $(tail -n 3 ck2.md.err)"
fi
if py to-torch-save --dir ck2 --out ck2.pt >ck2.pt.json 2>ck2.pt.err; then
  pass "dcp_to_torch_save(ck2) equals dcp.load: $(cat ck2.pt.json)"
else
  fail "gpt2_dcp.py to-torch-save ck2: $(tail -n 3 ck2.pt.err)"
fi

[ -x "$BUILD/fsdp-train" ] || { fail "no $BUILD/fsdp-train"; finish; }

if [ "${FSDP_DCP_PYTHON_ONLY:-}" = 1 ]; then
  echo "FSDP_DCP_PYTHON_ONLY=1: fsdp-train's part not run"
  finish
fi
if ! "$BUILD/fsdp-train" --help 2>&1 | grep -q -- --export-dcp; then
  fail "$BUILD/fsdp-train has no --export-dcp (DCP import/export, issue 40)"
  finish
fi

# --- fsdp-train continues PyTorch's run --------------------------------------------------------
STRATEGIES=("no_shard:--strategy no_shard --devices 1"
            "full_shard_3:--strategy full_shard --devices 3"
            "hybrid_2x2:--strategy hybrid_shard --mesh 2,2 --devices 4")
for ck in ck1 ck2; do
  want=$(json_get "$ck.json" 'j["continued"]')
  for s in "${STRATEGIES[@]}"; do
    name=${s%%:*}
    read -r -a flags <<<"${s#*:}"
    if timeout 180 "${TRAIN[@]}" "${flags[@]}" --init-from "$D/$ck" --init-from-optimizer \
        --steps $((K + M)) --metrics "$D/$ck.$name.jsonl" >"$ck.$name.out" 2>&1; then
      close "fsdp-train $name continues PyTorch's $ck (steps $((K + 1))..$((K + M)))" \
        "$(losses_of "$ck.$name.jsonl" $((K + 1)) $((K + M)))" "$want"
    else
      fail "fsdp-train $name --init-from $ck: $(tail -n 5 "$ck.$name.out")"
    fi
  done
done

# --- PyTorch reads fsdp-train's export ---------------------------------------------------------
HYBRID=(--strategy hybrid_shard --mesh 2,2 --devices 4 --seed 5)
if timeout 180 "${TRAIN[@]}" "${HYBRID[@]}" --steps $((K + 2)) --metrics "$D/full.jsonl" \
    >full.out 2>&1 &&
   timeout 180 "${TRAIN[@]}" "${HYBRID[@]}" --steps $K --metrics "$D/exp.jsonl" \
    --export-dcp "$D/exp" --export-logits "$D/exp.npy" >exp.out 2>&1; then
  pass "fsdp-train hybrid_2x2 exports $K steps: $(ls -a exp | tr '\n' ' ')"
  py metadata --dir exp >exp.md.json 2>exp.md.err &&
    echo "fsdp-train's export: $(python3 -c '
import json
md = json.load(open("exp.md.json"))
files = sorted({c["file"] for v in md.values() for c in v.get("chunks", [])})
print(len(md), "keys,", sum("chunks" in v for v in md.values()), "tensors in", files)')"
  for procs in 1 2; do
    if py load-logits --dir exp --logits exp.npy --procs $procs --vocab-rows 50304 --continue 2 \
        "${PYFLAGS[@]}" >"exp.load$procs.json" 2>"exp.load$procs.err"; then
      pass "PyTorch loads fsdp-train's export in $procs process(es): $(cat "exp.load$procs.json")"
      close "PyTorch continues fsdp-train's export ($procs process(es)) like fsdp-train" \
        "$(json_get "exp.load$procs.json" 'j.get("continued", [])')" \
        "$(losses_of full.jsonl $((K + 1)) $((K + 2)))"
    else
      fail "gpt2_dcp.py load-logits of fsdp-train's export (procs $procs): $(tail -n 5 "exp.load$procs.err")"
    fi
  done
  if py to-torch-save --dir exp --out exp.pt >exp.pt.json 2>exp.pt.err; then
    pass "dcp_to_torch_save reads fsdp-train's export: $(cat exp.pt.json)"
  else
    fail "dcp_to_torch_save of fsdp-train's export: $(tail -n 5 exp.pt.err)"
  fi
else
  fail "fsdp-train hybrid_2x2 --export-dcp: $(tail -n 5 full.out exp.out)"
fi
finish
