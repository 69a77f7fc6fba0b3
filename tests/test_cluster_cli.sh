#!/usr/bin/env bash
# The cluster commands through the real program: keygen, worker (flag and
# key-file errors; a running daemon refuses garbage and a stalled client and
# stays up), netbench --local. Run from the repository root by tests/run.sh
# with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
lk_tmp cluster_cli

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
PIDS+=("$WPID")
PORT=$(listen_port "$T/wlog" "$WPID")
if [ -z "$PORT" ]; then no worker_listens "$(cat "$T/wlog")"; exit 0; fi
ok worker_listens
exec 3<>"/dev/tcp/127.0.0.1/$PORT"
printf 'GET / HTTP/1.1\r\nHost: x\r\n\r\n' >&3
exec 3>&-
exec 4<>"/dev/tcp/127.0.0.1/$PORT"
printf 'LKW1\001\000' >&4           # half a header, then silence (left open)
for _ in $(seq 100); do grep -q 'not a lockstep frame' "$T/wlog" && break; sleep 0.05; done
has worker_refuses_garbage "$T/wlog" 'refused 127\.0\.0\.1:[0-9]+: .*not a lockstep frame \(magic 47 45 54 20\)'
for _ in $(seq 140); do grep -q 'sent 6 bytes in' "$T/wlog" && break; sleep 0.05; done
has worker_drops_stalled "$T/wlog" 'refused 127\.0\.0\.1:[0-9]+: timeout: sent 6 bytes in [0-9.]+ s, not enough to authenticate'
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
M="$RD/models/stories260K.gguf"
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
expect run_workers_no_key 2 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$PORT"
has run_workers_no_key_msg "$T/err" '--workers needs --key-file' 
expect run_bad_layout 2 "$L" run -m "$M" -p hi -n 2 --local 3 --tp 2
has run_bad_layout_msg "$T/err" 'does not match the 3 ranks'

# A worker without the model (an empty --model-dir) and an empty cache gets
# only its own slices from the head, in a sparse file; a restarted worker
# reuses them; another layout is another entry; a damaged entry is sent
# again; a cache too small for the slices (--cache-max, or a full disk) is a
# clear error and the worker keeps serving.
mkdir -p "$T/nomodels" "$T/c1" "$T/c2" "$T/c3" "$T/small"
SIZE=$(stat -c %s "$M")
DATA_OFF=$("$L" info "$M" 2>/dev/null | sed -n 's/.*data at byte \([0-9]*\)).*/\1/p')
# start_worker LOG FLAGS...: a daemon; its port in WP, its pid in WK
start_worker() {
    local log=$1; shift
    "$L" worker --listen 127.0.0.1:0 --key-file "$T/k1" --model-dir "$T/nomodels" "$@" 2>"$log" &
    WK=$!
    PIDS+=("$WK")
    WP=$(listen_port "$log" "$WK")
}
same_text() { # name, layout...: generates through the cluster and compares with one node
    local name=$1; shift
    # shellcheck disable=SC2068
    if gen --temp 0 $@ >"$T/many.txt" && cmp -s "$T/one.txt" "$T/many.txt"; then ok "$name"
    else no "$name" "$(head -c 200 "$T/many.txt")" "$(grep -v info "$T/run.err" | tail -n 3)"; fi
}
expect worker_bad_cache_max 2 "$L" worker --listen 127.0.0.1:0 --key-file "$T/k1" --cache-dir "$T/c1" --cache-max 12Q
has worker_bad_cache_max_msg "$T/err" "--cache-max '12Q': expected a size"
expect worker_cache_dir_file 2 "$L" worker --listen 127.0.0.1:0 --key-file "$T/k1" --cache-dir "$T/k1"
has worker_cache_dir_file_msg "$T/err" "--cache-dir $T/k1: Not a directory"
expect worker_help 0 "$L" worker --help
has worker_help_cache_max "$T/out" '--cache-max SIZE'

