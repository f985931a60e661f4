#!/bin/sh
# The README and the manual check themselves: every code block of README.md and of every docs/*.md
# page either works as a new user would use it or carries a marker saying why it is not run here.
#
#   readme_test.sh cpp      BUILD_DIR SOURCE_DIR   compile every ```cpp block against the INSTALLED
#                                                  package (cmake --install, find_package(fsdp))
#   readme_test.sh commands BUILD_DIR SOURCE_DIR   run every command of every ```sh/```bash block
#   readme_test.sh list     BUILD_DIR SOURCE_DIR   print what `commands` would run and skip
#
# Markers (the pages' authors write them; every skip is printed with its reason):
#   <!-- fragment: NAME (reason) -->  on the line before a ```cpp block: a fragment, not compiled.
#   <!-- docs-test: skip (reason) --> on the line before a ```sh block: not run (e.g. it installs
#                                     system packages, or is `make test` itself).
#   # needs a cluster ...             a comment line of its own in a block (the whole block), or
#                                     at the end of one command: it needs several machines or a
#                                     cluster's launcher; readers see it too.
# Pages are taken in order (README.md, then docs/*.md by name), each page's commands in order, so a
# page's commands may use what its own earlier commands wrote, never another page's. They run in a
# scratch copy of the repository root (its top-level entries linked,
# `build` pointing at BUILD_DIR, HOME a scratch directory), each with a time limit. fsdp-train
# training commands get `--model tiny --steps 3 --seq-len 16` appended (the last value of a flag
# wins; GPT-2 commands, `--model gpt2`, keep their model and get `--layers 2 --d-model 32 --heads 2
# --steps 3 --seq-len 16`), so they take seconds; dry runs and --help run as written.
# Every OK, FAIL, RUN and SKIP line names the page and line (e.g. docs/fsdp-train.md:42), the block
# and the command.
set -eu
mode=$1
build=$(cd "$2" && pwd)
src=$(cd "$3" && pwd)
work=$(mktemp -d /tmp/fsdp-readme-XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/blocks"

# The pages, relative to SOURCE_DIR: the README first, then the manual.
pages="README.md"
for page in "$src"/docs/*.md; do
  [ -f "$page" ] && pages="$pages docs/$(basename "$page")"
done

# Split every page into blocks: $work/blocks/N.LANG holds the body of the N-th fenced block (N
# counts over all pages, in order); $work/blocks/index lists "N PAGE LINE LANG MARKER" (LINE: the
# page's line of the opening fence; MARKER: the previous non-empty line if it is an HTML
# comment, else "-").
touch "$work/blocks/index"
npages=0
for page in $pages; do
  npages=$((npages + 1))
  awk -v dir="$work/blocks" -v page="$page" -v n="$(wc -l <"$work/blocks/index")" '
    function flush() { close(file) }
    !in_block && /^```/ {
      lang = substr($0, 4); sub(/[ \t].*/, "", lang); if (lang == "") lang = "text"
      in_block = 1; n++; file = dir "/" n "." lang
      printf "" > file
      m = (prev ~ /^<!--.*-->[ \t]*$/) ? prev : "-"
      gsub(/[ \t]+/, " ", m)
      print n " " page " " NR " " lang " " m >> (dir "/index")
      next
    }
    in_block && /^```[ \t]*$/ { in_block = 0; flush(); prev = ""; next }
    in_block { print > file; next }
    NF { prev = $0 }
  ' "$src/$page"
done

status=0
count=0
skipped=0

if [ "$mode" = cpp ]; then
  # ---- C++ blocks, compiled against the installed package ----------------------------------
  cmake --install "$build" --prefix "$work/prefix" --component dev >/dev/null
  mkdir -p "$work/project"
  {
    echo 'cmake_minimum_required(VERSION 3.18)'
    echo 'project(readme_blocks LANGUAGES CXX)'
    echo 'set(CMAKE_CXX_STANDARD 17)'
    echo 'find_package(fsdp REQUIRED)'
  } >"$work/project/CMakeLists.txt"
  targets=""
  while read -r n page line lang marker; do
    [ "$lang" = cpp ] || continue
    case "$marker" in
      "<!-- fragment:"*)
        name=$(printf '%s' "$marker" | sed -e 's/^<!-- fragment: *//' -e 's/ *-->$//')
        echo "SKIP $page:$line cpp block: fragment $name"
        skipped=$((skipped + 1))
        continue ;;
    esac
    cp "$work/blocks/$n.cpp" "$work/project/block_$n.cpp"
    if grep -qE '(^|[^a-z_])int main\(' "$work/blocks/$n.cpp"; then
      echo "add_executable(block_$n block_$n.cpp)" >>"$work/project/CMakeLists.txt"
    else
      echo "add_library(block_$n OBJECT block_$n.cpp)" >>"$work/project/CMakeLists.txt"
    fi
    echo "target_link_libraries(block_$n PRIVATE fsdp::fsdp)" >>"$work/project/CMakeLists.txt"
    targets="$targets $n:$page:$line"
    count=$((count + 1))
  done <"$work/blocks/index"
  if [ -z "$targets" ]; then
    echo "no C++ block to compile in README.md and docs/*.md ($skipped fragments)"
    exit 0
  fi
  # The package's own compiler, as in example_test.sh (CXX, when set, wins).
  cxx=${CXX:-$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")}
  cmake -S "$work/project" -B "$work/project/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
  # Everything at once (-k 0: past failures), then each block alone to name what failed.
  cmake --build "$work/project/build" -- -k 0 >"$work/all.log" 2>&1 || true
  for target in $targets; do
    n=${target%%:*}
    where=${target#*:}
    if cmake --build "$work/project/build" --target "block_$n" >"$work/one.log" 2>&1; then
      echo "OK   $where cpp block compiles and links against the installed fsdp"
    else
      echo "FAIL $where cpp block does not compile against the installed fsdp" \
        "(mark it <!-- fragment: NAME (reason) --> if it is not a whole program):"
      grep -E 'error|undefined' "$work/one.log" | head -n 15 | sed 's/^/       /'
      status=1
    fi
  done
  echo "docs cpp: $count blocks compiled, $skipped fragments skipped" \
    "(README.md and $((npages - 1)) pages of docs/)"
  exit $status
fi

case "$mode" in
  commands | list) ;;  # list: print what `commands` would run and skip, run nothing
  *) echo "usage: readme_test.sh cpp|commands|list BUILD_DIR SOURCE_DIR" >&2; exit 2 ;;
esac

# ---- Shell commands, run as a new user would, on this machine ------------------------------
root=$work/root
mkdir -p "$root" "$work/home"
for entry in "$src"/* "$src"/.[!.]*; do
  [ -e "$entry" ] || continue
  name=$(basename "$entry")
  [ "$name" = build ] || [ "$name" = .git ] && continue
  ln -s "$entry" "$root/$name"
done
ln -s "$build" "$root/build"

run_command() {  # $1: page:line, $2: command
  # Without its trailing comment, so that appended flags are not commented out.
  cmd=$(printf '%s' "$2" | sed -e 's/[[:space:]]#.*$//' -e 's/[[:space:]]*$//')
  case "$cmd" in
    *fsdp-train*--dry-run* | *fsdp-train*--help* | *"|"* | *"&&"* | *";"*) ;;
    *fsdp-train*--model\ gpt2*) cmd="$cmd --layers 2 --d-model 32 --heads 2 --steps 3 --seq-len 16" ;;
    *fsdp-train*) cmd="$cmd --model tiny --steps 3 --seq-len 16" ;;
  esac
  echo "RUN  $1: $cmd"
  count=$((count + 1))
  [ "$mode" = list ] && return 0
  if (cd "$root" && HOME=$work/home timeout 300 sh -c "$cmd") </dev/null >"$work/out.log" 2>&1; then
    return 0
  else
    rc=$?
  fi
  echo "FAIL $1 (exit $rc): $cmd"
  tail -n 15 "$work/out.log" | sed 's/^/       /'
  status=1
}

while read -r n page line lang marker; do
  case "$lang" in sh | bash | shell) ;; *) continue ;; esac
  case "$marker" in
    "<!-- docs-test: skip"*)
      echo "SKIP $page:$line $lang block: $(printf '%s' "$marker" | sed -e 's/^<!-- docs-test: //' -e 's/ *-->$//')"
      skipped=$((skipped + 1))
      continue ;;
  esac
  first=$(grep -m 1 '^# needs a cluster' "$work/blocks/$n.$lang" || true)
  if [ -n "$first" ]; then
    echo "SKIP $page:$line $lang block: ${first#\# }"
    skipped=$((skipped + 1))
    continue
  fi
  # Logical commands: continuation lines joined, comment lines dropped; "N<TAB>command" where N
  # is the page's line the command starts on.
  awk -v base="$line" '{
    n = base + NR
    if (joining) {
      text = text " " $0
    } else {
      if ($0 ~ /^[ \t]*(#|$)/) next
      start = n; text = $0
    }
    if (text ~ /\\[ \t]*$/) { sub(/\\[ \t]*$/, "", text); joining = 1; next }
    joining = 0
    print start "\t" text
  }' "$work/blocks/$n.$lang" >"$work/commands"
  while IFS="$(printf '\t')" read -r at cmd; do
    case "$cmd" in
      *"# needs a cluster"*)
        echo "SKIP $page:$at: ${cmd%%#*}(${cmd#*# })"
        skipped=$((skipped + 1))
        continue ;;
    esac
    run_command "$page:$at" "$cmd"
  done <"$work/commands"
done <"$work/blocks/index"
echo "docs commands: $count run, $skipped skipped (README.md and $((npages - 1)) pages of docs/)"
exit $status
