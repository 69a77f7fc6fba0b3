#!/usr/bin/env bash
# lockstep doctor through the real program (issue 12): usage errors (exit 2);
# a healthy --local 2 cluster (exit 0, JSON with both nodes, a link with its
# transport and latency, the all-reduce, real decode steps, a verdict and the
# layout plan recommends); a cluster of two worker daemons where one holds a
# different model file under the same name (exit 1, the model check fails and
# names that worker and both identities, the agreeing worker passes; the
# workers' CPU model, clock source, CPUs and free memory, from their
# handshakes, are this host's; one given more threads than its CPUs is
# named); an
# oversubscribed --local cluster (more threads than cores: named). Run from
# the repository root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
lk_tmp doctor

M1=$RD/models/stories260K.gguf
M2=$RD/models/stories260K-q8_0.gguf

# ---- usage ---------------------------------------------------------------------------
expect doctor_help 0 "$L" doctor --help
expect doctor_bad_flag 2 "$L" doctor --no-such-flag
expect doctor_local_and_workers 2 "$L" doctor --local 2 --workers 127.0.0.1:1
expect doctor_workers_no_key 2 "$L" doctor --workers 127.0.0.1:1
expect doctor_bad_layout 2 "$L" doctor --local 2 --tp 3
expect doctor_bad_transport 2 "$L" doctor --local 2 --transport carrier-pigeon

# ---- a healthy local cluster -------------------------------------------------------------
expect doctor_local2 0 "$L" doctor -m "$M1" --local 2 --iters 50 --json
pyt doctor_local2_ok 'd["ok"] is True and d["nodes_n"] == 2 and len(d["nodes"]) == 2'
pyt doctor_local2_link 'd["nodes"][1]["transport"] == "shm" and d["nodes"][1]["latency_us"] > 0 and d["nodes"][1]["link_gbps"] > 0'
pyt doctor_local2_agree "$CHK(d, check='agreement', node=1, result='ok') == 1"
pyt doctor_local2_allreduce 'd["allreduce_bytes"] == 256 and d["allreduce_us"] > 0'
pyt doctor_local2_decode 'd["decode_tok_s"] > 0 and d["decode_step_ms"] > 0 and d["allreduces_per_token"] > 0'
pyt doctor_local2_verdict 'd["verdict"].startswith("decode is bound by") and d["recommended"]["tp"] >= 1 and d["recommended"]["pp"] >= 1'
# plan fed doctor's JSON: its links, all-reduce table and read rate give the same estimate for this layout
cp "$T/out" "$T/doctor.json"
expect plan_from_doctor 0 "$L" plan -m "$M1" --doctor "$T/doctor.json" --tp 2 --ctx 256 --json
pyt plan_from_doctor_same "abs(d[\"decode_tok_s\"] / json.load(open('$T/doctor.json'))['predicted_tok_s'] - 1) < 0.01"
expect plan_doctor_not_json 1 "$L" plan -m "$M1" --doctor "$M1"
expect doctor_local2_tcp_text 0 "$L" doctor -m "$M1" --local 2 --transport tcp --iters 50
if grep -Eq 'link: tcp, [0-9.]+ us one-way' "$T/out" && grep -q '^verdict: decode is bound by' "$T/out" \
   && grep -q '^plan recommends: --tp [0-9]* --pp [0-9]*' "$T/out" && grep -q '^all checks passed' "$T/out"; then
    ok doctor_local2_tcp_text_says
else
    no doctor_local2_tcp_text_says "$(cat "$T/out")"
fi

# ---- oversubscribed: more threads than this machine has cores ------------------------------
NC=$(nproc)
expect doctor_oversubscribed 1 "$L" doctor --local 2 --threads "$NC" --iters 20 --json
pyt doctor_oversubscribed_named "$CHK(d, check='threads', result='fail', detail=r'oversubscribed: 2 ranks x $NC threads = [0-9]+ threads on [0-9]+ CPUs') == 1"

