#!/usr/bin/env bash
# scripts/libtorch2-chroot.sh release: `run` keeps the bind mount of every directory it ran in,
# which keeps that directory busy (rm -rf fails) until `release DIR` unmounts it and every mount
# under it (a name with a space too).
set -euo pipefail
tool=$(cd "$(dirname "$0")/.." && pwd -P)/scripts/libtorch2-chroot.sh
"$tool" check || exit $?  # 77: skipped, saying why (CI: fails)
root=$("$tool" path)
[ -x "$root/usr/bin/python3" ] || { echo "no chroot at $root (PyTorch 2 is native here)"; exit 77; }
d=$(mktemp -d)
trap '"$tool" release "$d" >/dev/null 2>&1 || true; rm -rf "$d"' EXIT
mkdir -p "$d/a dir"
(cd "$d" && "$tool" run true)
(cd "$d/a dir" && "$tool" run true)
mounted() { awk '{print $2}' /proc/mounts | grep -c "^$root$d" || true; }
[ "$(mounted)" -eq 2 ] || { echo "FAIL: $(mounted) mounts under $root$d after two runs, not 2"; exit 1; }
if rm -rf "$d" 2>/dev/null; then
  echo "FAIL: rm -rf $d succeeded while its bind mounts were there: nothing to release"; exit 1
fi
"$tool" release "$d"
[ "$(mounted)" -eq 0 ] || { echo "FAIL: $(mounted) mounts under $root$d after release"; exit 1; }
rm -rf "$d" || { echo "FAIL: rm -rf $d after release"; exit 1; }
echo "PASS: two bind mounts released, the directory removed"
