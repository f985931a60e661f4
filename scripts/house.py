#!/usr/bin/env python3
"""The house rules of fsdp.cpp, checked, and the map of where each concept lives.

  scripts/house.py --check   exit 1, naming each file, if a rule is broken:
                             - every file under src/ and include/fsdp/ belongs to a layer below;
                             - a file includes internal headers (src/...) of its own layer or of
                               lower layers only, and public headers (fsdp/...) of its own layer
                               or lower ones (fsdp/fsdp.h, the umbrella header, may include all);
                             - tools/, examples/ and bench/ include no internal header and call
                               nothing in fsdp::detail;
                             - no source file is over MAX_LINES lines.
  scripts/house.py --map     print docs/layout.md (ctest `house` checks that the file is current)

Each layer uses only the layers above it in LAYERS (lower index = lower layer). A new file must
be given a layer here: an unassigned file is an error, so the map cannot go stale silently.
"""
import fnmatch
import os
import re
import sys

ROOT = os.environ.get("HOUSE_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 700

# (name, what the layer is, file patterns relative to the repository root), lowest first.
LAYERS = [
    ("base", "errors, the libtorch version differences, small utilities",
     ["include/fsdp/error.h", "src/error.cpp", "src/compat.h", "include/fsdp/parse_enum.h",
      "src/unique_fd.h", "src/addr_info.h", "src/sanitizer.h", "include/fsdp/memory.h",
      "src/memory.cpp"]),
    ("cluster", "where this process sits in the job, read from the launcher's environment",
     ["include/fsdp/cluster.h", "src/cluster.cpp"]),
    ("runtime", "the process, the rendezvous, the groups and their collectives, the mesh",
     ["include/fsdp/mesh.h", "src/mesh.cpp", "include/fsdp/backend.h", "src/backend.cpp", "include/fsdp/process.h", "src/process*",
      "include/fsdp/runtime*.h", "src/runtime*", "src/rendezvous.*",
      "include/fsdp/collectives.h", "src/collectives.cpp", "src/c10d_group.*",
      "src/collective_check.*"]),
    ("engine", "sharding a model: strategy, units, the gather/reduce engine, deferred "
               "construction, activation checkpointing, reports",
     ["include/fsdp/strategy.h", "src/strategy.cpp", "include/fsdp/unit_info.h",
      "include/fsdp/sharded.h", "include/fsdp/detail/*", "src/sharded_module.cpp",
      "src/engine*", "src/plan_units.cpp", "src/buffer_pool.*", "src/device_streams.h",
      "src/shard_slice.h", "src/flat_view.h", "include/fsdp/deferred_init.h", "src/deferred_init*",
      "include/fsdp/activation_checkpoint.h", "src/activation_checkpoint.cpp",
      "include/fsdp/report.h", "src/report.cpp"]),
    ("checkpoint", "sharded and full checkpoints, their formats and files",
     ["include/fsdp/checkpoint.h", "include/fsdp/async_checkpoint.h", "src/checkpoint/*"]),
    ("planner", "which strategy and mesh: the cost model and published checks",
     ["include/fsdp/planner.h", "src/planner/*"]),
    ("launcher", "starting and supervising the ranks of a job on this node",
     ["include/fsdp/launcher.h", "src/launcher.cpp", "src/supervisor.cpp", "src/rank_output.*",
      "src/tcp_port.*"]),
    ("umbrella", "the one header that includes everything", ["include/fsdp/fsdp.h"]),
]
SOURCE_EXT = (".h", ".cpp", ".cpp.in")
LIBRARY_DIRS = ("src", "include/fsdp")
CLIENT_DIRS = ("tools", "examples", "bench")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def files_under(top):
    out = []
    for d, _, names in os.walk(os.path.join(ROOT, top)):
        for n in names:
            if n.endswith(SOURCE_EXT):
                out.append(os.path.relpath(os.path.join(d, n), ROOT))
    return sorted(out)


def layer_of(path):
    for i, (_, _, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatch(path, p) for p in patterns):
            return i
    return None


def resolve(includer, name):
    """The repository path an #include "name" in `includer` refers to, or None if outside."""
    for base in (os.path.dirname(includer), "src", "include"):
        p = os.path.normpath(os.path.join(base, name))
        if os.path.isfile(os.path.join(ROOT, p)):
            return p
    return None


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def check():
    problems = []
    library = [f for d in LIBRARY_DIRS for f in files_under(d)]
    for f in library:
        if layer_of(f) is None:
            problems.append(f"{f}: in no layer; add it to LAYERS in scripts/house.py")
    for f in library:
        mine = layer_of(f)
        if mine is None or LAYERS[mine][0] == "umbrella":
            continue
        for name in INCLUDE.findall(read(f)):
            target = resolve(f, name)
            if target is None or target == f:
                continue
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                problems.append(f"{f} ({LAYERS[mine][0]}) includes {target} "
                                f"({LAYERS[theirs][0]}), a higher layer")
    for f in [f for d in CLIENT_DIRS for f in files_under(d)]:
        text = read(f)
        for name in INCLUDE.findall(text):
            target = resolve(f, name)
            if target is not None and target.startswith("src/"):
                problems.append(f"{f} includes the internal header {target}; use include/fsdp/")
        if "fsdp::detail::" in text:
            problems.append(f"{f} calls into fsdp::detail; give it a public function")
    for f in library + [f for d in CLIENT_DIRS for f in files_under(d)]:
        n = read(f).count("\n")
        if n > MAX_LINES:
            problems.append(f"{f} has {n} lines (over {MAX_LINES}); split it by concept")
    for p in problems:
        print(p)
    if problems:
        print(f"house: {len(problems)} problem(s)")
        return 1
    print(f"house: {len(library)} library files in {len(LAYERS)} layers, no rule broken")
    return 0


def summary(path):
    """The first sentence of a file's header comment, without its "name.h (internal):" label."""
    lines = []
    for line in read(path).splitlines():
        if not line.startswith("//"):
            break
        lines.append(line[2:].strip())
    text = " ".join(lines)
    text = re.sub(r"^[\w/.\-]+\.(h|cpp)( \(internal[^)]*\))?: ", "", text)
    m = re.match(r"(.+?\.)(\s|$)", text)
    text = (m.group(1) if m else text).rstrip(".")
    text = text[:1].upper() + text[1:]
    return text if len(text) <= 110 else text[:107].rstrip() + "..."


def layout_map():
    out = ["# Where each concept lives",
           "",
           "Generated by `scripts/house.py --map` (ctest `house` fails when it is stale). The",
           "library is layered: each layer below uses only the layers listed before it, never a",
           "later one, and tools, examples and benchmarks use only the public headers",
           "(`include/fsdp/`). `scripts/house.py --check` enforces both, and that no source file",
           f"is over {MAX_LINES} lines. Each line is the file's own header comment.", ""]
    library = [f for d in LIBRARY_DIRS for f in files_under(d)]
    for i, (name, what, _) in enumerate(LAYERS):
        mine = [f for f in library if layer_of(f) == i]
        if not mine:
            continue
        out += [f"## {i + 1}. {name}: {what}", ""]
        out += [f"- `{f}`: {summary(f)}" for f in mine]
        out.append("")
    out += ["## Programs and the rest", ""]
    for d in ("tools/fsdp-train", "tools/fsdp-run", "tools/fsdp-plan", "tools/fsdp-plot",
              "tools/fsdp-tokenize"):
        for f in files_under(d):
            if f.endswith(".cpp") and summary(f):
                out.append(f"- `{f}`: {summary(f)}")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(check())
    if sys.argv[1:] == ["--map"]:
        sys.stdout.write(layout_map())
        sys.exit(0)
    sys.exit(__doc__)
