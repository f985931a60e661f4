#!/bin/sh
# Keeps the README true to the tools: every flag that `--help` lists must be documented in the
# README, every flag the README's tables list for a tool must exist in its --help, and each
# table row's default column must agree with the default --help shows (taken from the code).
# usage: docs_test.sh BUILD_DIR SOURCE_DIR
set -eu
build=$1
readme=$2/README.md
status=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for tool in fsdp-train fsdp-run fsdp-plan; do
  "$build/$tool" --help >"$work/$tool.help"
  for flag in $(grep -oE -- '--[a-z][a-z0-9-]+' "$work/$tool.help" | sort -u); do
    [ "$flag" = "--help" ] && continue
    if ! grep -q -- "\`$flag" "$readme"; then
      echo "README.md does not document $tool $flag"
      status=1
    fi
  done
  # "flag default" per line, for every option --help shows: "--steps INT=100" (CLI11 2.1) or
  # "--steps INT [100]" (CLI11 2.4); aliases ("--nnodes,--num-nodes") each get a line. Options
  # without a default (flags, FILE) get an empty default.
  awk '/^  --/ {
         d = ""
         if (index($2, "=") > 0) d = substr($2, index($2, "=") + 1)
         else if ($3 ~ /^\[/) { d = $3; gsub(/^\[|\]$/, "", d) }
         n = split($1, names, ",")
         for (i = 1; i <= n; i++) print names[i] " " d
       }' "$work/$tool.help" >"$work/$tool.defaults"
done

# Flags in the README's tables (rows starting with | `--flag) must exist in one of the tools.
all_help=$(cat "$work/fsdp-train.help" "$work/fsdp-run.help" "$work/fsdp-plan.help")
for flag in $(grep -oE -- '^\| `--[a-z][a-z0-9-]+' "$readme" | sed 's/^| `//' | sort -u); do
  if ! printf '%s\n' "$all_help" | grep -q -- "$flag"; then
    echo "README.md documents $flag, which no tool's --help lists"
    status=1
  fi
done

# Defaults: "README.md:LINE TOOL FLAG README_DEFAULT" for each table row. A row belongs to the
# tool its section's heading names (fsdp-run, fsdp-plan, else fsdp-train). The README's cell may explain
# its value ("0 (auto)") or quote it ("The "): its first word is what must equal --help's
# default. Where --help shows no default, the cell must not claim a number.
awk '/^```/ { fenced = !fenced; next }
     fenced { next }
     /^#+ / { tool = ($0 ~ /fsdp-run/) ? "fsdp-run" : ($0 ~ /fsdp-plan/) ? "fsdp-plan" : "fsdp-train" }
     /^\| `--[a-z]/ {
       row = $0; gsub(/\\\|/, "/", row)  # an escaped \| inside a cell
       split(row, cell, "|")
       flag = cell[2]; sub(/^ *`/, "", flag); sub(/[ `].*/, "", flag)
       d = cell[3]; gsub(/[`"]/, "", d); sub(/^ +/, "", d); sub(/ .*/, "", d)
       print "README.md:" NR " " tool " " flag " " d
     }' "$readme" >"$work/rows"
while read -r where tool flag doc; do
  if ! grep -q -- "^$flag " "$work/$tool.defaults"; then
    continue  # not this tool's flag: reported above if no tool has it
  fi
  help_default=$(grep -- "^$flag " "$work/$tool.defaults" | head -n 1 | cut -d' ' -f2-)
  if [ -n "$help_default" ]; then
    if [ "$doc" != "$help_default" ]; then
      echo "$where: $tool $flag: the README's default is '$doc' but --help says '$help_default'"
      status=1
    fi
  elif printf '%s' "$doc" | grep -qE '^[-+]?[0-9]'; then
    echo "$where: $tool $flag: the README's default is '$doc' but --help shows none"
    status=1
  fi
done <"$work/rows"
[ "$status" -eq 0 ] && echo "docs_match_help: every flag and default in README.md matches --help"
exit $status
