# Helpers for the real-launcher tests (sourced by bash): checks that count failures, and the
# per-step losses of a run's --metrics file.

FAILURES=0
TEST_NAME=${TEST_NAME:-launcher test}

skip() {  # ctest reads exit status 77 as "skipped" (SKIP_RETURN_CODE)
  echo "SKIP: $*"
  exit 77
}

pass() { echo "PASS: $*"; }

fail() {
  echo "FAIL: $*"
  FAILURES=$((FAILURES + 1))
}

# The losses of a --metrics file, one per line, exactly as written (17 significant digits).
losses() {
  grep -o '"loss":[^,}]*' "$1" 2>/dev/null | cut -d: -f2
}

# expect_same_losses NAME FILE REFERENCE: the run's losses equal the reference bit for bit.
expect_same_losses() {
  local name=$1 file=$2 ref=$3
  local got want
  got=$(losses "$file")
  want=$(losses "$ref")
  if [ -z "$got" ]; then
    fail "$name: no losses in $file"
  elif [ "$got" != "$want" ]; then
    fail "$name: losses differ from the reference: got [$(echo $got)] want [$(echo $want)]"
  else
    pass "$name: losses equal the reference [$(echo $got)]"
  fi
}

# expect_contains NAME TEXT FILE
expect_contains() {
  if grep -qF -- "$2" "$3"; then pass "$1"; else fail "$1: '$2' not in: $(tail -n 5 "$3")"; fi
}

# A TCP port nobody listens on now (ss is iproute2's, which scripts/setup.sh installs).
free_port() {
  local p
  for _ in $(seq 200); do
    p=$((20000 + RANDOM % 30000))
    [ -z "$(ss -Htln "sport = :$p" 2>/dev/null)" ] && { echo "$p"; return 0; }
  done
  return 1
}

port_is_free() { [ -z "$(ss -Htln "sport = :$1" 2>/dev/null)" ]; }

finish() {
  if [ "$FAILURES" -ne 0 ]; then
    echo "$TEST_NAME: $FAILURES check(s) failed"
    exit 1
  fi
  echo "$TEST_NAME: all checks passed"
  exit 0
}
