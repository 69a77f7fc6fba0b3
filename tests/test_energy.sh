#!/usr/bin/env bash
# Energy per token (issue 12) through the real program, against power
# counters whose truth the test knows: a fake RAPL zone (LK_POWERCAP_ROOT)
# whose energy_uj a writer sets from the wall clock at a known 5 W and which
# wraps every 10 J (the reader must add across the wrap), and a fake hwmon
# sensor (LK_HWMON_ROOT) reading a constant 7 W. `bench --json` must report
# decode watts near those figures, `run` its energy line, `serve` the
# lockstep_energy_joules_total counter growing; with neither source, bench
# says "unavailable" and its JSON fields are null. Run from the repository
# root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
lk_tmp energy
M=$RD/models/stories260K.gguf
# A decode of 400 tokens of this model lasts tens of milliseconds on a fast
# core (27 ms a repetition on a Zen 5), so the fake counter below moves in
# steps of 2 ms: at 20 ms steps the three windows read 0.1 or 0.2 J each
# where 0.135 J went by, and the watts came out anywhere in 3.7-7.4 W. The
# wraps (every 2 s) fall in the whole run, which the sampler reads across.
BENCH=(bench -m "$M" -t 1 -p 4 -n 400 -r 3 --json)

# ---- a RAPL package zone at 5 W, wrapping at 10 J; a subzone the reader must skip
mkdir -p "$T/pc/intel-rapl:0" "$T/pc/intel-rapl:0:0"
echo 10000000 >"$T/pc/intel-rapl:0/max_energy_range_uj"
echo 0 >"$T/pc/intel-rapl:0/energy_uj"
echo 123 >"$T/pc/intel-rapl:0:0/energy_uj"
python3 - "$T/pc/intel-rapl:0/energy_uj" <<'EOF' &
import os, sys, time
p, t0 = sys.argv[1], time.monotonic()
while True:
    uj = int((time.monotonic() - t0) * 5e6) % 10000000  # 5 W, wrapping at 10 J
    with open(p + ".tmp", "w") as f: f.write("%d\n" % uj)
    os.replace(p + ".tmp", p)                         # the reader never sees half a number
    time.sleep(0.002)
EOF
PIDS+=($!)
sleep 0.3
LK_POWERCAP_ROOT=$T/pc "$L" "${BENCH[@]}" >"$T/out" 2>"$T/err"; rc=$?
if [ $rc -eq 0 ] && python3 -c "
import json, sys
d = json.loads(open(sys.argv[1]).read().splitlines()[0])
w, j = d['decode_watts'], d['decode_j_per_token']
sys.exit(0 if 3.5 <= w <= 6.5 and abs(j - w / d['decode_tok_s']) < 0.5 * j else 1)" "$T/out"; then
    ok bench_rapl_watts_across_wraps
else no bench_rapl_watts_across_wraps "exit $rc" "$(head -c 600 "$T/out")" "$(tail -n 3 "$T/err")"; fi

LK_POWERCAP_ROOT=$T/pc "$L" run -m "$M" -p "Once upon a time" -n 300 --temp 0 >"$T/out" 2>"$T/err"; rc=$?
if [ $rc -eq 0 ] && grep -qE '^lockstep: energy [0-9.]+ J while generating: [0-9.]+ W average, [0-9.]+ J per generated token \(RAPL, 1 package zone' "$T/err"; then
    ok run_energy_line
else no run_energy_line "exit $rc" "$(tail -n 3 "$T/err")"; fi

# ---- serve: the counter grows while the server runs
PORT=$(free_port)
LK_POWERCAP_ROOT=$T/pc "$L" serve -m "$M" --port "$PORT" >"$T/serve.log" 2>&1 &
SP=$!
PIDS+=($SP)
python3 - "$PORT" >"$T/m" 2>&1 <<'EOF'
import re, sys, time, urllib.request
def metric():
    try:
        t = urllib.request.urlopen('http://127.0.0.1:%s/metrics' % sys.argv[1], timeout=5).read().decode()
    except OSError:
        return None
    m = re.search(r'^lockstep_energy_joules_total ([0-9.]+)$', t, re.M)
    return float(m.group(1)) if m else -1
for _ in range(100):
    if metric() is not None: break
    time.sleep(0.1)
t0, a = time.monotonic(), metric()
time.sleep(2)
t1, b = time.monotonic(), metric()
w = (b - a) / (t1 - t0) if a is not None and b is not None and a >= 0 else 0
print("readings %s then %s, %.2f s apart: %.2f W" % (a, b, t1 - t0, w))
sys.exit(0 if 3.5 <= w <= 6.5 else 1)
EOF
if [ $? -eq 0 ]; then ok serve_metrics_energy
else no serve_metrics_energy "$(cat "$T/m")" "$(tail -n 3 "$T/serve.log")"; fi
kill $SP 2>/dev/null; wait $SP 2>/dev/null

# ---- no RAPL: a hwmon sensor at a constant 7 W (microwatts)
mkdir -p "$T/hw/hwmon3" "$T/empty"
echo 7000000 >"$T/hw/hwmon3/power1_average"
LK_POWERCAP_ROOT=$T/empty LK_HWMON_ROOT=$T/hw "$L" "${BENCH[@]}" >"$T/out" 2>"$T/err"; rc=$?
if [ $rc -eq 0 ] && python3 -c "
import json, sys
d = json.loads(open(sys.argv[1]).read().splitlines()[0])
sys.exit(0 if 6.0 <= d['decode_watts'] <= 8.0 else 1)" "$T/out"; then
    ok bench_hwmon_watts
else no bench_hwmon_watts "exit $rc" "$(head -c 600 "$T/out")" "$(tail -n 3 "$T/err")"; fi

# ---- neither: said, and null in JSON
LK_POWERCAP_ROOT=$T/empty LK_HWMON_ROOT=$T/empty "$L" bench -m "$M" -t 1 -p 4 -n 8 -r 1 >"$T/out" 2>"$T/err"; rc=$?
if [ $rc -eq 0 ] && grep -q 'energy: unavailable' "$T/err" && ! grep -q 'J/token' "$T/out"; then ok bench_energy_unavailable
else no bench_energy_unavailable "exit $rc" "$(tail -n 3 "$T/err")"; fi
LK_POWERCAP_ROOT=$T/empty LK_HWMON_ROOT=$T/empty "$L" bench -m "$M" -t 1 -p 4 -n 8 -r 1 --json >"$T/out" 2>"$T/err"
if python3 -c "
import json, sys
d = json.loads(open(sys.argv[1]).read().splitlines()[0])
sys.exit(0 if d['decode_watts'] is None and d['decode_j_per_token'] is None else 1)" "$T/out" 2>/dev/null; then
    ok bench_json_null_without_counters
else no bench_json_null_without_counters "$(head -c 400 "$T/out")"; fi
