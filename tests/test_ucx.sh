#!/usr/bin/env bash
# --transport ucx through the real program (issue 13): with UCX restricted to
# TCP (UCX_TLS=tcp) and to shared memory (UCX_TLS=posix,self), stories260K
# and a synthetic model under --local 2 --tp 2 and --local 2 --pp 2, and a
# batch of prompts under --tp 2, write exactly what one process writes; the
# per-peer report printed at start names the transport UCX really uses
# (tcp/... under UCX_TLS=tcp, posix/... under posix) on both ranks; a killed
# worker is named; netbench runs over it. SKIPs when the build has no UCX.
# Run from the repository root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
lk_tmp ucx

M=$RD/models/stories260K.gguf

# Without UCX built in: the clear error, exit 2, and nothing else to test.
"$L" run -m "$M" -p hi -n 1 --transport ucx --local 2 >"$T/out" 2>"$T/err"
rc=$?
if grep -q 'built without UCX' "$T/err"; then
    if [ "$rc" -eq 2 ] && grep -q 'lockstep was built without UCX (install libucx-dev and rebuild)' "$T/err"; then
        ok ucx_not_built_error
    else no ucx_not_built_error "exit $rc" "$(cat "$T/err")"; fi
    echo "SKIP ucx: lockstep was built without UCX (install libucx-dev and rebuild)"
    exit 0
fi
"$L" run --transport nope -m "$M" -p hi >"$T/out" 2>"$T/err"
rc=$?
if [ "$rc" -eq 2 ] && grep -q "transport must be auto, tcp, shm, ucx or mpi (got 'nope')" "$T/err"; then ok bad_transport
else no bad_transport "exit $rc" "$(cat "$T/err")"; fi

# --seal keeps data on sealed TCP: UCX links cannot be sealed, so the pair is refused
"$L" run -m "$M" -p hi -n 1 --local 2 --transport ucx --seal >"$T/out" 2>"$T/err"
rc=$?
if [ "$rc" -ne 0 ] && grep -q -- '--seal and --transport ucx do not go together' "$T/err"; then ok ucx_seal_refused
else no ucx_seal_refused "exit $rc" "$(tail -n 3 "$T/err")"; fi

export UCX_WARN_UNUSED_ENV_VARS=n
PROMPTS="$T/prompts.txt"
printf 'Once upon a time\nThe little dog\nLily wanted to\n' >"$PROMPTS"
# same NAME MODEL ARGS...: one process, then every layout over UCX, byte-identical
models="$M"
td_need ucx_synth synth/synth-llama-q8_0.gguf && models="$models $TD/synth/synth-llama-q8_0.gguf"
for model in $models; do
    mn=$(basename "$model" .gguf | tr 'A-Z' 'a-z' | tr -c 'a-z0-9\n' _)
    "$L" run -m "$model" -p "Once upon a time" -n 24 --temp 0 >"$T/one_$mn.txt" 2>"$T/one.err" || no "one_$mn" "$(tail -n 3 "$T/one.err")"
    "$L" run -m "$model" --prompts-file "$PROMPTS" -n 12 --temp 0 --json 2>"$T/one.err" | ids >"$T/oneb_$mn.txt"
    [ "$(wc -l <"$T/oneb_$mn.txt")" -eq 3 ] || no "oneb_$mn" "$(tail -n 3 "$T/one.err")"
