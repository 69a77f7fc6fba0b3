#!/usr/bin/env bash
# Runs every test program (plain build, then the ASan+UBSan build) and every
# tests/test_*.sh integration script, counts PASS/FAIL/SKIP lines, and ends
# with "N passed, N failed, N skipped", after the list of what was skipped and
# why (a test skips when it needs the shared test data, LK_TESTDATA, default
# ../shared/testdata, and that is absent). ONLY=substring runs just the matching programs;
# B=folder picks the build folder (default build). A program that crashes or exits non-zero without a
# FAIL line counts as one failure.
set -u
cd "$(dirname "$0")/.."
pass=0; fail=0; skip=0; skipped=""
B=${B:-build}
export LOCKSTEP=${LOCKSTEP:-$B/lockstep}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
run_one() { # label, command...
    local label=$1; shift
    if [ -n "${ONLY:-}" ] && [[ "$label" != *"$ONLY"* ]]; then return; fi
    local out rc
    local t0=$(date +%s.%N)
    out=$("$@" 2>&1); rc=$?
    local p f s
    p=$(grep -c '^PASS ' <<<"$out"); f=$(grep -c '^FAIL ' <<<"$out"); s=$(grep -c '^SKIP ' <<<"$out")
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; echo "FAIL $label (exit $rc)"; fi
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
    if [ "$s" -ne 0 ]; then skipped+=$(grep '^SKIP ' <<<"$out" | sed "s|^SKIP |   $label: |")$'\n'; fi
    printf '== %-40s %3d passed %3d failed %3d skipped  (%.1fs)\n' "$label" "$p" "$f" "$s" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')"
    # each FAIL line with the 8 lines before it (a C test's CHECK messages)
    # and the 4 after (a JS test's reasons), then the tail of the output
    if [ "$f" -ne 0 ]; then grep -B8 -A4 '^FAIL ' <<<"$out" | sed 's/^/   ! /'; fi
    if [ "$f" -ne 0 ] || [ -n "${VERBOSE:-}" ]; then sed 's/^/   | /' <<<"$out" | tail -n 60; fi
}
for t in $B/tests/test_*; do
    [ -x "$t" ] && run_one "$(basename "$t")" "$t"
done
# BF16 products take AMX-BF16 tiles where the CPU has them, else vdpbf16ps
# (AVX512_BF16), else fp32 FMAs: the kernels' checks again on each path
# this CPU has below its own (LK_CPU_OFF turns features off)
if [ -x $B/tests/test_quant ]; then
    if grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null; then
        LK_CPU_OFF=amxbf16 run_one "test_quant (LK_CPU_OFF=amxbf16)" $B/tests/test_quant
    fi
    LK_CPU_OFF=avx512bf16,amxbf16 run_one "test_quant (LK_CPU_OFF=avx512bf16,amxbf16)" $B/tests/test_quant
fi
for t in $B/asan/tests/test_*; do
    [ -x "$t" ] && LOCKSTEP=$B/asan/lockstep run_one "asan/$(basename "$t")" "$t"
done
for t in tests/test_*.sh; do
    [ -f "$t" ] && run_one "$(basename "$t")" bash "$t"
done
if [ "$skip" -ne 0 ]; then printf 'skipped (%d):\n%s' "$skip" "$skipped"; fi
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
