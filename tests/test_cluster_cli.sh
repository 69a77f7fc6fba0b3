#!/usr/bin/env bash
# The cluster commands through the real program: keygen, worker (flag and
# key-file errors; a running daemon refuses garbage and a stalled client and
# stays up), netbench --local. Run from the repository root by tests/run.sh
# with LOCKSTEP set.
set -u
L=${LOCKSTEP:-build/lockstep}
T=$(mktemp -d /tmp/lk_cluster_cli.XXXXXX)
WPID=
cleanup() { [ -n "$WPID" ] && kill "$WPID" 2>/dev/null; wait 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT

ok() { echo "PASS $1"; }
no() { echo "FAIL $1"; shift; for l in "$@"; do echo "  $l"; done; }
expect() {
    local name=$1 code=$2; shift 2
    "$@" >"$T/out" 2>"$T/err"; local rc=$?
    if [ "$rc" -eq "$code" ]; then ok "$name"; else no "$name" "exit $rc, want $code" "$(tail -n 3 "$T/err")"; fi
}
has() {
    if grep -Eq -- "$3" "$2"; then ok "$1"; else no "$1" "no line matching '$3' in:" "$(head -n 12 "$2")"; fi
}

# keygen: 64 hex digits, fresh each time
expect keygen 0 "$L" keygen
cp "$T/out" "$T/k1"
has keygen_format "$T/k1" '^[0-9a-f]{64}$'
"$L" keygen >"$T/k2"
if cmp -s "$T/k1" "$T/k2"; then no keygen_fresh "two keys were equal"; else ok keygen_fresh; fi

# worker flag and key-file errors
expect worker_no_key 2 "$L" worker --listen 127.0.0.1:0
has worker_no_key_msg "$T/err" '--key-file FILE is required'
expect worker_missing_key 2 "$L" worker --listen 127.0.0.1:0 --key-file "$T/nope.key"
has worker_missing_key_msg "$T/err" "key file $T/nope.key: No such file"
echo abcd >"$T/short.key"
expect worker_short_key 2 "$L" worker --listen 127.0.0.1:0 --key-file "$T/short.key"
has worker_short_key_msg "$T/err" 'expected 64 hex digits'
expect worker_bad_listen 1 "$L" worker --listen nonsense --key-file "$T/k1"
has worker_bad_listen_msg "$T/err" "bad address 'nonsense'"

# a running daemon: garbage and a stalled half frame are refused, it stays up
"$L" worker --listen 127.0.0.1:0 --key-file "$T/k1" 2>"$T/wlog" &
WPID=$!
PORT=
for _ in $(seq 50); do
    PORT=$(sed -n 's/.*listening on .* (port \([0-9]*\)).*/\1/p' "$T/wlog")
    [ -n "$PORT" ] && break
    sleep 0.1
done
if [ -z "$PORT" ]; then no worker_listens "$(cat "$T/wlog")"; exit 0; fi
ok worker_listens
exec 3<>"/dev/tcp/127.0.0.1/$PORT"
printf 'GET / HTTP/1.1\r\nHost: x\r\n\r\n' >&3
exec 3>&-
exec 4<>"/dev/tcp/127.0.0.1/$PORT"
printf 'LKW1\001\000' >&4           # half a header, then silence (left open)
for _ in $(seq 100); do grep -q 'not a lockstep frame' "$T/wlog" && break; sleep 0.05; done
has worker_refuses_garbage "$T/wlog" 'refused 127\.0\.0\.1:[0-9]+: .*not a lockstep frame \(magic 47 45 54 20\)'
for _ in $(seq 140); do grep -q 'receiving 24 bytes (got 6)' "$T/wlog" && break; sleep 0.05; done
has worker_drops_stalled "$T/wlog" 'refused 127\.0\.0\.1:[0-9]+: .*timeout .*receiving 24 bytes \(got 6\)'
exec 4>&-
if kill -0 "$WPID" 2>/dev/null; then ok worker_still_up; else no worker_still_up "$(tail -n 5 "$T/wlog")"; fi

# netbench against the daemon: a wrong key is refused, the right one served (twice)
expect netbench_workers_wrong_key 1 "$L" netbench --workers "127.0.0.1:$PORT" --key-file "$T/k2" --sizes 64 --iters 20
has netbench_workers_wrong_key_msg "$T/err" 'authentication failed'
expect netbench_workers 0 "$L" netbench --workers "127.0.0.1:$PORT" --key-file "$T/k1" --sizes 64,4K --iters 20
has netbench_workers_table "$T/out" '^netbench: 2 ranks, data over (shm|tcp)'
has netbench_workers_row "$T/out" '^4 KiB +[0-9.]+ +[0-9.]+ +[0-9.]+ \| [0-9.]+ / [0-9.]+ '
expect netbench_workers_again 0 "$L" netbench --workers "127.0.0.1:$PORT" --key-file "$T/k1" --sizes 64 --iters 20 --transport tcp
has netbench_workers_tcp "$T/out" '^netbench: 2 ranks, data over tcp'
expect netbench_workers_no_key 2 "$L" netbench --workers "127.0.0.1:$PORT"

# run over a cluster writes exactly what one node writes (greedy, and sampled
# with penalties): --local TP and PP, and --workers through the daemon
TD=${LK_TESTDATA:-../shared/testdata}
M="$TD/models/stories260K.gguf"
gen() { "$L" run -m "$M" -p "Once upon a time" -n 24 "$@" 2>>"$T/run.err"; }
gen --temp 0 >"$T/one.txt"
for layout in "--local 2" "--local 3 --pp 3" "--local 4 --tp 2 --pp 2 --transport tcp" \
              "--workers 127.0.0.1:$PORT --key-file $T/k1"; do
    name=run_$(echo "$layout" | tr -c 'a-z0-9' _ | sed 's/__*/_/g; s/_$//' | cut -c1-40)
    # shellcheck disable=SC2086
    if gen --temp 0 $layout >"$T/many.txt" && cmp -s "$T/one.txt" "$T/many.txt"; then ok "$name"
    else no "$name" "$(head -c 200 "$T/many.txt")" "$(grep -v info "$T/run.err" | tail -n 3)"; fi
done
gen --temp 0.9 --seed 7 --repeat-penalty 1.3 --presence-penalty -0.5 >"$T/one_s.txt"
if gen --temp 0.9 --seed 7 --repeat-penalty 1.3 --presence-penalty -0.5 --local 3 >"$T/many_s.txt" &&
   cmp -s "$T/one_s.txt" "$T/many_s.txt"; then ok run_sampled_local_3
else no run_sampled_local_3 "$(head -c 200 "$T/many_s.txt")"; fi
expect run_workers_no_key 1 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$PORT"
has run_workers_no_key_msg "$T/err" '--workers needs --key-file' 
expect run_bad_layout 1 "$L" run -m "$M" -p hi -n 2 --local 3 --tp 2
has run_bad_layout_msg "$T/err" 'does not match the 3 ranks'

# netbench: the table for 2 local ranks, and its flag errors
expect netbench_local 0 "$L" netbench --local 2 --sizes 64,4K --iters 50
has netbench_header "$T/out" '^netbench: 2 ranks, data over (shm|tcp)'
has netbench_row "$T/out" '^4 KiB +[0-9.]+ +[0-9.]+ +[0-9.]+ \| [0-9.]+ / [0-9.]+ '
expect netbench_tcp 0 "$L" netbench --local 3 --transport tcp --sizes 1K --iters 20 --wire f16
has netbench_tcp_header "$T/out" '^netbench: 3 ranks, data over tcp, .*wire f16'
expect netbench_bad_size 2 "$L" netbench --local 2 --sizes 12Q
expect netbench_no_ranks 2 "$L" netbench