done
for tls in tcp posix,self; do
    tn=${tls%%,*}
    for model in $models; do
        mn=$(basename "$model" .gguf | tr 'A-Z' 'a-z' | tr -c 'a-z0-9\n' _)
        for layout in "--tp 2" "--pp 2"; do
            name=ucx_${tn}_${mn}_$(echo "$layout" | tr -dc 'a-z0-9')
            if UCX_TLS=$tls "$L" run -m "$model" -p "Once upon a time" -n 24 --temp 0 --local 2 $layout --transport ucx \
                   >"$T/many.txt" 2>"$T/many.err" && cmp -s "$T/one_$mn.txt" "$T/many.txt"; then ok "$name"
            else no "$name" "$(head -c 200 "$T/many.txt")" "$(grep -v info "$T/many.err" | tail -n 3)"; fi
        done
        name=ucx_${tn}_${mn}_batch_tp2
        if UCX_TLS=$tls "$L" run -m "$model" --prompts-file "$PROMPTS" -n 12 --temp 0 --json --local 2 --tp 2 \
               --transport ucx 2>"$T/many.err" | ids >"$T/manyb.txt" && cmp -s "$T/oneb_$mn.txt" "$T/manyb.txt"; then ok "$name"
        else no "$name" "$(head -c 200 "$T/manyb.txt")" "$(grep -v info "$T/many.err" | tail -n 3)"; fi
    done
    # the report on both ranks names what UCX was restricted to, and only that
    n=$(grep -c "^lockstep: ucx link to rank [01] (127\.0\.0\.1:[0-9]*): $tn/" "$T/many.err")
    if [ "$n" -eq 2 ] && ! grep 'ucx link to' "$T/many.err" | grep -vq ": $tn/"; then ok "ucx_${tn}_report_names_$tn"
    else no "ucx_${tn}_report_names_$tn" "$(grep 'ucx' "$T/many.err")"; fi
done
# peers agree here: no warning about disagreement
if grep -q 'disagree' "$T"/*.err; then no ucx_no_disagreement "$(grep disagree "$T"/*.err)"; else ok ucx_no_disagreement; fi

# netbench over UCX (tcp): the table and the report
if UCX_TLS=tcp "$L" netbench --local 2 --transport ucx --sizes 64,16K --iters 50 >"$T/nb.txt" 2>"$T/nb.err"; then
    has netbench_ucx_table "$T/nb.txt" '^netbench: 2 ranks, data over ucx'
    has netbench_ucx_row "$T/nb.txt" '^16 KiB +[0-9.]+ +[0-9.]+ +[0-9.]+ \| [0-9.]+ / [0-9.]+ '
    has netbench_ucx_report "$T/nb.err" 'ucx link to rank 1 \(127\.0\.0\.1:[0-9]+\): tcp/lo'
else no netbench_ucx "$(tail -n 3 "$T/nb.err")"; fi

# a worker killed while the head waits on it over UCX is named, within seconds
# (-c 8192: the default 2048 positions were all generated in 0.3 s over
# posix shared memory, before the kill came)
for tls in tcp posix,self; do
    tn=${tls%%,*}
    UCX_TLS=$tls "$L" run -m "$M" -p "Once upon a time" -n 100000 -c 8192 --ignore-eos --temp 0 --local 2 --tp 2 \
        --transport ucx >/dev/null 2>"$T/dead.err" &
    hp=$!
    for _ in $(seq 100); do grep -q 'ucx link to' "$T/dead.err" && break; sleep 0.05; done
    sleep 0.3
    wk=$(pgrep -P "$hp" | head -n 1)
    t0=$(date +%s%N)
    [ -n "$wk" ] && kill -9 "$wk"
    for _ in $(seq 100); do kill -0 "$hp" 2>/dev/null || break; sleep 0.05; done
    t1=$(date +%s%N)
    if kill -0 "$hp" 2>/dev/null; then kill "$hp"; no "ucx_${tn}_dead_worker" "head still running 5 s after the kill"
    elif [ -z "$wk" ]; then no "ucx_${tn}_dead_worker" "no worker process found" "$(tail -n 3 "$T/dead.err")"
    elif grep -Eq 'rank 1' "$T/dead.err" && [ $(( (t1 - t0) / 1000000 )) -lt 4000 ]; then ok "ucx_${tn}_dead_worker"
    else no "ucx_${tn}_dead_worker" "$(( (t1 - t0) / 1000000 )) ms" "$(tail -n 3 "$T/dead.err")"; fi
    wait "$hp" 2>/dev/null || true   # the head fails, as it should; the checks above tell
done
