#!/usr/bin/env python3
"""`make bench`: measures fsdp-train and writes BENCHMARKS.md, its charts and the raw results.

What it runs (every run is fsdp-train or a PyTorch script; one intra-op thread per rank):
  peers    fsdp-train (NO_SHARD, FULL_SHARD, HYBRID_SHARD) against PyTorch DistributedDataParallel
           (bench/ddp_peer.py, the same GPT, AdamW, clipping, global batch) at W = 2 and 4, in
           alternating rounds; with Debian 12's python3-torch 1.13 against our libtorch 1.13
           build, and with PyTorch 2.6 against our 2.6 build in the libtorch 2.6 chroot
           (scripts/libtorch2-chroot.sh) when it exists.
  limit    one process, one thread, the same global batch: the machine's limit for W ranks on C
           cores is that step time / min(W, C).
  theory   bytes communicated per step per group and sharded state per rank, measured (fsdp-train
           --metrics) next to the formulas.
  scaling  step time and peak RSS against model size per strategy (W = 4), and against W.
  planner  fsdp-plan --calibrate, then fsdp-plan's predicted step time, sharded state and bytes
           against measured fsdp-train runs: every strategy, W = 2, 4, 8, two model sizes.
  construction  building and sharding a GPT with --init deferred against --init eager, W = 1, 2, 4.
  gpt2     GPT-2 124M at llm.c's configuration (B = 4, T = 64, AdamW, sequential tokens)
           against PyTorch eager (bench/gpt2_peer.py) from the same llm.c model file and tokens,
           one process and W = 2, PyTorch 1.13 and 2.6; peak RSS and sharded state per rank of
           every strategy at W = 2 and 4.
  stepcost GPT-2 124M (B = 4, T = 64): each strategy's step time against NO_SHARD at the same W
           (FULL_SHARD and SHARD_GRAD_OP at W = 2, HYBRID_SHARD (2, 2) at W = 4), 3 alternated
           rounds, with the minor page faults per steady step; --trace's cost on the medium GPT at
           W = 4; one traced FULL_SHARD step drawn by fsdp-plot --trace (the timeline picture).
  plangpt2 fsdp-plan --model gpt2 against fsdp-train on GPT-2 124M (B = 4, T = 64): every strategy
           at W = 2 and 4, 3 alternated rounds: step time and the trace's exposed communication,
           predicted and measured.
  checkpoint  sharded save and load of the medium GPT with AdamW at W = 4 against `dd conv=fsync`
           and `cat` of the same bytes (reads with the page cache dropped, root only, and warm);
           async saves: time training is blocked per save against a memcpy of the staging bytes,
           step time while a save is written in the background against no checkpoints.
  memory   under a per-rank memory cap (a memory cgroup per rank: the kernel kills a rank that
           exceeds it), the largest GPT each strategy trains at W = 4 (--layers varied).

    /usr/bin/python3 bench/bench.py --build build            # ~1.5 h: BENCHMARKS.md, docs/bench/
    /usr/bin/python3 bench/bench.py --build build --quick --out /tmp/b   # one tiny configuration

A benchmark, not a test: it asserts nothing about speed; it prints and writes what it measured.
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = "/usr/bin/python3"  # Debian's, with python3-torch (PATH's python3 may be another)
CHROOT_SCRIPT = os.path.join(ROOT, "scripts", "libtorch2-chroot.sh")
CORES = os.cpu_count() or 1


def log(*a):
    print("bench:", *a, flush=True)


def shown(args):
    """A command as BENCHMARKS.md shows it: paths relative to the repository, no temp files."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--json", "--metrics", "--quiet", "--trace", "--trace-steps"):
            skip = a != "--quiet"
            continue
        out.append(os.path.relpath(a, ROOT) if a.startswith(ROOT + "/") else a)
    return " ".join(out)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


class Runner:
    def __init__(self, build, work, quick):
        self.build, self.work, self.quick = build, work, quick
        self.train = os.path.join(build, "fsdp-train")
        self.env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

    def train_args(self, model, steps, batch, seq, extra):
        """fsdp-train's command; one warm-up step unless `extra` sets --warmup-steps."""
        warmup = [] if "--warmup-steps" in extra else ["--warmup-steps", "1"]
        return [self.train, "--model", model, "--steps", str(steps), "--global-batch", str(batch),
                "--seq-len", str(seq)] + warmup + ["--threads", "1", "--quiet"] + extra

    def fsdp(self, model, steps, batch, seq, world, strategy, extra=(), prefix=(), label=""):
        """One fsdp-train run; returns its per-step metrics and plan."""
        metrics = os.path.join(self.work, "m.jsonl")
        if os.path.exists(metrics):
            os.unlink(metrics)
        mesh = []
        if strategy.startswith("hybrid"):
            mesh = ["--mesh", f"2,{world // 2}"]
        args = self.train_args(model, steps, batch, seq,
                               ["--devices", str(world), "--strategy", strategy] + mesh +
                               list(extra))
        plan = json.loads(subprocess.run(list(prefix) + args + ["--dry-run", "--json"], env=self.env,
                                         check=True, capture_output=True, text=True).stdout)
        t0 = time.time()
        p = subprocess.run(list(prefix) + args + ["--metrics", metrics], env=self.env,
                           capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}): {p.stdout[-500:]} "
                               f"{p.stderr[-500:]}")
        steps_m = [json.loads(line) for line in open(metrics)]
        times = [s["step_time_s"] for s in steps_m]
        return {"kind": "fsdp", "label": label or strategy, "strategy": strategy, "world": world,
                "model": model, "extra": list(extra), "params": plan["total_params"],
                "command": shown(args),
                "step_times": times, "median_step_s": median(times[2:] or times),
                "wall_s": time.time() - t0, "steps": steps_m, "plan": plan, "output": p.stdout}

    def ddp(self, python, model, steps, batch, seq, world, prefix=(), extra=()):
        out = os.path.join(self.work, "peer.jsonl")
        if os.path.exists(out):
            os.unlink(out)
        args = [python, os.path.join(HERE, "ddp_peer.py"), "--nproc", str(world), "--model", model,
                "--steps", str(steps), "--global-batch", str(batch), "--seq-len", str(seq),
                "--json", out] + list(extra)
        subprocess.run(list(prefix) + args, env=self.env, check=True, capture_output=True,
                       timeout=900)
        r = json.loads(open(out).read().splitlines()[-1])
        r.update(kind=r["peer"], label=f"PyTorch {r['peer'].upper() if r['peer'] == 'ddp' else 'one process'}",
                 model=model, command=shown(args))
        return r


    def gpt2_peer(self, python, world, model_file, tokens, steps, batch, seq, prefix=(),
                  heap=False):
        """bench/gpt2_peer.py: PyTorch eager GPT-2, one process or DDP over `world` ranks;
        `heap`: with glibc set as fsdp-train's --heap retain sets it (GPT2_HEAP)."""
        out = os.path.join(self.work, "gpt2_peer.jsonl")
        if os.path.exists(out):
            os.unlink(out)
        args = [python, os.path.join(HERE, "gpt2_peer.py"), "--nproc", str(world), "--model-file",
                model_file, "--tokens", tokens, "--batch", str(batch), "--seq-len", str(seq),
                "--steps", str(steps), "--json", out]
        env = dict(self.env, GLIBC_TUNABLES=GPT2_HEAP) if heap else self.env
        subprocess.run(list(prefix) + args, env=env, check=True, capture_output=True,
                       timeout=1800)
        r = json.loads(open(out).read().splitlines()[-1])
        label = "PyTorch DDP" if world > 1 else "PyTorch, one process"
        r.update(kind="pytorch", label=label + (", fsdp's heap" if heap else ""), heap=heap,
                 command=("GLIBC_TUNABLES=" + GPT2_HEAP + " " if heap else "") + shown(args))
        return r


