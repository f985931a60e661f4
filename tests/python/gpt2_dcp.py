#!/usr/bin/python3
"""A PyTorch GPT-2 with nanoGPT's parameter names that writes and reads PyTorch Distributed
Checkpoint (DCP) directories, for the DCP interchange test with fsdp-train (issue 40,
tests/dcp_pytorch_test.sh). Needs PyTorch 2.6 (torch.distributed.checkpoint): run it inside the
Debian 13 chroot, scripts/libtorch2-chroot.sh run python3 tests/python/gpt2_dcp.py ...

Written from GPT-2's definition (Radford et al. 2019), with the same math as gpt2_reference.py
and fsdp-train's --model gpt2: learned position embeddings, pre-LayerNorm blocks (eps 1e-5),
causal softmax attention written out, an MLP of width 4C with GELU's tanh form, a final
LayerNorm, and the head tied to the token embedding. transformer.wte has --vocab-rows rows
(50257, or 50304 as nanoGPT, llm.c and fsdp-train pad it; padding rows start at zero and get no
gradient); the head and the softmax cover the first 50257 (the real vocabulary) only.
Parameter names: transformer.wte, transformer.wpe, transformer.h.N.{ln_1, attn.c_attn,
attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, transformer.ln_f, lm_head (nn.Linear without bias whose
weight *is* transformer.wte.weight, so a state dict has both names).

Data: an llm.c token file; step s (0-based) trains on window s: tokens [s*B*T, s*B*T + B*T] as
B rows of T + 1 (llm.c's sequential loader, gpt2_reference.py, fsdp-train --data-order
sequential). AdamW with one parameter group (weight decay on every parameter, as fsdp-train).

Commands (every one prints one JSON object on stdout; notes go to stderr; exit 1 on a failed
check, 2 on bad usage):

  train-save --tokens FILE --out DIR [--procs 1|2] [--steps K] [--continue M] [--dtype D]
             [--write-logits FILE.npy] [--init-llmc FILE] [model and optimizer flags]
      Initialise (--seed, or the weights of an llm.c model file, fsdp-train --export-llmc, which
      checks that this model's losses are fsdp-train's before any checkpoint is involved), train K AdamW steps (windows 0..K-1), then
          model_sd, optim_sd = get_state_dict(model, opt)
          dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=DIR)
      so DIR's keys are model.<fqn>, optim.state.<fqn>.{exp_avg,exp_avg_sq,step} and
      optim.param_groups.0.<key>. --procs 1: one process, no process group. --procs 2: two Gloo
      processes on 127.0.0.1 (a TCPStore on a free port that this process hosts) whose state
      dicts hold DTensors on a 1-D CPU DeviceMesh: Shard(0) for every tensor of one dimension or
      more (distribute_tensor of the trained full tensors), Replicate for the 0-dim AdamW steps;
      DIR gets __0_0.distcp and __1_0.distcp with the halves. --dtype fp32|bf16|fp16: the dtype
      of the saved weights and exp_avg/exp_avg_sq (steps stay fp32). Then it continues M steps
      (windows K..K+M-1) in this process from what was saved (weights and moments rounded to
      --dtype and back, as a reader that loads the directory into fp32 sees them) and prints
      {"losses": [K losses], "continued": [M losses], ...}. --write-logits: the logits
      [B, T, 50257] of window 0 under the saved weights, float32 .npy (the reference for
      load-logits' round trip).

  load-logits --dir DIR --logits FILE.npy [--procs 1|2] [--vocab-rows 50304] [--continue M]
      Builds the model (fsdp-train exports its padded table: --vocab-rows 50304) and dcp.load()s
      DIR into it: --procs 1 into plain tensors, --procs 2 into Shard(0) DTensors on a CPU mesh
      (DCP reshards the saved chunks). Every model.* key the model has (lm_head.weight included)
      must be in DIR, and lm_head.weight must equal transformer.wte.weight. AdamW's state is
      loaded too when DIR has optim.* keys (set_state_dict) and reported: its steps and
      param_groups. Computes the logits of window 0 and compares them with FILE.npy (float32
      [B, T, 50257], fsdp-train --export-logits): prints max|diff| / max|ref| and fails above
      --tol (1e-6). --continue M: then trains M steps from the loaded state (windows from the
      loaded AdamW step on) and prints their losses as "continued".

  to-torch-save --dir DIR --out FILE.pt
      torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DIR, FILE.pt), then checks
      that every tensor of FILE.pt equals what dcp.load gives for the same key.

  metadata --dir DIR
      DIR/.metadata's keys: each tensor's dtype, size and chunks (offsets, sizes, file, byte
      offset, length), and the non-tensor (BYTE_IO) keys.

Model flags (defaults: the tiny GPT-2 of tests/dcp_pytorch_test.sh): --layers 2 --d-model 64
--heads 4 --context 64 --vocab-rows 50304 --batch 12 --seq-len 16 --seed 0. Optimizer flags:
--lr 1e-3 --beta1 0.9 --beta2 0.999 --eps 1e-8 --weight-decay 0.1. --timeout 300: seconds for the
2-process runs (every child is killed when one fails or time runs out).

Example:
  scripts/libtorch2-chroot.sh run python3 tests/python/gpt2_dcp.py train-save \\
      --tokens train.bin --out ck --procs 2 --steps 3 --continue 2 --write-logits ref.npy
  scripts/libtorch2-chroot.sh run python3 tests/python/gpt2_dcp.py load-logits \\
      --dir ck --logits ref.npy --procs 2
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time

# One BLAS thread (before torch loads OpenBLAS): the logits are reproducible to the last bit
# (2 OpenBLAS threads change them by 4e-7 of their largest value, near load-logits' 1e-6).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REAL_VOCAB = 50257
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def note(*a):
    print(*a, file=sys.stderr, flush=True)


# --- the model -------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)  # q, k, v in one [3C, C] weight
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.heads
        q, k, v = self.c_attn(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, hs).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # [B, H, T, T]
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=1e-5)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln_2 = nn.LayerNorm(d_model, eps=1e-5)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, layers, d_model, heads, context, vocab_rows, real_vocab=REAL_VOCAB):
        super().__init__()
        assert d_model % heads == 0 and vocab_rows >= real_vocab
        self.real_vocab = real_vocab
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_rows, d_model),
            wpe=nn.Embedding(context, d_model),
            h=nn.ModuleList(Block(d_model, heads) for _ in range(layers)),
            ln_f=nn.LayerNorm(d_model, eps=1e-5),
        ))
        self.lm_head = nn.Linear(d_model, vocab_rows, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        # GPT-2's init: N(0, 0.02) weights and embeddings, zero biases, LayerNorm 1 / 0, the two
        # projections into the residual stream N(0, 0.02 / sqrt(2 L)); padding rows zero.
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    p.normal_(0.0, 0.02 / math.sqrt(2 * layers))
                elif name.endswith(".weight") and p.dim() == 2:
                    p.normal_(0.0, 0.02)
                elif ".ln_" in name or "ln_f" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.zero_()
            self.transformer.wte.weight[real_vocab:].zero_()

    def forward(self, idx):
        T = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return F.linear(x, self.lm_head.weight[:self.real_vocab])  # the real vocabulary only


def read_tokens(path):
    data = open(path, "rb").read()
    magic, version, ntok = struct.unpack("<3i", data[:12])
    assert magic == 20240520 and version == 1 and len(data) == 1024 + 2 * ntok, \
        f"{path} is not an llm.c token file"
    return torch.frombuffer(bytearray(data[1024:]), dtype=torch.int16).to(torch.int64) & 0xFFFF


def window(data, s, B, T):
    windows = (data.numel() - 1) // (B * T)
    w = data[(s % windows) * B * T:][:B * T + 1]
    return w[:-1].view(B, T), w[1:].view(B, T)


def read_llmc_model(model, path):
    """Copies an llm.c fp32 model file (fsdp-train --export-llmc) into `model`, whose shape must
    match the header's (the vocabulary rows are cut or zero-padded to the model's)."""
    data = open(path, "rb").read()
    header = struct.unpack("<256i", data[:1024])
    assert header[0] == 20240326 and header[1] == 3, f"{path}: not an llm.c fp32 model file"
    max_t, V, L, NH, C, Vp = header[2:8]
    t = model.transformer
    assert (L, C, max_t) == (len(t.h), t.wpe.weight.shape[1], t.wpe.weight.shape[0]), \
        f"{path} has L {L}, C {C}, context {max_t}: another shape than the model"
    flat = torch.frombuffer(bytearray(data[1024:]), dtype=torch.float32)
    at = 0

    def take(*shape):
        nonlocal at
        n = math.prod(shape)
        at += n
        return flat[at - n:at].view(shape)
    wte, wpe = take(Vp, C), take(max_t, C)
    per_layer = [("ln_1.weight", (C,)), ("ln_1.bias", (C,)), ("attn.c_attn.weight", (3 * C, C)),
                 ("attn.c_attn.bias", (3 * C,)), ("attn.c_proj.weight", (C, C)),
                 ("attn.c_proj.bias", (C,)), ("ln_2.weight", (C,)), ("ln_2.bias", (C,)),
                 ("mlp.c_fc.weight", (4 * C, C)), ("mlp.c_fc.bias", (4 * C,)),
                 ("mlp.c_proj.weight", (C, 4 * C)), ("mlp.c_proj.bias", (C,))]
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, shape in per_layer:
            stacked = take(L, *shape)
            for l in range(L):
                params[f"transformer.h.{l}.{name}"].copy_(stacked[l])
        t.ln_f.weight.copy_(take(C))
        t.ln_f.bias.copy_(take(C))
        assert at == flat.numel(), f"{path}: {flat.numel() - at} floats left over"
        rows = min(Vp, t.wte.weight.shape[0])
        t.wte.weight.zero_()
        t.wte.weight[:rows].copy_(wte[:rows])
        t.wpe.weight.copy_(wpe)


def build(a):
    model = GPT2(a.layers, a.d_model, a.heads, a.context, a.vocab_rows)
    if getattr(a, "init_llmc", None):
        read_llmc_model(model, a.init_llmc)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                            weight_decay=a.weight_decay)
    return model, opt


def train(model, opt, data, a, first, count):
    losses = []
    for s in range(first, first + count):
        idx, targets = window(data, s, a.batch, a.seq_len)
        opt.zero_grad()
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def logits_of_window0(model, data, a):
    with torch.no_grad():
        return model(window(data, 0, a.batch, a.seq_len)[0]).float()


# --- processes -------------------------------------------------------------------------------


def run_workers(a, procs):
    """Runs this script's command again as `procs` Gloo ranks (a TCPStore hosted here on a free
    port); kills every child when one fails or --timeout passes. Returns the exit status."""
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                     use_libuv=False)
    children = []
    for rank in range(procs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(procs), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(store.port), GPT2_DCP_WORKER="1", GLOO_SOCKET_IFNAME="lo",
                   OMP_NUM_THREADS="1", USE_LIBUV="0")
        children.append(subprocess.Popen([sys.executable] + sys.argv, env=env))
    deadline = time.monotonic() + a.timeout
    status = 0
    while True:
        codes = [c.poll() for c in children]
        if any(c not in (None, 0) for c in codes):
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            note(f"gpt2_dcp: rank {bad[0][0]} of {procs} exited with {bad[0][1]}; stopping the others")
            status = 1
            break
        if all(c == 0 for c in codes):
            break
        if time.monotonic() > deadline:
            note(f"gpt2_dcp: {procs} processes still running after --timeout {a.timeout} s; killing them")
            status = 1
            break
        time.sleep(0.05)
    for c in children:
        if c.poll() is None:
            c.kill()
        c.wait()
    del store
    return status


def init_worker():
    """In a child of run_workers: the Gloo group and a 1-D CPU mesh over it."""
    import torch.distributed as dist
    from torch.distributed import TCPStore
    from torch.distributed.device_mesh import init_device_mesh
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     use_libuv=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return rank, init_device_mesh("cpu", (world,))


def is_worker():
    return os.environ.get("GPT2_DCP_WORKER") == "1"


def to_dtensors(tree, mesh):
    """Every tensor of a (nested) state dict as a DTensor: Shard(0) with a dimension, else
    Replicate. The full tensors are equal on every rank (the same training, or a loaded file)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    if isinstance(tree, dict):
        return {k: to_dtensors(v, mesh) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_dtensors(v, mesh) for v in tree]
    if isinstance(tree, torch.Tensor):
        placement = Shard(0) if tree.dim() > 0 else Replicate()
        dt = distribute_tensor(tree.detach().float(), mesh, [placement])
        return dt.to(tree.dtype)
    return tree


