#!/usr/bin/env bash
# Two "hosts" over a real network link: two Linux network namespaces joined by a veth pair, each
# a node of 2 ranks of `fsdp-train --num-nodes 2 --mesh 2,2 --strategy hybrid_shard`, so the
# shard groups stay inside a host and only the replicate all-reduce (and the rendezvous store)
# crosses the link. Three runs:
#   clean   per-step losses equal, to the last bit, those of the single-host `--devices 4` run;
#   netem   5 ms delay and 1% loss on the link: the same losses, only slower;
#   down    the link goes down mid-run: every rank on both hosts exits non-zero within
#           --timeout + 10 s, each host's error names a rank of the other host, nothing is left.
# The namespaces use TEST-NET-1 (192.0.2.0/24, RFC 5737) on their own veth pair only; nothing
# outside them is contacted. Needs root (CAP_NET_ADMIN) and iproute2 (with tc); otherwise it
# prints why and exits 77, which ctest reports as skipped.
# usage: two_hosts_test.sh BUILD_DIR [STEPS]
set -uo pipefail
export PATH=$PATH:/usr/sbin:/sbin   # ip, tc, nft

build=$1
steps=${2:-12}
train=$build/fsdp-train
tag=fsdp$$                     # namespace and link names unique to this run
ns0=${tag}n0 ns1=${tag}n1
veth0=${tag}a veth1=${tag}b
addr0=192.0.2.1 addr1=192.0.2.2
port=29511
timeout_s=8                    # --timeout of the link-down run
work=$(mktemp -d)
failures=0

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# Kills whatever still runs inside our namespaces, then deletes them. Always runs (trap).
kill_ns_processes() {
  local ns pids
  for ns in "$ns0" "$ns1"; do
    pids=$(ip netns pids "$ns" 2>/dev/null) || continue
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  done
  return 0
}
cleanup() {
  kill_ns_processes
  sleep 0.2
  ip netns del "$ns0" 2>/dev/null
  ip netns del "$ns1" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ -x "$train" ] || { echo "FAIL: $train is not built"; exit 1; }
command -v ip >/dev/null || skip "iproute2's 'ip' is not installed (scripts/setup.sh installs it)"
command -v tc >/dev/null || skip "iproute2's 'tc' is not installed (scripts/setup.sh installs it)"
[ "$(id -u)" -eq 0 ] || skip "creating network namespaces needs root (CAP_NET_ADMIN); uid is $(id -u)"
if ! err=$(ip netns add "$ns0" 2>&1); then
  skip "cannot create a network namespace: $err"
fi
ip netns add "$ns1" || { echo "FAIL: ip netns add $ns1"; exit 1; }
ip link add "$veth0" type veth peer name "$veth1" || skip "cannot create a veth pair (no veth module?)"
ip link set "$veth0" netns "$ns0" && ip link set "$veth1" netns "$ns1" || { echo "FAIL: veth move"; exit 1; }
ip -n "$ns0" addr add "$addr0/24" dev "$veth0" && ip -n "$ns1" addr add "$addr1/24" dev "$veth1"
for ns in "$ns0" "$ns1"; do ip -n "$ns" link set lo up; done
ip -n "$ns0" link set "$veth0" up && ip -n "$ns1" link set "$veth1" up
# (No wait needed: the store client retries its connection until --timeout.)

common=(--num-nodes 2 --devices 2 --master-addr "$addr0" --mesh 2,2
        --strategy hybrid_shard --model tiny --global-batch 8 --seq-len 32 --threads 1 --quiet)

# Per-step losses of a metrics file, as printed (round-trip precision: equal text = equal bits).
losses() { grep -o '"loss":[^,}]*' "$1" | cut -d: -f2; }
mean_step_time() {
  grep -o '"step_time_s":[^,}]*' "$1" | cut -d: -f2 | awk '{s += $1; n++} END {if (n) printf "%.4f", s / n}'
}

# Starts both nodes in their namespaces; $1 = run name, rest = extra flags. Sets pid0/pid1.
# Each run gets its own port: the last run's connections linger in TIME_WAIT on the old one.
start_nodes() {
  local name=$1; shift
  port=$((port + 1))
  set -- --master-port "$port" "$@"
  ip netns exec "$ns0" "$train" "${common[@]}" --node-rank 0 --metrics "$work/$name.jsonl" "$@" \
    >"$work/$name.node0.log" 2>&1 &
  pid0=$!
  ip netns exec "$ns1" "$train" "${common[@]}" --node-rank 1 "$@" >"$work/$name.node1.log" 2>&1 &
  pid1=$!
}
# Waits for our child $1 up to $2 seconds; sets $rc to its exit status (124: it had to be killed)
# and $t_end to when it ended. Not in a $(...) subshell: only this shell can wait for its children.
wait_for() {
  local pid=$1 limit=$2 t=0
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$t" -ge $((limit * 10)) ]; then
      kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rc=124; t_end=$(date +%s.%N); return
    fi
    sleep 0.1; t=$((t + 1))
  done
  t_end=$(date +%s.%N)
  wait "$pid"; rc=$?
}
show_logs() { for f in "$work/$1".node*.log; do echo "--- $(basename "$f")"; tail -n 20 "$f"; done; }

