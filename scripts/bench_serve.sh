#!/usr/bin/env bash
# Reproduces BENCHMARKS.md's "Serving" rows: aggregate decode tok/s and time
# to first token p50/p99 at several concurrency levels, for lockstep serve
# on one node and as a --local 2 --tp 2 cluster, next to llama.cpp's
# llama-server with as many slots (-np), same file, same machine, same
# client (bench/serve_load.py), servers run one after the other.
#   scripts/bench_serve.sh MODEL [LEVELS]
# Environment: LOCKSTEP (default build/lockstep), LLAMA_SERVER (path of
# llama-server; scripts/llamacpp.sh builds one; unset: lockstep rows only),
# THREADS (default: the cores), N_TOK (decode tokens per request, default
# 64), REQ_X (requests per level = REQ_X x concurrency, default 2), WORDS
# (prompt words, default 16), ROUNDS (default 1: each server's rows ROUNDS
# times, the servers taking turns, so a noisy machine shows in the spread),
# NO_TP (set: no --local 2 --tp 2 rows), SERVE_ARGS (more flags for lockstep
# serve, e.g. --kv-f16).
# The memory-bandwidth bound of one token, measured in the same run, is
# printed first (lockstep bench).
set -euo pipefail
cd "$(dirname "$0")/.."
M=$1
LEVELS=${2:-1,4,16,32}
L=${LOCKSTEP:-build/lockstep}
TH=${THREADS:-$(nproc)}
N_TOK=${N_TOK:-64}
REQ_X=${REQ_X:-2}
WORDS=${WORDS:-16}
MAXC=$(tr ',' '\n' <<<"$LEVELS" | sort -n | tail -1)
CTX=$((N_TOK + 512))
PORT=${PORT:-18555}
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores; $(date -u +%FT%TZ); $(uptime | sed 's/.*load/load/')"
echo "# model $M; $WORDS-word prompts, $N_TOK tokens per request, $REQ_X x concurrency requests per level, $TH threads"
"$L" bench -m "$M" -t "$TH" -p 16 -n 16 -r 1 --md 2>/dev/null | grep -E '^\| (model|[^-])' | sed 's/^/# bound (lockstep bench, same run): /' || true

wait_ready() { # URL PID
    for _ in $(seq 600); do
        python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)" "$1" 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}

run_levels() { # NAME URL
    for c in ${LEVELS//,/ }; do
        printf '%s ' "$1"
        python3 bench/serve_load.py --url "$2" -c "$c" -n $((REQ_X * c < 4 ? 4 : REQ_X * c)) --max-tokens "$N_TOK" --prompt-words "$WORDS" || true
    done
}

serve_lockstep() { # NAME ARGS...
    local name=$1; shift
    # shellcheck disable=SC2086 # SERVE_ARGS is a list of flags
    "$L" serve -m "$M" --port "$PORT" -np "$MAXC" --ctx "$CTX" --queue 1024 ${SERVE_ARGS:-} "$@" >/tmp/bench_serve.$$.out 2>&1 &
    local pid=$!
    if wait_ready "http://127.0.0.1:$PORT" "$pid"; then run_levels "$name" "http://127.0.0.1:$PORT"
    else echo "$name: did not start: $(tail -3 /tmp/bench_serve.$$.out)"; fi
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
}

for _round in $(seq "${ROUNDS:-1}"); do
    serve_lockstep "lockstep-1node" -t "$TH"
    [ -n "${NO_TP:-}" ] || serve_lockstep "lockstep-tp2" --local 2 --tp 2 -t $((TH / 2 > 0 ? TH / 2 : 1))
    if [ -n "${LLAMA_SERVER:-}" ]; then
        # llama-server divides -c among its slots: each slot gets CTX
        "$LLAMA_SERVER" -m "$M" --port "$PORT" -np "$MAXC" -c $((CTX * MAXC)) -t "$TH" -cb --no-webui >/tmp/bench_serve.$$.out 2>&1 &
        pid=$!
        if wait_ready "http://127.0.0.1:$PORT" "$pid"; then run_levels "llama-server" "http://127.0.0.1:$PORT"
        else echo "llama-server: did not start: $(tail -3 /tmp/bench_serve.$$.out)"; fi
        kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
    fi
done
rm -f /tmp/bench_serve.$$.out
