#!/usr/bin/env bash
# Runs every fuzzer briefly, as CI does: first its regression inputs
# (fuzz/regress/NAME/, inputs that once crashed it: each must now pass), then
# SECONDS of fuzzing from the seeds `make fuzz` generated, in a scratch corpus
# (nothing is written into the tree). Any crash, leak, UBSan report or
# timeout fails the run, with the fuzzer's report and the input's path.
#   fuzz/run.sh [SECONDS per fuzzer, default 20] [build folder, default build]
# ONLY=substring runs the matching fuzzers only. SEED=N fixes libFuzzer's
# random seed (CI uses SEED=1, so that a run explores the same inputs each
# time and a red CI is a change's doing, not the dice's; leave it unset when
# hunting, to explore new ground each run). Run from anywhere; paths are
# relative to the repository root, where the fuzzers expect to run.
set -u
cd "$(dirname "$0")/.."
secs=${1:-20}
B=${2:-build}
[ -d "$B/fuzz/seeds" ] || { echo "fuzz/run.sh: no $B/fuzz/seeds: run make fuzz B=$B first"; exit 1; }
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
work=$(mktemp -d /tmp/lk_fuzz.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail=0
for f in "$B"/fuzz/fuzz_*; do
    [ -x "$f" ] || continue
    name=${f##*/fuzz_}
    if [ -n "${ONLY:-}" ] && [[ "$name" != *"$ONLY"* ]]; then continue; fi
    if [ -d "fuzz/regress/$name" ] && [ -n "$(ls -A "fuzz/regress/$name")" ]; then
        if ! "$f" -runs=1 fuzz/regress/"$name"/* >"$work/$name.regress" 2>&1; then
            echo "FAIL fuzz_$name: a regression input crashes again"; tail -n 40 "$work/$name.regress"; fail=1; continue
        fi
    fi
    mkdir -p "$work/$name"
    # -timeout: one input may take 10 s at most (a hang is a finding too)
    "$f" "$work/$name" "$B/fuzz/seeds/$name" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -max_len=65536 ${SEED:+-seed="$SEED"} -artifact_prefix="$work/$name-" -print_final_stats=1 >"$work/$name.log" 2>&1
    rc=$?
    stats=$(grep -E '^#[0-9]+.*(DONE|pulse|NEW|REDUCE)' "$work/$name.log" | tail -n 1 | sed 's/^#\([0-9]*\)\s*[A-Z]*\s*/\1 execs, /')
    if [ "$rc" -ne 0 ]; then
        echo "FAIL fuzz_$name (exit $rc): $stats"
        grep -E 'ERROR|SUMMARY|runtime error|Test unit written|Timeout|==[0-9]+==' "$work/$name.log" | head -n 20
        grep -A30 -m1 'ERROR: ' "$work/$name.log" | head -n 40
        for a in "$work/$name"-*; do [ -f "$a" ] && echo "  input: $(base64 -w0 <"$a" | head -c 2000)"; done
        fail=1
    else
        echo "PASS fuzz_$name: $stats"
    fi
done
exit $fail
