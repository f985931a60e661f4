"""PyTorch DistributedDataParallel peer of fsdp-train, for bench/compare_ddp.sh.

The same byte-level GPT as tools/fsdp-train/gpt.h (same presets, layers, initialisation), the
same AdamW (betas 0.9/0.95, weight decay 0.01), clipping at 1.0, global batch split evenly over
the ranks, Gloo on CPU. Prints the median seconds per step of steps 3..N from rank 0.

    python3 bench/ddp_peer.py --nproc 4 --model small --steps 12 --global-batch 16 --seq-len 128

It starts its own ranks (torch.multiprocessing, FileStore rendezvous): Debian's PyTorch 2.6 has
no libuv, which torchrun's rendezvous insists on.
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import peer_ranks

PRESETS = {  # name: (d_model, layers, heads, context), as in tools/fsdp-train/options.cpp
    "tiny": (64, 2, 4, 64),
    "small": (256, 4, 4, 256),
    "medium": (512, 8, 8, 512),
}
VOCAB = 256


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def attention(self, x):
        B, T, C = x.shape
        dh = C // self.heads
        q, k, v = (m(x).view(B, T, self.heads, dh).transpose(1, 2) for m in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(dh))
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        y = torch.softmax(scores, -1) @ v
        return self.out(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d, layers, heads, context):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        residual_std = 0.02 / math.sqrt(2.0 * layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln" in name:
                    continue
                if name.endswith(".bias"):
                    p.zero_()
                elif name.endswith("out.weight") or name.endswith("proj.weight"):
                    p.normal_(0.0, residual_std)
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, tokens):
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.size(1), device=tokens.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def corpus():
    root = "/usr/share/common-licenses"
    data = b"".join(open(os.path.join(root, f), "rb").read() for f in sorted(os.listdir(root))
                    if os.path.isfile(os.path.join(root, f)))
    return torch.tensor(list(data), dtype=torch.uint8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="small", choices=PRESETS)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=0, help="override the preset's blocks")
    ap.add_argument("--d-model", type=int, default=0, help="override the preset's width")
    ap.add_argument("--heads", type=int, default=0, help="override the preset's heads")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping; 0 = off")
    ap.add_argument("--no-ddp", action="store_true",
                    help="--nproc 1 only: plain training, no process group (the machine's limit)")
    ap.add_argument("--json", default="", help="append the result as one JSON line to this file")
    args = ap.parse_args()
    d, layers, heads, context = PRESETS[args.model]
    args.shape = (args.d_model or d, args.layers or layers, args.heads or heads, context)
    assert args.nproc == 1 or not args.no_ddp, "--no-ddp runs one process"
    peer_ranks.start(worker, args, args.nproc, plain=args.no_ddp)


def worker(rank, args, store_path):
    peer_ranks.join(rank, args.nproc, store_path)
    world = args.nproc
    torch.manual_seed(1234)
    model = GPT(*args.shape)
    if store_path:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    data = corpus()
    gen = torch.Generator().manual_seed(1234)
    per_rank, T = args.global_batch // world, args.seq_len
    times = []
    for step in range(args.steps):
        starts = torch.randint(len(data) - T - 1, (args.global_batch,), generator=gen)
        mine = starts[rank * per_rank:(rank + 1) * per_rank]
        batch = torch.stack([data[s:s + T + 1] for s in mine.tolist()]).long()
        t0 = time.perf_counter()
        logits = model(batch[:, :T])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        if store_path:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        median = statistics.median(times[2:]) if len(times) > 2 else statistics.median(times)
        print(f"ddp_peer: torch {torch.__version__}, {world} ranks, model {args.model} "
              f"({params} params), median s/step of steps 3..{args.steps}: {median:.4f}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"peer": "plain" if not store_path else "ddp",
                                    "torch": torch.__version__, "world": world,
                                    "params": params, "step_times": times,
                                    "median_step_s": median}) + "\n")
    if store_path:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
