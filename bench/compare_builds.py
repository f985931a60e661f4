#!/usr/bin/env python3
"""Step time of two fsdp-train builds on the same work, alternated on the same machine.

The question it answers: is a change slower than what came before it (e.g. issue 39's "NO_SHARD
no slower than today")? Both builds run the same GPT-2 124M configuration (llm.c's: B = 4,
T = 64, AdamW, sequential tokens, one thread per rank) in ROUNDS rounds, the order alternating,
and print each run's median steady step (steps after the third) and the median over rounds.
Run it on an idle machine.

usage: bench/compare_builds.py OLD_BUILD_DIR NEW_BUILD_DIR [--strategy no_shard] [--devices 2]
                               [--rounds 3] [--steps 8]
e.g.   git worktree add /tmp/old <commit> && cmake -S /tmp/old -B /tmp/old/build -G Ninja \\
         -DCMAKE_BUILD_TYPE=Release && ninja -C /tmp/old/build fsdp-train
       bench/compare_builds.py /tmp/old/build build
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import GPT2_LLMC, write_llmc_tokens  # noqa: E402


def run(build, tokens, metrics, a):
    cmd = [os.path.join(build, "fsdp-train"), "--model", "gpt2", "--steps", str(a.steps),
           "--global-batch", "4", "--seq-len", "64", "--threads", "1", "--devices",
           str(a.devices), "--strategy", a.strategy, "--data", tokens, "--metrics", metrics,
           "--quiet"] + GPT2_LLMC
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=1800)
    steps = [json.loads(line) for line in open(metrics) if '"loss"' in line]
    return statistics.median(s["step_time_s"] for s in steps[3:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--strategy", default="no_shard")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        tokens = os.path.join(work, "tokens.bin")
        write_llmc_tokens(tokens, 1 << 16, 50257, 24)
        times = {"old": [], "new": []}
        for k in range(a.rounds):
            for name in (("old", "new") if k % 2 == 0 else ("new", "old")):
                t = run(getattr(a, name), tokens, os.path.join(work, "m.jsonl"), a)
                times[name].append(t)
                print(f"round {k + 1} {name}: {t:.4f} s/step", flush=True)
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"{a.strategy} W={a.devices} GPT-2 124M B=4 T=64: old {old:.4f} s/step "
          f"({' / '.join(f'{x:.4f}' for x in times['old'])}), new {new:.4f} s/step "
          f"({' / '.join(f'{x:.4f}' for x in times['new'])}), new/old {new / old:.3f}; "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
