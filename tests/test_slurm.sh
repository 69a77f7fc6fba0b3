#!/usr/bin/env bash
# Launch under a real single-host Slurm (issue 13): the test starts munged,
# slurmctld and slurmd in a private configuration (its own key, socket,
# ports, state and spool under a temporary folder), then
# `srun -n 2 --mpi=pmix lockstep run ...` must write exactly what one process
# writes, also with --transport mpi. SKIPs (saying why) without Slurm/munge (Debian slurmctld, slurmd,
# slurm-client, munge), without root, without MPI in the build, or when the
# daemons do not come up. Run from the repository root by tests/run.sh with
# LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
M=$RD/models/stories260K.gguf
for c in munged slurmctld slurmd srun sinfo; do
    command -v "$c" >/dev/null 2>&1 || { echo "SKIP slurm: $c not found (Debian slurmctld slurmd slurm-client munge)"; exit 0; }
done
[ "$(id -u)" -eq 0 ] || { echo "SKIP slurm: the private slurmd must run as root"; exit 0; }
if OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 "$L" run -m "$M" -p hi --local 2 2>&1 | grep -q 'built without MPI'; then
    echo "SKIP slurm: lockstep was built without MPI (install libopenmpi-dev and rebuild)"
    exit 0
fi
lk_tmp slurm
chmod 755 "$T"
cleanup() {
    for f in slurmd.pid slurmctld.pid munged.pid; do
        [ -s "$T/$f" ] && kill "$(cat "$T/$f")" 2>/dev/null
    done
    for _ in $(seq 40); do
        alive=
        for f in slurmd.pid slurmctld.pid munged.pid; do
            [ -s "$T/$f" ] && kill -0 "$(cat "$T/$f")" 2>/dev/null && alive=1
        done
        [ -z "$alive" ] && break
        sleep 0.1
    done
    lk_cleanup
}
trap cleanup EXIT

# munge with its own key and socket
mkdir -p "$T/state" "$T/spool" "$T/munge"
chmod 700 "$T/munge"
head -c 1024 /dev/urandom >"$T/munge/munge.key"
chmod 600 "$T/munge/munge.key"
SOCK=$T/munge/munge.sock
munged --force --socket="$SOCK" --key-file="$T/munge/munge.key" --pid-file="$T/munged.pid" \
    --log-file="$T/munged.log" --seed-file="$T/munge/seed" 2>"$T/munged.err" ||
    { echo "SKIP slurm: munged did not start: $(tail -n 2 "$T/munged.err")"; exit 0; }
host=$(hostname -s)
# A random port pair may be taken (another program's listener or an
# ephemeral port): slurmctld then dies after daemonising ("Address already
# in use") and every sinfo waits out its message timeout. So: a wall-clock
# bound on the wait, sinfo bounded too, and another port pair when the
# controller is gone.
export SLURM_CONF=$T/slurm.conf
up=
for attempt in 1 2 3; do
    p1=$(( 20000 + RANDOM % 20000 ))
    cat >"$T/slurm.conf" <<EOF
ClusterName=lktest
SlurmctldHost=$host
SlurmctldPort=$p1
SlurmdPort=$(( p1 + 1 ))
AuthType=auth/munge
AuthInfo=socket=$SOCK
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/slurmctld.log
SlurmdLogFile=$T/slurmd.log
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
MessageTimeout=5
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=lktest Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    slurmctld -f "$SLURM_CONF" -i 2>"$T/ctld.err" && slurmd -f "$SLURM_CONF" 2>"$T/d.err" ||
        { echo "SKIP slurm: slurmctld/slurmd did not start: $(tail -n 2 "$T"/*.err)"; exit 0; }
    t_end=$(( $(date +%s) + 10 ))
    while [ "$(date +%s)" -lt "$t_end" ]; do
        timeout 3 sinfo -h -o %t 2>/dev/null | grep -q idle && { up=1; break; }
        # the controller gone (its pid file is written once it runs): another port
        [ -s "$T/slurmctld.pid" ] && ! kill -0 "$(cat "$T/slurmctld.pid")" 2>/dev/null && break
        sleep 0.1
    done
    [ -n "$up" ] && break
    echo "note: slurm attempt $attempt on port $p1: $(tail -n 1 "$T/slurmctld.log" 2>/dev/null)"
    for f in slurmd.pid slurmctld.pid; do
        [ -s "$T/$f" ] && kill "$(cat "$T/$f")" 2>/dev/null
        rm -f "$T/$f"
    done
    sleep 0.5
done
[ -n "$up" ] || { echo "SKIP slurm: the node did not become idle in 3 tries of 10 s: $(tail -n 2 "$T/slurmctld.log" 2>/dev/null)"; exit 0; }
ok slurm_daemons_up

"$L" run -m "$M" -p "Once upon a time" -n 24 --temp 0 >"$T/one.txt" 2>/dev/null
if timeout 60 srun -n 2 --mpi=pmix "$L" run -m "$M" -p "Once upon a time" -n 24 --temp 0 >"$T/many.txt" 2>"$T/many.err" &&
   cmp -s "$T/one.txt" "$T/many.txt" && grep -q 'started by srun: rank 0 of 2 is the head' "$T/many.err"; then ok slurm_srun_n2
else no slurm_srun_n2 "$(head -c 200 "$T/many.txt")" "$(grep -v info "$T/many.err" | tail -n 4)"; fi
# the data over MPI (--transport mpi) in the same job step kind: the links say so
if timeout 60 srun -n 2 --mpi=pmix "$L" run -m "$M" -p "Once upon a time" -n 24 --temp 0 --transport mpi >"$T/many.txt" 2>"$T/many.err" &&
   cmp -s "$T/one.txt" "$T/many.txt" && grep -q 'mpi link to rank 1 (.*): MPI rank 0 -> 1' "$T/many.err"; then ok slurm_srun_n2_transport_mpi
else no slurm_srun_n2_transport_mpi "$(head -c 200 "$T/many.txt")" "$(grep -v info "$T/many.err" | tail -n 4)"; fi
