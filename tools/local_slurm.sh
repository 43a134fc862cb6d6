#!/usr/bin/env bash
# A real SLURM cluster on this machine: slurmctld and one slurmd per node, each node in a network
# namespace of its own, the nodes joined through a bridge by links of a configurable rate.
#
#   tools/local_slurm.sh up [NODES]     start it (default 2 nodes: n1, n2); installs slurm-wlm
#                                       with apt-get when slurmctld is missing
#   tools/local_slurm.sh run CMD...     run CMD where the cluster's commands work (srun, sbatch,
#                                       squeue, scontrol: the controller's namespace)
#   tools/local_slurm.sh down           stop the daemons, remove the namespaces and the state
#   tools/local_slurm.sh status         sinfo
#   tools/local_slurm.sh node-down K    node K is lost: every process on it killed (slurmd and
#                                       job steps alike), and SLURM told it is down
#   tools/local_slurm.sh node-up K      node K back: its slurmd started again, waits until idle
#
# Needs root (network namespaces, tc). RATE_MBIT (default 0: unlimited) shapes each node's link
# with tbf, as ../shared/tools/slow_link.sh does. LOCAL_SLURM_DIR (default /tmp/jaxspeed-slurm)
# holds slurm.conf, the state and the daemons' logs. Every address is inside namespaces this
# script creates (10.78.0.0/24: node k at 10.78.0.k, the controller at 10.78.0.254); each
# namespace's /etc/hosts (/etc/netns/NS/hosts) names every node, so JAX's SLURM detection finds
# the coordinator by the first node's name. `up` cleans up after itself when it fails.
# A requeued job starts again within seconds here (cred_expire=5, sched_interval=2); on a
# cluster with SLURM's defaults it waits about 2 minutes.
set -Eeuo pipefail  # -E: the ERR trap of `up` fires inside its functions too

DIR=${LOCAL_SLURM_DIR:-/tmp/jaxspeed-slurm}
RATE=${RATE_MBIT:-0}
CTL=jsslurmctl  # the controller's namespace, and the bridge's
NET=10.78.0
PORT_CTL=17817
PORT_NODE=17818

node_ns() { echo "jsslurm$1"; }  # the namespace of node number $1

nodes() { [ -f "$DIR/nodes" ] && cat "$DIR/nodes" || echo 0; }

need_root() {
  [ "$(id -u)" = 0 ] || { echo "local_slurm.sh: needs root (network namespaces)" >&2; exit 2; }
}

install_slurm() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && return 0
  echo "local_slurm.sh: installing slurm-wlm (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null
}

write_conf() {
  local count=$1 host; host=$(hostname)
  mkdir -p "$DIR/state" "$DIR/log"
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=jaxspeed
SlurmctldHost=$host($NET.254)
SlurmctldPort=$PORT_CTL
SlurmdPort=$PORT_NODE
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=2
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/state/slurmd-%n
SlurmctldPidFile=$DIR/state/slurmctld.pid
SlurmdPidFile=$DIR/state/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=30
EOF
  for k in $(seq 1 "$count"); do
    echo "NodeName=n$k NodeHostname=$host NodeAddr=$NET.$k CPUs=$(nproc) State=UNKNOWN" \
      >>"$DIR/slurm.conf"
  done
  echo "PartitionName=debug Nodes=n[1-$count] Default=YES MaxTime=INFINITE State=UP" \
    >>"$DIR/slurm.conf"
}

hosts_file() {  # every node's name, and the controller's
  local count=$1
  echo "127.0.0.1 localhost"
  echo "$NET.254 $(hostname) jsslurmctl"
  for k in $(seq 1 "$count"); do echo "$NET.$k n$k"; done
}

make_network() {
  local count=$1 ns k
  ip netns add $CTL
  ip -n $CTL link set lo up
  ip -n $CTL link add br0 type bridge
  ip -n $CTL addr add $NET.254/24 dev br0
  ip -n $CTL link set br0 up
  mkdir -p /etc/netns/$CTL
  hosts_file "$count" >/etc/netns/$CTL/hosts
  for k in $(seq 1 "$count"); do
    ns=$(node_ns "$k")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "jsn${k}a" type veth peer name "jsn${k}b"
    ip link set "jsn${k}a" netns "$ns"
    ip link set "jsn${k}b" netns $CTL
    ip -n "$ns" addr add "$NET.$k/24" dev "jsn${k}a"
    ip -n "$ns" link set "jsn${k}a" up
    ip -n $CTL link set "jsn${k}b" master br0
    ip -n $CTL link set "jsn${k}b" up
    if [ "$RATE" != 0 ]; then
      ip netns exec "$ns" tc qdisc add dev "jsn${k}a" root tbf rate "${RATE}mbit" burst 256kb \
        latency 100ms
    fi
    mkdir -p "/etc/netns/$ns"
    hosts_file "$count" | sed "s/^$NET\.254 $(hostname) /$NET.254 /" >"/etc/netns/$ns/hosts"
    # each node's own address under the host's name: slurmd and gloo advertise it
    echo "$NET.$k $(hostname)" >>"/etc/netns/$ns/hosts"
  done
}

