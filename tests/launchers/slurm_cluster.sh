# A throwaway SLURM cluster on this machine, for the real-launcher tests (sourced by bash).
#
#   slurm_cluster_start DIR   munged, slurmctld and two slurmd ("nodes" named after this host and
#                             localhost, both on 127.0.0.1) with every file in DIR; exports
#                             SLURM_CONF. Returns non-zero with the reason on stderr.
#   slurm_cluster_stop        kills the daemons it started (by pid) and waits for them.
#
# Needs root and Debian 12's slurmctld, slurmd, slurm-client and munge (scripts/setup.sh). No
# system service is touched: the daemons run in the foreground as children of the test, with
# their own munge key and socket, ports picked free, proctrack/linuxproc and task/none (no
# cgroups), no accounting.

SLURM_DAEMON_PIDS=()

_free_port() {  # a port nobody listens on, other than those given as arguments
  local p
  while :; do
    p=$((20000 + RANDOM % 30000))
    [ -z "$(ss -Htln "sport = :$p" 2>/dev/null)" ] && [[ " $* " != *" $p "* ]] && break
  done
  echo "$p"
}

slurm_cluster_start() {
  local dir=$1
  local host
  host=$(hostname -s)
  if [ "$host" = localhost ]; then
    echo "slurm_cluster: the host is named localhost; two emulated nodes need two names" >&2
    return 1
  fi
  if ! getent hosts "$host" >/dev/null; then
    echo "slurm_cluster: this host's name '$host' does not resolve" >&2
    return 1
  fi
  mkdir -p "$dir" && chmod 755 "$dir"   # munged (user munge) must reach its socket
  mkdir -p "$dir/munge-key" "$dir/munge" "$dir/ctld" "$dir/spool"
  head -c 128 /dev/urandom > "$dir/munge-key/munge.key"
  chown -R munge:munge "$dir/munge-key" "$dir/munge"
  chmod 700 "$dir/munge-key"
  chmod 400 "$dir/munge-key/munge.key"
  chmod 755 "$dir/munge"
  runuser -u munge -- munged --foreground --key-file="$dir/munge-key/munge.key" \
    --socket="$dir/munge/munge.sock" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed" >"$dir/munged.out" 2>&1 &
  SLURM_DAEMON_PIDS+=($!)
  local i
  for i in $(seq 50); do [ -S "$dir/munge/munge.sock" ] && break; sleep 0.1; done
  if [ ! -S "$dir/munge/munge.sock" ]; then
    echo "slurm_cluster: munged did not start: $(tail -n 3 "$dir/munged.out")" >&2
    return 1
  fi
  local ctld_port node_a_port node_b_port
  ctld_port=$(_free_port)
  node_a_port=$(_free_port "$ctld_port")
  node_b_port=$(_free_port "$ctld_port" "$node_a_port")
  cat > "$dir/slurm.conf" <<CONF
ClusterName=fsdptest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerParameters=defer_batch
KillWait=2
NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host Port=$node_a_port CPUs=4 State=UNKNOWN
NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=localhost Port=$node_b_port CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
  export SLURM_CONF="$dir/slurm.conf"
  SLURM_CLUSTER_NODES="$host,localhost"
  slurmctld -D -i -f "$SLURM_CONF" >"$dir/slurmctld.out" 2>&1 &
  SLURM_DAEMON_PIDS+=($!)
  local node
  for node in "$host" localhost; do
    slurmd -D -N "$node" -f "$SLURM_CONF" >"$dir/slurmd-$node.out" 2>&1 &
    SLURM_DAEMON_PIDS+=($!)
  done
  for i in $(seq 150); do
    if [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | wc -l)" -ge 2 ]; then return 0; fi
    sleep 0.2
  done
  echo "slurm_cluster: the nodes did not come up within 30 s: $(sinfo -N 2>&1 | tail -n 3)" \
       "$(tail -n 3 "$dir/slurmctld.log" "$dir"/slurmd-*.log 2>/dev/null)" >&2
  return 1
}

slurm_cluster_stop() {
  local pid
  for pid in "${SLURM_DAEMON_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${SLURM_DAEMON_PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  SLURM_DAEMON_PIDS=()
}
