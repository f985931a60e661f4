#!/bin/sh
# Keeps the README true to the tools: every flag that `--help` lists must be documented in the
# README, and every flag the README's tables list for a tool must exist in its --help.
# usage: docs_test.sh BUILD_DIR SOURCE_DIR
set -eu
build=$1
readme=$2/README.md
status=0
for tool in fsdp-train fsdp-run; do
  help=$("$build/$tool" --help)
  for flag in $(printf '%s\n' "$help" | grep -oE -- '--[a-z][a-z0-9-]+' | sort -u); do
    [ "$flag" = "--help" ] && continue
    if ! grep -q -- "\`$flag" "$readme"; then
      echo "README.md does not document $tool $flag"
      status=1
    fi
  done
done
# Flags in the README's tables (rows starting with | `--flag) must exist in one of the tools.
all_help=$("$build/fsdp-train" --help; "$build/fsdp-run" --help)
for flag in $(grep -oE -- '^\| `--[a-z][a-z0-9-]+' "$readme" | sed 's/^| `//' | sort -u); do
  if ! printf '%s\n' "$all_help" | grep -q -- "$flag"; then
    echo "README.md documents $flag, which no tool's --help lists"
    status=1
  fi
done
exit $status
