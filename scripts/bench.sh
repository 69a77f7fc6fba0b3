#!/usr/bin/env bash
# Reproduces BENCHMARKS.md: generates the benchmark models (random weights of
# real shapes; nothing is downloaded) and runs every measurement, printing the
# bound (memory bandwidth, link ping-pong) measured in the same run.
#   scripts/bench.sh [DIR]   (DIR: where the models go, default /tmp/lockstep-bench)
# Takes about 20-30 minutes on a 2-core machine; run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:-/tmp/lockstep-bench}
L=build/lockstep
make -s build/lockstep
mkdir -p "$D"
for t in q4_0 q8_0 q4_k f16; do
    [ -f "$D/tl-$t.gguf" ] || $L gen-model --shape tinyllama-1.1b --type "$t" -o "$D/tl-$t.gguf" -q
done
for t in q4_0 q8_0; do
    [ -f "$D/l3-8b-4l-$t.gguf" ] || $L gen-model --shape llama3-8b --layers 4 --type "$t" -o "$D/l3-8b-4l-$t.gguf" -q
done
echo "## single node (uptime: $(uptime))"
for t in q4_0 q8_0 q4_k f16; do $L bench -m "$D/tl-$t.gguf" -t 1,2 -p 64 -n 32 -r 5 --md; done
for t in q4_0 q8_0; do $L bench -m "$D/l3-8b-4l-$t.gguf" -t 1,2 -p 64 -n 16 -r 3 --md; done
$L bench -m "$D/tl-q4_0.gguf" -t 2 -p 512 -n 0 -r 2 --md
echo "## cluster (TinyLlama Q4_0, 64 tokens greedy)"
for cfg in "-t 2" "-t 1" "--local 2 --transport shm -t 1" "--local 2 --transport tcp -t 1" "--local 2 --pp 2 -t 1"; do
    echo "### $cfg"
    for rep in 1 2 3; do
        $L run -m "$D/tl-q4_0.gguf" -p "Once upon a time" -n 64 --temp 0 $cfg 2>&1 >/dev/null | grep '^lockstep:'
    done
done
echo "## links"
$L netbench --local 2 --transport shm --sizes 64,4K,8K,16K,1M
$L netbench --local 2 --transport tcp --sizes 64,4K,8K,16K,1M
