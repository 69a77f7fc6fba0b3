#!/usr/bin/env bash
# Reproduces BENCHMARKS.md's "Many sequences per step" rows: aggregate
# decode tok/s of S sequences decoding together (lockstep bench --seqs), on
# one node and on local clusters, for the TinyLlama-1.1B shape in Q4_0 and
# Q4_K (random weights of the real shape; nothing is downloaded). Each bench
# row carries its bound measured in the same run: S x the memory-bandwidth
# bound, capped by the row's own prefill (GEMM) rate.
#   scripts/bench_batch.sh [DIR] [THREADS]
# DIR: where the models go (default /tmp/lockstep-bench); THREADS: the
# one-node thread counts (default 1,2); P, N: prompt and decode tokens per
# sequence (default 32, 32); SEQS: the one-node sequence counts (default
# 1,2,4,8,16). Run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:-/tmp/lockstep-bench}
TH=${2:-1,2}
P=${P:-32}
N=${N:-32}
SEQS=${SEQS:-1,2,4,8,16}
L=build/lockstep
make -s build/lockstep
mkdir -p "$D"
for t in q4_0 q4_k; do
    [ -f "$D/tl-$t.gguf" ] || $L gen-model --shape tinyllama-1.1b --type "$t" -o "$D/tl-$t.gguf" -q
done
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores; $(date -u +%FT%TZ); uptime: $(uptime | sed 's/.*load/load/')"
for t in q4_0 q4_k; do
    echo "## one node, $t"
    $L bench -m "$D/tl-$t.gguf" -t "$TH" -p "$P" -n "$N" --seqs "$SEQS" -r 3 --md
    echo "## --local 2 --tp 2, 1 thread per rank, $t"
    $L bench -m "$D/tl-$t.gguf" -t 1 -p "$P" -n "$N" --seqs 1,4,16 -r 3 --local 2 --tp 2 --md
    echo "## --local 2 --pp 2, 1 thread per rank, $t"
    $L bench -m "$D/tl-$t.gguf" -t 1 -p "$P" -n "$N" --seqs 1,8 -r 3 --local 2 --pp 2 --md
done
