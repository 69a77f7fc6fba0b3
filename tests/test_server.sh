#!/usr/bin/env bash
# `lockstep serve` through real sockets and the official openai npm client
# (tests/server/: client.mjs, abuse.mjs, load.mjs; the package is installed
# with `npm ci --prefix tests/server` when tests/server/node_modules is
# missing). Servers on free ports (--port 0, the URL read from stdout), all on
# stories260K, each started with -t 1 (a spinning thread pool on a busy
# 2-core machine is slow, not different):
#   - one node, and a --local 2 --tp 2 cluster with an API key: client.mjs
#     (models, chat and completions, streamed and not, logprobs, stop strings,
#     usage, finish reasons, errors; greedy completions equal `lockstep run`);
#   - on the ASan+UBSan build when there is one (else the plain one):
#     --ctx 256 --max-body-kb 16 --timeout 3, and one with --no-kv-reuse:
#     abuse.mjs (bad input gets a clear 4xx and the server serves on: malformed
#     JSON, wrong types, unknown fields, bad max_tokens, bodies and headers over
#     the limit, prompts over the context, 1-byte-per-second clients, 500 idle
#     connections, clients that hang up mid-request), and two with small
#     --parallel and --queue (a burst gets 429 past them);
#   - load.mjs on the one-node server: LOAD_CLIENTS (32) streaming clients for
#     LOAD_SECONDS (60) s, outputs equal to the requests run alone, RSS flat;
#     the same for LOAD_TP2_SECONDS (30) s on a --local 2 --tp 2 server (its
#     long prompts' all-reduces go through the shm windows, the decodes'
#     through the rings, interleaved); then a shorter run (ASAN_LOAD_CLIENTS 8 for ASAN_LOAD_SECONDS 15 s) on
#     the ASan+UBSan build ($(dirname LOCKSTEP)/asan/lockstep, made by
#     `make tests`), which must then stop cleanly with no sanitizer report.
# Every server must stop on SIGTERM with exit 0. The trap kills whatever is
# left. Run from the repository root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
LA=${LOCKSTEP_ASAN:-$(dirname "$L")/asan/lockstep}
LOAD_CLIENTS=${LOAD_CLIENTS:-32}
LOAD_SECONDS=${LOAD_SECONDS:-60}
ASAN_LOAD_CLIENTS=${ASAN_LOAD_CLIENTS:-8}
ASAN_LOAD_SECONDS=${ASAN_LOAD_SECONDS:-15}
LOAD_TP2_SECONDS=${LOAD_TP2_SECONDS:-30}
M=$TD/models/stories260K.gguf
[ -f "$M" ] || M=$RD/models/stories260K.gguf
lk_tmp server

# stop_pid PID: SIGTERM, then (after 10 s) SIGKILL, its child processes (--local ranks) too; RC = its exit status
stop_pid() {
    local pid=$1 kids i
    kids=$(pgrep -P "$pid" 2>/dev/null)
    kill -TERM "$pid" 2>/dev/null
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null; fi
    wait "$pid" 2>/dev/null
    RC=$?
    for i in $kids; do kill -KILL "$i" 2>/dev/null; done
}
cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && stop_pid "$p"; done
    PIDS=() # stopped and reaped: nothing left for lk_cleanup to signal
    lk_cleanup
}
trap cleanup EXIT
trap 'exit 1' INT TERM

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "SKIP test_server: needs node and npm (scripts/deps.sh installs them)"
    exit 0
fi
if [ ! -d tests/server/node_modules/openai ]; then
    if ! npm ci --prefix tests/server --no-audit --no-fund --loglevel=error >"$T/npm.log" 2>&1; then
        no npm_ci "npm ci --prefix tests/server failed:" "$(tail -n 5 "$T/npm.log")"
        exit 1
    fi
fi

