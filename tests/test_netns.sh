#!/usr/bin/env bash
# A lockstep cluster across network namespaces, so the head's and the
# worker's traffic crosses real IP routing instead of loopback:
#
#   head ns  10.231.1.2 --veth-- 10.231.1.1  router ns  10.231.2.1 --veth-- 10.231.2.2  worker ns
#                                           (ip_forward=1)
#
# Each end only has a route to the other /24 via the router, so every packet
# is forwarded by a kernel that is not an endpoint. Checks: the route really
# goes via the router; a worker daemon in its namespace serves a head in
# another one, and `run --tp 2` (data over tcp, and transport auto) gives the
# same greedy ids as one node; the router forwarded the data (transport auto
# rightly picks shm here: the namespaces share one host, boot id and
# hostname, so only --transport tcp sends the all-reduces through the router); a head with the
# wrong key is refused with an authentication message (the worker logs the
# head's routed address and keeps serving); --pp 2 works across the router too.
#
# Needs root and iproute2. Only when `ip netns add` itself fails does it print
# the single line `PASS netns_unavailable_skipped` (and says why on stderr).
# No address outside the namespaces this script creates is ever used; the
# namespaces (and with them the veth ends) are deleted on exit.
# Run from the repository root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
L=$(realpath -m "$L")
M=testdata/models/stories260K.gguf
P="Once upon a time"
NH=lk_nh_$$ NR=lk_nr_$$ NW=lk_nw_$$
HEAD_IP=10.231.1.2 RH_IP=10.231.1.1 RW_IP=10.231.2.1 WORK_IP=10.231.2.2
lk_tmp netns
WPID=
MADE=()

cleanup() {
    if [ -n "$WPID" ]; then kill "$WPID" 2>/dev/null; wait "$WPID" 2>/dev/null; fi
    local ns
    for ns in ${MADE[@]+"${MADE[@]}"}; do timeout 10 ip netns del "$ns" 2>/dev/null; done
    lk_cleanup
}
trap cleanup EXIT
trap "exit 1" INT TERM HUP

# nsx NS CMD...: runs CMD inside namespace NS, bounded
nsx() { local ns=$1; shift; timeout 60 ip netns exec "$ns" "$@"; }
# head NAME OUT ARGS...: runs the head in its namespace, expects exit 0
head_run() {
    local name=$1 out=$2; shift 2
    nsx "$NH" "$L" run -m "$M" -p "$P" --workers "$WORK_IP:$PORT" --temp 0 --json -n 16 "$@" >"$out" 2>"$T/err"
    local rc=$?
    if [ "$rc" -eq 0 ]; then ok "$name"; else no "$name" "exit $rc, want 0" "$(tail -n 3 "$T/err")"; fi
}
same_ids() { # NAME FILE: generated_ids equal the one-node run's
    local got; got=$(ids <"$2")
    if [ -n "$got" ] && [ "$got" = "$REF" ]; then ok "$1"; else no "$1" "got '$got'" "want '$REF'"; fi
}
fwd_bytes() { # bytes the router sent towards the worker
    nsx "$NR" cat /sys/class/net/rw/statistics/tx_bytes 2>/dev/null || echo 0
}

# ---- the namespaces ----
if ! timeout 10 ip netns add "$NH" 2>"$T/nserr"; then
    echo "test_netns: 'ip netns add' failed ($(head -n 1 "$T/nserr")): not root or no netns support; skipped" >&2
    ok netns_unavailable_skipped
    exit 0
