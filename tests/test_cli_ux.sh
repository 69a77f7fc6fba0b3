#!/usr/bin/env bash
# What a new user (often a llama.cpp user) hits first, through the real
# program (issue 14): an oversized --ctx is refused at once with the numbers
# (not minutes of paging and an abort), a --ctx beyond the trained context
# warns; -n 0 prints no speed; -n -1, -f FILE, -p - and --ctx-size work as in
# llama.cpp; --version on every command; bad values of known flags and
# impossible cluster layouts exit 2, naming only flags the user gave.
# Run from the repository root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
M=$RD/models/stories260K.gguf
lk_tmp cli_ux

# ---- an oversized context: refused at once, with the numbers -------------------
t0=$(date +%s.%N)
expect ctx_huge_refused 1 timeout 20 "$L" run -m "$M" -p hi -n 2 -c 99999999
t1=$(date +%s.%N)
has ctx_huge_msg "$T/err" '--ctx 99999999 needs [0-9.]+ GiB \(KV cache 99999999 positions .* GiB of memory is available'
if awk -v a="$t0" -v b="$t1" 'BEGIN{exit !(b - a < 2)}'; then ok ctx_huge_instant
else no ctx_huge_instant "took $(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}') s"; fi
expect ctx_overflow_usage 2 "$L" run -m "$M" -p hi -n 2 -c 99999999999
expect kv_budget_huge_refused 1 timeout 20 "$L" run -m "$M" -p hi -n 2 --kv-budget 1T
has kv_budget_huge_msg "$T/err" '--kv-budget \([0-9]+ positions\) needs'
# stories260K was trained on 2048 positions: 4096 runs, with one warning line
expect ctx_beyond_train_runs 0 "$L" run -m "$M" -p "Once upon a time" -n 4 --temp 0 -c 4096
has ctx_beyond_train_warns "$T/err" 'warn: --ctx 4096 is beyond the 2048 positions the model was trained on'
expect ctx_within_train 0 "$L" run -m "$M" -p "Once upon a time" -n 4 --temp 0 -c 2048
hasnt ctx_within_train_quiet "$T/err" 'trained on'

# ---- -n 0: no speed is printed ---------------------------------------------------
expect n0_runs 0 "$L" run -m "$M" -p "Once upon a time" -n 0
hasnt n0_no_speed "$T/err" 'tok/s'
has n0_says_nothing_generated "$T/err" 'nothing generated \(-n 0\)'
expect n0_json 0 "$L" run -m "$M" -p "Once upon a time" -n 0 --json
has n0_json_null_speed "$T/out" '"prefill_tok_s":null'

# ---- llama.cpp habits ------------------------------------------------------------
# -n -1: until the end of generation or a full context (here the context: 48 positions)
expect n_minus1_runs 0 "$L" run -m "$M" -p "Once upon a time" -n -1 --temp 0 --ignore-eos -c 48 --json
if grep -q '"generated_ids"' "$T/out" && [ "$(sed 's/.*"generated_ids":\[\([^]]*\)\].*/\1/' "$T/out" | tr ',' '\n' | wc -l)" -ge 40 ]; then
    ok n_minus1_fills_context
