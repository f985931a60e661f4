#!/usr/bin/python3
"""An independent GPT-2 for the parity test (tests/test_train_tokens.cpp, Gpt2.ParityWithPyTorch).

Written from GPT-2's definition (Radford et al. 2019; the model llm.c's train_gpt2.py builds), not
from fsdp-train's C++: it reads an llm.c fp32 model file (header [20240326, 3, maxT, V, L, NH, C,
Vp], then wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw,
fcprojb, lnfw, lnfb) and an llm.c token file, trains STEPS AdamW steps on llm.c's sequential
windows (step s: tokens [s*B*T, s*B*T + B*T] as B rows of T + 1) and prints one JSON object:
{"losses": [loss of step 1 before its update, ...]}.

usage: gpt2_reference.py MODEL.bin TOKENS.bin B T STEPS LR BETA1 BETA2 EPS WEIGHT_DECAY
"""
import json
import math
import struct
import sys

import torch
import torch.nn.functional as F


def read_model(path):
    data = open(path, "rb").read()
    header = struct.unpack("<256i", data[:1024])
    assert header[0] == 20240326 and header[1] == 3, header[:2]
    max_t, V, L, NH, C, Vp = header[2:8]
    shapes = [
        ("wte", (Vp, C)), ("wpe", (max_t, C)),
        ("ln1w", (L, C)), ("ln1b", (L, C)), ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)),
        ("attprojw", (L, C, C)), ("attprojb", (L, C)), ("ln2w", (L, C)), ("ln2b", (L, C)),
        ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)), ("fcprojw", (L, C, 4 * C)),
        ("fcprojb", (L, C)), ("lnfw", (C,)), ("lnfb", (C,)),
    ]
    flat = torch.frombuffer(bytearray(data[1024:]), dtype=torch.float32)
    params, at = {}, 0
    for name, shape in shapes:
        n = math.prod(shape)
        params[name] = flat[at:at + n].view(shape).clone().requires_grad_(True)
        at += n
    assert at == flat.numel(), (at, flat.numel())
    return params, dict(V=V, L=L, NH=NH, C=C)


def read_tokens(path):
    data = open(path, "rb").read()
    magic, version, ntok = struct.unpack("<3i", data[:12])
    assert magic == 20240520 and version == 1 and len(data) == 1024 + 2 * ntok
    return torch.frombuffer(bytearray(data[1024:]), dtype=torch.int16).to(torch.int64) & 0xFFFF


def loss_of(p, cfg, idx, targets):
    B, T = idx.shape
    C, NH, V = cfg["C"], cfg["NH"], cfg["V"]
    hs = C // NH
    x = p["wte"][idx] + p["wpe"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(cfg["L"]):
        h = F.layer_norm(x, (C,), p["ln1w"][l], p["ln1b"][l], eps=1e-5)
        q, k, v = (h @ p["qkvw"][l].t() + p["qkvb"][l]).split(C, dim=-1)
        q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p["attprojw"][l].t() + p["attprojb"][l]
        h = F.layer_norm(x, (C,), p["ln2w"][l], p["ln2b"][l], eps=1e-5)
        h = F.gelu(h @ p["fcw"][l].t() + p["fcb"][l], approximate="tanh")
        x = x + h @ p["fcprojw"][l].t() + p["fcprojb"][l]
    x = F.layer_norm(x, (C,), p["lnfw"], p["lnfb"], eps=1e-5)
    logits = x @ p["wte"][:V].t()  # tied head; the softmax covers the real vocabulary only
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def main():
    model, tokens, B, T, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    lr, beta1, beta2, eps, wd = map(float, sys.argv[6:11])
    torch.set_num_threads(1)
    params, cfg = read_model(model)
    data = read_tokens(tokens)
    opt = torch.optim.AdamW(params.values(), lr=lr, betas=(beta1, beta2), eps=eps,
                            weight_decay=wd)
    windows = (data.numel() - 1) // (B * T)
    losses = []
    for s in range(steps):
        w = data[(s % windows) * B * T:][:B * T + 1]
        opt.zero_grad()
        loss = loss_of(params, cfg, w[:-1].view(B, T), w[1:].view(B, T))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
