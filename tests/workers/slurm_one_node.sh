#!/bin/bash
# A real one-node Slurm (Debian's slurmctld, slurmd, munge) for one command, in a private network and pid namespace:
#
#   unshare --net --pid --fork --mount-proc --kill-child tests/workers/slurm_one_node.sh DIR COMMAND...
#
# The namespace has only loopback, so the daemons' ports (6817, 6818 on every interface) are reachable from nothing
# outside it; it is PID 1's, so every daemon and task ends with it (also when the test kills it). State, key and logs
# live in DIR (private). Slurm resolves its addresses with AI_ADDRCONFIG, which finds no IPv4 address but 127.0.0.1:
# a second address on lo (10.254.254.1/32, reachable from inside only) satisfies it. munged wants its socket's
# folders open to all: a tmpfs on /run, seen by this namespace only, holds it.
set -euo pipefail
D=$1; shift
umask 077
ip link set lo up
ip addr add 10.254.254.1/32 dev lo
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -m 0711 /run/munge
mkdir -p "$D/state" "$D/spool"
dd if=/dev/urandom of="$D/munge.key" bs=1024 count=1 status=none
munged --socket /run/munge/munge.socket --key-file "$D/munge.key" --pid-file "$D/munged.pid" \
  --log-file "$D/munged.log" --seed-file "$D/munged.seed"
NODE=$(hostname)
cat > "$D/slurm.conf" <<CONF
ClusterName=kerasdist
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=/run/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
chmod 0644 "$D/slurm.conf"
export SLURM_CONF=$D/slurm.conf
slurmctld
slurmd
for _ in $(seq 50); do
  timeout 3 sinfo -h -o %T 2>/dev/null | grep -q idle && break
  sleep 0.2
done
exec "$@"