def libtorch_version():
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "libtorch-dev"],
                             capture_output=True, text=True).stdout
        return out or "unknown"
    except OSError:
        return "unknown"


def machine():
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"cpu": cpu, "cores": CORES, "memory_bytes": mem, "kernel": platform.release(),
            "libtorch": libtorch_version(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_before": os.getloadavg()[0]}


# ---------------------------------------------------------------------------------------------
# Sections

def peers(r, results, quick):
    """fsdp-train vs DDP (and the one-process limit), alternating rounds."""
    model, batch, seq, steps = ("tiny", 8, 32, 4) if quick else ("small", 16, 128, 12)
    worlds = [2] if quick else [2, 4]
    rounds = 1 if quick else 3
    rows = []
    for rnd in range(rounds):
        for w in worlds:
            configs = [("ddp", None), ("fsdp", "no_shard"), ("fsdp", "full_shard")]
            if w >= 4:
                configs.append(("fsdp", "hybrid_shard"))
            if rnd % 2:
                configs.reverse()  # alternate the order: drift hits every config alike
            for kind, strategy in configs:
                log(f"peers 1.13: round {rnd + 1}/{rounds} W={w} {strategy or 'DDP'}")
                if kind == "ddp":
                    res = r.ddp(PY, model, steps, batch, seq, w)
                else:
                    res = r.fsdp(model, steps, batch, seq, w, strategy)
                res.update(round=rnd, torch_line="1.13")
                rows.append(res)
        log(f"limit 1.13: round {rnd + 1}/{rounds}")
        res = r.fsdp(model, steps, batch, seq, 1, "no_shard", label="one process")
        res.update(round=rnd, torch_line="1.13", kind="limit")
        rows.append(res)
        res = r.ddp(PY, model, steps, batch, seq, 1, extra=["--no-ddp"])
        res.update(round=rnd, torch_line="1.13", kind="limit-py")
        rows.append(res)
    results["peers"] = rows
    results["peer_shape"] = {"model": model, "global_batch": batch, "seq_len": seq,
                             "steps": steps, "rounds": rounds}


def runner_26(r, quick):
    """(Runner for our libtorch 2.6 build of fsdp-train in the chroot, command prefix), built
    once; or (None, why not)."""
    build26 = os.path.join(r.build, "libtorch2")
    root = None
    if os.path.exists(CHROOT_SCRIPT):
        root = subprocess.run([CHROOT_SCRIPT, "path"], capture_output=True, text=True).stdout.strip()
    if quick or not root or not os.path.exists(os.path.join(root, "usr/bin/python3")):
        return None, ("quick mode" if quick else "no libtorch 2.6 chroot (make libtorch2-chroot)")
    if not getattr(r, "built_26", False):
        log("building fsdp-train against libtorch 2.6 in", build26)
        subprocess.run([CHROOT_SCRIPT, "run", "bash", "-c",
                        # clang where the chroot has it, as `make` builds by default.
                        'if command -v clang++ >/dev/null; then export CC=clang CXX=clang++; fi; '
                        'cmake -S "$2" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null && '
                        'cmake --build "$1" --target fsdp-train >/dev/null', "_", build26, ROOT],
                       check=True)
        r.built_26 = True
    # The chroot sees the repository (bind-mounted) but not this machine's /tmp.
    work26 = os.path.join(build26, "bench-work")
    os.makedirs(work26, exist_ok=True)
    return Runner(build26, work26, quick), [CHROOT_SCRIPT, "run"]


def peers_26(r, results, quick):
    """The same against PyTorch 2.6, in the libtorch 2.6 chroot, with our 2.6 build."""
    r26, prefix = runner_26(r, quick)
    if r26 is None:
        results["peers_26"] = {"skipped": prefix}
        return
    model, batch, seq, steps, rounds = "small", 16, 128, 12, 2
    rows = []
    for rnd in range(rounds):
        for w in (2, 4):
            configs = [("ddp", None), ("fsdp", "no_shard"), ("fsdp", "full_shard")]
            if rnd % 2:
                configs.reverse()
            for kind, strategy in configs:
                log(f"peers 2.6: round {rnd + 1}/{rounds} W={w} {strategy or 'DDP'}")
                if kind == "ddp":
                    res = r26.ddp("python3", model, steps, batch, seq, w, prefix=prefix)
                else:
                    res = r26.fsdp(model, steps, batch, seq, w, strategy, prefix=prefix)
                res.update(round=rnd, torch_line="2.6")
                rows.append(res)
        log(f"limit 2.6: round {rnd + 1}/{rounds}")
        res = r26.fsdp(model, steps, batch, seq, 1, "no_shard", prefix=prefix, label="one process")
        res.update(round=rnd, torch_line="2.6", kind="limit")
        rows.append(res)
        res = r26.ddp("python3", model, steps, batch, seq, 1, prefix=prefix, extra=["--no-ddp"])
        res.update(round=rnd, torch_line="2.6", kind="limit-py")
        rows.append(res)
    results["peers_26"] = rows
    # PyTorch's own FSDP on CPU, for the record (the error text is quoted in BENCHMARKS.md).
    probe = subprocess.run(prefix + ["python3", os.path.join(HERE, "fsdp_cpu_probe.py")],
                           capture_output=True, text=True, timeout=300)
    results["fsdp_cpu_probe"] = (probe.stdout + probe.stderr).strip()[-2000:]


def scaling(r, results, quick):
    models = ["tiny"] if quick else ["tiny", "small", "medium"]
    strategies = ["full_shard"] if quick else ["no_shard", "shard_grad_op", "full_shard",
                                               "hybrid_shard"]
    w, batch, seq, steps = (2, 4, 32, 3) if quick else (4, 8, 64, 6)  # tiny: context 64
    rows = []
    for m in models:
        for s in strategies:
            log(f"scaling: model {m} {s} W={w}")
            res = r.fsdp(m, steps, batch, seq, w, s)
            rows.append(res)
    results["scaling_model"] = rows
    rows = []
    for world in ([1, 2] if quick else [1, 2, 4, 8]):
        log(f"scaling: W={world}")
        rows.append(r.fsdp("tiny" if quick else "small", steps, 8, seq, world, "full_shard"))
    results["scaling_world"] = rows


def planner(r, results, quick):
    """fsdp-plan's predictions against measured fsdp-train runs (issue 25): calibrate this
    machine (fsdp-plan --calibrate), then every strategy at W = 2, 4, 8 for two model sizes:
    step time, sharded state and bytes per step, predicted and measured."""
    plan = os.path.join(r.build, "fsdp-plan")
    cluster = os.path.join(r.work, "this-machine.json")
    started, load_before = time.time(), os.getloadavg()[0]
    log("planner: fsdp-plan --calibrate")
    subprocess.run([plan, "--calibrate", "--devices", "2" if quick else "4", "--output", cluster]
                   + (["--sizes", "1,4", "--calibrate-steps", "2"] if quick else []),
                   env=r.env, check=True, capture_output=True, text=True, timeout=900)
    models = [("tiny", 8, 32)] if quick else [("small", 16, 128), ("medium", 8, 64)]
    worlds = [2] if quick else [2, 4, 8]
    strategies = ["full_shard", "no_shard"] if quick else [
        "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]
    steps, rounds = (3, 1) if quick else (6, 3)
    configs = [(model, batch, seq, w, s) for model, batch, seq in models for w in worlds
               for s in strategies]
    # Every configuration once per round, the order reversed every other round, so the machine's
    # drift over the run (other jobs, its memory) lands on every strategy alike; the spread of a
    # row over rounds says which measured differences are real.
    measured = {}
    for k in range(rounds):
        for cfg in (configs if k % 2 == 0 else configs[::-1]):
            model, batch, seq, w, s = cfg
            log(f"planner: round {k + 1}/{rounds} {model} W={w} {s}")
            measured.setdefault(cfg, []).append(r.fsdp(model, steps, batch, seq, w, s))
    rows = []
    for cfg in configs:
        model, batch, seq, w, s = cfg
        runs = measured[cfg]
        m = runs[0]
        mesh = f"2,{w // 2}" if s.startswith("hybrid") else None
        p = json.loads(subprocess.run(
            [plan, "--cluster", cluster, "--ranks-per-node", str(w), "--model", model,
             "--seq-len", str(seq), "--micro-batch", str(batch // w), "--clip",
             "--strategy", s, "--json"] + (["--mesh", mesh] if mesh else []),
            env=r.env, check=True, capture_output=True, text=True).stdout)
        c = p["candidates"][0]
        last = m["steps"][-1]
        rows.append({"model": model, "world": w, "strategy": s, "mesh": c["mesh"],
                     "global_batch": batch, "seq_len": seq, "command": m["command"],
                     "measured_step_s": median([x["median_step_s"] for x in runs]),
                     "measured_rounds_s": [x["median_step_s"] for x in runs],
                     "predicted_step_s": c["time_s"]["step"],
                     "predicted_compute_s": c["time_s"]["compute"],
                     "predicted_comm_s": c["time_s"]["communication"],
                     "predicted_update_s": c["time_s"]["update"],
                     "measured_sharded_state": last["sharded_state_bytes"],
                     "predicted_sharded_state": c["memory_bytes"]["sharded_state"],
                     "measured_comm": [last["comm_bytes"]["shard"],
                                       last["comm_bytes"]["replicate"]],
                     "predicted_comm": [c["comm_bytes_per_step"]["shard"]["total"],
                                        c["comm_bytes_per_step"]["replicate"]["all_reduce"]]})
    here = machine()
    results["planner"] = {"cluster": json.load(open(cluster)), "rows": rows, "rounds": rounds,
                          "machine": {"cpu": here["cpu"], "kernel": here["kernel"],
                                      "load_before": load_before,
                                      "load_after": os.getloadavg()[0],
                                      "seconds": time.time() - started},
                          "command": "fsdp-plan --calibrate --devices 4; then per row fsdp-train "
                                     "--metrics and fsdp-plan --cluster FILE --json"}


class MemoryCap:
    """One memory cgroup per rank (v2 memory.max, or v1 memory.limit_in_bytes)."""

    def __init__(self, limit):
        self.limit = limit
        self.base = None
        for base, knob in (("/sys/fs/cgroup", "memory.max"), ("/sys/fs/cgroup/unified", "memory.max"),
                           ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")):
            if os.path.exists(os.path.join(base, knob if knob != "memory.max" else "cgroup.controllers")):
                if knob == "memory.max" and "memory" not in open(os.path.join(base, "cgroup.controllers")).read():
                    continue
                self.base, self.knob = base, knob
                break
        self.kind = None if not self.base else ("v2" if self.knob == "memory.max" else "v1")

    def why_not(self):
        if not self.base:
            return "no memory cgroup controller (v2 memory.max or v1 memory.limit_in_bytes)"
        try:
            d = os.path.join(self.base, f"fsdp-bench-probe-{os.getpid()}")
            os.mkdir(d)
            os.rmdir(d)
        except OSError as e:
            return f"cannot create a memory cgroup under {self.base}: {e}"
        return None

    def groups(self, n):
        out = []
        for i in range(n):
            d = os.path.join(self.base, f"fsdp-bench-{os.getpid()}-rank{i}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, self.knob), "w") as f:
                f.write(str(self.limit))
            if self.kind == "v1" and os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                with open(os.path.join(d, "memory.memsw.limit_in_bytes"), "w") as f:
                    f.write(str(self.limit))
            out.append(d)
        return out

    @staticmethod
    def remove(groups):
        for d in groups:
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except OSError:
                    time.sleep(0.1)


def fits(r, cap, strategy, layers, d_model, heads, world, steps, extra=(), timeout=600):
    """Trains `steps` steps with every rank in its own capped cgroup; True if all ranks finish.
    `extra`: more fsdp-train flags (--init eager, --checkpoint-dir ...)."""
    groups = cap.groups(world)
    with socket.socket() as sock:  # a port nobody listens on now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = r.train_args("medium", steps, world, 32,
                        ["--strategy", strategy, "--layers", str(layers), "--d-model", str(d_model),
                         "--heads", str(heads), "--timeout", "120",
                         # The lean setting for the largest model: glibc gives freed memory back
                         # (the default, retain, keeps it for speed; docs/performance.md).
                         "--heap", "lean"] +
                        (["--mesh", f"2,{world // 2}"] if strategy.startswith("hybrid") else []) +
                        list(extra))
    procs = []
    try:
        for rank in range(world):
            env = dict(r.env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            # The shell joins its rank's cgroup, then becomes fsdp-train.
            cmd = f'echo $$ > "{groups[rank]}/cgroup.procs" && exec "$@"'
            procs.append(subprocess.Popen(["sh", "-c", cmd, "sh"] + args, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          start_new_session=True))
        codes = []
        deadline = time.time() + timeout
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return all(c == 0 for c in codes), codes
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        MemoryCap.remove(groups)


def memory_headline(r, results, quick):
    cap_bytes = 512 << 20
    cap = MemoryCap(cap_bytes)
    why = cap.why_not()
    if why:
        results["memory"] = {"skipped": why}
        return
    world, d_model, heads, steps = 4, 512, 8, 2
    strategies = ["full_shard"] if quick else ["no_shard", "shard_grad_op", "full_shard",
                                               "hybrid_shard"]
    rows = []
    for s in strategies:
        # Double until a run dies, then bisect (to 1 layer, or 2 probes in quick mode).
        lo, hi, probes = 0, None, []
        layers = 1
        while hi is None and layers <= 512:
            ok, codes = fits(r, cap, s, layers, d_model, heads, world, steps)
            probes.append({"layers": layers, "ok": ok, "exit_codes": codes})
            log(f"memory: {s} {layers} layers: {'fits' if ok else 'killed/failed ' + str(codes)}")
            if ok:
                lo = layers
                layers *= 2
                if quick and len(probes) >= 2:
                    break
            else:
                hi = layers
        while hi is not None and hi - lo > 1 and not quick:
            mid = (lo + hi) // 2
            ok, codes = fits(r, cap, s, mid, d_model, heads, world, steps)
            probes.append({"layers": mid, "ok": ok, "exit_codes": codes})
            log(f"memory: {s} {mid} layers: {'fits' if ok else 'killed/failed ' + str(codes)}")
            lo, hi = (mid, hi) if ok else (lo, mid)
        params = None
        if lo:
            plan = json.loads(subprocess.run(
                r.train_args("medium", 1, world, 32, ["--strategy", s, "--layers", str(lo),
                                                      "--d-model", str(d_model), "--heads",
                                                      str(heads), "--devices", str(world)] +
                             (["--mesh", f"2,{world // 2}"] if s.startswith("hybrid") else []) +
                             ["--dry-run", "--json"]),
                env=r.env, check=True, capture_output=True, text=True).stdout)
            params = plan["total_params"]
        rows.append({"strategy": s, "largest_layers": lo, "first_failing_layers": hi,
                     "params": params, "probes": probes})
    results["memory"] = {"cap_bytes": cap_bytes, "cgroup": cap.kind, "world": world,
                         "d_model": d_model, "heads": heads, "steps": steps, "rows": rows,
                         "settings": "--init deferred (default) --heap lean"}


def beyond_one_rank(r, results, quick):
    """A model whose fp32 weights alone exceed a rank's memory cap by 1.25x or more trains under
    FULL_SHARD with deferred construction, checkpoints and exports; --init eager dies."""
    if quick:
        return
    cap_bytes = 1 << 30
    cap = MemoryCap(cap_bytes)
    why = cap.why_not()
    if why:
        results["beyond"] = {"skipped": why}
        return
    world, d_model, heads, layers, steps = 8, 512, 8, 108, 2
    plan = json.loads(subprocess.run(
        r.train_args("medium", 1, world, 32, ["--layers", str(layers), "--d-model", str(d_model),
                                              "--heads", str(heads), "--devices", str(world),
                                              "--dry-run", "--json"]),
        env=r.env, check=True, capture_output=True, text=True).stdout)
    params = plan["total_params"]
    out = tempfile.mkdtemp(prefix="fsdp-beyond-", dir=r.work)
    rows = []
    try:
        for init in ("deferred", "eager"):
            extra = ["--init", init, "--checkpoint-dir", os.path.join(out, init),
                     "--export-full", os.path.join(out, init + ".safetensors")]
            t0 = time.time()
            ok, codes = fits(r, cap, "full_shard", layers, d_model, heads, world, steps, extra,
                             timeout=1200)
            exported = os.path.exists(os.path.join(out, init + ".safetensors"))
            ckpt = os.path.isdir(os.path.join(out, init))
            rows.append({"init": init, "ok": ok, "exit_codes": codes, "exported": exported,
                         "checkpointed": ckpt and bool(os.listdir(os.path.join(out, init))),
                         "wall_s": time.time() - t0})
            log(f"beyond: --init {init}: {'trained, checkpointed, exported' if ok else 'died ' + str(codes)}")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    results["beyond"] = {"cap_bytes": cap_bytes, "world": world, "layers": layers,
                         "d_model": d_model, "params": params, "weights_bytes": params * 4,
                         "steps": steps, "rows": rows}


def construction_cost(r, results, quick):
    """Building and sharding the model, --init deferred against --init eager (issue 20: within
    10%): fsdp-train's own construction timer (the first --metrics record), the two alternated
    round by round so that load drifts hit both alike."""
    worlds, layers, rounds = ([2], 2, 1) if quick else ([1, 2, 4], 16, 5)
    rows = []
    for world in worlds:
        runs = {"deferred": [], "eager": []}
        for _ in range(rounds):
            for init in ("deferred", "eager"):
                m = r.fsdp("medium", 1, world, 32, world, "full_shard",
                           extra=["--layers", str(layers), "--d-model", "512", "--heads", "8",
                                  "--init", init])
                c = m["steps"][0]["construction"]
                runs[init].append({"seconds": c["seconds"], "peak_rss_bytes": c["peak_rss_bytes"]})
        d = median([x["seconds"] for x in runs["deferred"]])
        e = median([x["seconds"] for x in runs["eager"]])
        rows.append({"world": world, "layers": layers, "params": m["params"], "rounds": rounds,
                     "deferred_s": d, "eager_s": e, "ratio": d / e if e else float("nan"),
                     "deferred_peak_rss": median([x["peak_rss_bytes"] for x in runs["deferred"]]),
                     "eager_peak_rss": median([x["peak_rss_bytes"] for x in runs["eager"]]),
                     "runs": runs, "command": m["command"]})
        log(f"construction: W = {world}: deferred {d:.2f} s, eager {e:.2f} s ({d / e:.2f}x)")
    results["construction"] = {"rows": rows, "load_after": os.getloadavg()[0]}


def drop_page_cache():
    """Drops the page cache (root); False where it cannot."""
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def seconds_of(pattern, text):
    """The float group of `pattern` in `text`; RuntimeError naming the pattern if absent."""
    m = re.search(pattern, text)
    if not m:
        raise RuntimeError(f"no {pattern!r} in fsdp-train's output: {text[-800:]}")
    return float(m.group(1))


# llm.c's optimizer settings (AdamW 1e-4, betas 0.9/0.999, eps 1e-8, no weight decay, no
# clipping, constant rate) and its sequential loader: what bench/gpt2_peer.py does.
GPT2_LLMC = ["--lr", "1e-4", "--warmup-steps", "0", "--lr-schedule", "constant", "--beta1", "0.9",
             "--beta2", "0.999", "--adam-eps", "1e-8", "--weight-decay", "0", "--clip-grad", "0",
             "--data-order", "sequential"]
# fsdp-train's default heap policy (--heap retain, include/fsdp/process.h) as glibc's tunables,
# for a PyTorch peer run with the same malloc settings.
GPT2_HEAP = ("glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824:"
             "glibc.malloc.mmap_max=0")
GPT2_STRATEGIES = ["no_shard", "shard_grad_op", "full_shard", "hybrid_shard", "hybrid_shard_zero2"]


def write_llmc_tokens(path, count, vocab, seed):
    """An llm.c token file of `count` pseudo-random ids below `vocab`."""
    import random
    import struct
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
        f.write(struct.pack(f"<{count}H", *(rng.randrange(vocab) for _ in range(count))))


def gpt2_line(r, prefix, python, shape, steps, rounds, batch, seq, line):
    """One torch line's rows: fsdp-train and gpt2_peer.py from the same llm.c model file and
    tokens, one process and W = 2, in alternating rounds."""
    tokens, init = os.path.join(r.work, "gpt2_tokens.bin"), os.path.join(r.work, "gpt2_init.bin")
    write_llmc_tokens(tokens, 1 << 16, 50257, 24)
    # The weights both sides start from: fsdp-train's GPT-2 init, exported after one step.
    subprocess.run(list(prefix) + r.train_args("gpt2", 1, batch, seq, shape + [
        "--data", tokens, "--export-llmc", init]), env=r.env, check=True, capture_output=True,
        timeout=900)
    extra = shape + ["--data", tokens, "--init-from", init] + GPT2_LLMC
    rows = []
    for rnd in range(rounds):
        configs = [(1, None), (1, "heap"), (1, "no_shard"), (2, None), (2, "heap"),
                   (2, "no_shard"), (2, "full_shard")]
        if rnd % 2:
            configs.reverse()
        for world, strategy in configs:
            log(f"gpt2 {line}: round {rnd + 1}/{rounds} W={world} {strategy or 'PyTorch'}")
            if strategy in (None, "heap"):
                res = r.gpt2_peer(python, world, init, tokens, steps, batch, seq, prefix=prefix,
                                  heap=strategy == "heap")
            else:
                res = r.fsdp("gpt2", steps, batch, seq, world, strategy, extra=extra, prefix=prefix)
                res["losses"] = [s["loss"] for s in res["steps"]]
                res.pop("output")
            res.update(round=rnd, torch_line=line, world=world)
            rows.append(res)
    return rows


def gpt2(r, results, quick):
    """GPT-2 124M at llm.c's configuration (B = 4, T = 64, AdamW) against PyTorch eager on the
    same weights and tokens, one process and W = 2; then peak RSS and sharded state per rank for
    every strategy at W = 2 and 4 (issue 24)."""
    shape = ["--layers", "2", "--d-model", "64", "--heads", "4"] if quick else []
    steps, rounds = (3, 1) if quick else (5, 2)
    batch, seq = 4, 64
    out = {"shape": shape, "steps": steps, "rounds": rounds, "batch": batch, "seq_len": seq,
           "rows": gpt2_line(r, (), PY, shape, steps, rounds, batch, seq, "1.13")}
    r26, prefix = runner_26(r, quick)
    if r26 is None:
        out["skipped_26"] = prefix
    else:
        out["rows"] += gpt2_line(r26, prefix, "python3", shape, steps, 1 if quick else rounds,
                                 batch, seq, "2.6")
    tokens = os.path.join(r.work, "gpt2_tokens.bin")
    memory = []
    for world in (2, 4):
        for s in GPT2_STRATEGIES:
            log(f"gpt2 memory: W={world} {s}")
            res = r.fsdp("gpt2", 3, batch, seq, world, s, extra=shape + ["--data", tokens] + GPT2_LLMC)
            last = res["steps"][-1]
            plan = res["plan"]
            memory.append({"strategy": s, "world": world, "mesh": plan["mesh"],
                           "params": plan["total_params"],
                           "sharded_state_bytes": last["sharded_state_bytes"],
                           "plan_sharded_bytes": plan["memory_bytes_per_rank"]["sharded"]["total"],
                           "peak_gathered_params": plan["memory_bytes_per_rank"]["peak_gathered_params"],
                           "peak_rss_bytes": max(st["peak_rss_bytes"] for st in res["steps"]),
                           "command": res["command"]})
    out["memory"] = memory
    results["gpt2"] = out


def _copy_rounds(nbytes, barrier, rounds, out):
    src, dst = bytearray(b"x") * nbytes, bytearray(b"y") * nbytes  # both touched before timing
    for i in range(rounds):
        barrier.wait()
        t = time.perf_counter()
        dst[:] = src
        out.put((i, time.perf_counter() - t))


def memcpy_seconds(nbytes, procs, rounds=5):
    """Per round, the slowest of `procs` processes each copying `nbytes` between touched buffers
    at the same moment: what `procs` ranks staging at once can do on this machine."""
    import multiprocessing as mp
    barrier, out = mp.Barrier(procs), mp.Queue()
    workers = [mp.Process(target=_copy_rounds, args=(nbytes, barrier, rounds, out))
               for _ in range(procs)]
    for w in workers:
        w.start()
    slowest = [0.0] * rounds
    for _ in range(procs * rounds):
        i, t = out.get(timeout=300)
        slowest[i] = max(slowest[i], t)
    for w in workers:
        w.join()
    return slowest


def _write_direct(path, nbytes, barrier, out):
    import mmap
    size = -(-nbytes // 4096) * 4096
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)  # as fsdp's staging buffers: fewer pages to pin
    buf.write(b"\x01" * size)  # touched before timing, like a staging buffer after its first use
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    barrier.wait()
    t0 = time.perf_counter()
    done = 0
    while done < size:
        done += os.pwrite(fd, memoryview(buf)[done:], done)
    os.fsync(fd)
    out.put((t0, time.perf_counter()))
    os.close(fd)


def write_direct(files, work):
    """Seconds for every file written at once, each by its own process with one O_DIRECT write
    from a touched, aligned buffer of its size (huge pages), then fsync: what the disk takes without the
    page cache (whose new pages are slow to first touch in this VM), the way an async save's
    background writers write their staging images."""
    import multiprocessing as mp
    barrier, out = mp.Barrier(len(files)), mp.Queue()
    procs = [mp.Process(target=_write_direct,
                        args=(f"{work}/direct-{i}.bin", os.path.getsize(f), barrier, out))
             for i, f in enumerate(files)]
    for p in procs:
        p.start()
    times = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    for i in range(len(files)):
        os.unlink(f"{work}/direct-{i}.bin")
    return max(t[1] for t in times) - min(t[0] for t in times)


def read_into_new_memory(files):
    """Seconds for one `dd bs=<file size>` per file, all at once: each reads its file into one
    new buffer, as a loading rank does (its shards and optimizer state are new memory)."""
    t = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={f}", "of=/dev/null", f"bs={max(1, os.path.getsize(f))}",
                               "count=1", "iflag=fullblock", "status=none"]) for f in files]
    for p in procs:
        if p.wait(timeout=300) != 0:
            raise RuntimeError(f"dd of {p.args[1]} failed ({p.returncode})")
    return time.perf_counter() - t


def write_like_saves(metrics, every, nbytes, procs, work, stop):
    """While a run writes `metrics`, after each step that is a multiple of `every` (when an async
    save would start), `procs` dd processes write `nbytes` each with O_DIRECT and fsync, as the
    ranks' background writers do: what the disk alone costs the steps. Returns the writes' seconds."""
    seen, took = 0, []
    while not stop.is_set():
        try:
            with open(metrics) as f:
                steps = [json.loads(line)["step"] for line in f if line.endswith("\n")]
        except FileNotFoundError:
            steps = []
        for step in steps[seen:]:
            if step % every == 0:
                t = time.perf_counter()
                dds = [subprocess.Popen(["dd", "if=/dev/zero", f"of={work}/disk-{i}.bin",
                                         f"bs={2**20}", f"count={max(1, nbytes // 2**20)}",
                                         "oflag=direct", "conv=fsync", "status=none"])
                       for i in range(procs)]
                for d in dds:
                    d.wait(timeout=300)
                took.append(time.perf_counter() - t)
        seen = len(steps)
        time.sleep(0.005)
    for i in range(procs):
        if os.path.exists(f"{work}/disk-{i}.bin"):
            os.unlink(f"{work}/disk-{i}.bin")
    return took


def checkpoint_io(r, results, quick):
    """Checkpoint I/O (issue 23): fsdp-train's sharded save (fsyncs included) and load
    (--resume with nothing left to train: the load alone, rank 0's timer) of a GPT with AdamW,
    FULL_SHARD, against `dd conv=fsync` writing and `cat` reading the checkpoint's own files, cold
    (page cache dropped before each read, needs root) and warm; then async saves
    (--checkpoint-async): training's blocked time per save (every save) against a memcpy of
    the staging bytes, and the step time of the steps during which a save is written against a
    run without checkpoints."""
    world, model, rounds = (2, "small", 1) if quick else (4, "medium", 3)
    ck = os.path.join(r.work, "ck")
    shutil.rmtree(ck, ignore_errors=True)
    args = r.train_args(model, 1, world, 64, ["--devices", str(world), "--strategy", "full_shard",
                                              "--checkpoint-dir", ck])
    rows = {"save_s": [], "dd_write_s": [], "load_cold_s": [], "cat_cold_s": [],
            "load_warm_s": [], "cat_warm_s": []}
    dropped = True
    for _ in range(rounds):
        shutil.rmtree(ck, ignore_errors=True)
        out = subprocess.run(args, env=r.env, check=True, capture_output=True, text=True).stdout
        rows["save_s"].append(seconds_of(r"checkpoints .*: \S+ \S+ in ([0-9.]+) s", out))
        step_dir = os.path.join(ck, "step-00000001")
        files = sorted(os.path.join(step_dir, f) for f in os.listdir(step_dir))
        nbytes = sum(os.path.getsize(f) for f in files)
        target = os.path.join(r.work, "dd.bin")
        dd = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M",
                             f"count={(nbytes + 2**20 - 1) // 2**20}", "conv=fsync"],
                            check=True, capture_output=True, text=True).stderr
        rows["dd_write_s"].append(seconds_of(r"copied, ([0-9.e-]+) s", dd))
        os.unlink(target)
        shard_files = [f for f in files if os.path.getsize(f) > 2**20]  # not meta.json, rng.bin
        rows.setdefault("dd_direct_s", []).append(write_direct(shard_files, r.work))
        for temp in ("cold", "warm"):
            if temp == "cold":
                dropped = drop_page_cache() and dropped
            t = time.perf_counter()
            subprocess.run(["cat"] + files, stdout=subprocess.DEVNULL, check=True)
            rows[f"cat_{temp}_s"].append(time.perf_counter() - t)
            # The same files read as the ranks read them: at once, each into new memory.
            if temp == "cold":
                dropped = drop_page_cache() and dropped
            rows.setdefault(f"dd_new_{temp}_s", []).append(read_into_new_memory(files))
            if temp == "cold":
                dropped = drop_page_cache() and dropped
            out = subprocess.run(args + ["--resume"], env=r.env, check=True, capture_output=True,
                                 text=True).stdout
            rows[f"load_{temp}_s"].append(seconds_of(r"resumed from .* in ([0-9.]+) s\)", out))
        # A loader puts the bytes in new memory (new shards, new optimizer state): the first touch
        # of as many fresh bytes (a new mapping, written once) is the other floor of a load.
        t = time.perf_counter()
        fresh = b"\x01" * nbytes
        rows.setdefault("first_touch_s", []).append(time.perf_counter() - t)
        del fresh
    io = {k: median(v) for k, v in rows.items()}
    io["best"] = {k: min(v) for k, v in rows.items()}
    io.update(bytes=nbytes, world=world, model=model, rounds=rounds, runs=rows,
              cache_dropped=dropped, command=shown(args))
    for what in ("save", "load_cold", "load_warm"):
        base = {"save": "dd_write", "load_cold": "cat_cold", "load_warm": "cat_warm"}[what]
        io[f"{what}_ratio"] = io[f"{base}_s"] / io[f"{what}_s"]
        if what == "save":
            io["save_direct_ratio"] = io["dd_direct_s"] / io["save_s"]
        else:
            io[f"{what}_new_memory_ratio"] = io[f"dd_new_{what[5:]}_s"] / io[f"{what}_s"]
        log(f"checkpoint: {what} {nbytes / 2**20 / io[f'{what}_s']:.0f} MiB/s, "
            f"{base} {nbytes / 2**20 / io[f'{base}_s']:.0f} MiB/s ({100 * io[f'{what}_ratio']:.0f}%)")

    steps, every = (6, 2) if quick else (13, 4)
    plain = r.fsdp(model, steps, world, 128, world, "full_shard")
    ck2 = os.path.join(r.work, "ck-async")
    shutil.rmtree(ck2, ignore_errors=True)
    run = r.fsdp(model, steps, world, 128, world, "full_shard", label="async",
                 extra=["--checkpoint-dir", ck2, "--checkpoint-every", str(every),
                        "--checkpoint-async"])
    # Every save, the first too: fsdp-train reserves the staging buffer in the background after
    # the first step (AsyncCheckpointer::reserve), so no save allocates it.
    blocked = [m["checkpoint_blocked_s"] for m in run["steps"] if "checkpoint_blocked_s" in m]
    staging = re.search(r"staging buffer ([0-9.]+) ([KMG])iB", run["output"])
    staging_bytes = int(float(staging.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30}[staging.group(2)])
    background_write_s = float(re.search(r"background write ([0-9.]+) s per save",
                                         run["output"]).group(1))
    copies = memcpy_seconds(staging_bytes, 1)
    together = memcpy_seconds(staging_bytes, world)
    def after_saves(r):
        """Step times of the steps that follow a save's start: its background write runs then."""
        return [m["step_time_s"] for m in r["steps"]
                if m["step"] > every and (m["step"] - 1) % every == 0]

    during = after_saves(run)
    # The disk alone: the same bytes written by dd (O_DIRECT, fsync) at the same moments of a run
    # without checkpoints, so the steps that would follow a save run beside the writes.
    import threading
    metrics, stop, took = os.path.join(r.work, "m.jsonl"), threading.Event(), []
    if os.path.exists(metrics):
        os.unlink(metrics)
    watcher = threading.Thread(target=lambda: took.extend(
        write_like_saves(metrics, every, staging_bytes, world, r.work, stop)))
    watcher.start()
    try:
        disk = r.fsdp(model, steps, world, 128, world, "full_shard", label="disk")
    finally:
        stop.set()
        watcher.join()
    disk_during = after_saves(disk)
    io["async"] = {"blocked_s": median(blocked), "first_blocked_s": blocked[0],
                   "staging_bytes": staging_bytes, "write_s": background_write_s,
                   "memcpy_s": min(copies), "blocked_ratio": median(blocked) / min(copies),
                   "memcpy_together_s": min(together),
                   "blocked_ratio_together": median(blocked) / min(together),
                   "step_during_save_s": median(during), "step_plain_s": plain["median_step_s"],
                   "slowdown": median(during) / plain["median_step_s"] - 1,
                   "step_during_disk_s": median(disk_during), "disk_writes": len(took),
                   "disk_write_s": median(took) if took else None,
                   "disk_slowdown": median(disk_during) / plain["median_step_s"] - 1,
                   "steps": steps, "every": every, "command": run["command"]}
    log(f"checkpoint: async blocked {median(blocked):.4f} s per save "
        f"({io['async']['blocked_ratio']:.2f}x memcpy), steps during a save "
        f"{100 * io['async']['slowdown']:+.1f}%, steps during dd of as many bytes "
        f"{100 * io['async']['disk_slowdown']:+.1f}%")
    io["load_after"] = os.getloadavg()[0]
    results["checkpoint"] = io