# Makes the link slow and lossy in both directions; sets $impairment to what it did (or why it
# could not). tc netem (5 ms delay, 1% loss) where the kernel has it; kernels built without
# sch_netem (this CI machine's) get 1% random loss from nftables and a 20 Mbit/s tbf rate limit.
impair_link() {
  local err
  if err=$(tc -n "$ns0" qdisc add dev "$veth0" root netem delay 5ms loss 1% 2>&1); then
    tc -n "$ns1" qdisc add dev "$veth1" root netem delay 5ms loss 1% || return 1
    impairment="tc netem delay 5ms loss 1% on both ends"
    return 0
  fi
  impairment="tc netem is unavailable ($err)"
  command -v nft >/dev/null || { impairment+=" and nft is not installed"; return 1; }
  for pair in "$ns0 $veth0" "$ns1 $veth1"; do
    set -- $pair
    ip netns exec "$1" nft add table inet fsdptest &&
      ip netns exec "$1" nft add chain inet fsdptest out '{ type filter hook output priority 0; }' &&
      ip netns exec "$1" nft add rule inet fsdptest out oifname "$2" numgen random mod 100 '<' 1 drop &&
      tc -n "$1" qdisc add dev "$2" root tbf rate 20mbit burst 32kbit latency 50ms ||
      { impairment+="; nftables/tbf failed too"; return 1; }
  done
  impairment+="; instead 1% random loss (nftables numgen) and a 20 Mbit/s tbf limit on both ends"
  return 0
}

# --- reference: one host, 4 ranks on loopback.
timeout -s KILL 300 "$train" --devices 4 --mesh 2,2 --strategy hybrid_shard --model tiny --global-batch 8 --seq-len 32 \
  --threads 1 --quiet --steps "$steps" --metrics "$work/ref.jsonl" >"$work/ref.log" 2>&1 \
  || { cat "$work/ref.log"; echo "FAIL: the single-host reference run failed"; exit 1; }
[ "$(losses "$work/ref.jsonl" | wc -l)" -eq "$steps" ] || { echo "FAIL: reference has no $steps losses"; exit 1; }

# --- clean link and lossy link: same losses to the bit.
for variant in clean netem; do
  if [ "$variant" = netem ] && ! impair_link; then
    echo "skip netem: $impairment"; continue
  fi
  start_nodes "$variant" --steps "$steps" --timeout 60
  wait_for "$pid0" 240; rc0=$rc
  wait_for "$pid1" 30; rc1=$rc
  if [ "$rc0" != 0 ] || [ "$rc1" != 0 ]; then
    show_logs "$variant"; fail "$variant: node exit statuses $rc0 and $rc1, expected 0 and 0"; continue
  fi
  if ! diff <(losses "$work/ref.jsonl") <(losses "$work/$variant.jsonl") >"$work/$variant.diff"; then
    cat "$work/$variant.diff"; fail "$variant: per-step losses differ from the single-host run"
  else
    [ "$variant" = netem ] && echo "$variant: $impairment"
    echo "ok $variant: $steps losses bit-identical to the single-host run;" \
         "mean step time $(mean_step_time "$work/$variant.jsonl") s (single host $(mean_step_time "$work/ref.jsonl") s)"
  fi
done
for pair in "$ns0 $veth0" "$ns1 $veth1"; do
  set -- $pair
  tc -n "$1" qdisc del dev "$2" root 2>/dev/null
  ip netns exec "$1" nft delete table inet fsdptest 2>/dev/null
done

# --- the link goes down mid-run.
start_nodes down --steps 1000000 --timeout "$timeout_s"
for _ in $(seq 600); do   # until node 0 has logged 3 steps (both hosts are training)
  [ "$(cat "$work/down.jsonl" 2>/dev/null | wc -l)" -ge 3 ] && break
  kill -0 "$pid0" 2>/dev/null || break
  sleep 0.1
done
if [ "$(cat "$work/down.jsonl" 2>/dev/null | wc -l)" -lt 3 ]; then
  show_logs down; fail "down: the run did not start training"
else
  ip -n "$ns0" link set "$veth0" down
  t_down=$(date +%s.%N)
  limit=$((timeout_s + 10))
  wait_for "$pid0" $((limit + 20)); rc0=$rc t0=$t_end
  wait_for "$pid1" $((limit + 20)); rc1=$rc t1=$t_end
  e0=$(awk -v a="$t0" -v b="$t_down" 'BEGIN {printf "%.1f", a - b}')
  e1=$(awk -v a="$t1" -v b="$t_down" 'BEGIN {printf "%.1f", a - b}')
  echo "down: node 0 exited $rc0 after ${e0} s, node 1 exited $rc1 after ${e1} s (--timeout $timeout_s)"
  for n in 0 1; do
    rc=$([ $n = 0 ] && echo "$rc0" || echo "$rc1"); el=$([ $n = 0 ] && echo "$e0" || echo "$e1")
    log=$work/down.node$n.log
    [ "$rc" != 0 ] && [ "$rc" != 124 ] || fail "down: node $n exited $rc, expected a non-zero status of its own"
    awk -v e="$el" -v l="$limit" 'BEGIN {exit !(e <= l)}' || fail "down: node $n took ${el} s, more than --timeout + 10 = $limit s"
    # Node 0 holds ranks 0-1 and must name rank 2 or 3; node 1 must name rank 0 or 1: a group
    # with ranks on both hosts, the replicate group ("replicate group [0, 2]") or, when the link
    # drops during the per-step metrics, the world group ("world group [0, 1, 2, 3]"). Gloo's
    # timeout says which group, not which peer.
    peers="(\\[[01], [23]\\]|world group \\[0, 1, 2, 3\\])"
    grep -Eq "$peers" "$log" || fail "down: node $n's errors do not name a group with a rank of the other host"
  done
  show_logs down
  sleep 1   # the supervisors have exited; their ranks die with them (PR_SET_PDEATHSIG)
  for ns in "$ns0" "$ns1"; do
    left=$(ip netns pids "$ns")
    [ -z "$left" ] || fail "down: processes left in $ns: $(ps -o pid=,args= -p $(echo $left | tr ' ' ,))"
  done
fi

if [ "$failures" -ne 0 ]; then echo "two_hosts: $failures failure(s)"; exit 1; fi
echo "two_hosts: all passed"
