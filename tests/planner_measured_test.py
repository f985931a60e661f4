#!/usr/bin/env python3
"""fsdp-plan's memory and bytes against fsdp-train's measured counters (issue 25).

For every strategy at W = 2 and 4 on the tiny model, one optimizer step of fsdp-train --metrics
gives the largest rank's sharded state (parameter and gradient shards, AdamW state) and the
payload bytes it issued on the shard and replicate groups; fsdp-plan --json must predict exactly
those numbers. Also: the planner's GPT presets have fsdp-train's parameter counts.
Usage: planner_measured_test.py BUILD_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

build = sys.argv[1]
train = os.path.join(build, "fsdp-train")
plan = os.path.join(build, "fsdp-plan")
# A calibrated cluster file of the user must not change what the test compares.
env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
           FSDP_CLUSTER_FILE="/nonexistent/this-machine.json")
failures = []


def run(cmd):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return r.stdout


# Every preset fsdp-train builds: the model it builds (--dry-run), the planner's shape-derived
# count (fsdp-plan) and fsdp-train --plan's units (from the built model) count the same parameters.
for model in ("tiny", "small", "medium", "gpt2"):
    dry = json.loads(run([train, "--model", model, "--dry-run", "--json"]))
    planned = json.loads(run([plan, "--model", model, "--json"]))["model"]["parameters"]
    if dry["total_params"] != planned:
        failures.append(f"{model}: fsdp-train has {dry['total_params']} parameters, fsdp-plan {planned}")
    own = json.loads(run([train, "--model", model, "--devices", "2", "--global-batch", "4",
                          "--seq-len", "64", "--plan", "--json"]))["model"]["parameters"]
    if dry["total_params"] != own:
        failures.append(f"{model}: fsdp-train has {dry['total_params']} parameters, its --plan {own}")
# GPT-2's family at another shape: fsdp-plan's gpt2 preset with --layers/--d-model/--heads.
dry = json.loads(run([train, "--model", "gpt2", "--layers", "2", "--d-model", "128", "--heads", "4",
                      "--dry-run", "--json"]))
planned = json.loads(run([plan, "--model", "gpt2", "--layers", "2", "--d-model", "128", "--heads",
                          "4", "--json"]))["model"]["parameters"]
if dry["total_params"] != planned:
    failures.append(f"gpt2 2x128: fsdp-train has {dry['total_params']} parameters, fsdp-plan {planned}")

# --params as people write model sizes.
for text, count, model in (("70e9", 70_000_000_000, "llama2-7b"), ("70B", 70_000_000_000, "llama2-7b"),
                           ("6.7B", 6_700_000_000, "llama2-7b"), ("124M", 124_000_000, "gpt2"),
                           ("350k", 350_000, "tiny"), ("1.5T", 1_500_000_000_000, "llama2-7b"),
                           ("7000000000", 7_000_000_000, "llama2-7b")):
    got = json.loads(run([plan, "--model", model, "--params", text, "--json"]))
    if got["model"]["parameters"] != count:
        failures.append(f"fsdp-plan --params {text}: {got['model']['parameters']} parameters, not {count}")

# Bad input to fsdp-plan: one line on stderr naming the value, exit status 2.
for args, names in ((["--cluster", "dgx-9000"], "dgx-9000"), (["--nodes", "-3"], "-3"),
                    (["--ranks-per-node", "8", "--mesh", "3,-1"], "3"),
                    (["--model", "gpt-7"], "gpt-7"), (["--micro-batch", "0"], "micro-batch 0"),
                    (["--params", "70x"], "70x"), (["--params", "1.5"], "1.5"),
                    (["--params", "-7B"], "-7B")):
    r = subprocess.run([plan] + args, env=env, capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    if r.returncode != 2 or len(lines) != 1 or names not in lines[0]:
        failures.append(f"fsdp-plan {' '.join(args)}: exit {r.returncode}, stderr {r.stderr!r}")

# fsdp-train --plan: the same table for its own model on this machine, its configuration marked.
train_plan = run([train, "--devices", "4", "--strategy", "hybrid_shard", "--mesh", "2,2",
                  "--model", "tiny", "--plan"])
marked = [l for l in train_plan.splitlines() if l.startswith("* ")]
if len(marked) != 1 or "HYBRID_SHARD" not in marked[0] or "(2, 2)" not in marked[0]:
    failures.append(f"fsdp-train --plan marks {marked}, not HYBRID_SHARD (2, 2)")
from_train = json.loads(subprocess.run(
    [train, "--devices", "4", "--model", "tiny", "--plan", "--json"], env=env,
    capture_output=True, text=True, timeout=120, check=True).stdout)
from_plan = json.loads(subprocess.run(
    [plan, "--model", "tiny", "--ranks-per-node", "4", "--micro-batch", "2", "--clip", "--json"],
    env=env, capture_output=True, text=True, timeout=120, check=True).stdout)
if from_train["candidates"] != from_plan["candidates"]:
    failures.append("fsdp-train --plan --json and fsdp-plan --json disagree for the tiny model")

cases = []
for w, hybrid_mesh in ((2, "1,2"), (4, "2,2")):
    for strategy, mesh in (("full_shard", None), ("shard_grad_op", None), ("no_shard", None),
                           ("hybrid_shard", hybrid_mesh), ("hybrid_shard_zero2", hybrid_mesh)):
        cases.append((w, strategy, mesh))

global_batch, seq = 8, 32
with tempfile.TemporaryDirectory() as tmp:
    for w, strategy, mesh in cases:
        metrics = os.path.join(tmp, f"{strategy}-{w}.jsonl")
        mesh_flags = ["--mesh", mesh] if mesh else []
        run([train, "--devices", str(w), "--model", "tiny", "--steps", "1", "--strategy", strategy,
             "--global-batch", str(global_batch), "--seq-len", str(seq), "--metrics", metrics,
             "--quiet"] + mesh_flags)
        with open(metrics) as f:
            measured = json.loads(f.readline())
        p = json.loads(run([plan, "--model", "tiny", "--cluster", "this-machine",
                            "--ranks-per-node", str(w), "--strategy", strategy, "--clip",
                            "--micro-batch", str(global_batch // w), "--seq-len", str(seq),
                            "--json"] + (["--mesh", mesh] if mesh else [])))
        c = p["candidates"][0]
        got = {"sharded_state": c["memory_bytes"]["sharded_state"],
               "shard": c["comm_bytes_per_step"]["shard"]["total"],
               "replicate": c["comm_bytes_per_step"]["replicate"]["all_reduce"]}
        want = {"sharded_state": measured["sharded_state_bytes"],
                "shard": measured["comm_bytes"]["shard"],
                "replicate": measured["comm_bytes"]["replicate"]}
        label = f"{strategy} W={w} mesh {c['mesh']}"
        print(f"{label:40s} measured {want}  planned {got}")
        if got != want:
            failures.append(f"{label}: measured {want}, planned {got}")

if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"OK: {len(cases)} runs, memory and bytes exactly as planned")
