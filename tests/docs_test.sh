#!/bin/sh
# Keeps the manual true to the programs: every flag a program's --help lists must have a row in
# a flag table of that program's page, every row of a table must name a flag of the program the
# table documents, and each row's default column must agree with the default --help shows (taken
# from the code).
# usage: docs_test.sh BUILD_DIR SOURCE_DIR
#
# Which page documents which program ("PROGRAM PAGE"). On a page, a table row documents the
# program that the nearest heading above it names (the first fsdp-* program in the heading's
# text), else the page's own program: fsdp-train.md's "## fsdp-plot: ..." section documents
# fsdp-plot. A program that was not built (fsdp-tokenize needs PCRE2) is skipped, saying so.
set -eu
build=$1
src=$2
programs="fsdp-train:docs/fsdp-train.md fsdp-plot:docs/fsdp-train.md
fsdp-tokenize:docs/fsdp-train.md fsdp-run:docs/launching.md fsdp-plan:docs/planner.md"
status=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# "PAGE:LINE PROGRAM FLAG DEFAULT" for every flag-table row of every page that documents a
# program. A row starts with | `--flag or | `-o, --flag (the first long name is the flag). The
# page's cell may explain its value ("0 (auto)") or quote it ("The "): its first word is what
# must equal --help's default.
rows() {  # $1: page (relative to SOURCE_DIR), $2: its own program
  awk -v page="$1" -v own="$2" '
    /^```/ { fenced = !fenced; next }
    fenced { next }
    /^#+ / {
      tool = match($0, /fsdp-(train|run|plan|plot|tokenize)/) ? substr($0, RSTART, RLENGTH) : own
    }
    /^\| `-/ {
      row = $0; gsub(/\\\|/, "/", row)  # an escaped \| inside a cell
      split(row, cell, "|")
      names = cell[2]
      if (!match(names, /--[a-z][a-z0-9-]+/)) next
      flag = substr(names, RSTART, RLENGTH)
      d = cell[3]; gsub(/[`"]/, "", d); sub(/^ +/, "", d); sub(/ .*/, "", d)
      print page ":" NR " " (tool == "" ? own : tool) " " flag " " d
    }' "$src/$1"
}

: >"$work/rows"
for entry in $programs; do
  page=${entry#*:}
  grep -q " $page\$" "$work/pages" 2>/dev/null && continue
  own=${entry%%:*}
  echo "$own $page" >>"$work/pages"
  if [ ! -f "$src/$page" ]; then
    echo "$page is missing: it documents $own"
    status=1
    continue
  fi
  rows "$page" "$own" >>"$work/rows"
done

for entry in $programs; do
  tool=${entry%%:*}
  page=${entry#*:}
  if [ ! -x "$build/$tool" ]; then
    echo "SKIP $tool: not built in $build (its page $page is not checked against it)"
    continue
  fi
  "$build/$tool" --help >"$work/$tool.help"
  # "flag default" for every option --help shows: "--steps INT=100" (CLI11 2.1) or
  # "--steps INT [100]" (CLI11 2.4); every name of an option ("-o,--output", "--nnodes,--num-nodes")
  # gets a line. Options without a default (flags, FILE) get an empty default.
  awk '/^  -/ {
         d = ""
         if (index($2, "=") > 0) d = substr($2, index($2, "=") + 1)
         else if ($3 ~ /^\[/) { d = $3; gsub(/^\[|\]$/, "", d) }
         n = split($1, names, ",")
         for (i = 1; i <= n; i++) print names[i] " " d
       }' "$work/$tool.help" >"$work/$tool.defaults"
  if [ ! -s "$work/$tool.defaults" ]; then
    echo "$tool --help lists no option: cannot check $page against it"
    status=1
    continue
  fi
  # Every long option of --help has a row on the page, in a table that documents this tool.
  for flag in $(grep -E -- '^--[a-z]' "$work/$tool.defaults" | cut -d' ' -f1 | sort -u); do
    [ "$flag" = "--help" ] && continue
    if ! grep -q -- " $tool $flag " "$work/rows"; then
      # An alias ("--num-nodes" of "--nnodes,--num-nodes") is documented by its option's row.
      line=$(grep -E -- "^  (-[a-z],)?(--[a-z0-9-]+,)*$flag[ ,]" "$work/$tool.help" | head -n 1)
      documented=0
      for alias in $(printf '%s' "$line" | awk '{ print $1 }' | tr ',' ' '); do
        grep -q -- " $tool $alias " "$work/rows" && documented=1
      done
      if [ "$documented" -eq 0 ]; then
        echo "$page does not document $tool $flag" \
          "(no row | \`$flag ... in a table of its $tool section)"
        status=1
      fi
    fi
  done
done

# Every row: its flag exists in its program's --help, and the defaults agree.
while read -r where tool flag doc; do
  [ -f "$work/$tool.defaults" ] || continue  # not built: said above
  if ! grep -q -- "^$flag " "$work/$tool.defaults"; then
    echo "$where: $flag is in a table of $tool's, but $tool --help has no $flag"
    status=1
    continue
  fi
  help_default=$(grep -- "^$flag " "$work/$tool.defaults" | head -n 1 | cut -d' ' -f2-)
  if [ -n "$help_default" ]; then
    if [ "$doc" != "$help_default" ]; then
      echo "$where: $tool $flag: the page's default is '$doc' but --help says '$help_default'"
      status=1
    fi
  elif printf '%s' "$doc" | grep -qE '^[-+]?[0-9]'; then
    echo "$where: $tool $flag: the page's default is '$doc' but --help shows none"
    status=1
  fi
done <"$work/rows"
if [ "$status" -eq 0 ]; then
  echo "docs_match_help: every flag of fsdp-train, fsdp-plot, fsdp-tokenize (docs/fsdp-train.md)," \
    "fsdp-run (docs/launching.md) and fsdp-plan (docs/planner.md) is in its page's table, with" \
    "--help's default ($(wc -l <"$work/rows") rows)"
fi
exit $status