# ---------------------------------------------------------------------------------------------

def steady(res, after=3):
    """Median step time and minor faults of the steps after `after` (the first steps allocate)."""
    rest = res["steps"][after:] or res["steps"][-1:]
    return (median([s["step_time_s"] for s in rest]),
            median([s.get("minor_faults", float("nan")) for s in rest]))


def step_cost(r, results, quick):
    """What each strategy costs against NO_SHARD on GPT-2 (issue 39), the trace's own cost, and
    the timeline of one FULL_SHARD step."""
    shape = ["--layers", "2", "--d-model", "64", "--heads", "4"] if quick else []
    steps, rounds, batch, seq = (5, 1, 4, 64) if quick else (8, 3, 4, 64)
    tokens = os.path.join(r.work, "gpt2_tokens.bin")
    write_llmc_tokens(tokens, 1 << 16, 50257, 24)
    extra = shape + ["--data", tokens] + GPT2_LLMC
    configs = [(2, "no_shard"), (2, "full_shard"), (2, "shard_grad_op"), (4, "no_shard"),
               (4, "hybrid_shard")]
    rows = []
    for rnd in range(rounds):
        for world, strategy in (configs if rnd % 2 == 0 else configs[::-1]):
            log(f"stepcost: round {rnd + 1}/{rounds} W={world} {strategy}")
            res = r.fsdp("gpt2", steps, batch, seq, world, strategy, extra=extra)
            step_s, faults = steady(res)
            rows.append({"round": rnd, "world": world, "strategy": strategy, "mesh": res["plan"]["mesh"],
                         "median_step_s": step_s, "minor_faults": faults,
                         "step_times": res["step_times"],
                         "faults": [s.get("minor_faults") for s in res["steps"]],
                         "command": res["command"]})
    # The trace's cost: the medium GPT at W = 4, FULL_SHARD, with and without --trace over the
    # same steady steps, alternated.
    tsteps = 4 if quick else 8
    model, tbatch, tseq = ("tiny", 8, 32) if quick else ("medium", 16, 128)
    overhead = []
    trace_file = os.path.join(r.work, "overhead.json")
    for rnd in range(rounds):
        for traced in ((False, True) if rnd % 2 == 0 else (True, False)):
            log(f"stepcost: trace overhead round {rnd + 1}/{rounds} traced={traced}")
            flags = ["--trace", trace_file, "--trace-steps", f"3:{tsteps}"] if traced else []
            res = r.fsdp(model, tsteps, tbatch, tseq, 4, "full_shard", extra=flags)
            overhead.append({"round": rnd, "traced": traced, "median_step_s": steady(res)[0],
                             "command": res["command"]})
    # The picture: one GPT-2 FULL_SHARD run at W = 2, steps 4 to 5 traced, step 5 drawn.
    out_dir = os.path.join(r.out, "docs", "bench")
    trace = os.path.join(r.work, "timeline.json")
    res = r.fsdp("gpt2", 6, batch, seq, 2, "full_shard",
                 extra=extra + ["--trace", trace, "--trace-steps", "4:5"])
    exposed = re.search(r"exposed communication\s+(.*) of the step", res["output"])
    timeline = {"command": res["command"], "exposed": exposed.group(1) if exposed else None}
    png = os.path.join(out_dir, "timeline-gpt2-full-shard.png")
    plot = subprocess.run([os.path.join(r.build, "fsdp-plot"), "--trace", trace, "--step", "5",
                           "-o", png], capture_output=True, text=True)
    timeline["png"] = os.path.basename(png) if plot.returncode == 0 else None
    timeline["plot_error"] = plot.stderr.strip() if plot.returncode else None
    results["step_cost"] = {"shape": shape, "steps": steps, "rounds": rounds, "batch": batch,
                            "seq_len": seq, "rows": rows, "trace_overhead": overhead,
                            "trace_model": [model, tbatch, tseq, tsteps], "timeline": timeline}


