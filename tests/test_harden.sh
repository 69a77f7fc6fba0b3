#!/usr/bin/env bash
# Hardening items of issue 14 through the real program:
#  - threads: without -t every command uses the physical cores among the
#    CPUs it may run on (taskset narrows them; the pool really has that many
#    threads: bench's table reports the engine's pool size), says the count
#    on one stderr line at start, and -t 0 / negative / huge is a usage
#    error (exit 2) naming the range in every command;
#  - text from a hostile GGUF (a chat template that fails to parse, a
#    tokenizer model name) reaches the terminal with its escapes written as
#    \xNN, never raw;
#  - a worker checks its own KV memory before allocating: a head whose share
#    fits asks a worker with less room (RLIMIT_AS) for a huge context and
#    hears an error naming the worker and both sizes, instead of a worker
#    killed by an allocation;
#  - a /dev/shm too small for the ranks' segments (a container's): the shm
#    setup fails with a message naming the room it needed, the ranks talk
#    over TCP and the text is one node's; --transport shm makes it an error.
#    Once it was a SIGBUS mid-generation. (Root: a private tmpfs of 1 MiB
#    on /dev/shm in a mount namespace; SKIP without unshare.)
# Run from the repository root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
M=$RD/models/stories260K.gguf
lk_tmp harden

