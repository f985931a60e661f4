#!/usr/bin/env python3
"""Activation checkpointing's memory and time (docs/performance.md): fsdp-train without and with
--activation-checkpointing, in alternating rounds, printing per run the peak RSS of the largest
rank after each step, the wall time per step and the CPU time per step of all ranks together
(utime + stime from /proc/<pid>/stat, sampled every 0.2 s), steps 2.. only (step 1 also runs the
first forward's output check), and the machine's load average.

    bench/activation_checkpointing.py --build build                 # medium GPT, 3 rounds
    bench/activation_checkpointing.py --build build --rounds 1 --model tiny --seq-len 64
    bench/activation_checkpointing.py --build build --global-batch 16 --heap unchanged
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576 bench/activation_checkpointing.py ...

CPU time is the figure to compare on a shared machine: wall time moves with other jobs' load.
A benchmark, not a test: it asserts nothing; it prints what it measured.
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

TICK = os.sysconf("SC_CLK_TCK")


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def cpu_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    except OSError:
        return None


def run(cmd, metrics):
    """Runs one fsdp-train --devices job; returns per-step records and the load averages seen."""
    proc = subprocess.Popen(cmd + ["--metrics", metrics], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    cpu, steps, loads = {}, [], []
    while True:
        done = proc.poll() is not None
        for rank_pid in children(proc.pid):  # the ranks: children of the supervisor
            seconds = cpu_seconds(rank_pid)
            if seconds is not None:
                cpu[rank_pid] = seconds
        try:
            with open(metrics) as f:
                lines = [json.loads(l) for l in f if l.strip()]
        except OSError:
            lines = []
        for j in lines[len(steps):]:
            steps.append({"step": j["step"], "wall": j["step_time_s"], "cpu": sum(cpu.values()),
                          "rss_mib": j["peak_rss_bytes"] / 2**20})
        loads.append(os.getloadavg()[0])
        if done:
            break
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.read()[-500:]}")
    return steps, loads


def ratio(a, b):
    return a / b if b > 0 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--devices", default="4")
    ap.add_argument("--model", default="medium")
    ap.add_argument("--seq-len", default="512")
    ap.add_argument("--global-batch", default="8")
    ap.add_argument("--steps", default="4")
    ap.add_argument("--heap", default="retain", help="fsdp-train --heap: retain | unchanged")
    a = ap.parse_args()
    base = [os.path.join(a.build, "fsdp-train"), "--devices", a.devices, "--strategy", "full_shard",
            "--model", a.model, "--seq-len", a.seq_len, "--global-batch", a.global_batch,
            "--steps", a.steps, "--heap", a.heap, "--quiet"]
    print(f"{' '.join(base)} [--activation-checkpointing]; "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}, "
          f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', '')!r}")
    print(f"{'run':<10} {'peak RSS MiB by step':<28} {'wall s/step':>11} {'CPU s/step':>10} "
          f"{'load':>9}")
    totals = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for ac in (False, True):
                cmd = base + (["--activation-checkpointing"] if ac else [])
                steps, loads = run(cmd, os.path.join(tmp, f"{r}-{ac}.jsonl"))
                later = steps[1:] or steps
                first = steps[0] if len(steps) > 1 else {"cpu": 0.0}
                wall = sum(s["wall"] for s in later) / len(later)
                cpu = (later[-1]["cpu"] - first["cpu"]) / len(later)
                peak = max(s["rss_mib"] for s in steps)
                totals[ac].append((peak, wall, cpu))
                rss = " ".join("%.0f" % s["rss_mib"] for s in steps)
                label = "with" if ac else "without"
                print(f"{label:<10} {rss:<28} {wall:>11.1f} {cpu:>10.1f} "
                      f"{min(loads):>4.1f}-{max(loads):<4.1f}")
            w, c = totals[False][-1], totals[True][-1]
            print(f"  round {r + 1}: peak RSS {100 * (c[0] / w[0] - 1):+.1f}%, "
                  f"CPU per step {ratio(c[2], w[2]):.2f}x, wall per step {ratio(c[1], w[1]):.2f}x")
    mean = {ac: [sum(x[i] for x in v) / len(v) for i in range(3)] for ac, v in totals.items()}
    w, c = mean[False], mean[True]
    print(f"mean of {a.rounds} round(s): peak RSS {w[0]:.0f} -> {c[0]:.0f} MiB "
          f"({100 * (c[0] / w[0] - 1):+.1f}%), CPU per step {w[2]:.1f} -> {c[2]:.1f} s "
          f"({ratio(c[2], w[2]):.2f}x), wall per step {w[1]:.1f} -> {c[1]:.1f} s "
          f"({ratio(c[1], w[1]):.2f}x)")


if __name__ == "__main__":
    main()
