#!/usr/bin/env bash
# --emulate-link through the real program (issue 12): usage errors (exit 2:
# no --local, --transport shm, a bad rule, a rank outside the cluster, on
# run, bench and doctor); a --local 2 run with 1000 us one-way on its link
# takes at least the round trips physics demands per token (every layer's two
# all-reduces wait one one-way delay each, the step message and the
# candidates one more each); doctor --local 3 with only the pair 0-1 slowed
# names that link (FAIL, its latency as evidence, at least the delay set)
# and passes the other; doctor --local 2 with a 500 us link says decode is
# latency-bound and that fewer nodes would be faster. Run from the
# repository root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
lk_tmp slowlink

M=$RD/models/stories260K.gguf

# ---- usage ---------------------------------------------------------------------------------
expect emu_needs_local 2 "$L" run -m "$M" -p hi --emulate-link 5
says emu_needs_local_says 'emulate-link needs --local'
expect emu_shm 2 "$L" run -m "$M" -p hi --local 2 --transport shm --emulate-link 5
says emu_shm_says 'relays TCP links, so --transport shm makes no sense'
expect emu_bad_rule 2 "$L" run -m "$M" -p hi --local 2 --emulate-link 5:fast
says emu_bad_rule_says "bad rule '5:fast'"
expect emu_bad_pair 2 "$L" run -m "$M" -p hi --local 2 --emulate-link 0-2:5
says emu_bad_pair_says 'ranks 0 and 2, but the cluster has ranks 0..1'
expect emu_jitter_over_delay 2 "$L" run -m "$M" -p hi --local 2 --emulate-link 5:0:9
expect emu_bench_shm 2 "$L" bench -m "$M" --local 2 --transport shm --emulate-link 5
expect emu_doctor_no_local 2 "$L" doctor -m "$M" --emulate-link 0-1:5
expect emu_serve_help 0 "$L" serve --help
if grep -q -- '--emulate-link' "$T/out"; then ok emu_serve_help_lists; else no emu_serve_help_lists "$(grep -c . "$T/out") lines"; fi

# ---- a run through a 1000 us link --------------------------------------------------------------
# 5 layers x 2 all-reduces (2 ranks: each waits one one-way delay), the step
# message and the candidates: 12 one-way delays, 12 ms, per decode step at
# least; of 6 tokens the first comes from the prompt's step, so decode_s
# times 5 steps (decode_tok_s = 5 / decode_s)
expect emu_run_slow 0 "$L" run -m "$M" -p "Once upon a time" -n 6 --temp 0 --local 2 --emulate-link 1000 --json
pyt emu_run_slow_physics 'd["timings"]["decode_s"] / 5 >= 0.012 and abs(d["timings"]["decode_tok_s"] * d["timings"]["decode_s"] - 5) < 0.01 and len(d["generated_ids"]) == 6'
# the same tokens as the plain run: the relay carries the bytes unchanged
cp "$T/out" "$T/slow.json"
expect emu_run_plain 0 "$L" run -m "$M" -p "Once upon a time" -n 6 --temp 0 --local 2 --json
pyt emu_run_same_tokens "d['generated_ids'] == json.load(open('$T/slow.json'))['generated_ids']"
expect emu_bench 0 "$L" bench -m "$M" --local 2 --emulate-link 100:1 -p 8 -n 4 -r 1 --json

# ---- doctor: one slow link among three ranks ------------------------------------------------
expect doctor_slowlink 1 "$L" doctor -m "$M" --local 3 --emulate-link 0-1:300 --iters 20 --json
pyt doctor_slowlink_named "$CHK(d, check='link', node=1, result='fail', detail=r'head <-> node 1 \\(127\\.0\\.0\\.1:[0-9]+\\) over tcp: [0-9.]+ us one-way .*emulated: 300 us one-way.*markedly slower') == 1"
pyt doctor_slowlink_evidence 'd["nodes"][1]["latency_us"] >= 300 and d["nodes"][2]["latency_us"] < 300 and d["nodes"][2]["transport"] == "tcp"'
pyt doctor_slowlink_other_ok "$CHK(d, check='link', node=2, result='ok') == 1"

# ---- doctor: a layout bound by latency, where fewer nodes would be faster -----------------------
expect doctor_latency_bound 0 "$L" doctor -m "$M" --local 2 --emulate-link 500 --iters 20 --json
pyt doctor_latency_bound_verdict 'd["verdict"].startswith("decode is bound by link latency")'
pyt doctor_latency_bound_fewer "$CHK(d, check='layout', result='warn', detail=r'fewer nodes would be faster: plan ranks --tp 1 --pp 1 first') == 1"
