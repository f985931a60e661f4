#!/bin/sh
# `make bench` in its quick mode (one tiny configuration per section) must run end to end and
# write BENCHMARKS.md, the charts and results.json; and what it measures about bytes is exact
# enough to check: the communication per group and the sharded state per rank equal the
# formulas within 1% (timings are printed by the benchmark, never asserted).
# usage: bench_test.sh BUILD_DIR SOURCE_DIR
set -eu
build=$1
src=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
/usr/bin/python3 "$src/bench/bench.py" --build "$build" --quick --out "$out" \
  --sections peers,scaling,memory
for f in BENCHMARKS.md docs/bench/results.json docs/bench/scaling_world.png; do
  [ -s "$out/$f" ] || { echo "bench_test: $f was not written" >&2; exit 1; }
done
/usr/bin/python3 - "$out/BENCHMARKS.md" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
for heading in ("## Against PyTorch DDP (libtorch / PyTorch 1.13)", "## Communication and sharded state",
                "## Scaling", "## The memory headline", "## GPU"):
    assert heading in text, f"BENCHMARKS.md lacks '{heading}'"
section = text.split("## Communication and sharded state", 1)[1].split("\n## ", 1)[0]
ratios = [float(m) for m in re.findall(r"\| (\d+\.\d{4}) \|\s*$", section, re.M)]
assert len(ratios) >= 4, f"expected the formula ratio columns, found {ratios}"
bad = [r for r in ratios if abs(r - 1) > 0.01]
assert not bad, f"measured / formula off by more than 1%: {bad}"
print(f"bench_test: BENCHMARKS.md written; {len(ratios)} byte counts within 1% of the formulas")
PY