fi
MADE+=("$NH")
setup() {
    timeout 10 ip netns add "$NR" && MADE+=("$NR") &&
    timeout 10 ip netns add "$NW" && MADE+=("$NW") &&
    # veth pairs created inside the router namespace, the far end moved straight
    # into its namespace: no interface ever appears in the host's namespace
    timeout 10 ip -n "$NR" link add rh type veth peer name eth0 netns "$NH" &&
    timeout 10 ip -n "$NR" link add rw type veth peer name eth0 netns "$NW" &&
    timeout 10 ip -n "$NH" addr add "$HEAD_IP/24" dev eth0 &&
    timeout 10 ip -n "$NR" addr add "$RH_IP/24" dev rh &&
    timeout 10 ip -n "$NR" addr add "$RW_IP/24" dev rw &&
    timeout 10 ip -n "$NW" addr add "$WORK_IP/24" dev eth0 &&
    for ns in "$NH" "$NR" "$NW"; do timeout 10 ip -n "$ns" link set lo up || return 1; done &&
    timeout 10 ip -n "$NH" link set eth0 up && timeout 10 ip -n "$NW" link set eth0 up &&
    timeout 10 ip -n "$NR" link set rh up && timeout 10 ip -n "$NR" link set rw up &&
    timeout 10 ip -n "$NH" route add 10.231.2.0/24 via "$RH_IP" &&
    timeout 10 ip -n "$NW" route add 10.231.1.0/24 via "$RW_IP" &&
    nsx "$NR" sh -c 'echo 1 > /proc/sys/net/ipv4/ip_forward'
}
if setup 2>"$T/err"; then ok netns_setup; else no netns_setup "$(tail -n 3 "$T/err")"; exit 0; fi

timeout 10 ip -n "$NH" route get "$WORK_IP" >"$T/route" 2>&1
has route_via_router "$T/route" "^$WORK_IP via $RH_IP dev eth0 src $HEAD_IP"

# ---- the one-node reference (outside any namespace: no network at all) ----
timeout 60 "$L" run -m "$M" -p "$P" --temp 0 --json -n 16 >"$T/ref" 2>"$T/err"
REF=$(ids <"$T/ref")
if [ -n "$REF" ]; then ok one_node_reference; else no one_node_reference "$(tail -n 3 "$T/err")"; exit 0; fi

# ---- the worker daemon in its namespace ----
"$L" keygen >"$T/key"
"$L" keygen >"$T/wrong"
timeout 120 ip netns exec "$NW" "$L" worker --listen "$WORK_IP:0" --key-file "$T/key" 2>"$T/wlog" &
WPID=$!
PORT=$(listen_port "$T/wlog" "$WPID")
if [ -z "$PORT" ]; then no worker_listens "$(tail -n 5 "$T/wlog")"; exit 0; fi
ok worker_listens

# tp 2 with the mesh data over tcp: everything crosses the router
b0=$(fwd_bytes)
head_run tp2_tcp_across_router "$T/tcp" --key-file "$T/key" --tp 2 --transport tcp
same_ids tp2_tcp_ids_equal_one_node "$T/tcp"
has tp2_tcp_two_ranks "$T/tcp" '"ranks":2'
b1=$(fwd_bytes)
# 16 steps of all-reduces of the hidden rows plus the handshake: well over 20 KB
if [ $((b1 - b0)) -gt 20000 ]; then ok router_forwarded_data
else no router_forwarded_data "router sent $((b1 - b0)) bytes towards the worker"; fi
has worker_saw_routed_head "$T/wlog" "session with head $HEAD_IP:[0-9]+"
has worker_mesh_over_tcp "$T/wlog" "mesh rank 1: rank 0 \\($HEAD_IP:[0-9]+\\) over tcp"

# the wrong key: refused with an authentication message, the worker stays up
nsx "$NH" "$L" run -m "$M" -p "$P" --workers "$WORK_IP:$PORT" --key-file "$T/wrong" --tp 2 --temp 0 --json -n 16 \
    >"$T/out" 2>"$T/err"
rc=$?
if [ "$rc" -ne 0 ]; then ok wrong_key_refused; else no wrong_key_refused "exit 0 with the wrong key"; fi
has wrong_key_msg "$T/err" 'authenticat'
for _ in $(seq 40); do grep -q "refused $HEAD_IP" "$T/wlog" && break; sleep 0.05; done
has worker_logs_refusal "$T/wlog" "refused $HEAD_IP:[0-9]+: .*authenticat"
if kill -0 "$WPID" 2>/dev/null; then ok worker_still_up; else no worker_still_up "$(tail -n 5 "$T/wlog")"; fi

# after the refusal: a good run (transport auto) still works
head_run tp2_after_refusal "$T/auto" --key-file "$T/key" --tp 2
same_ids tp2_auto_ids_equal_one_node "$T/auto"

# two pipeline stages across the router
head_run pp2_across_router "$T/pp" --key-file "$T/key" --pp 2 --transport tcp
same_ids pp2_ids_equal_one_node "$T/pp"
