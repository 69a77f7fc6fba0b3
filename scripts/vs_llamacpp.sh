#!/usr/bin/env bash
# lockstep bench and llama.cpp's llama-bench on the same files, rows
# interleaved in one time window (these machines are noisy: compare rows of
# one round only): prefill of 64 tokens and decode of 16, per type and
# thread count, ROUNDS times. lockstep's rows carry its decode / the bound
# of its own bandwidth probe, measured in the same run.
#   scripts/vs_llamacpp.sh DIR
# DIR holds tl-TYPE.gguf for each type (lockstep gen-model --shape
# tinyllama-1.1b --type TYPE -o DIR/tl-TYPE.gguf). Environment: TYPES
# (default "q4_0 q8_0"), TH (thread counts, default "1 2"), ROUNDS (default
# 2), LOCKSTEP (default build/lockstep), LLAMA_BENCH (default
# /tmp/llama.cpp/build/bin/llama-bench: scripts/llamacpp.sh builds it).
# SEQS=1,4,16: several sequences decoding together instead, each after a
# prompt of 128 tokens, 64 tokens each: lockstep bench -s against
# llama-batched-bench (LLAMA_BATCHED, default beside LLAMA_BENCH); the
# aggregate decode tok/s of each.
set -euo pipefail
[ $# -eq 1 ] && [ "$1" != "-h" ] && [ "$1" != "--help" ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; }
DIR=$1
L=${LOCKSTEP:-build/lockstep}
LB=${LLAMA_BENCH:-/tmp/llama.cpp/build/bin/llama-bench}
echo "# $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; $(date -u +%FT%TZ)"
for r in $(seq "${ROUNDS:-2}"); do for ty in ${TYPES:-q4_0 q8_0}; do for t in ${TH:-1 2}; do
    M=$DIR/tl-$ty.gguf
    if [ -n "${SEQS:-}" ]; then
        "$L" bench -m "$M" -t "$t" -s "$SEQS" -p 128 -n 64 -r 2 2>&1 | tr '\r' '\n' | grep -E "^\| [^m-]" |
            awk -F'|' -v ty="$ty" -v t="$t" '{printf "lockstep %s t=%s seqs=%s tg=%s\n", ty, t, $4, $6}' | sed 's/([^)]*)//g; s/  */ /g'
        "${LLAMA_BATCHED:-$(dirname "$LB")/llama-batched-bench}" -m "$M" -c 4096 -b 2048 -ub 512 -npp 128 -ntg 64 \
            -npl "$SEQS" -t "$t" -fa off 2>/dev/null |
            awk -F'|' -v ty="$ty" -v t="$t" '$2 ~ /^ *128 *$/ {gsub(/ /, ""); printf "llama    %s t=%s seqs=%s tg=%s\n", ty, t, $4, $9}'
        continue
    fi
    "$L" bench -m "$M" -t "$t" -p 64 -n 16 -r 3 2>&1 | tr '\r' '\n' | grep -E "^\| [^m-]" |
        awk -F'|' -v ty="$ty" -v t="$t" '{printf "lockstep %s t=%s pp64=%s tg16=%s bw=%s GB/s decode/bound=%s\n", ty, t, $5, $6, $7, $10}' |
        sed 's/([^)]*)//g; s/  */ /g'
    "$LB" -m "$M" -t "$t" -p 64 -n 16 -r 3 -o csv 2>/dev/null |
        awk -F, -v ty="$ty" -v t="$t" 'NR>1{gsub(/"/,""); printf "llama    %s t=%s %s=%.1f\n", ty, t, ($(NF-6)=="0" ? "pp64" : "tg16"), $(NF-1)}'
done; done; done