start_worker "$T/s1.log" --cache-dir "$T/c1"
: >"$T/run.err"
same_text slices_tp2_sent --workers "127.0.0.1:$WP" --key-file "$T/k1"
got=$(sed -n 's/.*received \([0-9]*\) of \([0-9]*\) bytes.*/\1 \2/p' "$T/s1.log")
if [ -n "$got" ] && [ "${got#* }" = "$SIZE" ] && [ $(( ${got% *} * 100 )) -lt $(( SIZE * 75 )) ]; then
    ok slices_tp2_only_its_share
else no slices_tp2_only_its_share "received/size: '$got' of $SIZE" "$(tail -n 5 "$T/s1.log")"; fi
has slices_head_says_sent "$T/run.err" "sent worker rank 1 \(127\.0\.0\.1:$WP\) its slices: [0-9]+ of $SIZE bytes"
E1=$(ls "$T"/c1/*.gguf 2>/dev/null)
if [ "$(echo "$E1" | wc -w)" -eq 1 ] && [ -f "${E1%.gguf}.meta" ] && [ "$(stat -c %s "$E1")" = "$SIZE" ] &&
   [ $(( $(du -k "$E1" | cut -f1) * 1024 )) -lt "$SIZE" ]; then ok slices_sparse_entry
else no slices_sparse_entry "$(ls -ls "$T/c1")"; fi
# restarted: reused, not sent again
kill "$WK"; wait "$WK" 2>/dev/null
start_worker "$T/s1b.log" --cache-dir "$T/c1"
same_text slices_restart_same_text --workers "127.0.0.1:$WP" --key-file "$T/k1"
has slices_restart_reused "$T/s1b.log" "reusing cached slices $E1 .*every byte"
if grep -q 'receiving' "$T/s1b.log"; then no slices_restart_not_resent "$(grep receiving "$T/s1b.log")"
else ok slices_restart_not_resent; fi
# another layout (the worker is pipeline stage 1): a second entry
same_text slices_pp2 --workers "127.0.0.1:$WP" --key-file "$T/k1" --pp 2
n=$(ls "$T"/c1/*.gguf | wc -l)
if [ "$n" -eq 2 ]; then ok slices_second_layout_entry; else no slices_second_layout_entry "$(ls "$T/c1")"; fi
# the same worker again: the entry it checked is trusted while unchanged
same_text slices_rerun_same_text --workers "127.0.0.1:$WP" --key-file "$T/k1"
has slices_rerun_no_full_check "$T/s1b.log" "reusing cached slices $E1 .*unchanged since checked"
# a flipped byte in the first entry (the first tensor's first bytes: always sent)
printf '\125' | dd of="$E1" bs=1 seek=$((DATA_OFF + 100)) conv=notrunc 2>/dev/null
same_text slices_damaged_resent_same_text --workers "127.0.0.1:$WP" --key-file "$T/k1"
has slices_damage_detected "$T/s1b.log" "cache entry $E1 is unusable \(.*digest \(corrupted\)\): removing it"
n=$(grep -c 'receiving rank 1.s slices' "$T/s1b.log") # the pp 2 entry, then this one again
if [ "$n" -eq 2 ]; then ok slices_damaged_resent; else no slices_damaged_resent "$n transfers" "$(tail -n 4 "$T/s1b.log")"; fi
# a smaller share of the same model (--tp-weights 3,1): the entry of the
# larger one holds every byte of it, nothing is sent
same_text slices_subset_same_text --workers "127.0.0.1:$WP" --key-file "$T/k1" --tp-weights 3,1
has slices_subset_reused "$T/s1b.log" "reusing cached slices $E1: recorded for another layout"
n=$(grep -c 'receiving rank 1.s slices' "$T/s1b.log")
if [ "$n" -eq 2 ]; then ok slices_subset_not_sent; else no slices_subset_not_sent "$n transfers"; fi
# three ranks: each worker gets about a third of the layers' bytes; a
# partial file an old crash left behind is cleared when room is made
STALE="$T/c2/$(printf '%064d' 0)-$(printf '%016d' 0).gguf.99999.part"
: >"$STALE"
touch -d '1 hour ago' "$STALE"
start_worker "$T/s2.log" --cache-dir "$T/c2"
W2=$WP
start_worker "$T/s3.log" --cache-dir "$T/c3"
same_text slices_tp3 --workers "127.0.0.1:$W2,127.0.0.1:$WP" --key-file "$T/k1"
got=$(sed -n 's/.*received \([0-9]*\) of .*/\1/p' "$T/s3.log")
if [ -n "$got" ] && [ $(( got * 100 )) -lt $(( SIZE * 65 )) ]; then ok slices_tp3_smaller_share
else no slices_tp3_smaller_share "received '$got' of $SIZE"; fi
if [ -e "$STALE" ]; then no slices_stale_part_cleared "$(ls "$T/c2")"; else ok slices_stale_part_cleared; fi

# --cache-max: too small for the slices: refused before a byte is sent, the
# worker keeps serving; room for one entry: the least recently used goes
start_worker "$T/s4.log" --cache-dir "$T/small" --cache-max 100K
expect slices_cache_max_refused 1 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$WP" --key-file "$T/k1"
has slices_cache_max_msg "$T/err" "worker rank 1 \(127\.0\.0\.1:$WP\) cannot load the model: cache limit: .* more than --cache-max 100\.0 KiB"
expect slices_cache_max_still_serving 1 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$WP" --key-file "$T/k1"
has slices_cache_max_msg_again "$T/err" 'cache limit'
if ls "$T"/small/* >/dev/null 2>&1; then no slices_cache_max_nothing_left "$(ls "$T/small")"; else ok slices_cache_max_nothing_left; fi
kill "$WK"
start_worker "$T/s5.log" --cache-dir "$T/small" --cache-max 1200K
same_text slices_evict_first --workers "127.0.0.1:$WP" --key-file "$T/k1"
same_text slices_evict_second --workers "127.0.0.1:$WP" --key-file "$T/k1" --pp 2
has slices_evicted "$T/s5.log" 'cache over --cache-max 1200\.0 KiB: removed [0-9a-f]{64}-[0-9a-f]{16} .*least recently used'
n=$(ls "$T"/small/*.gguf | wc -l)
if [ "$n" -eq 1 ]; then ok slices_evicted_one_left; else no slices_evicted_one_left "$(ls "$T/small")"; fi
kill "$WK"

# a full disk: a 256 KiB tmpfs in a user namespace of our own (skipped where
# unprivileged namespaces are off)
if unshare -Urm true 2>/dev/null; then
    mkdir -p "$T/tiny"
    unshare -Urm sh -c "mount -t tmpfs -o size=256k none '$T/tiny' && exec '$L' worker --listen 127.0.0.1:0 \
        --key-file '$T/k1' --model-dir '$T/nomodels' --cache-dir '$T/tiny'" 2>"$T/s6.log" &
    PIDS+=($!)
    WP=$(listen_port "$T/s6.log" $!)
    expect slices_disk_full 1 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$WP" --key-file "$T/k1"
    has slices_disk_full_msg "$T/err" "cannot load the model: cache disk full: $T/tiny has .* free, this rank's slices need"
    expect slices_disk_full_still_serving 1 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$WP" --key-file "$T/k1"
fi

# netbench: the table for 2 local ranks, and its flag errors
expect netbench_local 0 "$L" netbench --local 2 --sizes 64,4K --iters 50
has netbench_header "$T/out" '^netbench: 2 ranks, data over (shm|tcp)'
has netbench_row "$T/out" '^4 KiB +[0-9.]+ +[0-9.]+ +[0-9.]+ \| [0-9.]+ / [0-9.]+ '
expect netbench_tcp 0 "$L" netbench --local 3 --transport tcp --sizes 1K --iters 20 --wire f16
has netbench_tcp_header "$T/out" '^netbench: 3 ranks, data over tcp, .*wire f16'
expect netbench_bad_size 2 "$L" netbench --local 2 --sizes 12Q
# the links' spin budget from the environment (LK_LINK_SPIN_US), a bad value named
expect netbench_env_spin_off 0 env LK_LINK_SPIN_US=0 "$L" netbench --local 2 --sizes 64 --iters 20
has netbench_env_spin_off_header "$T/out" '^netbench: 2 ranks, data over (shm|tcp), spin off'
expect netbench_env_spin_bad 0 env LK_LINK_SPIN_US=5ms "$L" netbench --local 2 --sizes 64 --iters 20
has netbench_env_spin_bad_header "$T/out" '^netbench: 2 ranks, data over (shm|tcp), spin on'
has netbench_env_spin_bad_msg "$T/err" 'LK_LINK_SPIN_US=5ms is not a whole number of microseconds'
expect netbench_no_ranks 2 "$L" netbench

# --seal: every TCP link of the session sealed (AEAD records);
# the same text as one node; shm between local ranks stays unsealed and says
# so; a worker with --seal refuses a head without it (both settings named),
# one without --seal seals when the head asks
: >"$T/run.err"
same_text seal_local_tcp --local 3 --transport tcp --seal
has seal_local_tcp_ctl "$T/run.err" 'worker rank 1 \(127\.0\.0\.1:[0-9]+\): control link sealed'
has seal_local_tcp_mesh "$T/run.err" 'mesh rank 0: rank 2 \(127\.0\.0\.1:[0-9]+\) over tcp \(sealed, (AES-256-GCM|ChaCha20-Poly1305)\)'
same_text seal_local_tp_pp --local 4 --tp 2 --pp 2 --transport tcp --seal
: >"$T/run.err"
same_text seal_local_shm --local 2 --seal
has seal_local_shm_says "$T/run.err" 'over shm \(same host; shm is not sealed, only the tcp control link\)'
mkdir -p "$T/c7"
start_worker "$T/s7.log" --seal --cache-dir "$T/c7" # its slices arrive over the sealed link
expect seal_worker_refuses_plain 1 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$WP" --key-file "$T/k1"
has seal_worker_refuses_plain_msg "$T/err" 'seal mismatch: head does not seal \(no --seal\), worker requires sealed links \(--seal\)'
for _ in $(seq 100); do grep -q 'seal mismatch' "$T/s7.log" && break; sleep 0.05; done
has seal_worker_logs_refusal "$T/s7.log" 'refused 127\.0\.0\.1:[0-9]+: .*seal mismatch: worker requires sealed links \(--seal\), head does not seal'
: >"$T/run.err"
same_text seal_worker_required --workers "127.0.0.1:$WP" --key-file "$T/k1" --seal --transport tcp
same_text seal_worker_either --workers "127.0.0.1:$PORT" --key-file "$T/k1" --seal
for _ in $(seq 100); do grep -q 'link sealed' "$T/wlog" && break; sleep 0.05; done
has seal_worker_either_log "$T/wlog" 'head 127\.0\.0\.1:[0-9]+: link sealed'
expect seal_netbench_local 0 "$L" netbench --local 2 --transport tcp --seal --sizes 64,16K,100K --iters 20
has seal_netbench_local_header "$T/out" '^netbench: 2 ranks, data over tcp\+seal'
has seal_netbench_local_row "$T/out" '^100 KiB +[0-9.]+ +[0-9.]+ +[0-9.]+ \| [0-9.]+ / [0-9.]+ '
expect seal_netbench_workers 0 "$L" netbench --workers "127.0.0.1:$WP" --key-file "$T/k1" --seal --transport tcp --sizes 4K --iters 20
has seal_netbench_workers_header "$T/out" '^netbench: 2 ranks, data over tcp\+seal'
expect seal_netbench_no_key 2 "$L" netbench --addrs 127.0.0.1:1,127.0.0.1:2 --rank 0 --seal
has seal_netbench_no_key_msg "$T/err" '--seal needs --key-file'
kill "$WK"

# a worker whose SIMD level differs (LK_SIMD) computes other bits: refused,
# both strings named
LK_SIMD=scalar start_worker "$T/simd.log"
expect simd_mismatch_refused 1 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$WP" --key-file "$T/k1"
has simd_mismatch_msg "$T/err" 'CPU feature mismatch: head has \[[^]]*simd=[a-z0-9]+\], worker has \[[^]]*simd=scalar\]'
# and says what would make them agree: the same features, so the level
has simd_mismatch_hint "$T/err" 'LK_SIMD=scalar on the head would make them agree'
kill "$WK"
# a worker without a feature the head has (LK_CPU_OFF): the hint names it
LK_CPU_OFF=fma start_worker "$T/cpuoff.log"
expect cpu_off_mismatch_refused 1 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$WP" --key-file "$T/k1"
has cpu_off_mismatch_hint "$T/err" 'worker has \[x86_64 avx2 f16c[^]]*\]; LK_CPU_OFF=fma on the head would make them agree'
kill "$WK"

# a closed port (the worker just stopped): retried within the deadline, then
# named as refused, with the address, not as "Connection timed out"
start_worker "$T/gone.log"
CP=$WP
kill "$WK"; wait "$WK" 2>/dev/null
expect closed_port_refused 1 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$CP" --key-file "$T/k1"
has closed_port_refused_msg "$T/err" "worker rank 1: connect to 127\.0\.0\.1:$CP: connection refused \([0-9]+ attempts in [0-9.]+ s\): is a worker listening on 127\.0\.0\.1:$CP\?"

# another file under the model's name in --model-dir: the mismatch names the
# worker's file and its size, and the two ids differ in print
mkdir -p "$T/other"
cp "$RD/models/stories260K-q8_0.gguf" "$T/other/stories260K.gguf"
start_worker "$T/other.log" --model-dir "$T/other"
expect model_mismatch_refused 1 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$WP" --key-file "$T/k1"
OSIZE=$(stat -c %s "$T/other/stories260K.gguf")
has model_mismatch_msg "$T/err" "model mismatch: head has ([0-9a-f]{16}|[0-9a-f]{64}), worker has ([0-9a-f]{16}|[0-9a-f]{64}) \($T/other/stories260K\.gguf, $OSIZE bytes\)"
kill "$WK"

# many refused connections from one address: a bounded number of WARN lines,
# then one line counting the rest
start_worker "$T/flood.log"
for _ in $(seq 40); do
    exec 5<>"/dev/tcp/127.0.0.1/$WP" && exec 5>&-
done
for _ in $(seq 160); do grep -q 'more refused from' "$T/flood.log" && break; sleep 0.05; done
n=$(grep -c 'refused 127\.0\.0\.1:' "$T/flood.log")
if [ "$n" -ge 1 ] && [ "$n" -le 3 ]; then ok flood_refusals_bounded
else no flood_refusals_bounded "$n refusal lines" "$(head -n 5 "$T/flood.log")"; fi
m=$(sed -n 's/.*worker: \([0-9]*\) more refused from 127\.0\.0\.1 in the last [0-9.]* s (latest: .*)$/\1/p' "$T/flood.log" |
    awk '{s += $1} END {print s}')
if [ -n "$m" ] && [ "$m" -gt 0 ] && [ $((m + n)) -eq 40 ]; then ok flood_refusals_counted
else no flood_refusals_counted "summary '$m' + $n lines, want 40" "$(tail -n 3 "$T/flood.log")"; fi
if kill -0 "$WK" 2>/dev/null; then ok flood_worker_still_up; else no flood_worker_still_up; fi
kill "$WK"