# ---- a worker with a different model file under the same name -------------------------------
"$L" keygen >"$T/key"
mkdir -p "$T/a" "$T/b" "$T/head"
cp "$M1" "$T/head/m.gguf"; cp "$M1" "$T/a/m.gguf"; cp "$M2" "$T/b/m.gguf"
start_worker() { # DIR LOG: sets WP to its port (empty if it did not start)
    "$L" worker --listen 127.0.0.1:0 --key-file "$T/key" --model-dir "$1" --threads 1 </dev/null >/dev/null 2>"$2" &
    PIDS+=($!)
    WP=$(listen_port "$2" $!)
}
start_worker "$T/a" "$T/wa.log"; PA=$WP
start_worker "$T/b" "$T/wb.log"; PB=$WP
if [ -z "$PA" ] || [ -z "$PB" ]; then
    no doctor_mismatch "workers did not start" "$(cat "$T/wa.log" "$T/wb.log")"
else
    expect doctor_mismatch 1 "$L" doctor -m "$T/head/m.gguf" --workers "127.0.0.1:$PA,127.0.0.1:$PB" --key-file "$T/key" \
        --threads 1 --iters 20 --json
    pyt doctor_mismatch_named "$CHK(d, check='model', result='fail', node=2, detail='model mismatch: head has [0-9a-f]+, worker has [0-9a-f]+') == 1"
    pyt doctor_mismatch_others_agree "$CHK(d, check='agreement', result='ok') == 2"
    pyt doctor_mismatch_links 'all(n["transport"] and n["latency_us"] > 0 for n in d["nodes"][1:])'
    # the workers' own facts, from their handshakes, against this host's (they run here)
    export CPUM=$(sed -n 's/^model name[[:space:]]*: *//p' /proc/cpuinfo | head -n 1)
    export CLK=$(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null || echo '?')
    pyt doctor_worker_facts 'all(n["cpu_model"] == __import__("os").environ["CPUM"] and n["clocksource"] == __import__("os").environ["CLK"]
        and n["cpus"] == d["nodes"][0]["cpus"] and 0.5 < n["mem_avail_gb"] / d["nodes"][0]["mem_avail_gb"] < 2 for n in d["nodes"][1:])'
    pyt doctor_worker_memory_checked "$CHK(d, check='memory', node=2, result='ok', detail='its share needs [0-9.]+ GB') == 1"
    # a worker given more threads than its CPUs: named as that node's fault
    expect doctor_worker_oversubscribed 1 "$L" doctor --workers "127.0.0.1:$PA" --key-file "$T/key" --threads $((NC + 1)) \
        --iters 20 --json
    pyt doctor_worker_oversubscribed_named "$CHK(d, check='threads', node=1, result='fail', detail=r'oversubscribed: $((NC + 1)) threads on its $NC CPUs') == 1"
fi

# ---- a worker short of memory for its share (LK_MEM_AVAILABLE: it rehearses a 100 KiB node) --------
mkdir -p "$T/c"
cp "$M1" "$T/c/m.gguf"
LK_MEM_AVAILABLE=100K start_worker "$T/c" "$T/wc.log"; PC=$WP
if [ -z "$PA" ] || [ -z "$PC" ]; then
    no doctor_short_of_memory "workers did not start" "$(cat "$T/wc.log")"
else
    expect doctor_short_of_memory 1 "$L" doctor -m "$T/head/m.gguf" --workers "127.0.0.1:$PA,127.0.0.1:$PC" --key-file "$T/key" \
        --threads 1 --iters 20 --json
    pyt doctor_short_of_memory_named "$CHK(d, check='memory', node=2, result='fail', detail=r'its share needs [0-9.]+ GB .*, 0.00 GB free there') == 1
        and $CHK(d, check='memory', node=1, result='ok') == 1"
fi

# ---- run --trace: Chrome trace events of a --local 2 --tp 2 run ------------------------------
expect trace_run 0 "$L" run -m "$M1" -p "Once upon a time" -n 6 --temp 0 --local 2 --tp 2 --trace "$T/trace.json"
cp "$T/trace.json" "$T/out" 2>/dev/null || : >"$T/out"
# spans from both ranks (pid = rank), one step span per generated token on each
pyt trace_ranks_and_steps 'sorted({e["pid"] for e in d["traceEvents"] if e.get("cat") == "step"}) == [0, 1]
    and all(sum(1 for e in d["traceEvents"] if e.get("cat") == "step" and e["pid"] == r) == 6 for r in (0, 1))'
