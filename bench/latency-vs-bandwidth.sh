#!/usr/bin/env bash
# The seed's lesson as an experiment (issue 12): does the link's latency or
# its bandwidth set the pace of a cluster? Runs `bench --tp 2` and `--pp 2`
# on a --local 2 cluster whose one mesh link goes through the link emulator
# (--emulate-link DELAY:RATE) at every one-way delay x rate below, and prints
# the measured decode and prefill tok/s next to what `plan` predicts for the
# same point from the same figures (a one-node profile of this machine, the
# delay plus the relay's own hop measured at delay 0, and the rate).
#
#   bench/latency-vs-bandwidth.sh [MODEL.gguf]
#   env: LOCKSTEP (build/lockstep), DELAYS ("0 5 25 100 250 1000" us),
#        RATES ("1 10 100" Gbit/s), N (decode tokens, 32), P (prompt, 64),
#        T (threads per rank, 1), LAYOUTS ("tp pp"), REPS (1),
#        SHAPE/LAYERS/TYPE of the generated model (tinyllama-1.1b, 2, q4_0;
#        SHAPE=tiny LAYERS=2: compute next to nothing, the links alone)
# Without MODEL it generates one: gen-model's tinyllama-1.1b shape cut to 2
# layers, q4_0, with stories260K's 512-token vocabulary (50 MB: a few ms of
# weight reading per token, so that the delays swept span compute).
#
# Caveat, on one machine: both ranks and the relay (which spins a core
# while traffic flows) share this host's cores and memory bandwidth; give T
# so that 2 x T + 1 fits the cores, or the figures measure the scheduler.
set -eu
L=${LOCKSTEP:-build/lockstep}
DELAYS=${DELAYS:-"0 5 25 100 250 1000"}
RATES=${RATES:-"1 10 100"}
N=${N:-32}; P=${P:-64}; T=${T:-1}; REPS=${REPS:-1}
LAYOUTS=${LAYOUTS:-"tp pp"}
W=$(mktemp -d /tmp/lk_lvb.XXXXXX)
trap 'rm -rf "$W"' EXIT
M=${1:-}
if [ -z "$M" ]; then
    M=$W/model.gguf
    "$L" gen-model --shape "${SHAPE:-tinyllama-1.1b}" --layers "${LAYERS:-2}" --type "${TYPE:-q4_0}" \
        --vocab testdata/models/stories260K.gguf -o "$M" -q 2>/dev/null
fi
# num FIELD: FIELD of the first JSON line on stdin
num() { python3 -c "import json,sys; d=json.loads(sys.stdin.readline()); print('%.1f' % d[sys.argv[1]])" "$1"; }

echo "# $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg); model $(basename "$M") (${SHAPE:-tinyllama-1.1b}, ${LAYERS:-2} layers, ${TYPE:-q4_0}, $(($(stat -c %s "$M") >> 20)) MiB); -p $P -n $N, $T thread(s) per rank"
# one node's profile for plan (its step times at T and 2T threads)
"$L" bench -m "$M" -t "$T,$((2 * T))" -p "$P" -n "$N" -r "$REPS" --json 2>/dev/null >"$W/node.json"
# the relay's own hop: the one-way latency of an emulated link set to 0 us
"$L" doctor --local 2 --emulate-link 0 --iters 200 --json 2>/dev/null >"$W/d0.json" || true
L0=$(python3 -c "import json,sys; print('%.1f' % json.load(open(sys.argv[1]))['nodes'][1]['latency_us'])" "$W/d0.json")
echo "# relay hop (one-way latency of a link emulated at 0 us): $L0 us; plan is given delay + $L0 us"
echo
echo "| layout | one-way delay (us) | rate (Gbit/s) | decode tok/s measured | plan | prefill tok/s measured | plan |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for lay in $LAYOUTS; do
    for d in $DELAYS; do
        for r in $RATES; do
            out=$("$L" bench -m "$M" --local 2 --"$lay" 2 -t "$T" --emulate-link "$d:$r" -p "$P" -n "$N" -r "$REPS" \
                  --json 2>"$W/err") || { echo "bench failed at $lay $d:$r: $(tail -n 2 "$W/err")" >&2; exit 1; }
            mt=$(num decode_tok_s <<<"$out"); mp=$(num prefill_tok_s <<<"$out")
            lat=$(python3 -c "print($d + $L0)")
            pl=$("$L" plan -m "$M" --nodes 2 --"$lay" 2 --node-bench "$W/node.json" --latency-us "$lat" \
                 --link-gbps "$r" --seqs 1 --ctx $((P + N)) --prompt "$P" --json 2>/dev/null | head -n 1)
            pt=$(num decode_tok_s <<<"$pl"); pp=$(num prefill_tok_s <<<"$pl")
            echo "| $lay 2 | $d | $r | $mt | $pt | $mp | $pp |"
        done
    done
done
