#!/usr/bin/env bash
# A cluster rank killed while the server is serving (issue 10): the requests
# in flight end with an error naming the lost rank (a streamed one with an
# error event, a plain one with 503), /health says "degraded" with the
# reason, the server stays up and answers, and service comes back: a --local
# cluster restarts its ranks itself; with --workers, once the worker is
# restarted on its address. Greedy text after recovery equals text before.
set -u
. "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/.."
M=testdata/models/stories260K.gguf
lk_tmp server_fail
# the servers and workers are disowned (no job-control noise when killed): SIGKILL them
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; lk_cleanup; }
trap cleanup EXIT
# has_flat NAME FILE REGEX: a line matches, or the file's lines joined by spaces do
has_flat() {
    if grep -Eq -- "$3" "$2" || tr '\n' ' ' <"$2" | grep -Eq -- "$3"; then ok "$1"
    else no "$1" "expected /$3/ in: $(head -c 600 "$2")"; fi
}
[ -f "$M" ] || { echo "SKIP server_fail: needs $M"; exit 0; }

# start_server NAME ARGS...: sets URL and SPID (waits for "ready at")
start_server() {
    local name=$1; shift
    "$L" serve -m "$M" --port 0 --temp 0 -t 1 --retry-interval 3 "$@" >"$T/$name.out" 2>"$T/$name.err" &
    SPID=$!
    PIDS+=("$SPID"); disown "$SPID"
    URL=
    for _ in $(seq 300); do
        URL=$(sed -n 's/.*ready at \(http:[^ ]*\)\/v1.*/\1/p' "$T/$name.out")
        [ -n "$URL" ] && break
        kill -0 "$SPID" 2>/dev/null || break
        sleep 0.1
    done
    [ -n "$URL" ]
}

long='{"prompt":"Once upon a time","max_tokens":1500,"ignore_eos":true,"temperature":0'
short='{"prompt":"Once upon a time","max_tokens":24,"temperature":0}'

# kill_during NAME PID: two long requests (stream and not) in flight, then PID is killed
kill_during() {
    local name=$1 victim=$2
    curl -sN "$URL/v1/completions" -d "$long,\"stream\":true}" >"$T/$name.stream" &
    local c1=$!
    curl -s -w '\nHTTP %{http_code}\n' "$URL/v1/completions" -d "$long}" >"$T/$name.plain" &
    local c2=$!
    # both running (a first streamed token arrived) before the kill
    for _ in $(seq 100); do grep -q '"text"' "$T/$name.stream" && break; sleep 0.05; done
    sleep 0.2
    kill -9 "$victim"
    wait "$c1" "$c2"
    curl -s -w '\nHTTP %{http_code}\n' "$URL/health" >"$T/$name.health"
}

# ---- a --local cluster: the server restarts its ranks ------------------------
if start_server local --local 2 --tp 2; then ok server_local_ready; else no server_local_ready "$(tail -3 "$T/local.err")"; exit 0; fi
curl -s "$URL/v1/completions" -d "$short" >"$T/before.json"
has_flat before_text "$T/before.json" '"finish_reason":"length"'
W=$(pgrep -P "$SPID" | head -1)
kill_during local "$W"
has_flat local_stream_error_names_rank "$T/local.stream" '^data: \{"error":\{"message":"the engine failed while running this request: .*rank 1'
has_flat local_stream_ends "$T/local.stream" '^data: \[DONE\]'
has_flat local_plain_503 "$T/local.plain" '^HTTP 503'
has_flat local_plain_error_names_rank "$T/local.plain" '"error":\{"message":"the engine failed while running this request: .*rank 1'
has_flat local_health_degraded "$T/local.health" '"status":"degraded","reason":"the engine failed: .*rank 1.*HTTP 503'
if kill -0 "$SPID" 2>/dev/null; then ok local_server_up; else no local_server_up "$(tail -5 "$T/local.err")"; fi
curl -s -w '\nHTTP %{http_code}\n' "$URL/v1/completions" -d "$short" >"$T/during.json"
has_flat local_request_while_degraded_503 "$T/during.json" 'cannot run requests now: the engine failed: .*rank 1.*HTTP 503'
curl -s -w '\nHTTP %{http_code}\n' "$URL/v1/models" >"$T/models.json"
has_flat local_models_while_degraded "$T/models.json" '"object":"list".*HTTP 200'
for _ in $(seq 150); do curl -s "$URL/health" | grep -q '"status":"ok"' && break; sleep 0.1; done
curl -s "$URL/health" >"$T/health2"
has_flat local_health_back "$T/health2" '"status":"ok"'
curl -s "$URL/v1/completions" -d "$short" >"$T/after.json"
t1=$(grep -o '"text":"[^"]*"' "$T/before.json"); t2=$(grep -o '"text":"[^"]*"' "$T/after.json")
if [ -n "$t1" ] && [ "$t1" = "$t2" ]; then ok local_same_text_after; else no local_same_text_after "before $t1, after $t2"; fi
has_flat local_reopen_logged "$T/local.err" 'the engine is back after 1 attempt'
kill "$SPID"; wait "$SPID" 2>/dev/null

# ---- --workers: degraded until the worker is back ------------------------------
"$L" keygen >"$T/key"
"$L" worker --listen 127.0.0.1:0 --key-file "$T/key" 2>"$T/w1.log" &
WPID=$!; PIDS+=("$WPID"); disown "$WPID"
WPORT=$(listen_port "$T/w1.log" "$WPID")
if start_server workers --workers "127.0.0.1:$WPORT" --key-file "$T/key" --tp 2; then ok server_workers_ready
else no server_workers_ready "$(tail -3 "$T/workers.err")"; exit 0; fi
# the worker daemon serves the session in a child process: kill the whole daemon
kill_during workers "$WPID"
pkill -9 -P "$WPID" 2>/dev/null
has_flat workers_plain_503 "$T/workers.plain" '^HTTP 503'
has_flat workers_health_degraded "$T/workers.health" '"status":"degraded".*rank 1.*HTTP 503'
# reopening fails while the worker is away, and says why
for _ in $(seq 400); do grep -q "reopening the engine failed" "$T/workers.err" && break; sleep 0.1; done
curl -s "$URL/health" >"$T/health3"
has_flat workers_health_says_reopen_failed "$T/health3" '"status":"degraded","reason":"the engine failed: .*; reopening it failed \(attempt [0-9]+\)'
"$L" worker --listen "127.0.0.1:$WPORT" --key-file "$T/key" 2>"$T/w2.log" &
PIDS+=("$!"); disown "$!"
for _ in $(seq 500); do curl -s "$URL/health" | grep -q "\"status\":\"ok\"" && break; sleep 0.1; done
curl -s "$URL/health" >"$T/health4"
has_flat workers_health_back "$T/health4" '"status":"ok"'
curl -s "$URL/v1/completions" -d "$short" >"$T/after2.json"
t3=$(grep -o '"text":"[^"]*"' "$T/after2.json")
if [ -n "$t1" ] && [ "$t1" = "$t3" ]; then ok workers_same_text_after; else no workers_same_text_after "before $t1, after $t3"; fi
exit 0
