#!/usr/bin/env python3
"""Writes BENCHMARKS.md and its charts (gnuplot PNGs) from bench/bench.py's results.json.

    /usr/bin/python3 bench/bench_report.py docs/bench/results.json --out .
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess

NOTES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "BENCHMARKS.notes.md")


# bench.py's section names and the key each leaves in results.json.
SECTION_KEYS = {"peers": "peers", "peers26": "peers_26", "scaling": "scaling_model",
                "memory": "memory", "beyond": "beyond", "construction": "construction",
                "checkpoint": "checkpoint", "gpt2": "gpt2", "stepcost": "step_cost",
                "planner": "planner", "plangpt2": "planner_gpt2"}

def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def fmt_s(x):
    return f"{x:.4f}" if x == x else "n/a"


def fmt_b(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0


def fmt_count(n):
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def details(title, obj):
    """Raw numbers stay in docs/bench/results.json; the page only says where."""
    return f"Raw results: `docs/bench/results.json` ({title}).\n"


def planner_section(pl, cores):
    """fsdp-plan's predictions against measured fsdp-train runs (bench.py's planner section)."""
    rows = pl["rows"]
    c = pl["cluster"]
    def bands(link):
        return ", ".join(f"{b['bytes'] >> 20} MiB {b['busbw_gbs']:.3f}" for b in link.get("bands", []))
    links = "; ".join(f"{name} {bands(link)}" for name, link in (
        ("ring all-gather", c["intra"]), ("ring reduce-scatter", c["intra"].get("reduce_scatter", {})),
        ("Gloo's all-reduce", c["intra"].get("all_reduce", {}))) if link.get("bands"))
    pm = pl.get("machine", {})
    load = (f"load average {pm['load_before']:.1f} before and {pm['load_after']:.1f} after"
            if "load_before" in pm else f"load average {pm.get('load_after', float('nan')):.1f} after")
    spread = {}
    for r in rows:
        g = spread.setdefault((r["model"], r["world"]), {"m": [], "p": []})
        g["m"].append(r["measured_step_s"])
        g["p"].append(r["predicted_step_s"])
    m_spread = max(max(g["m"]) / min(g["m"]) for g in spread.values())
    p_spread = max(max(g["p"]) / min(g["p"]) for g in spread.values())
    md = ["## Planner: predicted against measured", "",
          f"Measured separately from the sections above: {pm.get('cpu', '?')}, {load}, "
          f"{pm.get('seconds', 0) / 60:.0f} min. Within one model and W the measured step times "
          f"differ by up to {m_spread:.2f}x between strategies, the predicted by up to "
          f"{p_spread:.2f}x: where the first is much larger, the machine's load (other jobs), "
          "not the strategy, decided the measured order.", "",
          "`fsdp-plan --calibrate` measured this machine first (compute: "
          f"{c['peak_tflops'] * 1e3:.1f} GFLOP/s per core from one-process fsdp-train steps (the middle of three runs)"
          + (f" less their update; the update: {c['memory_bandwidth_gbs']:.1f} GB/s per core from "
             "libtorch's AdamW over 32 Mi parameters" if c.get("memory_bandwidth_gbs") else "")
          + f"; busbw GB/s by buffer size: {links}; {cores} cores shared by "
          "the ranks), then each row ran fsdp-train (median of steps 3 and on) and asked "
          "`fsdp-plan --cluster FILE --json` for the same model, batch, strategy and mesh. "
          "Sharded state and bytes per step must be equal; step time is the cost model's "
          "prediction: on a CPU whose cores all compute nothing overlaps, so compute + x times "
          "the collectives' benchmarked time (each collective at its own busbw) + the update "
          "(`update`: the optimizer over the rank's shard at the measured bandwidth, shared by the "
          "ranks of a core), x = k r / m at r ranks per core, the links measured "
          f"at m = {c.get('comm_ranks_per_node', 0) / max(1, c.get('cores', 1)):g} per core, and "
          + (f"k = {c['comm_contention']:.2f} measured by the calibration's {c.get('comm_ranks_per_node', 0)}"
             "-rank FULL_SHARD runs of the small GPT (the middle of three; 4 sequences of 128 "
             "tokens, unlike every row below)" if c.get("comm_contention") else "k = 1 (not measured)")
          + " (NOTE [planner cost model]).", "",
          f"Each configuration ran once per round, {pl.get('rounds', 1)} round(s), the order "
          "reversed every other round; `measured` is the median over rounds, `rounds` the "
          "fastest and slowest round.", "",
          "| model | W | strategy | mesh | measured s/step | rounds | predicted | of it update | error | state equal | bytes equal |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    errors = []
    for r in rows:
        err = r["predicted_step_s"] / r["measured_step_s"] - 1
        errors.append(abs(err))
        span = r.get("measured_rounds_s", [r["measured_step_s"]])
        md.append(f"| {r['model']} | {r['world']} | {r['strategy']} | ({r['mesh'][0]}, {r['mesh'][1]}) | "
                  f"{r['measured_step_s']:.4f} | {min(span):.3f}-{max(span):.3f} | "
                  f"{r['predicted_step_s']:.4f} | "
                  + (f"{r['predicted_update_s']:.4f}" if "predicted_update_s" in r else "-")
                  + f" | {100 * err:+.0f}% | "
                  f"{'yes' if r['measured_sharded_state'] == r['predicted_sharded_state'] else '**no**'} | "
                  f"{'yes' if r['measured_comm'] == r['predicted_comm'] else '**no**'} |")
    within = sum(e <= 0.2 for e in errors)
    md += ["", f"Step time within 20%: {within} of {len(errors)} rows; median error "
           f"{100 * med(errors):.0f}%, largest {100 * max(errors):.0f}%.", ""]
    # Ranking of strategies by step time, per model and W.
    md += ["| model | W | measured ranking (fastest first) | predicted ranking | same |",
           "|---|---|---|---|---|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["world"]), []).append(r)
    same = agree = 0
    pairs = {"ordered": 0, "resolved": 0, "right": 0, "wrong": []}
    for (model, w), g in groups.items():
        meas = [x["strategy"] for x in sorted(g, key=lambda x: x["measured_step_s"])]
        pred = [x["strategy"] for x in sorted(g, key=lambda x: x["predicted_step_s"])]
        same += meas == pred
        agree += rounds_agree(g)
        md.append(f"| {model} | {w} | {', '.join(meas)} | {tied_ranking(g)} | "
                  f"{'yes' if meas == pred else 'no'} |")
        rank_pairs(g, pairs, f"{model} W={w}")
    md += ["", f"Rankings equal in {same} of {len(groups)} (model, W) groups (`~` joins "
           f"strategies predicted within {100 * TIE:.0f}% of each other: the same work, or nearly)."
           " A whole ranking of five is a strict test where strategies differ by a few percent: the "
           f"measurement's own rounds rank the five alike in {agree} of {len(groups)} groups, so no "
           "prediction can match a whole measured ranking more often than the measurement repeats "
           "it. So also by pairs: of the "
           f"{pairs['ordered']} pairs of strategies (same model and W) the model puts more than "
           f"{100 * TIE:.0f}% apart, {pairs['resolved']} are resolved by the measurement (every round "
           "of one faster than every round of the other), and the predicted order is the measured "
           f"one in **{pairs['right']} of {pairs['resolved']}**"
           + (" (wrong: " + "; ".join(pairs["wrong"]) + ")" if pairs["wrong"] else "")
           + ". Rerun: `/usr/bin/python3 bench/bench.py --build build --sections planner --merge`.",
           "", "![predicted vs measured step time](docs/bench/planner.png)", ""]
    return md


TIE = 0.02  # predictions closer than this are the same prediction


def tied_ranking(g):
    """The predicted ranking, fastest first, with `~` between strategies predicted within TIE."""
    order = sorted(g, key=lambda x: x["predicted_step_s"])
    out = order[0]["strategy"]
    for a, b in zip(order, order[1:]):
        close = b["predicted_step_s"] <= a["predicted_step_s"] * (1 + TIE)
        out += (" ~ " if close else ", ") + b["strategy"]
    return out


def rounds_agree(g):
    """Whether every round of the measurement ranks the group's strategies alike (a round's time
    of a configuration is its entry in measured_rounds_s)."""
    n = min(len(x.get("measured_rounds_s", [])) for x in g)
    orders = {tuple(x["strategy"] for x in sorted(g, key=lambda x: x["measured_rounds_s"][k]))
              for k in range(n)}
    return n > 1 and len(orders) == 1


def rank_pairs(g, pairs, where):
    """Counts, over pairs of one group: those the model orders (more than TIE apart), those the
    measurement resolves too (round ranges apart), and whether the orders agree."""
    for i, a in enumerate(g):
        for b in g[i + 1:]:
            fast, slow = sorted((a, b), key=lambda x: x["predicted_step_s"])
            if slow["predicted_step_s"] <= fast["predicted_step_s"] * (1 + TIE):
                continue
            pairs["ordered"] += 1
            fr = fast.get("measured_rounds_s", [fast["measured_step_s"]])
            sr = slow.get("measured_rounds_s", [slow["measured_step_s"]])
            if max(fr) < min(sr):
                pairs["resolved"] += 1
                pairs["right"] += 1
            elif max(sr) < min(fr):
                pairs["resolved"] += 1
                pairs["wrong"].append(f"{where} {slow['strategy']} before {fast['strategy']}")


def gpt2_section(g):
    """GPT-2 at llm.c's configuration against PyTorch eager, and memory per strategy."""
    b, t = g["batch"], g["seq_len"]
    name = "GPT-2 124M" if not g["shape"] else "GPT-2 " + " ".join(g["shape"])
    md = [f"## {name} against PyTorch eager (llm.c's configuration)", "",
          f"`--model gpt2` at llm.c's own configuration: B = {b}, T = {t}, one optimizer step per "
          "step, AdamW 1e-4 (betas 0.9/0.999, eps 1e-8, no weight decay, no clipping), llm.c's "
          "sequential windows of one token file. Both sides start from the same llm.c model file "
          "(fsdp-train's GPT-2 init, exported by `--export-llmc`) and read the same tokens: "
          "`bench/gpt2_peer.py` is GPT-2 written as a PyTorch user writes it (nn.Linear with "
          "fused qkv, nn.LayerNorm, tanh GELU, tied head; scaled_dot_product_attention where "
          "PyTorch has it), plain training in one process or DistributedDataParallel over Gloo "
          f"at W = 2 (global batch {b}: {b // 2} rows per rank), run twice: as is, and with "
          "glibc's malloc set as fsdp-train sets it by default (`--heap retain`: no mmap for "
          "blocks under 32 MiB, no trimming; `GLIBC_TUNABLES`, "
          "[The CPU heap](docs/performance.md#the-cpu-heap)), so the "
          "rows show what the heap policy is worth on its own. One thread per process. "
          f"{g['rounds']} round(s), each running every configuration in turn (the order alternates), "
          f"{g['steps']} steps per run, the median of steps 3..{g['steps']}. `vs PyTorch` is the "
          "median over rounds of (this run / PyTorch at the same W in the same round); `loss` is the "
          "largest difference of any step's loss from PyTorch's (the same work, checked).", ""]
    for line in ("1.13", "2.6"):
        rows = [r for r in g["rows"] if r["torch_line"] == line]
        if not rows:
            md += [f"PyTorch {line}: not run ({g.get('skipped_26', 'no rows')}).", ""]
            continue
        attention = next((r["attention"] for r in rows if r["kind"] == "pytorch"), "?")
        md += [f"**PyTorch {line}** (the peer's attention: {attention})", "",
               "| run | W | median s/step per round | median | tokens/s | vs PyTorch | vs PyTorch, "
               "fsdp's heap | loss |", "|---|---|---|---|---|---|---|---|"]
        for world in (1, 2):
            group = [r for r in rows if r["world"] == world]
            peer = {r["round"]: r for r in group if r["kind"] == "pytorch" and not r.get("heap")}
            tuned = {r["round"]: r for r in group if r["kind"] == "pytorch" and r.get("heap")}

            def ratio(mine, against):
                xs = [r["median_step_s"] / against[r["round"]]["median_step_s"] for r in mine
                      if r["round"] in against]
                return f"{med(xs):.3f}x" if xs else "n/a"
            by_label = {}  # in the order the runs came
            for r in group:
                label = r["label"] if r["kind"] == "pytorch" else "fsdp " + r["strategy"].upper()
                by_label.setdefault(label, []).append(r)
            for label, mine in by_label.items():
                per_round = [r["median_step_s"] for r in mine]
                m = med(per_round)
                vs, vs_tuned = ratio(mine, peer), ratio(mine, tuned)
                if mine[0]["kind"] == "pytorch":
                    loss = "-"
                else:
                    diffs = [abs(a - c) for r in mine if r["round"] in peer
                             for a, c in zip(r["losses"], peer[r["round"]]["losses"])]
                    loss = f"{max(diffs):.1e}" if diffs else "n/a"
                md.append(f"| {label} | {world} | {' / '.join(fmt_s(x) for x in per_round)} | "
                          f"{fmt_s(m)} | {b * t / m:.0f} | {vs} | {vs_tuned} | {loss} |")
        md.append("")
    mem = g.get("memory") or []
    if mem:
        md += ["**Memory per rank, every strategy** (3 steps, the largest rank): sharded state "
               "measured (`--metrics` sharded_state_bytes: parameter, gradient and AdamW shards) "
               "against P·(4 + 4 + 8)/S for P parameters sharded over S ranks; peak RSS per rank "
               "(the largest sample of any step) and what it holds beyond the sharded state "
               "(gathered units, activations, libtorch and the runtime). The plan's largest "
               "gathered moment (`--dry-run`) is shown for reference.", "",
               "| strategy | W | mesh (R, S) | sharded state | P·16/S | ratio | gathered peak (plan) "
               "| peak RSS | RSS - sharded |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mem:
            R, S = r["mesh"]
            formula = r["params"] * 16 / S
            md.append(f"| {r['strategy']} | {r['world']} | ({R}, {S}) | "
                      f"{fmt_b(r['sharded_state_bytes'])} | {fmt_b(formula)} | "
                      f"{r['sharded_state_bytes'] / formula:.4f} | "
                      f"{fmt_b(r['peak_gathered_params'] * 4)} | {fmt_b(r['peak_rss_bytes'])} | "
                      f"{fmt_b(r['peak_rss_bytes'] - r['sharded_state_bytes'])} |")
        md.append("")
    cmd = next((r["command"] for r in g["rows"] if r["kind"] == "fsdp"), "")
    peer = next((r["command"] for r in g["rows"] if r["kind"] == "pytorch"), "")
    md += [f"Rerun: `bench/bench.py --sections gpt2 --merge` (fsdp: `{cmd}`; PyTorch: "
           f"`{peer}`; the token file is {1 << 16} pseudo-random ids, the model file "
           "fsdp-train's `--export-llmc` after one step).", ""]
    return md


def planner_gpt2_section(c):
    """fsdp-plan against fsdp-train on GPT-2: step time and exposed communication."""
    name = "GPT-2 124M" if not c["shape"] else "GPT-2 " + " ".join(c["shape"])
    md = [f"## fsdp-plan on {name}", "",
          f"`--model gpt2`, B = {c['batch']}, T = {c['seq_len']}, AdamW as llm.c runs it, one "
          f"thread per rank: every strategy at W = 2 and 4, {c['rounds']} rounds alternating the "
          f"order, {c['steps']} steps per run (the step: the median of those after the third; "
          "the trace records steps 4 on). Predicted: `fsdp-plan --model gpt2` with this "
          "machine's calibration (`fsdp-plan --calibrate`). Exposed communication: the share of "
          "the step the training thread waits on collectives, measured by `--trace` (the mean "
          "of the ranks, the median of the rounds) and predicted by the cost model (its step "
          "minus its compute). `error` is predicted / measured - 1; the goal is within 20%.", "",
          "| strategy | W | mesh | measured s/step (rounds) | predicted | error | exposed "
          "measured | exposed predicted |", "|---|---|---|---|---|---|---|---|"]
    for r in c["rows"]:
        R, S = r["mesh"]
        err = r["predicted_step_s"] / r["measured_step_s"] - 1
        md.append(f"| {r['strategy'].upper()} | {r['world']} | ({R}, {S}) | "
                  f"{fmt_s(r['measured_step_s'])} "
                  f"({' / '.join(fmt_s(x) for x in r['measured_rounds_s'])}) | "
                  f"{fmt_s(r['predicted_step_s'])} | {100 * err:+.0f}% | "
                  f"{100 * r['measured_exposed_fraction']:.0f}% "
                  f"({fmt_s(r['measured_exposed_s'])}) | "
                  f"{100 * r['predicted_exposed_fraction']:.0f}% "
                  f"({fmt_s(r['predicted_exposed_s'])}) |")
    worst = max(abs(r["predicted_step_s"] / r["measured_step_s"] - 1) for r in c["rows"])
    md += ["", f"Largest step-time error: {100 * worst:.0f}%. Load average {c['load_before']:.2f} "
           f"before, {c['load_after']:.2f} after; {c['seconds'] / 60:.0f} minutes. Rerun: "
           "`bench/bench.py --sections plangpt2 --merge` (after `--sections planner` it reuses "
           f"that calibration; one run: `{c['rows'][0]['command']}`).", ""]
    return md


def step_cost_section(c):
    """Each strategy against NO_SHARD on GPT-2, faults per step, the trace's cost, the timeline."""
    b, t = c["batch"], c["seq_len"]
    name = "GPT-2 124M" if not c["shape"] else "GPT-2 " + " ".join(c["shape"])
    md = [f"## What each strategy costs on {name}, and where a step goes", "",
          f"`--model gpt2`, B = {b}, T = {t}, AdamW as llm.c runs it, one thread per rank. "
          f"{c['rounds']} rounds, each running every configuration in turn (the order "
          f"alternates), {c['steps']} steps per run; a run's step time and page faults are the "
          "medians of its steps after the third (the first steps allocate). `vs NO_SHARD` is the "
          "median over rounds of (the run / NO_SHARD at the same W in the same round), with the "
          "rounds' own ratios beside it. `faults/step`: minor page faults of the whole process "
          "(getrusage, the largest rank) per steady step: first touches of fresh memory, which "
          "cost this VM about 300 MiB/s (docs/performance.md, \"Where a step's time goes\").", "",
          "| strategy | W | mesh | s/step per round | median | vs NO_SHARD (rounds) | "
          "faults/step |", "|---|---|---|---|---|---|---|"]
    rows = c["rows"]
    base = {(r["world"], r["round"]): r["median_step_s"] for r in rows if r["strategy"] == "no_shard"}
    seen = []
    for r in rows:
        key = (r["world"], r["strategy"])
        if key not in seen:
            seen.append(key)
    for world, strategy in sorted(seen, key=lambda k: (k[0], k[1] != "no_shard", k[1])):
        mine = [r for r in rows if (r["world"], r["strategy"]) == (world, strategy)]
        ratios = [r["median_step_s"] / base[(world, r["round"])] for r in mine
                  if (world, r["round"]) in base]
        R, S = mine[0]["mesh"]
        md.append(f"| {strategy.upper()} | {world} | ({R}, {S}) | "
                  f"{' / '.join(fmt_s(r['median_step_s']) for r in mine)} | "
                  f"{fmt_s(med([r['median_step_s'] for r in mine]))} | "
                  f"{med(ratios):.3f}x ({' / '.join(f'{x:.2f}' for x in ratios)}) | "
                  f"{med([r['minor_faults'] for r in mine]):.0f} |")
    md.append("")
    ov = c.get("trace_overhead") or []
    if ov:
        model, tb, ts, tsteps = c["trace_model"]
        on = [r for r in ov if r["traced"]]
        off = {r["round"]: r["median_step_s"] for r in ov if not r["traced"]}
        ratios = [r["median_step_s"] / off[r["round"]] - 1 for r in on if r["round"] in off]
        md += [f"**The trace's cost**: `--model {model}`, FULL_SHARD, W = 4, global batch {tb}, "
               f"T = {ts}, {tsteps} steps with `--trace --trace-steps 3:{tsteps}` against without, "
               f"alternated: median step {fmt_s(med([r['median_step_s'] for r in on]))} s traced, "
               f"{fmt_s(med(list(off.values())))} s not: **{100 * med(ratios):+.1f}%** (rounds: "
               f"{' / '.join(f'{100 * x:+.1f}%' for x in ratios)}).", ""]
    tl = c.get("timeline") or {}
    if tl.get("png"):
        md += [f"**One FULL_SHARD step at W = 2** (step 5 of `{tl['command']} --trace "
               "timeline.json --trace-steps 4:5`, drawn by `fsdp-plot --trace timeline.json "
               "--step 5`): each rank's training thread (its units' forward and backward, the "
               "waits on collectives, the optimizer) above its communication threads (each "
               "collective as the group's worker runs it), on rank 0's clock."
               + (f" Exposed communication (the summary's trace line): {tl['exposed']}."
                  if tl.get("exposed") else ""), "",
               f"![GPT-2 FULL_SHARD timeline](docs/bench/{tl['png']})", ""]
    cmd = rows[0]["command"] if rows else ""
    md += [f"Rerun: `bench/bench.py --sections stepcost --merge` (a run: `{cmd}`; the token file "
           f"is {1 << 16} pseudo-random ids).", ""]
    return md


def label_of(r):
    if r["kind"] == "ddp":
        return "PyTorch DDP"
    return {"no_shard": "fsdp NO_SHARD", "full_shard": "fsdp FULL_SHARD",
            "hybrid_shard": "fsdp HYBRID_SHARD (2, W/2)",
            "shard_grad_op": "fsdp SHARD_GRAD_OP"}.get(r.get("strategy"), r.get("label", "?"))


def peer_table(rows, cores, line):
    """Per W: each config's median per round, the median, the ratio to DDP (per round, then
    median) and to the machine's limit."""
    out = []
    limits = [r["median_step_s"] for r in rows if r["kind"] in ("limit", "limit-py")]
    limit1 = min(med([r["median_step_s"] for r in rows if r["kind"] == k])
                 for k in ("limit", "limit-py") if any(r["kind"] == k for r in rows)) if limits else None
    summary = {}
    for w in sorted({r["world"] for r in rows if r["kind"] in ("ddp", "fsdp")}):
        group = [r for r in rows if r["world"] == w and r["kind"] in ("ddp", "fsdp")]
        rounds = sorted({r["round"] for r in group})
        ddp = {r["round"]: r["median_step_s"] for r in group if r["kind"] == "ddp"}
        limit = limit1 / min(w, cores) if limit1 else None
        out.append(f"\n**W = {w}** (PyTorch {line}; limit = one process's step / min(W, {cores} "
                   f"cores) = {fmt_s(limit) if limit else 'n/a'} s)\n")
        out.append("| run | params | median s/step per round | median | vs DDP | vs limit |")
        out.append("|---|---|---|---|---|---|")
        configs = []
        for r in group:
            key = label_of(r)
            if key not in configs:
                configs.append(key)
        for key in configs:
            mine = {r["round"]: r for r in group if label_of(r) == key}
            per_round = [mine[k]["median_step_s"] for k in rounds if k in mine]
            ratios = [mine[k]["median_step_s"] / ddp[k] for k in rounds if k in mine and k in ddp]
            m = med(per_round)
            params = next(iter(mine.values()))["params"]
            vs_ddp = f"{med(ratios):.3f}x" if ratios and key != "PyTorch DDP" else "1"
            vs_limit = f"{m / limit:.2f}x" if limit else "n/a"
            out.append(f"| {key} | {params:,} | {' / '.join(fmt_s(x) for x in per_round)} | "
                       f"{fmt_s(m)} | {vs_ddp} | {vs_limit} |")
            summary[(w, key)] = {"median": m, "vs_ddp": med(ratios) if ratios else None,
                                 "vs_limit": m / limit if limit else None}
    return "\n".join(out) + "\n", summary


def theory_rows(runs):
    """Measured bytes per step per group (from --metrics, steps >= 2) against the formulas."""
    out = ["| strategy | W | mesh (R, S) | group | measured ring bytes/rank/step | formula "
           "(issue) | formula, root gathered once | measured / formula' |",
           "|---|---|---|---|---|---|---|---|"]
    state = ["| strategy | W | P | sharded state / rank measured | P·(4+4+8)/S | ratio |",
             "|---|---|---|---|---|---|"]
    seen = set()
    for r in runs:
        if r["kind"] != "fsdp" or r["world"] < 2:
            continue
        key = (r["strategy"], r["world"], r["model"])
        if key in seen:
            continue
        seen.add(key)
        plan = r["plan"]
        R, S = plan["mesh"]
        P = plan["total_params"]
        b = 4
        units = plan["units"]
        padded = [u["padded_params"] + u.get("frozen_padded_params", 0) for u in units]
        steady = [s for s in r["steps"] if s["step"] >= 2]
        shard_payload = med([s["comm_bytes"]["shard"] for s in steady])
        rep_payload = med([s["comm_bytes"]["replicate"] for s in steady])
        strat = r["strategy"]
        mesh = f"({R}, {S})"
        if strat == "no_shard":
            W = R  # NO_SHARD: every rank is a replica; the all-reduce group is the world
            measured = 2 * rep_payload * (W - 1) / W
            f_issue = 2 * P * b * (W - 1) / W
            f_ours = 2 * sum(padded) * b * (W - 1) / W
            out.append(f"| {strat} | {r['world']} | {mesh} | world (all-reduce) | {measured:,.0f} | "
                       f"{f_issue:,.0f} | {f_ours:,.0f} | {measured / f_ours:.4f} |")
        else:
            gathers = 3 if strat in ("full_shard", "hybrid_shard") else 2
            # Gradient-norm clipping adds one 8-byte all-reduce; its ring volume is left out.
            clip_payload = 8
            measured = (shard_payload - clip_payload) * (S - 1) / S
            f_issue = gathers * P * b * (S - 1) / S
            root_once = sum(padded) * gathers - (padded[0] if gathers == 3 else 0)
            f_ours = root_once * b * (S - 1) / S
            out.append(f"| {strat} | {r['world']} | {mesh} | shard (all-gather + reduce-scatter) | "
                       f"{measured:,.0f} | {f_issue:,.0f} | {f_ours:,.0f} | {measured / f_ours:.4f} |")
            if R > 1:
                measured = 2 * rep_payload * (R - 1) / R
                f_issue = 2 * (P / S) * b * (R - 1) / R
                f_ours = 2 * sum(p // S for p in padded) * b * (R - 1) / R
                out.append(f"| {strat} | {r['world']} | {mesh} | replicate (all-reduce) | "
                           f"{measured:,.0f} | {f_issue:,.0f} | {f_ours:,.0f} | {measured / f_ours:.4f} |")
        sharded = med([s["sharded_state_bytes"] for s in steady])
        formula = P * 16 / S
        state.append(f"| {strat} | {r['world']} | {P:,} | {sharded:,.0f} | {formula:,.0f} | "
                     f"{sharded / formula:.4f} |")
    return "\n".join(out) + "\n\n" + "\n".join(state) + "\n"


def gnuplot(script, png):
    if not shutil.which("gnuplot"):
        return False
    term = ("if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo size 900,520 "
            "noenhanced } else { set terminal png size 900,520 noenhanced }\n")
    subprocess.run(["gnuplot"], input=term + f"set output '{png}'\n" + script, text=True, check=True)
    return True


def charts(res, out_dir):
    made = []
    sm = res.get("scaling_model") or []
    if sm:
        strategies = sorted({r["strategy"] for r in sm})
        for metric, ylabel, name in (("median_step_s", "seconds per step (median)", "scaling_time"),
                                     ("peak_rss", "peak RSS per rank (MiB)", "scaling_rss")):
            plots = []
            for s in strategies:
                dat = os.path.join(out_dir, f"{name}_{s}.dat")
                with open(dat, "w") as f:
                    for r in sorted((r for r in sm if r["strategy"] == s), key=lambda r: r["params"]):
                        y = r["median_step_s"] if metric == "median_step_s" else \
                            max(st["peak_rss_bytes"] for st in r["steps"]) / 2**20
                        f.write(f"{r['params'] / 1e6} {y}\n")
                plots.append(f"'{dat}' using 1:2 with linespoints title '{s}'")
            png = os.path.join(out_dir, f"{name}.png")
            if gnuplot(f"set xlabel 'parameters (M)'\nset ylabel '{ylabel}'\nset logscale x\n"
                       f"set key top left\nset grid\nplot {', '.join(plots)}\n", png):
                made.append(png)
            for s in strategies:
                os.unlink(os.path.join(out_dir, f"{name}_{s}.dat"))
    sw = res.get("scaling_world") or []
    if sw:
        dat = os.path.join(out_dir, "world.dat")
        with open(dat, "w") as f:
            for r in sw:
                f.write(f"{r['world']} {r['median_step_s']}\n")
        png = os.path.join(out_dir, "scaling_world.png")
        if gnuplot("set xlabel 'ranks W (FULL_SHARD)'\nset ylabel 'seconds per step (median)'\n"
                   f"set grid\nset xtics (1, 2, 4, 8)\nplot '{dat}' using 1:2 with linespoints "
                   "title 'fsdp-train FULL_SHARD'\n", png):
            made.append(png)
        os.unlink(dat)
    mem = res.get("memory") or {}
    if mem.get("rows"):
        dat = os.path.join(out_dir, "memory.dat")
        with open(dat, "w") as f:
            for i, r in enumerate(mem["rows"]):
                f.write(f"{i} \"{r['strategy']}\" {(r['params'] or 0) / 1e6}\n")
        png = os.path.join(out_dir, "memory_headline.png")
        if gnuplot(f"set ylabel 'largest GPT trained (M parameters)'\nset style fill solid 0.6\n"
                   f"set boxwidth 0.6\nset yrange [0:*]\nset grid ytics\n"
                   f"set title 'W = {mem['world']}, {fmt_b(mem['cap_bytes'])} per rank'\n"
                   f"plot '{dat}' using 1:3:xtic(2) with boxes notitle, '' using 1:3:(sprintf('%.1f M', $3)) "
                   f"with labels offset 0,1 notitle\n", png):
            made.append(png)
        os.unlink(dat)
    pl = (res.get("planner") or {}).get("rows") or []
    if pl:
        # Measured bars with the prediction (the theory) beside them, one pair per run.
        dat = os.path.join(out_dir, "planner.dat")
        with open(dat, "w") as f:
            for i, r in enumerate(pl):
                short = {"full_shard": "FS", "shard_grad_op": "SGO", "no_shard": "NS",
                         "hybrid_shard": "HS", "hybrid_shard_zero2": "HS2"}[r["strategy"]]
                f.write(f"{i} \"{r['model'][0]}{r['world']} {short}\" {r['measured_step_s']} "
                        f"{r['predicted_step_s']}\n")
        png = os.path.join(out_dir, "planner.png")
        if gnuplot("set ylabel 'seconds per step'\nset style data histograms\n"
                   "set style histogram clustered gap 1\nset style fill solid 0.7\n"
                   "set xtics rotate by -60 font ',8'\nset grid ytics\nset key top left\n"
                   "set title 'fsdp-plan: predicted vs measured (s = small, m = medium; W; strategy)'\n"
                   f"plot '{dat}' using 3:xtic(2) title 'measured', '' using 4 title 'predicted'\n",
                   png):
            made.append(png)
        os.unlink(dat)
    return made


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    res = json.load(open(args.results))
    out_dir = os.path.join(args.out, "docs", "bench")
    os.makedirs(out_dir, exist_ok=True)
    m = res["machine"]
    md = ["# fsdp.cpp benchmarks", "",
          "Generated by `make bench` (`/usr/bin/python3 bench/bench.py --build build`; the charts "
          "and `docs/bench/results.json`, the raw results of this page, come with it). Every "
          "number below is a median of measured steps on this machine; rerun the command to "
          "check. No test asserts any of it." + (" **Quick mode: one tiny configuration per "
                                                 "section, not a measurement.**" if res["quick"] else ""),
          "",
          "## Machine", "",
          f"- CPU: {m['cpu']}, {m['cores']} cores; memory {fmt_b(m['memory_bytes'])}; kernel "
          f"{m['kernel']}",
          f"- libtorch {m['libtorch']} (Debian 12 `libtorch-dev`), Python {m['python']} with "
          "Debian's `python3-torch`; PyTorch 2.6 and our libtorch 2.6 build in the Debian 13 "
          "chroot (`scripts/libtorch2-chroot.sh`)",
          (f"- {m['date']}; load average {m['load_before']:.2f} before, {m['load_after']:.2f} "
           f"after; the whole run took {res['seconds'] / 60:.1f} min"
           if not res.get("section_runs") else
           "- sections, each as last measured (`--merge` keeps the others): " + "; ".join(
               f"{name} {run['date']}, {run['seconds'] / 60:.1f} min, load "
               f"{run['load_before']:.2f} before and {run['load_after']:.2f} after"
               for name, run in res["section_runs"].items())
           + (f"; the others from {m['date']} on" if any(
               key in res and name not in res["section_runs"]
               for name, key in SECTION_KEYS.items()) else "")),
          "- every rank and every peer process runs one intra-op thread (`OMP_NUM_THREADS=1`, "
          "`--threads 1`)", ""]
    if os.path.exists(NOTES) and not res["quick"]:
        md += [open(NOTES).read().strip(), ""]
    summary = {}
    if res.get("peers"):
        shape = res["peer_shape"]
        md += ["## Against PyTorch DDP (libtorch / PyTorch 1.13)", "",
               f"The same byte-level GPT (`--model {shape['model']}`; parameter counts printed "
               f"by both and equal), global batch {shape['global_batch']} x {shape['seq_len']}, "
               f"AdamW (betas 0.9/0.95, weight decay 0.01), clipping at 1.0, Gloo. "
               f"{shape['rounds']} rounds, each running every configuration in turn (the order "
               f"alternates), {shape['steps']} steps per run, the median of steps 3..{shape['steps']}. "
               "`vs DDP` is the median over rounds of (ours / DDP in the same round).", ""]
        table, summary = peer_table(res["peers"], m["cores"], "1.13")
        md += [table, details("DDP comparison, 1.13", res["peers"]), ""]
        cmd = next((r["command"] for r in res["peers"] if r["kind"] == "fsdp"), "")
        md += [f"Example command: `{cmd}`; the peer: `/usr/bin/python3 bench/ddp_peer.py --nproc W "
               f"--model {shape['model']} --steps {shape['steps']} --global-batch "
               f"{shape['global_batch']} --seq-len {shape['seq_len']}`.", ""]
    p26 = res.get("peers_26")
    md += ["## Against PyTorch DDP (libtorch / PyTorch 2.6)", ""]
    if isinstance(p26, dict):
        md += [f"Not run: {p26['skipped']}.", ""]
    elif p26:
        table, s26 = peer_table(p26, m["cores"], "2.6")
        md += [table, details("DDP comparison, 2.6", p26), ""]
        summary.update({("2.6",) + k: v for k, v in s26.items()})
    if res.get("fsdp_cpu_probe"):
        md += ["PyTorch's own FSDP on CPU (PyTorch 2.6, one rank, Gloo; `bench/fsdp_cpu_probe.py`): "
               "neither API trains, so there is no FSDP peer on CPU:", "", "```",
               res["fsdp_cpu_probe"], "```", ""]
    runs = (res.get("peers") or []) + (res.get("scaling_model") or [])
    if runs:
        md += ["## Communication and sharded state against the formulas", "",
               "Bytes each rank sends per optimizer step in a ring algorithm (payload x (n-1)/n "
               "for all-gather and reduce-scatter, 2 x payload x (n-1)/n for all-reduce), from "
               "the payload fsdp counts per group (`--metrics` `comm_bytes`, steps 2 and on), "
               "against the issue's formulas with P parameters of b = 4 bytes. fsdp keeps the root "
               "unit (embeddings, final norm, head) gathered from forward through backward, so it "
               "all-gathers the root once, not twice: the last two columns compare with that "
               "formula (padded sizes). Sharded state: parameter and gradient shards plus AdamW's "
               "two moments, against P x (4 + 4 + 8) / S.", "", theory_rows(runs)]
    if res.get("scaling_model"):
        md += ["## Scaling", "", "Step time and peak RSS per rank against model size "
               "(`--model tiny, small, medium`, W = 4, global batch 8 x 64):", "",
               "| model | params | strategy | median s/step | peak RSS / rank |", "|---|---|---|---|---|"]
        for r in res["scaling_model"]:
            rss = max(st["peak_rss_bytes"] for st in r["steps"])
            md.append(f"| {r['model']} | {r['params']:,} | {r['strategy']} | "
                      f"{fmt_s(r['median_step_s'])} | {fmt_b(rss)} |")
        md += ["", "![step time vs parameters](docs/bench/scaling_time.png)",
               "![peak RSS vs parameters](docs/bench/scaling_rss.png)", "",
               details("scaling with model size", res["scaling_model"]), ""]
    if res.get("scaling_world"):
        md += ["Step time against the number of ranks (FULL_SHARD, `--model small`, global batch "
               "8, one thread per rank; this machine has "
               f"{m['cores']} cores, so beyond W = {m['cores']} ranks share cores):", "",
               "| W | median s/step |", "|---|---|"]
        md += [f"| {r['world']} | {fmt_s(r['median_step_s'])} |" for r in res["scaling_world"]]
        md += ["", "![step time vs W](docs/bench/scaling_world.png)", "",
               details("scaling with W", res["scaling_world"]), ""]
    mem = res.get("memory")
    if mem:
        md += ["## The memory headline: the largest model each strategy trains", ""]
        if mem.get("skipped"):
            md += [f"Not run: {mem['skipped']}.", ""]
        else:
            md += [f"Every rank runs in its own memory cgroup ({mem['cgroup']}, limit "
                   f"{fmt_b(mem['cap_bytes'])}): the kernel kills a rank that exceeds it, and the "
                   "run fails. GPTs of width "
                   f"{mem['d_model']} ({mem['heads']} heads) with more and more blocks "
                   f"(`fsdp-train --layers N --d-model {mem['d_model']} --heads {mem['heads']}`), "
                   f"W = {mem['world']} ranks started as a launcher would (one cgroup each), "
                   f"{mem['steps']} AdamW steps of batch 1 x 32 per rank; the number of blocks "
                   "doubles until a run dies, then is bisected.", "",
                   f"Settings: {mem.get('settings', '--heap unchanged, eager construction')}. "
                   "Theory: the sharded state per parameter with AdamW (4 bytes parameter, 4 "
                   "gradient, 8 optimizer state) is 16 for NO_SHARD, 4 + 12/W for SHARD_GRAD_OP, "
                   "16/W for FULL_SHARD and 16/S for HYBRID (R, S); the theory ratio is NO_SHARD's "
                   "16 over that (what the largest model could grow by if the state were all a "
                   "rank held).", "",
                   "| strategy | largest that trains | first that dies | parameters trained | "
                   "x NO_SHARD | theory x |",
                   "|---|---|---|---|---|---|"]
            W = mem["world"]
            theory = {"no_shard": 1.0, "shard_grad_op": 16 / (4 + 12 / W), "full_shard": float(W),
                      "hybrid_shard": float(W // 2)}
            base = next((r["params"] for r in mem["rows"] if r["strategy"] == "no_shard"), None)
            for r in mem["rows"]:
                ratio = f"{r['params'] / base:.2f}x" if base and r["params"] else "-"
                th = theory.get(r["strategy"])
                md.append(f"| {r['strategy']} | {r['largest_layers']} blocks | "
                          f"{r['first_failing_layers'] or 'none tried'} blocks | "
                          f"{fmt_count(r['params']) if r['params'] else 'none'} | {ratio} | "
                          f"{f'{th:.2f}x' if th else '-'} |")
            md += ["", "![largest model per strategy](docs/bench/memory_headline.png)", "",
                   details("memory cap", mem), ""]
    beyond = res.get("beyond")
    if beyond and not beyond.get("skipped"):
        md += ["## A model larger than one rank", "",
               f"FULL_SHARD, W = {beyond['world']}, every rank capped at "
               f"{fmt_b(beyond['cap_bytes'])}: a GPT of {beyond['layers']} blocks of width "
               f"{beyond['d_model']}, {fmt_count(beyond['params'])} parameters, whose fp32 weights "
               f"alone are {fmt_b(beyond['weights_bytes'])} = "
               f"{beyond['weights_bytes'] / beyond['cap_bytes']:.2f}x the cap. Asked: "
               f"{beyond['steps']} steps, a sharded checkpoint and a full .safetensors export, "
               "with deferred construction (`--init deferred`, each block keeps only its shard "
               "as it is built) and with `--init eager`, which must build the whole model on "
               "every rank first.", "",
               "Result: " + ("deferred trained, checkpointed and exported; eager "
                             + ("died." if not beyond["rows"][1]["ok"] else "trained too.")
                             if beyond["rows"][0]["ok"] else
                             "**not met**: the deferred run died under the cap too (exit codes "
                             "below; -9 is the cgroup's OOM kill, 1 a peer's error after it). "
                             "What it measured without a cap, and why it does not fit yet: "
                             "bench/BENCHMARKS.notes.md."), "",
               "| --init | result | exit codes | checkpoint | export | wall |", "|---|---|---|---|---|---|"]
        for r in beyond["rows"]:
            md.append(f"| {r['init']} | {'trained' if r['ok'] else 'died'} | {r['exit_codes']} | "
                      f"{'written' if r['checkpointed'] else '-'} | "
                      f"{'written' if r['exported'] else '-'} | {r['wall_s']:.0f} s |")
        md += [""]
    cons = res.get("construction")
    if cons:
        md += ["## Construction: deferred against eager", "",
               "Building and sharding the model (fsdp-train's own timer, the first `--metrics` "
               "record), FULL_SHARD: `--init deferred` (each block keeps its shard as it is built: "
               "the work added is slicing and one checksum) against `--init eager` (the whole "
               "model, then fsdp::shard). Medians over the rounds, the two alternated. The goal: "
               "deferred within 10% of eager.", "",
               "| W | model | deferred | eager | deferred / eager | peak RSS deferred | "
               "peak RSS eager |", "|---|---|---|---|---|---|---|"]
        for r in cons["rows"]:
            md.append(f"| {r['world']} | {r['layers']} blocks, {fmt_count(r['params'])} | "
                      f"{r['deferred_s']:.2f} s | {r['eager_s']:.2f} s | {r['ratio']:.2f}x | "
                      f"{fmt_b(r['deferred_peak_rss'])} | {fmt_b(r['eager_peak_rss'])} |")
        md += ["", f"Rerun: `bench/bench.py --sections construction --merge` "
               f"(one run: `{cons['rows'][-1]['command']}`).", ""]
    ck = res.get("checkpoint")
    if ck:
        mib = ck["bytes"] / 2**20

        def rate(sec):
            return f"{mib / sec:.0f} MiB/s ({sec:.3f} s)"
        md += ["## Checkpoint I/O", "",
               f"A sharded checkpoint of the {ck['model']} GPT with AdamW, FULL_SHARD, "
               f"W = {ck['world']}: {fmt_b(ck['bytes'])} in one file per rank. Save: fsdp-train's "
               "own timer on rank 0, the fsync of every file and of the directories included, "
               "against `dd if=/dev/zero conv=fsync` of as many bytes. Load: `--resume` with "
               "nothing left to train (rank 0's timer of load_checkpoint), against `cat` of the "
               "checkpoint's files; cold with the page cache dropped before each read"
               + ("" if ck["cache_dropped"] else " (**not dropped here: not root, reads came from "
                  "memory**)") + f", then warm. Medians of {ck['rounds']} rounds. Goals: "
               "save and load at >= 85% of the disk.", "",
               "| operation | fsdp | disk (dd / cat) | fsdp / disk | every file at once, a "
               "process each (save: one O_DIRECT write from touched memory; load: `dd` into new "
               "memory) | fsdp / that |",
               "|---|---|---|---|---|---|",
               f"| save | {rate(ck['save_s'])} | {rate(ck['dd_write_s'])} | "
               f"{100 * ck['save_ratio']:.0f}% | "
               + (f"{rate(ck['dd_direct_s'])} | {100 * ck['save_direct_ratio']:.0f}% |"
                  if "dd_direct_s" in ck else "- | - |")]
        for temp in ("cold", "warm"):
            new_mem = ck.get(f"dd_new_{temp}_s")
            md.append(f"| load, {temp} cache | {rate(ck[f'load_{temp}_s'])} | "
                      f"{rate(ck[f'cat_{temp}_s'])} | {100 * ck[f'load_{temp}_ratio']:.0f}% | "
                      + (f"{rate(new_mem)} | {100 * ck[f'load_{temp}_new_memory_ratio']:.0f}% |"
                         if new_mem else "- | - |"))
        best = ck.get("best")
        if best:
            md += ["", f"Best of the {ck['rounds']} rounds (the VM's memory, below, swings from "
                   f"run to run): save {100 * best['dd_write_s'] / best['save_s']:.0f}% of dd, "
                   f"load {100 * best['cat_cold_s'] / best['load_cold_s']:.0f}% of a cold cat and "
                   f"{100 * best['cat_warm_s'] / best['load_warm_s']:.0f}% of a warm one, "
                   f"{100 * best['dd_new_cold_s'] / best['load_cold_s']:.0f}% / "
                   f"{100 * best['dd_new_warm_s'] / best['load_warm_s']:.0f}% of the files read "
                   "into new memory."]
        md += ["",
               "A load also puts every byte in new memory (the new shards and optimizer state; the "
               "model changes only after every rank has read everything), and in this VM memory "
               "the guest has not touched before is slow: one process writing a fresh "
               f"{fmt_b(ck['bytes'])} buffer takes {ck['first_touch_s']:.3f} s, far more than "
               "reading the files. That, not the reads, is most of the load (a W = 1 load of this "
               "checkpoint: 0.05 s reading and checking, the rest mapping new memory; NOTE "
               "[one-pass load]); `cat` reuses one small buffer and pays none of it. The column "
               "\"into new memory\" reads the same files as the ranks do, all at once, each into "
               "one new buffer (`dd bs=<file size> count=1`): the disk's rate for a loader on this "
               "machine. `cat` \"cold\" runs at GB/s because the host caches the "
               "virtual disk: dropping the guest's page cache does not reach the disk."
               + (" A save meets the same memory on the way out: its writes fill new page-cache "
                  "pages, while the `dd conv=fsync` beside it, run right after fsdp-train exits, "
                  "gets the pages the ranks just freed (a first `dd` after boot took 0.72 s for "
                  "these bytes, the next ones 0.23 s). Written around the page cache from memory "
                  "already touched, as an async save's background writers do, the disk takes the "
                  "last column's time." if "dd_direct_s" in ck else ""), ""]
        a = ck.get("async")
        if a:
            md += [f"Async saves (`--checkpoint-async`, every {a['every']} of {a['steps']} steps, "
                   "seq 128): training is blocked per save "
                   + (f"(the median of every save; the first {a['first_blocked_s']:.4f} s: "
                      "fsdp-train reserves the staging buffer in the background after the first "
                      "step) " if "first_blocked_s" in a else "(after the first, which allocates "
                      "the staging buffer) ")
                   + f"{a['blocked_s']:.4f} s, against {a['memcpy_s']:.4f} s for a "
                   f"memcpy of its {fmt_b(a['staging_bytes'])} of staging into a touched buffer: "
                   f"**{a['blocked_ratio']:.2f}x** (goal <= 1.2x)"
                   + (f"; {ck['world']} processes copying as many bytes each at the same moment, "
                      f"as the {ck['world']} ranks stage at once on {m['cores']} cores, take "
                      f"{a['memcpy_together_s']:.4f} s: **{a['blocked_ratio_together']:.2f}x** "
                      "of that" if "memcpy_together_s" in a else "") + ". Steps while a save is written "
                   f"in the background: {a['step_during_save_s']:.3f} s against "
                   f"{a['step_plain_s']:.3f} s without checkpoints: **{100 * a['slowdown']:+.1f}%** "
                   "(goal within 10%; on this machine the writer thread shares 2 cores with "
                   f"{ck['world']} ranks)."
                   + (f" The background writes themselves took {a['write_s']:.3f} s per save "
                      "(the slowest rank's, fsync included): "
                      f"{ck['bytes'] / 2**20 / a['write_s']:.0f} MiB/s, "
                      f"**{100 * ck['dd_write_s'] / a['write_s']:.0f}%** of `dd conv=fsync` and "
                      + (f"{100 * ck['dd_direct_s'] / a['write_s']:.0f}% of the direct write in "
                         "the table" if "dd_direct_s" in ck else "") + "."
                      if "write_s" in a else "")
                   + (f" The disk alone: the same bytes written by {ck['world']} `dd oflag=direct "
                      "conv=fsync` at the moments the saves start, beside a run without "
                      f"checkpoints ({a['disk_writes']} writes of {a['disk_write_s']:.3f} s), "
                      f"make those steps {a['step_during_disk_s']:.3f} s: "
                      f"**{100 * a['disk_slowdown']:+.1f}%**. dd spends almost no guest CPU (the "
                      "copy is the host's), so that much is what writing costs this VM's steps, "
                      "whoever writes." if a.get("disk_writes") else ""), ""]
        md += [f"Rerun: `bench/bench.py --sections checkpoint --merge` (one save: "
               f"`{ck['command']}`; `bench/checkpoint_io.sh` and `bench/async_checkpoint.sh` are "
               "the same measurements as shell scripts).", ""]
    if res.get("gpt2"):
        md += gpt2_section(res["gpt2"])
    if res.get("step_cost"):
        md += step_cost_section(res["step_cost"])
    if res.get("planner"):
        md += planner_section(res["planner"], m["cores"])
    if res.get("planner_gpt2"):
        md += planner_gpt2_section(res["planner_gpt2"])
    md += ["## GPU", "",
           "Prepared, **not run here** (this machine has no GPU): `scripts/gpu-check.sh` builds "
           "fsdp against a pip-installed CUDA PyTorch, runs the GPU tests and compares fsdp-train "
           "with PyTorch FSDP2 (`fully_shard`, `bench/fsdp2_peer.py`) on one GPU. The table "
           "appears here when it has been run on a GPU machine.", ""]
    charts(res, out_dir)
    with open(os.path.join(args.out, "BENCHMARKS.md"), "w") as f:
        f.write("\n".join(md).rstrip() + "\n")


if __name__ == "__main__":
    main()