# ---- threads ---------------------------------------------------------------------
# The reference: distinct (package, core) pairs among the CPUs taskset/nproc
# say we may use, read from sysfs by the shell, not by the program.
cores_of() { # CPU list "0,1,5" -> physical cores among them
    local c
    for c in ${1//,/ }; do
        echo "$(cat /sys/devices/system/cpu/cpu$c/topology/physical_package_id 2>/dev/null || echo 0)-$(cat /sys/devices/system/cpu/cpu$c/topology/core_id 2>/dev/null || echo $c)"
    done | sort -u | wc -l
}
allowed=$(taskset -pc $$ 2>/dev/null | sed 's/.*: //')
if [ -z "$allowed" ] || ! command -v taskset >/dev/null; then
    echo "SKIP threads_default: no taskset"
else
    # expand "0-3,6" into "0,1,2,3,6"
    list=$(echo "$allowed" | tr ',' '\n' | awk -F- '{ if (NF == 2) for (i = $1; i <= $2; i++) print i; else print $1 }' | paste -sd,)
    want=$(cores_of "$list")
    quota=$(cat /sys/fs/cgroup/cpu.max 2>/dev/null | awk '$1 != "max" { print int($1 / $2) }')
    [ -n "$quota" ] && [ "$quota" -ge 1 ] && [ "$quota" -lt "$want" ] && want=$quota
    expect threads_default_runs 0 "$L" run -m "$M" -p "Once upon a time" -n 2 --temp 0
    has threads_default_said "$T/err" "^lockstep run: $want threads? \(default: [0-9]+ physical cores? of the [0-9]+ CPUs? this process may run on"
    # bench's threads column is the engine's pool size
    expect threads_default_bench 0 "$L" bench -m "$M" -p 8 -n 4 -r 1 --bw-mib 16 --csv
    got=$(awk -F, 'NR == 2 { print $2 }' "$T/out")
    if [ "$got" = "$want" ]; then ok threads_default_pool; else no threads_default_pool "pool has '$got' threads, want $want"; fi
    first=${list%%,*}
    expect threads_taskset_one 0 taskset -c "$first" "$L" bench -m "$M" -p 8 -n 4 -r 1 --bw-mib 16 --csv
    got=$(awk -F, 'NR == 2 { print $2 }' "$T/out")
    if [ "$got" = 1 ]; then ok threads_taskset_pool; else no threads_taskset_pool "pinned to CPU $first, the pool has '$got' threads"; fi
    has threads_taskset_said "$T/err" '^lockstep bench: 1 thread \(default: 1 physical core of the 1 CPU '
    if [ "$want" -ge 2 ]; then
        expect threads_local_split 0 "$L" run -m "$M" -p "Once upon a time" -n 2 --temp 0 --local 2
        has threads_local_said "$T/err" "^lockstep run: $((want / 2)) threads? per rank x 2 local ranks \(default"
    else
        echo "SKIP threads_local_split: one core"
    fi
fi
expect threads_given 0 "$L" run -m "$M" -p "Once upon a time" -n 2 --temp 0 -t 1
has threads_given_said "$T/err" '^lockstep run: 1 thread \(-t 1\)'
expect threads_over_cpus 0 "$L" run -m "$M" -p "Once upon a time" -n 2 --temp 0 -t 300
has threads_over_cpus_warns "$T/err" 'warn: --threads: 300 threads on [0-9]+ CPUs? this process may run on'
for t in 0 -5 100000; do
    expect "threads_bad_run_$t" 2 "$L" run -m "$M" -p hi -n 2 -t "$t"
    has "threads_bad_run_${t}_msg" "$T/err" "--threads $t is out of range: 1 to 1024"
    expect "threads_bad_chat_$t" 2 "$L" chat -m "$M" --chat-template chatml -t "$t"
    expect "threads_bad_worker_$t" 2 "$L" worker --listen 127.0.0.1:0 --key-file /nonexistent -t "$t"
    expect "threads_bad_quantize_$t" 2 "$L" quantize "$M" "$T/q.gguf" --type q8_0 -t "$t"
    expect "threads_bad_gen_model_$t" 2 "$L" gen-model --shape tiny -o "$T/g.gguf" -t "$t"
done
expect threads_bad_bench 2 "$L" bench -m "$M" -t 1,2000
has threads_bad_bench_msg "$T/err" '--threads 2000 is out of range'
expect threads_quantize_said 0 "$L" quantize "$M" "$T/q.gguf" --type q8_0 -q
has threads_quantize_line "$T/err" '^lockstep quantize: [0-9]+ threads? \(default: the CPUs this process may run on'
expect threads_chat_said 0 bash -c "echo hi | '$L' chat -m '$M' --chat-template chatml -n 2 -t 1"
has threads_chat_line "$T/err" '^lockstep chat: 1 thread \(-t 1\)'
"$L" keygen >"$T/key" 2>/dev/null
"$L" worker --listen 127.0.0.1:0 --key-file "$T/key" >"$T/wout" 2>"$T/werr" &
PIDS+=($!)
for _ in $(seq 50); do grep -q 'thread' "$T/werr" && break; sleep 0.1; done
has threads_worker_said "$T/werr" '^lockstep worker: what each head asks \(-t on the head\), else [0-9]+ threads? \(default'

# ---- a worker checks its own KV memory --------------------------------------------
# The worker may use less memory than the head (here RLIMIT_AS, as a cgroup
# limit would): the head's own share of --ctx 4000000 fits its machine, the
# worker's (~3 GiB) does not fit its 1.4 GiB. Before, the worker aborted in
# an allocation (the daemon gone) and the head heard 'connection closed'.
if ldd "$L" 2>/dev/null | grep -q libasan; then
    echo "SKIP worker_ctx_refused: an ASan build cannot run under ulimit -v"
else
    (ulimit -v 1500000; exec "$L" worker --listen 127.0.0.1:0 --key-file "$T/key") >"$T/w2out" 2>"$T/w2err" &
    PIDS+=($!)
    port=$(listen_port "$T/w2err" $!)
    t0=$(date +%s.%N)
    expect worker_ctx_refused 1 timeout 60 "$L" run -m "$M" -p hi -n 2 --workers "127.0.0.1:$port" --key-file "$T/key" -c 4000000
    t1=$(date +%s.%N)
    has worker_ctx_named "$T/err" "worker rank 1 \(127\.0\.0\.1:$port\) .*--ctx 4000000 needs [0-9.]+ GiB on this worker \(its KV cache share: 4000000 positions x 5 layers x [0-9]+ KV heads = [0-9.]+ GiB.* but only [0-9.]+ GiB of memory is available to it"
    if awk -v a="$t0" -v b="$t1" 'BEGIN{exit !(b - a < 15)}'; then ok worker_ctx_prompt
    else no worker_ctx_prompt "took $(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}') s"; fi
    # the worker is still there and serves the next head
    expect worker_after_refusal 0 timeout 60 "$L" run -m "$M" -p "Once upon a time" -n 4 --temp 0 --workers "127.0.0.1:$port" --key-file "$T/key"
    # a --local 2 cluster shares one machine: the head counts the whole KV
    # against the memory it may get, RLIMIT_AS (or a cgroup limit) included,
    # not MemAvailable alone, and refuses before a rank allocates
    expect local_ctx_refused 1 timeout 60 bash -c "ulimit -v 1500000; exec '$L' run -m '$M' -p hi -n 2 --local 2 -c 4000000"
    has local_ctx_msg "$T/err" '--ctx 4000000 needs [0-9.]+ GiB \(KV cache 4000000 positions .* but [0-9.]+ GiB of memory is available'
fi

# ---- a /dev/shm without room -----------------------------------------------------------
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
    small() { unshare -m bash -c 'mount -t tmpfs -o size=1M tmpfs /dev/shm && exec "$@"' small "$@"; }
    expect small_shm_one_node 0 "$L" run -m "$M" -p "Once upon a time" -n 300 --temp 0 -t 1
    cp "$T/out" "$T/one_node"
    expect small_shm_tp2 0 small "$L" run -m "$M" -p "Once upon a time" -n 300 --temp 0 -t 1 --local 2 --tp 2
    if cmp -s "$T/out" "$T/one_node"; then ok small_shm_same_text; else no small_shm_same_text "$(head -c 300 "$T/out")"; fi
    has small_shm_named "$T/err" 'over tcp: shm failed: shm segment /lockstep-[0-9a-f-]+: /dev/shm has no room for its [0-9]+ KiB'
    expect small_shm_forced 1 small "$L" run -m "$M" -p "Once upon a time" -n 4 --temp 0 -t 1 --local 2 --tp 2 --transport shm
    has small_shm_forced_named "$T/err" 'shm setup with rank 1: shm segment .*/dev/shm has no room'
else
    echo "SKIP small_shm: needs root and unshare -m"
fi
