#!/usr/bin/env bash
# lockstep plan and linkemu through the real program (issue 12): help and
# usage errors (exit 2), every layout as JSON, a GGUF cut right after its
# header gives the same plan as the whole file, a file cut inside its header
# is refused with the byte offset, the reason names the all-reduces of a
# latency-bound layout, and netbench run through linkemu measures the delay
# that was set. Run from the repository root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
lk_tmp plan_cli

# ---- help and usage ------------------------------------------------------------
expect plan_help 0 "$L" plan --help
has plan_help_shapes "$T/out" 'shapes: .*tinyllama-1.1b'
expect linkemu_help 0 "$L" linkemu --help
has linkemu_help_accuracy "$T/out" 'Accuracy \(tests/test_diag.c'
expect plan_no_model 2 "$L" plan
expect plan_both_models 2 "$L" plan --shape tiny -m x.gguf
expect plan_bad_shape 2 "$L" plan --shape no-such-shape
has plan_bad_shape_lists "$T/err" 'known: tiny tinyllama-1.1b'
expect plan_layout_too_big 2 "$L" plan --shape tiny --tp 4 --nodes 2
expect plan_bad_bw 2 "$L" plan --shape tiny --mem-bw-gbs -3
expect plan_bad_number 2 "$L" plan --shape tiny --latency-us fast
expect plan_pp_beyond_layers 2 "$L" plan --shape tiny --pp 3
expect plan_missing_file 1 "$L" plan -m "$T/none.gguf"
expect linkemu_no_args 2 "$L" linkemu
expect linkemu_bad_delay 2 "$L" linkemu --listen 127.0.0.1:0 --to 127.0.0.1:1 --delay-us -5
expect linkemu_jitter_over_delay 2 "$L" linkemu --listen 127.0.0.1:0 --to 127.0.0.1:1 --delay-us 5 --jitter-us 10

# ---- every layout, as JSON ----------------------------------------------------------
expect plan_json 0 "$L" plan --shape tinyllama-1.1b --nodes 4 --json
if python3 - "$T/out" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
want = {(1,1),(1,2),(1,3),(1,4),(2,1),(2,2),(3,1),(4,1)}
assert {(r["tp"], r["pp"]) for r in rows} == want, rows
for r in rows:
    for k in ("decode_tok_s", "prefill_tok_s", "mem_per_node_gb", "bottleneck", "decode_tok_s_seqs"):
        assert k in r, k
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["mem_per_node_gb"] > 0
# ranked best first by one-sequence decode
d = [r["decode_tok_s"] for r in rows]
assert d == sorted(d, reverse=True), d
EOF
then ok plan_json_layouts; else no plan_json_layouts "$(head -c 400 "$T/out")"; fi

# ---- text: best layout, reason, advice ----------------------------------------------
expect plan_latency_bound 0 "$L" plan --shape llama3-8b --tp 4 --latency-us 1000 --link-gbps 10 --mem-bw-gbs 100
has plan_reason_allreduces "$T/out" 'why: latency-bound: 64 all-reduces x 10[0-9][0-9] us = 6[0-9]\.[0-9] ms of a'
has plan_advice "$T/out" 'would help most: RDMA-class links'
# more nodes than pay: the best uses fewer, and says so
expect plan_fewer_nodes 0 "$L" plan --shape tinyllama-1.1b --nodes 8 --latency-us 2000 --mem-bw-gbs 50
has plan_fewer_nodes_said "$T/out" 'uses [1-7] of the 8 nodes'

# ---- a GGUF cut after its header ------------------------------------------------------
expect gen_tiny 0 "$L" gen-model --shape tiny --type q8_0 -o "$T/tiny.gguf"
expect plan_full_file 0 "$L" plan -m "$T/tiny.gguf" --nodes 2 --json
cp "$T/out" "$T/full.json"
head -c 65536 "$T/tiny.gguf" > "$T/cut.gguf"
expect plan_cut_file 0 "$L" plan -m "$T/cut.gguf" --nodes 2 --json
if cmp -s "$T/out" "$T/full.json"; then ok plan_cut_equals_full; else no plan_cut_equals_full "$(diff "$T/out" "$T/full.json" | head -n 4)"; fi
expect info_refuses_cut 1 "$L" info "$T/cut.gguf"
head -c 300 "$T/tiny.gguf" > "$T/short.gguf"
expect plan_short_file 1 "$L" plan -m "$T/short.gguf"
has plan_short_names_byte "$T/err" 'ends at byte [0-9]+ inside the GGUF header'

# ---- linkemu: netbench's ping-pong between two processes, one way through it -------------
# (bounds loose above: at load 20 on 2 cores a median one-way can double; never below the delay)
P0=$((20000 + RANDOM % 20000)); P1=$((P0 + 1))
"$L" linkemu --listen 127.0.0.1:0 --to 127.0.0.1:$P0 --delay-us 300 --duration-s 40 >"$T/le.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 50); do grep -q port "$T/le.out" && break; sleep 0.1; done
PE=$(sed -n 's/linkemu: port \([0-9]*\).*/\1/p' "$T/le.out")
timeout 40 "$L" netbench --addrs 127.0.0.1:$P0,127.0.0.1:$P1 --rank 0 --transport tcp --sizes 64 --iters 200 >"$T/nb0" 2>&1 &
PIDS+=($!)
# rank 1 must not reach the relay before rank 0 listens (the relay would find no one and drop it)
for _ in $(seq 100); do ss -ltn 2>/dev/null | grep -q ":$P0 " && break; sleep 0.1; done
timeout 40 "$L" netbench --addrs 127.0.0.1:$PE,127.0.0.1:$P1 --rank 1 --transport tcp --sizes 64 --iters 200 >"$T/nb1" 2>&1
wait "${PIDS[1]}"
ow=$(awk '$1 == 64 && $2 == "B" {print $3}' "$T/nb0")
if [ -n "$ow" ] && awk -v v="$ow" 'BEGIN{exit !(v >= 295 && v < 1000)}'; then ok "linkemu_netbench_delay"
else no linkemu_netbench_delay "one-way ${ow:-?} us, set 300" "$(cat "$T/nb0" | head -n 6)"; fi
# plan reads netbench's table
expect plan_reads_netbench 0 "$L" plan --shape tinyllama-1.1b --tp 2 --netbench "$T/nb0"
has plan_netbench_latency "$T/out" 'all-reduces as netbench measured them, [0-9]{3}\.[0-9] us one-way'
