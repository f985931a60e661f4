"""PyTorch FSDP2 (fully_shard) peer of fsdp-train on one GPU, for scripts/gpu-check.sh.

The GPT of bench/ddp_peer.py (that of tools/fsdp-train/gpt.h: same presets, layers and
initialisation) on cuda:0, each block and then the root wrapped with fully_shard as fsdp-train
wraps its units, the same AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.01), clipping at 1.0,
the same byte-level batches. --precision bf16-mixed: bf16 parameters and gradient reduction with
fp32 master weights (MixedPrecisionPolicy), as fsdp-train's flag of that name. Prints the median
seconds per step of steps 3..N, each step ending in torch.cuda.synchronize().

    python3 bench/fsdp2_peer.py --model small --steps 20 --global-batch 16 --seq-len 256

Needs PyTorch >= 2.4 with CUDA and one GPU; a one-rank NCCL group (FileStore rendezvous).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_peer import GPT, PRESETS, VOCAB, corpus  # noqa: E402

try:  # public since 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # 2.4, 2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=PRESETS)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fsdp2_peer: no GPU visible to this PyTorch")
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method="file://" + os.path.join(tmp, "store"),
                                rank=0, world_size=1)
        try:
            run(args)
        finally:
            dist.destroy_process_group()


def run(args):
    device = torch.device("cuda", 0)
    torch.manual_seed(1234)
    model = GPT(*PRESETS[args.model]).to(device)
    mp = MixedPrecisionPolicy()
    if args.precision == "bf16-mixed":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    data = corpus()
    gen = torch.Generator().manual_seed(1234)
    T = args.seq_len
    times = []
    for _ in range(args.steps):
        starts = torch.randint(len(data) - T - 1, (args.global_batch,), generator=gen)
        batch = torch.stack([data[s:s + T + 1] for s in starts.tolist()]).long().to(device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(batch[:, :T])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    print(f"fsdp2_peer: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, model "
          f"{args.model} ({params} params), {args.precision}, median s/step of steps "
          f"3..{args.steps}: {statistics.median(times[2:]):.4f}")


if __name__ == "__main__":
    main()