in_ns() {  # in_ns NS CMD...: CMD in NS's network, with NS's hosts file as /etc/hosts. Not
  # `ip netns exec`: that remounts /sys, and slurmd needs the host's cgroup tree under it.
  local ns=$1; shift
  SLURM_CONF="$DIR/slurm.conf" nsenter --net="/run/netns/$ns" unshare --mount \
    --propagation private sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' \
    "/etc/netns/$ns/hosts" "$@"
}

in_ctl() { in_ns $CTL "$@"; }

wait_idle() {  # until every node is idle, or 60 s
  local count=$1 deadline=$((SECONDS + 60))
  while [ $SECONDS -lt $deadline ]; do
    if [ "$(in_ctl sinfo -h -t idle -o '%D' 2>/dev/null | head -n 1)" = "$count" ]; then
      return 0
    fi
    sleep 1
  done
  echo "local_slurm.sh: the nodes did not come up in 60 s:" >&2
  in_ctl sinfo >&2 || true
  tail -n 5 "$DIR"/log/*.log >&2 || true
  return 1
}

up() {
  local count=${1:-2} k
  need_root
  [[ $count =~ ^[1-9][0-9]*$ ]] || { echo "local_slurm.sh: NODES must be >= 1" >&2; exit 2; }
  if ip netns list | grep -q "^$CTL\b"; then
    echo "local_slurm.sh: a local cluster is already up (tools/local_slurm.sh down first)" >&2
    exit 1
  fi
  install_slurm
  trap 'trap - ERR; echo "local_slurm.sh: up failed (logs: $DIR/log); cleaning up" >&2; KEEP_LOGS=1 down' ERR
  rm -rf "$DIR"; mkdir -p "$DIR"
  echo "$count" >"$DIR/nodes"
  write_conf "$count"
  make_network "$count"
  in_ctl slurmctld -c -f "$DIR/slurm.conf"
  for k in $(seq 1 "$count"); do
    mkdir -p "$DIR/state/slurmd-n$k"
    in_ns "$(node_ns "$k")" slurmd -N "n$k" -f "$DIR/slurm.conf"
  done
  wait_idle "$count"
  trap - ERR
  echo "local_slurm.sh: $count nodes up (rate ${RATE} Mbit/s, 0 = unlimited); state in $DIR"
}

down() {
  local count k ns
  count=$(nodes)
  if [ -f "$DIR/slurm.conf" ] && ip netns list | grep -q "^$CTL\b"; then
    in_ctl scontrol shutdown >/dev/null 2>&1 || true
  fi
  for pidfile in "$DIR"/state/*.pid; do  # what scontrol did not stop
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 1
  for k in $(seq 1 "$count"); do
    ns=$(node_ns "$k")
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  ip netns pids $CTL 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  ip netns del $CTL 2>/dev/null || true
  rm -rf /etc/netns/$CTL
  if [ -n "${KEEP_LOGS:-}" ]; then rm -rf "$DIR/state"; else rm -rf "$DIR"; fi
}

node_number() {
  [[ ${1:-} =~ ^[1-9][0-9]*$ ]] && [ "$1" -le "$(nodes)" ] || {
    echo "local_slurm.sh: no node ${1:-} (nodes 1..$(nodes))" >&2; exit 2; }
}

node_down() {
  local k=$1
  node_number "$k"
  ip netns pids "$(node_ns "$k")" | xargs -r kill -9
  in_ctl scontrol update nodename="n$k" state=down reason="lost (local_slurm.sh node-down)"
}

node_up() {
  local k=$1 deadline=$((SECONDS + 60))
  node_number "$k"
  in_ns "$(node_ns "$k")" slurmd -N "n$k" -f "$DIR/slurm.conf"
  in_ctl scontrol update nodename="n$k" state=resume 2>/dev/null || true  # already back
  while [ $SECONDS -lt $deadline ]; do
    [ "$(in_ctl sinfo -h -n "n$k" -o '%t')" = idle ] && return 0
    sleep 1
  done
  echo "local_slurm.sh: node n$k did not come back in 60 s" >&2
  return 1
}

case "${1:-}" in
up) shift; up "$@" ;;
down) need_root; down; echo "local_slurm.sh: down" ;;
run) shift; in_ctl "$@" ;;
status) in_ctl sinfo ;;
node-down) need_root; node_down "${2:-}" ;;
node-up) need_root; node_up "${2:-}" ;;
*) sed -n '2,/^set -/{/^set -/d;p}' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