def planner_gpt2(r, results, quick):
    """fsdp-plan against fsdp-train on GPT-2 124M (issue 39): every strategy at W = 2 and 4,
    B = 4, T = 64, 3 alternated rounds: the median steady step and the trace's exposed
    communication, beside fsdp-plan's predicted step and exposed communication for this machine
    (its calibration, the planner section's when that ran first)."""
    plan = os.path.join(r.build, "fsdp-plan")
    cluster = os.path.join(r.work, "this-machine.json")
    started, load_before = time.time(), os.getloadavg()[0]
    if not os.path.exists(cluster):
        log("plangpt2: fsdp-plan --calibrate")
        subprocess.run([plan, "--calibrate", "--devices", "2" if quick else "4", "--output", cluster]
                       + (["--sizes", "1,4", "--calibrate-steps", "2"] if quick else []),
                       env=r.env, check=True, capture_output=True, text=True, timeout=900)
    shape = ["--layers", "2", "--d-model", "64", "--heads", "4"] if quick else []
    steps, rounds, batch, seq = (5, 1, 4, 64) if quick else (7, 3, 4, 64)
    tokens = os.path.join(r.work, "gpt2_tokens.bin")
    write_llmc_tokens(tokens, 1 << 16, 50257, 24)
    trace = os.path.join(r.work, "plan-trace.json")
    extra = shape + ["--data", tokens] + GPT2_LLMC + ["--trace", trace, "--trace-steps",
                                                      f"4:{steps}"]
    strategies = ["full_shard", "no_shard"] if quick else [
        "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]
    configs = [(w, s) for w in ([2] if quick else [2, 4]) for s in strategies]
    measured = {}
    for k in range(rounds):
        for cfg in (configs if k % 2 == 0 else configs[::-1]):
            w, s = cfg
            log(f"plangpt2: round {k + 1}/{rounds} W={w} {s}")
            res = r.fsdp("gpt2", steps, batch, seq, w, s, extra=extra)
            found = re.search(r"exposed communication\s+(.*) of the step", res["output"])
            fractions = [float(x) / 100 for x in re.findall(r"\d+: ([0-9.]+)%", found.group(1))] \
                if found else []
            measured.setdefault(cfg, []).append(
                {"step_s": steady(res)[0], "exposed": fractions, "command": res["command"]})
    rows = []
    for w, s in configs:
        mesh = f"2,{w // 2}" if s.startswith("hybrid") else None
        p = json.loads(subprocess.run(
            [plan, "--cluster", cluster, "--ranks-per-node", str(w), "--model", "gpt2",
             "--seq-len", str(seq), "--micro-batch", str(batch // w), "--strategy", s, "--json"]
            + shape + (["--mesh", mesh] if mesh else []),
            env=r.env, check=True, capture_output=True, text=True).stdout)
        c = p["candidates"][0]
        runs = measured[(w, s)]
        step = median([x["step_s"] for x in runs])
        # A round's exposed share: the mean over its ranks; the row: the median of the rounds.
        exposed = median([sum(x["exposed"]) / len(x["exposed"]) for x in runs if x["exposed"]]
                         or [float("nan")])
        rows.append({"world": w, "strategy": s, "mesh": c["mesh"], "command": runs[0]["command"],
                     "measured_step_s": step, "measured_rounds_s": [x["step_s"] for x in runs],
                     "measured_exposed_fraction": exposed,
                     "measured_exposed_s": exposed * step,
                     "measured_exposed_rounds": [x["exposed"] for x in runs],
                     "predicted_step_s": c["time_s"]["step"],
                     "predicted_compute_s": c["time_s"]["compute"],
                     "predicted_exposed_s": c["time_s"]["exposed"],
                     "predicted_exposed_fraction": c["exposed_fraction"],
                     "predicted_update_s": c["time_s"]["update"]})
    results["planner_gpt2"] = {"rows": rows, "rounds": rounds, "steps": steps, "batch": batch,
                               "seq_len": seq, "shape": shape,
                               "cluster": json.load(open(cluster)).get("name", "this-machine"),
                               "load_before": load_before, "load_after": os.getloadavg()[0],
                               "seconds": time.time() - started}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=ROOT, help="where BENCHMARKS.md and docs/bench/ go")
    ap.add_argument("--quick", action="store_true", help="one tiny configuration per section")
    ap.add_argument("--sections",
                    default="peers,peers26,scaling,memory,beyond,construction,checkpoint,gpt2,"
                            "stepcost,planner,plangpt2")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other sections of an existing docs/bench/results.json")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sections = args.sections.split(",")
    results = {"machine": machine(), "quick": args.quick}
    started = time.time()
    out_dir = os.path.join(args.out, "docs", "bench")
    os.makedirs(out_dir, exist_ok=True)
    if args.merge and os.path.exists(os.path.join(out_dir, "results.json")):
        earlier = json.load(open(os.path.join(out_dir, "results.json")))
        results = dict(earlier, machine=dict(earlier["machine"], **{
            k: v for k, v in results["machine"].items() if k not in ("load_before", "date")}))
        started -= earlier.get("seconds", 0)

    def save():  # after every section: a failure later keeps what was measured
        results["seconds"] = time.time() - started
        results["machine"]["load_after"] = os.getloadavg()[0]
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)

    with tempfile.TemporaryDirectory() as work:
        r = Runner(build, work, args.quick)
        r.out = args.out
        for name, fn in (("peers", peers), ("peers26", peers_26), ("scaling", scaling),
                         ("memory", memory_headline), ("beyond", beyond_one_rank),
                         ("construction", construction_cost), ("checkpoint", checkpoint_io),
                         ("gpt2", gpt2), ("stepcost", step_cost), ("planner", planner),
                         ("plangpt2", planner_gpt2)):
            if name in sections:
                began, load = time.time(), os.getloadavg()[0]
                fn(r, results, args.quick)
                # When and how long each section ran: --merge keeps other runs' sections.
                results.setdefault("section_runs", {})[name] = {
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)),
                    "seconds": time.time() - began, "load_before": load,
                    "load_after": os.getloadavg()[0]}
                save()
    subprocess.run([PY, os.path.join(HERE, "bench_report.py"), os.path.join(out_dir, "results.json"),
                    "--out", args.out], check=True)
    log(f"done in {results['seconds']:.0f} s: {os.path.join(args.out, 'BENCHMARKS.md')}")


if __name__ == "__main__":
    main()