# every collective inside a step span of its own rank; compute spans too
pyt trace_comm_nested 'all(any(s["pid"] == e["pid"] and s["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-3
    for s in d["traceEvents"] if s.get("cat") == "step") for e in d["traceEvents"] if e.get("cat") in ("comm", "compute"))
    and sum(1 for e in d["traceEvents"] if e.get("cat") == "compute") > 0'
# an all-reduce per layer (stories260K: 5 layers, attention and FFN) on each rank
pyt trace_layers 'all({e["args"]["layer"] for e in d["traceEvents"] if e.get("cat") == "comm" and e["pid"] == r} >= {0, 1, 2, 3, 4}
    for r in (0, 1))'
if ls "$T"/trace.json.part.* >/dev/null 2>&1; then no trace_parts_removed "$(ls "$T")"; else ok trace_parts_removed; fi
expect trace_bad_path 1 "$L" run -m "$M1" -p "Hi" -n 1 --trace "$T/no/such/dir/t.json"
# one node: no collectives, yet every step span lasts as long as its work (compute spans inside)
expect trace_one_node 0 "$L" run -m "$M1" -p "Once upon a time" -n 6 --temp 0 -t 1 --trace "$T/trace1.json"
cp "$T/trace1.json" "$T/out" 2>/dev/null || : >"$T/out"
pyt trace_one_node_steps 'len([e for e in d["traceEvents"] if e.get("cat") == "step"]) == 6
    and all(e["dur"] > 0 for e in d["traceEvents"] if e.get("cat") == "step")
    and all(any(s["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-3
                for s in d["traceEvents"] if s.get("cat") == "step") for e in d["traceEvents"] if e.get("cat") == "compute")
    and sum(1 for e in d["traceEvents"] if e.get("cat") == "compute") >= 6'
# bench --trace: both ranks' steps of a --local 2 --tp 2 bench (warm-up, prefill and decode of every rep)
expect trace_bench 0 "$L" bench -m "$M1" -t 1 -p 4 -n 5 -r 1 --local 2 --tp 2 --trace "$T/trace.json"
cp "$T/trace.json" "$T/out" 2>/dev/null || : >"$T/out"
pyt trace_bench_ranks 'sorted({e["pid"] for e in d["traceEvents"] if e.get("cat") == "step"}) == [0, 1]
    and all(sum(1 for e in d["traceEvents"] if e.get("cat") == "step" and e["pid"] == r) >= 5 for r in (0, 1))
    and any(e.get("cat") == "comm" for e in d["traceEvents"])'
# serve --trace: one request's steps, written when the server stops (SIGTERM)
SPORT=$(free_port)
"$L" serve -m "$M1" --port "$SPORT" --local 2 --tp 2 -t 1 --trace "$T/strace.json" >"$T/serve.log" 2>&1 &
SP=$!
PIDS+=($SP)
python3 - "$SPORT" >"$T/sreq" 2>&1 <<'EOF'
import json, sys, time, urllib.request
u = 'http://127.0.0.1:%s' % sys.argv[1]
for _ in range(300):
    try:
        urllib.request.urlopen(u + '/health', timeout=2); break
    except Exception:
        time.sleep(0.1)
r = urllib.request.Request(u + '/v1/completions', json.dumps({"prompt": "Once upon", "max_tokens": 4, "temperature": 0}).encode(),
                           {"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(r, timeout=60))["usage"]["completion_tokens"])
EOF
kill -TERM $SP 2>/dev/null; wait $SP; src=$?
cp "$T/strace.json" "$T/out" 2>/dev/null || : >"$T/out"
if [ $src -eq 0 ] && [ "$(cat "$T/sreq")" = 4 ]; then ok trace_serve_exit; else no trace_serve_exit "exit $src, request: $(cat "$T/sreq")" "$(tail -n 3 "$T/serve.log")"; fi
pyt trace_serve_ranks 'sorted({e["pid"] for e in d["traceEvents"] if e.get("cat") == "step"}) == [0, 1]
    and all(sum(1 for e in d["traceEvents"] if e.get("cat") == "step" and e["pid"] == r) >= 4 for r in (0, 1))'