else no n_minus1_fills_context "$(head -c 300 "$T/out")"; fi
expect n_minus2_usage 2 "$L" run -m "$M" -p hi -n -2
# -f FILE and -p - give the same tokens as -p TEXT (the whole text, newlines included)
printf 'Once upon a time.\nLily' >"$T/prompt.txt"
"$L" run -m "$M" -p "$(cat "$T/prompt.txt")" -n 8 --temp 0 --json 2>/dev/null | sed 's/,"seed".*//' >"$T/want"
"$L" run -m "$M" -f "$T/prompt.txt" -n 8 --temp 0 --json 2>"$T/err" | sed 's/,"seed".*//' >"$T/got_f"
if [ -s "$T/want" ] && cmp -s "$T/want" "$T/got_f"; then ok prompt_from_file
else no prompt_from_file "$(cat "$T/want")" "---" "$(cat "$T/got_f")" "$(tail -n 2 "$T/err")"; fi
"$L" run -m "$M" -p - -n 8 --temp 0 --json <"$T/prompt.txt" 2>"$T/err" | sed 's/,"seed".*//' >"$T/got_p"
if [ -s "$T/want" ] && cmp -s "$T/want" "$T/got_p"; then ok prompt_from_stdin
else no prompt_from_stdin "$(cat "$T/want")" "---" "$(cat "$T/got_p")" "$(tail -n 2 "$T/err")"; fi
expect prompt_file_missing 2 "$L" run -m "$M" -f "$T/nope.txt"
has prompt_file_missing_msg "$T/err" "-f $T/nope.txt: No such file"
expect prompt_and_file 2 "$L" run -m "$M" -p hi -f "$T/prompt.txt"
# --ctx-size is --ctx
expect ctx_size_alias 0 "$L" run -m "$M" -p "Once upon a time" -n 4 --temp 0 --ctx-size 4096
has ctx_size_alias_used "$T/err" '--ctx 4096 is beyond'
expect ctx_size_alias_chat 0 bash -c "echo hi | '$L' chat -m '$M' --chat-template chatml -n 2 --ctx-size 128"
# --version: the program and every command, exit 0
expect version_top 0 "$L" --version
has version_top_msg "$T/out" '^lockstep [0-9]+\.[0-9]+'
for c in run chat bench info tokenize quantize gen-model worker keygen netbench; do
    "$L" $c --version </dev/null >"$T/out" 2>"$T/err"; rc=$?
    if [ "$rc" -eq 0 ] && grep -Eq '^lockstep [0-9]+\.[0-9]+' "$T/out"; then ok "version_$c"
    else no "version_$c" "exit $rc" "$(head -n 3 "$T/out" "$T/err")"; fi
done

# ---- usage errors exit 2 and name only the flags given ------------------------------
expect tp_local_mismatch 2 "$L" run -m "$M" -p hi -n 2 --tp 3 --local 2
has tp_local_mismatch_msg "$T/err" '--tp 3 does not match the 2 ranks of --local 2'
hasnt tp_local_no_invented_pp "$T/err" '--pp'
expect pp_local_mismatch 2 "$L" run -m "$M" -p hi -n 2 --pp 3 --local 2
hasnt pp_local_no_invented_tp "$T/err" '--tp'
expect tp_without_ranks 2 "$L" run -m "$M" -p hi -n 2 --tp 2
has tp_without_ranks_msg "$T/err" '--tp 2 needs ranks'
hasnt tp_without_ranks_no_pp "$T/err" '--pp'
expect pp_zero 2 "$L" run -m "$M" -p hi -n 2 --pp 0 --local 2
has pp_zero_msg "$T/err" '--pp is out of range'
expect tp_zero 2 "$L" run -m "$M" -p hi -n 2 --tp 0
expect workers_no_key 2 "$L" run -m "$M" -p hi -n 2 --workers 127.0.0.1:9
has workers_no_key_msg "$T/err" '--workers needs --key-file'
expect workers_and_local 2 "$L" run -m "$M" -p hi -n 2 --workers 127.0.0.1:9 --local 2
expect bad_transport 2 "$L" run -m "$M" -p hi -n 2 --local 2 --transport foo
has bad_transport_msg "$T/err" "--transport must be auto, tcp, shm, ucx or mpi \(got 'foo'\)"
expect bad_wire 2 "$L" run -m "$M" -p hi -n 2 --local 2 --wire q9
expect bad_ctx 2 "$L" run -m "$M" -p hi -n 2 --ctx -5
expect chat_tp_local_mismatch 2 "$L" chat -m "$M" --chat-template chatml --tp 3 --local 2
# the layouts that fit still run
expect tp_local_ok 0 "$L" run -m "$M" -p "Once upon a time" -n 4 --temp 0 --local 2 --tp 2
expect pp_local_ok 0 "$L" run -m "$M" -p "Once upon a time" -n 4 --temp 0 --local 2 --pp 2

# ---- kernel tuning flags: a bad setting names itself; a forced one is reported --
expect tune_bad_usage 2 "$L" bench -m "$M" -p 4 -n 2 -r 1 --tune pf=99
has tune_bad_msg "$T/err" "--tune: bad tuning setting 'pf=99'"
expect tune_both_usage 2 "$L" run -m "$M" -p hi -n 2 --no-tune --tune pf=1
expect tune_forced_runs 0 "$L" bench -m "$M" -p 4 -n 2 -r 1 --bw-mib 16 --tune pf=2,split=8,gemm=4 --json
has tune_forced_said "$T/err" 'tune pf=2,split=8,gemm=4: forced'
has tune_forced_json "$T/out" '"tune": *"pf=2,split=8,gemm=4: forced'
expect tune_off_runs 0 "$L" run -m "$M" -p "Once upon a time" -n 2 --temp 0 --no-tune