# start NAME BIN ARGS...: a server on a free port; sets URL and PID (empty when it did not start)
start() {
    local name=$1 bin=$2 i
    shift 2
    URL= PID=
    "$bin" serve -m "$M" --port 0 "$@" >"$T/$name.out" 2>"$T/$name.err" &
    local pid=$!
    PIDS+=("$pid")
    for ((i = 0; i < 1200; i++)); do
        URL=$(sed -n 's|.*ready at \(http://[^ ]*/v1\).*|\1|p' "$T/$name.out" 2>/dev/null)
        [ -n "$URL" ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if [ -z "$URL" ]; then
        no "${name}_start" "no 'ready at URL' on stdout within 120 s; stderr:" "$(tail -n 5 "$T/$name.err")"
        stop_pid "$pid"
        return 1
    fi
    PID=$pid
    ok "${name}_start"
}

# finish NAME PID: stops it; it must exit 0 and (ASan build) report nothing
finish() {
    local name=$1 pid=$2
    stop_pid "$pid"
    if [ "$RC" = 0 ]; then ok "${name}_stops_cleanly"; else no "${name}_stops_cleanly" "exit $RC after SIGTERM; stderr:" "$(tail -n 8 "$T/$name.err")"; fi
    # an orderly stop reports no error (it once named a lost --local worker:
    # the workers died with the scheduler thread that had forked them)
    if grep -q '^lockstep error' "$T/$name.err"; then no "${name}_stop_without_error" "$(grep '^lockstep error' "$T/$name.err" | head -n 3)"
    else ok "${name}_stop_without_error"; fi
    if grep -Eq 'ERROR: (Address|Leak)Sanitizer|runtime error:' "$T/$name.err"; then
        no "${name}_sanitizers" "$(grep -E -A 12 'ERROR: (Address|Leak)Sanitizer|runtime error:' "$T/$name.err" | head -n 30)"
    fi
}

# node SCRIPT ARGS...: its PASS/FAIL lines; a non-zero exit without a FAIL line fails too
js() {
    local script=$1 rc
    shift
    node "tests/server/$script" "$@" >"$T/js.out" 2>&1
    rc=$?
    cat "$T/js.out"
    if grep -q '^FAIL ' "$T/js.out"; then FAILED=1
    elif [ "$rc" -ne 0 ]; then no "$script" "exit $rc" "$(tail -n 8 "$T/js.out")"; fi
}

T0=$(date +%s)
# ---- functional: one node, and a 2-rank tensor-parallel cluster with an API key ----------
if start node1 "$L" --temp 0 -t 1; then
    js client.mjs --url "$URL" --lockstep "$L" --model "$M" --label node1 --threads 1
    NODE1_URL=$URL NODE1_PID=$PID
fi
echo "secret-key-for-the-tests" >"$T/key"
if start tp2 "$L" --temp 0 -t 1 --local 2 --tp 2 --api-key-file "$T/key"; then
    js client.mjs --url "$URL" --lockstep "$L" --model "$M" --label tp2 --threads 1 --key secret-key-for-the-tests --ranks 2
    finish tp2 "$PID"
fi

# ---- bad input: on the ASan build when there is one (error paths under the sanitizers) ----
LB=$L
[ -x "$LA" ] && LB=$LA
if start abuse "$LB" --temp 0 -t 1 --ctx 256 --max-body-kb 16 --timeout 3; then
    AB_URL=$URL AB_PID=$PID
    start queue "$LB" --temp 0 -t 1 --parallel 2 --queue 1 && Q_URL=$URL Q_PID=$PID
    start queue0 "$LB" --temp 0 -t 1 --parallel 1 --queue 0 && Q0_URL=$URL Q0_PID=$PID
    if start noreuse "$LB" --temp 0 -t 1 --no-kv-reuse; then
        js abuse.mjs --url "$AB_URL" --noreuse-url "$URL" --queue-url "${Q_URL:-}" --queue0-url "${Q0_URL:-}" \
            --ctx 256 --max-body-kb 16 --timeout 3
        finish noreuse "$PID"
    fi
    [ -n "${Q_PID:-}" ] && finish queue "$Q_PID"
    [ -n "${Q0_PID:-}" ] && finish queue0 "$Q0_PID"
    finish abuse "$AB_PID"
fi

# ---- load: the plain build, then the sanitizers ----------------------------------------------
if [ -n "${NODE1_PID:-}" ]; then
    js load.mjs --url "$NODE1_URL" --pid "$NODE1_PID" --clients "$LOAD_CLIENTS" --duration "$LOAD_SECONDS" --label load
    finish node1 "$NODE1_PID"
fi
if start tp2load "$L" --temp 0 -t 1 --local 2 --tp 2; then
    js load.mjs --url "$URL" --pid "$PID" --clients "$LOAD_CLIENTS" --duration "$LOAD_TP2_SECONDS" --label load_tp2
    finish tp2load "$PID"
fi
if [ ! -x "$LA" ]; then
    echo "SKIP asan_load: no ASan build at $LA (make tests builds it)"
elif start asan "$LA" --temp 0 -t 1; then
    js load.mjs --url "$URL" --clients "$ASAN_LOAD_CLIENTS" --duration "$ASAN_LOAD_SECONDS" --label asan_load
    finish asan "$PID"
fi
echo "  (test_server: $(($(date +%s) - T0)) s)"
exit $FAILED
