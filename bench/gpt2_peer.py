"""PyTorch eager peer of `fsdp-train --model gpt2`, for the bench's GPT-2 section (issue 24).

GPT-2 written as a PyTorch user writes it (nn.Embedding, nn.Linear with fused qkv, nn.LayerNorm,
tanh GELU, the head tied to the token embedding; PyTorch's scaled_dot_product_attention where
this PyTorch has it, else the explicit softmax), its weights read from an llm.c model file
(header [20240326, 3, maxT, V, L, NH, C, Vp], then wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw,
attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb, lnfw, lnfb), trained with llm.c's settings
(AdamW lr 1e-4, betas 0.9/0.999, eps 1e-8, no weight decay, no clipping) on llm.c's sequential
windows of a token file: step s reads tokens [s*B*T, s*B*T + B*T] as B rows of T + 1, rank r of
W its B/W rows. One process, or W processes under DistributedDataParallel (Gloo). Prints and
appends to --json: torch version, median seconds per step of steps 3..N (rank 0, from the
batch to the end of the optimizer step, a barrier included under DDP), and every step's loss
over the global batch.

    python3 bench/gpt2_peer.py --model-file init.bin --tokens train.bin --batch 4 --seq-len 64 \\
        --steps 6 --nproc 2

It starts its own ranks as bench/ddp_peer.py does (bench/peer_ranks.py).
"""
import argparse
import json
import math
import statistics
import struct
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import peer_ranks

SDPA = hasattr(F, "scaled_dot_product_attention")


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.NH, C // self.NH).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=-1))
        if SDPA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
            future = torch.ones(T, T, dtype=torch.bool).triu(1)
            y = att.masked_fill(future, float("-inf")).softmax(dim=-1) @ v
        return self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, max_t, V, L, NH, C, Vp):
        super().__init__()
        self.V = V
        self.wte, self.wpe = nn.Embedding(Vp, C), nn.Embedding(max_t, C)
        self.h = nn.ModuleList(Block(C, NH) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        # The tied head over the real vocabulary (llm.c's softmax covers V, not the padded Vp).
        return F.linear(self.ln_f(x), self.wte.weight[:self.V])


def load_llmc(path):
    data = open(path, "rb").read()
    header = struct.unpack("<256i", data[:1024])
    if header[:2] != (20240326, 3):
        raise SystemExit(f"{path}: not an llm.c fp32 model file (header {header[:2]})")
    max_t, V, L, NH, C, Vp = header[2:8]
    model = GPT2(max_t, V, L, NH, C, Vp)
    flat = torch.frombuffer(bytearray(data[1024:]), dtype=torch.float32)
    at = 0

    def take(*shape):
        nonlocal at
        n = math.prod(shape)
        t = flat[at:at + n].view(shape)
        at += n
        return t

    with torch.no_grad():
        model.wte.weight.copy_(take(Vp, C))
        model.wpe.weight.copy_(take(max_t, C))
        # Stacked over layers, in llm.c's order; nn.Linear's (out, in) layout is llm.c's.
        fields = [("ln_1.weight", (C,)), ("ln_1.bias", (C,)), ("c_attn.weight", (3 * C, C)),
                  ("c_attn.bias", (3 * C,)), ("attn_proj.weight", (C, C)), ("attn_proj.bias", (C,)),
                  ("ln_2.weight", (C,)), ("ln_2.bias", (C,)), ("c_fc.weight", (4 * C, C)),
                  ("c_fc.bias", (4 * C,)), ("mlp_proj.weight", (C, 4 * C)), ("mlp_proj.bias", (C,))]
        for name, shape in fields:
            stacked = take(L, *shape)
            for l in range(L):
                model.h[l].get_parameter(name).copy_(stacked[l])
        model.ln_f.weight.copy_(take(C))
        model.ln_f.bias.copy_(take(C))
    if at != flat.numel():
        raise SystemExit(f"{path}: {flat.numel()} floats after the header, the shapes need {at}")
    return model


def load_tokens(path):
    data = open(path, "rb").read()
    magic, version, ntok = struct.unpack("<3i", data[:12])
    if (magic, version) != (20240520, 1) or len(data) != 1024 + 2 * ntok:
        raise SystemExit(f"{path}: not an llm.c token file")
    return torch.frombuffer(bytearray(data[1024:]), dtype=torch.int16).to(torch.int64) & 0xFFFF


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-file", required=True, help="llm.c fp32 model file")
    ap.add_argument("--tokens", required=True, help="llm.c token file")
    ap.add_argument("--nproc", type=int, default=1, help="1: plain training; more: DDP over Gloo")
    ap.add_argument("--batch", type=int, default=4, help="global batch B (rows per step)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="", help="append the result as one JSON line to this file")
    args = ap.parse_args()
    if args.batch % args.nproc:
        raise SystemExit(f"--batch {args.batch} is not a multiple of --nproc {args.nproc}")
    peer_ranks.start(worker, args, args.nproc, plain=args.nproc == 1)


def worker(rank, args, store_path):
    peer_ranks.join(rank, args.nproc, store_path)
    world = args.nproc
    model = load_llmc(args.model_file)
    params = sum(p.numel() for p in model.parameters())
    if store_path:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    data = load_tokens(args.tokens)
    B, T = args.batch, args.seq_len
    windows = (data.numel() - 1) // (B * T)
    rows = B // world
    times, losses = [], []
    for step in range(args.steps):
        w = data[(step % windows) * B * T:][:B * T + 1]
        x, y = w[:-1].view(B, T)[rank * rows:(rank + 1) * rows], w[1:].view(B, T)[rank * rows:(rank + 1) * rows]
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if store_path:
            dist.barrier()
        times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        if store_path:  # outside the timed part: the loss over the global batch, for the report
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    if rank == 0:
        median = statistics.median(times[2:] if len(times) > 2 else times)
        print(f"gpt2_peer: torch {torch.__version__}, {world} process(es), {params} params, "
              f"{'sdpa' if SDPA else 'explicit softmax'} attention, median s/step of steps "
              f"3..{args.steps}: {median:.4f}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"peer": "ddp" if store_path else "one process",
                                    "torch": torch.__version__, "world": world, "params": params,
                                    "attention": "sdpa" if SDPA else "explicit softmax",
                                    "step_times": times, "median_step_s": median,
                                    "losses": losses}) + "\n")


if __name__ == "__main__":
    main()
