#!/usr/bin/env bash
# The honest scaling demo (issue 12): on one machine every rank shares one
# memory system, so "2 processes x 2 threads" cannot beat "1 process x 4
# threads": both read the same weights over the same memory bus. What a
# cluster of N machines of C cores each gives over one of them is emulated
# here by giving each rank C cores of its own (taskset) and comparing it with
# ONE rank on C cores — the question a buyer asks ("does a second box make
# me faster?"), not "do more processes beat more threads". It is fair only
# while C cores do not saturate the machine's memory bus (one core reads a
# fraction of it; the script prints both), and the links are this host's
# shared memory, far faster than a network (add linkemu for that).
#
#   bench/scaling.sh MODEL [N] [C]      (default N = 2 ranks, C = 1 core each; N x C <= cores)
#
# Prints, from one time window: one rank on C cores, N ranks on C cores each
# (--local N --tp N), their decode tok/s and speed-up, and what `lockstep
# plan` predicts for both from figures measured in the same run (the rank's
# own weight read rate, the links' netbench table). Environment: LOCKSTEP
# (default build/lockstep), N_TOK (decode tokens, default 64), REPS (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
M=${1:?usage: bench/scaling.sh MODEL [N] [C]}
N=${2:-2}
C=${3:-1}
L=${LOCKSTEP:-build/lockstep}
N_TOK=${N_TOK:-64}
REPS=${REPS:-3}
CORES=$(nproc)
if [ $((N * C)) -gt "$CORES" ]; then echo "scaling: $N ranks x $C cores need $((N * C)) cores; this machine has $CORES" >&2; exit 2; fi
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $CORES cores; $(date -u +%FT%TZ); $(uptime | sed 's/.*load/load/')"
echo "# model $M; $N ranks x $C core(s) each against 1 rank x $C core(s); $N_TOK decode tokens, $REPS reps"

# the machine's whole read rate, and one rank's (the emulation is fair while the second is well below the first)
taskset -c "0-$((CORES - 1))" "$L" bench -m "$M" -t "$CORES" -p 8 -n 8 -r 1 --json 2>/dev/null >"$T/all.json"
taskset -c "0-$((C - 1))" "$L" bench -m "$M" -t "$C" -p 16 -n "$N_TOK" -r "$REPS" --json 2>/dev/null >"$T/one.json"
taskset -c "0-$((N * C - 1))" "$L" bench -m "$M" -t "$C" -p 16 -n "$N_TOK" -r "$REPS" --local "$N" --tp "$N" --json 2>/dev/null >"$T/many.json"
taskset -c "0-$((N * C - 1))" "$L" netbench --local "$N" --sizes 4K,16K --iters 300 >"$T/nb.txt" 2>/dev/null

python3 - "$T" "$M" "$N" "$C" "$L" <<'EOF'
import json, subprocess, sys
T, M, N, C, L = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
row = lambda f: json.loads(open(f"{T}/{f}").read().splitlines()[0])
allr, one, many = row("all.json"), row("one.json"), row("many.json")
rank_bw = one["weight_bytes_per_token"] * one["decode_tok_s"] / 1e9   # what C cores read at in decode
print(f"# memory: the probe reads {allr['mem_bw_gbs']:.1f} GB/s with all {allr['threads']} threads; one rank on {C} core(s) "
      f"streamed weights at {rank_bw:.1f} GB/s in decode ({100 * rank_bw / allr['mem_bw_gbs']:.0f} % of it)")
def plan(tp):
    out = subprocess.run([L, "plan", "-m", M, "--nodes", str(tp), "--tp", str(tp), "--pp", "1", "--mem-bw-gbs", f"{rank_bw:.3f}",
                          "--netbench", f"{T}/nb.txt", "--json"], capture_output=True, text=True)
    try:
        return json.loads(out.stdout.splitlines()[0])["decode_tok_s"]
    except Exception:
        return float("nan")
p1, pn = plan(1), plan(N)
m1, mn = one["decode_tok_s"], many["decode_tok_s"]
print(f"| layout | decode tok/s (min-max) | plan predicts | measured / predicted |")
print(f"|---|---:|---:|---:|")
print(f"| 1 rank x {C} core(s) | {m1:.1f} ({one['decode_tok_s_min']:.1f}-{one['decode_tok_s_max']:.1f}) | {p1:.1f} | {m1 / p1:.2f} |")
print(f"| {N} ranks x {C} core(s), --tp {N} | {mn:.1f} ({many['decode_tok_s_min']:.1f}-{many['decode_tok_s_max']:.1f}) | {pn:.1f} | {mn / pn:.2f} |")
print(f"# speed-up of {N} emulated machines over one: measured {mn / m1:.2f}x, plan {pn / p1:.2f}x")
EOF
