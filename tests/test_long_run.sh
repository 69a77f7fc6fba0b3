#!/usr/bin/env bash
# A generation that lasts longer than every liveness timeout in the code
# (heartbeats 1.5 s, head silence 10 s): at least 60 s on a --local 2
# --tp 2 cluster, which must finish cleanly and give one process's tokens.
# The length is calibrated on this machine (decoding at depth d costs about
# d, so time grows with nearly the square of the length). Run by tests/run.sh.
set -u
. "$(dirname "$0")/lib.sh"
M=testdata/models/stories260K.gguf
lk_tmp long

gen() { # n ctx out-prefix extra flags...
    local n=$1 ctx=$2 out=$3; shift 3
    local t0=$(date +%s.%N)
    "$L" run -m "$M" -p "Once upon a time" -n "$n" --ctx "$ctx" --temp 0 --ignore-eos --json "$@" >"$out.json" 2>"$out.err"
    local rc=$?
    awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}' >"$out.time"
    return $rc
}

# calibrate: 3000 tokens on the cluster, the fastest of 3 runs: a busy
# moment only slows a run, and one slow calibration (1.2 s where the machine
# took 0.7) sized the generation at 53 s instead of 80
t3=
for k in 1 2 3; do
    gen 3000 3072 "$T/cal" --local 2 --tp 2 || { no calibrate "$(tail -n 3 "$T/cal.err")"; exit 0; }
    t3=$(awk -v a="${t3:-1e9}" -v b="$(cat "$T/cal.time")" 'BEGIN{print (b < a ? b : a)}')
done
# time grows as about length^1.8 here (3000 -> 8803 tokens: 7.2 -> 50.1 s on
# the loaded CI machine; a pure square undershot 60 s by 10 s), aimed at 80 s
# so that a machine 25 % faster than at calibration still passes 60 s
n=$(awk -v t="$t3" 'BEGIN{n = int(3000 * exp(log(80 / (t > 0.05 ? t : 0.05)) / 1.8)); if (n < 6000) n = 6000; if (n > 60000) n = 60000; print n}')
ctx=$((n + 64))
echo "  calibration: 3000 tokens in $t3 s; generating $n tokens"

gen "$n" "$ctx" "$T/tp" --local 2 --tp 2; rc=$?
secs=$(cat "$T/tp.time")
if [ $rc -eq 0 ]; then ok long_run_completes; else no long_run_completes "exit $rc after $secs s" "$(tail -n 5 "$T/tp.err")"; fi
if awk -v s="$secs" 'BEGIN{exit !(s >= 60)}'; then ok long_run_lasts_60s; else no long_run_lasts_60s "only $secs s"; fi
echo "  --local 2 --tp 2: $n tokens in $secs s"
if grep -Eiq 'silent|abandon|stopped answering|lost worker' "$T/tp.err"; then
    no long_run_no_liveness_alarm "$(grep -Ei 'silent|abandon|stopped answering|lost worker' "$T/tp.err" | head -n 3)"
else ok long_run_no_liveness_alarm; fi

gen "$n" "$ctx" "$T/one"; rc1=$?
echo "  one process: $n tokens in $(cat "$T/one.time") s"
if [ $rc1 -eq 0 ] && python3 - "$T/tp.json" "$T/one.json" "$n" <<'EOF'
import json, sys
a = json.load(open(sys.argv[1]))["generated_ids"]
b = json.load(open(sys.argv[2]))["generated_ids"]
n = int(sys.argv[3])
d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
print(f"  tokens: cluster {len(a)}, one process {len(b)}, first difference at {d}")
sys.exit(0 if len(a) == len(b) == n and d is None else 1)
EOF
then ok long_run_equals_one_process; else no long_run_equals_one_process "see above"; fi