def full(tree):
    from torch.distributed.tensor import DTensor
    if isinstance(tree, dict):
        return {k: full(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [full(v) for v in tree]
    if isinstance(tree, DTensor):
        return tree.full_tensor()
    return tree


def cast_floats(tree, dtype):
    """The saved form: weights and AdamW moments in `dtype`; the 0-dim steps stay as they are."""
    if isinstance(tree, dict):
        return {k: (v if k == "step" else cast_floats(v, dtype)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [cast_floats(v, dtype) for v in tree]
    if isinstance(tree, torch.Tensor) and tree.is_floating_point():
        return tree.detach().to(dtype)
    return tree


# --- commands --------------------------------------------------------------------------------


def save_dcp(model, opt, out, dtype, mesh=None):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    model_sd, optim_sd = cast_floats(model_sd, dtype), cast_floats(optim_sd, dtype)
    if mesh is not None:
        model_sd, optim_sd = to_dtensors(model_sd, mesh), to_dtensors(optim_sd, mesh)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out)


def round_state(model, opt, dtype):
    """Weights and moments as a reader of the saved checkpoint gets them back in fp32."""
    if dtype == torch.float32:
        return
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
        for st in opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].copy_(st[k].to(dtype).float())


def cmd_train_save(a):
    dtype = DTYPES[a.dtype]
    if is_worker():  # a rank of --procs 2: rebuild the trained state and save its shards
        rank, mesh = init_worker()
        model, opt = build(a)
        state = torch.load(os.environ["GPT2_DCP_STATE"], weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        save_dcp(model, opt, a.out, dtype, mesh)
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
        return 0
    torch.manual_seed(a.seed)
    model, opt = build(a)
    data = read_tokens(a.tokens)
    losses = train(model, opt, data, a, 0, a.steps)
    if a.procs == 1:
        save_dcp(model, opt, a.out, dtype)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["GPT2_DCP_STATE"] = os.path.join(tmp, "state.pt")
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
                       os.environ["GPT2_DCP_STATE"])
            if run_workers(a, a.procs) != 0:
                return 1
    round_state(model, opt, dtype)
    result = {"losses": losses}
    if a.write_logits:
        np.save(a.write_logits, logits_of_window0(model, data, a).numpy())
        result["logits"] = a.write_logits
    result["continued"] = train(model, opt, data, a, a.steps, a.continue_steps)
    result.update(procs=a.procs, dtype=a.dtype, vocab_rows=a.vocab_rows, dir=a.out)
    print(json.dumps(result))
    return 0


def checkpoint_keys(path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = FileSystemReader(path).read_metadata()
    return md, {k: isinstance(v, TensorStorageMetadata) for k, v in md.state_dict_metadata.items()}


def cmd_load_logits(a):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    if a.procs > 1 and not is_worker():
        return run_workers(a, a.procs)
    rank, mesh = init_worker() if is_worker() else (0, None)
    torch.manual_seed(a.seed + 1)  # any values: every one is overwritten by the load
    model, opt = build(a)
    _, keys = checkpoint_keys(a.dir)
    has_optim = any(k.startswith("optim.") for k in keys)
    model_sd, optim_sd = get_state_dict(model, opt)  # AdamW's state exists (a zero-lr step)
    target = {"model": model_sd}
    if has_optim:
        target["optim"] = optim_sd
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    wanted = flatten_state_dict(target)[0]
    missing = sorted(k for k in wanted if k not in keys and not k.startswith("optim.param_groups"))
    if missing:
        note(f"gpt2_dcp: {a.dir} lacks {len(missing)} key(s) the model needs: {', '.join(missing)}")
        return 1
    md = checkpoint_keys(a.dir)[0].state_dict_metadata
    shapes = [f"{k} is {list(md[k].size)} in {a.dir}, {list(v.shape)} in the model"
              for k, v in wanted.items()
              if isinstance(v, torch.Tensor) and k in md and list(md[k].size) != list(v.shape)]
    if shapes:
        note(f"gpt2_dcp: {len(shapes)} shape(s) differ: {'; '.join(shapes)}")
        return 1
    pg_missing = sorted(k for k in wanted if k not in keys)
    extra = sorted(k for k in keys if k not in wanted)
    # Separate tensors per key (lm_head.weight and wte are one tensor in the model): the tie is
    # checked after the load.
    target = {k: (to_dtensors(v, mesh) if mesh is not None else cast_floats(v, torch.float32))
              for k, v in target.items()}
    target["model"] = {k: (v.clone() if mesh is None else v) for k, v in target["model"].items()}
    dcp.load(target, checkpoint_id=a.dir, planner=DefaultLoadPlanner(allow_partial_load=True))
    loaded = full(target) if mesh is not None else target
    m = loaded["model"]
    tie_diff = (m["lm_head.weight"] - m["transformer.wte.weight"]).abs().max().item()
    if has_optim:
        set_state_dict(model, opt, model_state_dict=m, optim_state_dict=loaded["optim"])
    else:
        model.load_state_dict(m)
    status = 0
    result = {"procs": a.procs, "dir": a.dir, "lm_head_minus_wte": tie_diff}
    if tie_diff != 0:
        note(f"gpt2_dcp: lm_head.weight differs from transformer.wte.weight by up to {tie_diff}")
        status = 1
    if rank == 0:
        data = read_tokens(a.tokens)
        got = logits_of_window0(model, data, a)
        ref = torch.from_numpy(np.load(a.logits))
        if tuple(ref.shape) != tuple(got.shape) or ref.dtype != torch.float32:
            note(f"gpt2_dcp: {a.logits} is {ref.dtype} {tuple(ref.shape)}, expected float32 "
                 f"{tuple(got.shape)}")
            return 1
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        result.update(logits_max_abs_diff_over_max_abs=rel, tol=a.tol)
        if not rel <= a.tol:
            note(f"gpt2_dcp: logits differ: max|diff| / max|ref| = {rel:.3e} > {a.tol:g}")
            status = 1
        if has_optim:
            st = loaded["optim"]["state"]
            steps = sorted({float(v["step"]) for v in st.values()})
            pg = {k: v for k, v in loaded["optim"]["param_groups"][0].items() if k != "params"}
            result["optimizer"] = {"params_with_state": len(st), "steps": steps,
                                   "param_group": pg, "param_group_keys_not_in_checkpoint":
                                   [k.rsplit(".", 1)[1] for k in pg_missing]}
            if a.continue_steps:
                result["continued"] = train(model, opt, data, a, int(steps[-1]), a.continue_steps)
        else:
            result["optimizer"] = None
        result["checkpoint_keys_not_loaded"] = extra
        print(json.dumps(result, default=str))
    if mesh is not None:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    return status


def cmd_to_torch_save(a):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    dcp_to_torch_save(a.dir, a.out)
    converted = flatten_state_dict(torch.load(a.out, weights_only=True))[0]
    md, keys = checkpoint_keys(a.dir)
    target = {k: torch.empty(md.state_dict_metadata[k].size,
                             dtype=md.state_dict_metadata[k].properties.dtype)
              for k, is_tensor in keys.items() if is_tensor}
    dcp.load(target, checkpoint_id=a.dir)
    bad = sorted(k for k, v in target.items()
                 if k not in converted or not torch.equal(converted[k], v)
                 or converted[k].dtype != v.dtype)
    result = {"file": a.out, "tensors": len(target), "differ": bad,
              "model_tensors": sum(k.startswith("model.") for k in target),
              "keys_in_file_not_in_dir": sorted(set(converted) - set(keys))}
    print(json.dumps(result))
    if bad:
        note(f"gpt2_dcp: {len(bad)} tensor(s) of {a.out} differ from dcp.load: {', '.join(bad)}")
        return 1
    return 0


def cmd_metadata(a):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata, MetadataIndex
    md, _ = checkpoint_keys(a.dir)
    out = {}
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            chunks = []
            for c in v.chunks:
                s = md.storage_data[MetadataIndex(k, c.offsets)]
                chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes),
                               "file": s.relative_path, "offset": s.offset, "length": s.length})
            out[k] = {"dtype": str(v.properties.dtype).replace("torch.", ""),
                      "size": list(v.size), "chunks": chunks}
        else:
            s = md.storage_data[MetadataIndex(k)]
            out[k] = {"bytes": {"file": s.relative_path, "offset": s.offset, "length": s.length}}
    print(json.dumps(out))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def model_flags(q, vocab_rows=50304):
        q.add_argument("--layers", type=int, default=2)
        q.add_argument("--d-model", type=int, default=64)
        q.add_argument("--heads", type=int, default=4)
        q.add_argument("--context", type=int, default=64)
        q.add_argument("--vocab-rows", type=int, default=vocab_rows, choices=[50257, 50304])
        q.add_argument("--batch", type=int, default=12)
        q.add_argument("--seq-len", type=int, default=16)
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--lr", type=float, default=1e-3)
        q.add_argument("--beta1", type=float, default=0.9)
        q.add_argument("--beta2", type=float, default=0.999)
        q.add_argument("--eps", type=float, default=1e-8)
        q.add_argument("--weight-decay", type=float, default=0.1)
        q.add_argument("--procs", type=int, default=1, choices=[1, 2])
        q.add_argument("--timeout", type=float, default=300)
        q.add_argument("--continue", dest="continue_steps", type=int, default=0)

    q = sub.add_parser("train-save")
    q.add_argument("--tokens", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--steps", type=int, default=3)
    q.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    q.add_argument("--write-logits")
    q.add_argument("--init-llmc", metavar="FILE")
    model_flags(q)
    q = sub.add_parser("load-logits")
    q.add_argument("--dir", required=True)
    q.add_argument("--tokens", required=True)
    q.add_argument("--logits", required=True)
    q.add_argument("--tol", type=float, default=1e-6)
    model_flags(q)
    q = sub.add_parser("to-torch-save")
    q.add_argument("--dir", required=True)
    q.add_argument("--out", required=True)
    q = sub.add_parser("metadata")
    q.add_argument("--dir", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.command in ("train-save", "load-logits") and a.seq_len > a.context:
        p.error(f"--seq-len {a.seq_len} exceeds --context {a.context}")
    return {"train-save": cmd_train_save, "load-logits": cmd_load_logits,
            "to-torch-save": cmd_to_torch_save, "metadata": cmd_metadata}[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
