#!/usr/bin/env bash
# `lockstep run --prompts-file` (many prompts as concurrent sequences)
# through the real program. For stories260K's reference prompts and every
# synthetic dense model: each prompt's greedy tokens from one run of all the
# reference prompts together, with --parallel 1, 2 and all, equal its tokens
# from `run -p` alone, on one node and under --local 2 --tp 2, --local 2
# --pp 2 and --local 4 --tp 2 --pp 2; the run alone gives llama.cpp's tokens
# up to the first near-tie the reference marks (a top-1 margin below 2x the
# logit tolerance test_model.c uses for that file). Also: sampled prompts
# equal their sampled runs alone, the text blocks without --json, bench
# --seqs and the flag errors (exit 2). Run from the repository root by
# tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
lk_tmp batch_cli

# ref_field FIELD REF.json: that field of each case (the cases' keys are indented by 3 spaces)
ref_field() { grep -E "^   \"$1\": " "$2" | sed 's/^[^[]*\[//; s/\].*//' | tr -d ' '; }

M=$RD/models/stories260K.gguf

# ---- flags --------------------------------------------------------------------
"$L" run --help >"$T/help" 2>&1
has help_prompts_file "$T/help" '--prompts-file FILE'
has help_parallel "$T/help" '--parallel N'
has help_kv_budget "$T/help" '--kv-budget N'
printf 'Once upon a time\n\n{"prompt": 3}\n' >"$T/bad1"
expect bad_json_value 2 "$L" run -m "$M" --prompts-file "$T/bad1"
has bad_json_value_msg "$T/err" "line 3: expected an object with a \"prompt\" string"
printf 'Once upon a time\n{"prompt": "x"\n' >"$T/bad2"
expect malformed_line 2 "$L" run -m "$M" --prompts-file "$T/bad2"
has malformed_line_msg "$T/err" "$T/bad2: line 2: malformed JSON"
expect missing_file 2 "$L" run -m "$M" --prompts-file "$T/nope"
printf '\n  \n' >"$T/blank"
expect no_prompts 2 "$L" run -m "$M" --prompts-file "$T/blank"
has no_prompts_msg "$T/err" 'no prompts'
expect both_prompts 2 "$L" run -m "$M" --prompts-file "$T/blank" -p hi
expect parallel_zero 2 "$L" run -m "$M" -p hi --parallel 0
expect kv_budget_bad 2 "$L" run -m "$M" -p hi --kv-budget 12X
has kv_budget_bad_msg "$T/err" "--kv-budget '12X'"
# one page of 32 positions: a longer prompt is refused, a shorter one stops when the page is full
LONG="Once upon a time there was a big dog and a little cat who played in the sun all day long with a red ball"
expect kv_budget_small 2 "$L" run -m "$M" -p "$LONG" --kv-budget 16
has kv_budget_small_msg "$T/err" 'KV budget has .* pages \(--kv-budget\)'
expect kv_budget_full 0 "$L" run -m "$M" -p "Once upon a time there was a big dog" -n 64 --kv-budget 16 --temp 0
has kv_budget_full_msg "$T/err" 'KV cache \(--kv-budget\) is full'
expect kv_budget_bytes 0 "$L" run -m "$M" -p hi -n 4 --kv-budget 1M
expect bench_bad_seqs 2 "$L" bench -m "$M" --seqs 0
expect bench_bad_seqs2 2 "$L" bench -m "$M" --seqs 1,x

# ---- every model: batched = alone = llama.cpp ----------------------------------
# file, reference, tokens, near-tie margin (2 x test_model.c's gen_tol)
CASES=(
    "models/stories260K.gguf reference/stories260K.json 64 0.002"
    "synth/synth-llama-f32.gguf synth/synth-llama-f32.json 32 0.002"
    "synth/synth-llama3rope-f32.gguf synth/synth-llama3rope-f32.json 32 0.002"
    "synth/synth-qwen2-f32.gguf synth/synth-qwen2-f32.json 32 0.002"
    "synth/synth-qwen3-f32.gguf synth/synth-qwen3-f32.json 32 0.002"
    "synth/synth-llama-f16.gguf synth/synth-llama-f16.json 32 0.02"
    "synth/synth-llama-tied-f16.gguf synth/synth-llama-tied-f16.json 32 0.02"
    "synth/synth-llama-bf16.gguf synth/synth-llama-bf16.json 32 0.1"
    "synth/synth-llama-q8_0.gguf synth/synth-llama-q8_0.json 32 0.02"
    "synth/synth-llama-q4_0.gguf synth/synth-llama-q4_0.json 32 0.02"
    "synth/synth-qwen3-q8_0.gguf synth/synth-qwen3-q8_0.json 32 0.02"
    "synth/synth-llama-q4_k_m.gguf synth/synth-llama-q4_k_m.json 32 0.1"
    "synth/synth-llama-q5_k_m.gguf synth/synth-llama-q5_k_m.json 32 0.4"
    "synth/synth-llama-q6_k.gguf synth/synth-llama-q6_k.json 32 0.4"
    "synth/synth-qwen2-q4_k_m.gguf synth/synth-qwen2-q4_k_m.json 32 0.1"
)
LAYOUTS=("" "--local 2 --tp 2" "--local 2 --pp 2" "--local 4 --tp 2 --pp 2")

for c in "${CASES[@]}"; do
    set -- $c
    model=$TD/$1 ref=$TD/$2 n=$3 tie=$4
    name=$(basename "$1" .gguf)
    td_need "$name" "$1" "$2" || continue
    if [ ! -f "$model" ] || [ ! -f "$ref" ]; then no "$name" "missing $model or $ref"; continue; fi
    # the reference prompts as JSON lines (their texts are JSON strings already)
    grep -E '^   "prompt": ' "$ref" | sed 's/^ *//; s/,$//; s/^/{/; s/$/}/' >"$T/prompts"
    np=$(wc -l <"$T/prompts")
    ref_field prompt_token_ids "$ref" >"$T/ref_prompt"
    ref_field generated_token_ids "$ref" >"$T/ref_gen"
    ref_field generated_top1_margin "$ref" >"$T/ref_margin"
    # alone: run -p per prompt (printf %b undoes the JSON escapes these prompts use: \n)
    : >"$T/alone"
    bad=
    for i in $(seq "$np"); do
        text=$(sed -n "${i}p" "$T/prompts" | sed 's/^{"prompt": "//; s/"}$//')
        if ! "$L" run -m "$model" -p "$(printf '%b' "$text")" -n "$n" --temp 0 --json -t 1 >>"$T/alone" 2>"$T/err"; then
            bad="prompt $i alone: $(tail -n 2 "$T/err")"
        fi
    done
    if [ -n "$bad" ]; then no "${name}_alone" "$bad"; continue; fi
    # alone against llama.cpp: prompt ids exact, tokens up to the first near-tie
    ids prompt_ids <"$T/alone" >"$T/alone_prompt"
    ids generated_ids <"$T/alone" >"$T/alone_gen"
    msg=$(awk -v tie="$tie" -F, '
        FILENAME == ARGV[1] { rp[FNR] = $0; next }
        FILENAME == ARGV[2] { nr[FNR] = NF; for (k = 1; k <= NF; k++) rg[FNR, k] = $k; next }
        FILENAME == ARGV[3] { cmp[FNR] = nr[FNR]; for (k = 1; k <= NF; k++) if ($k + 0 < tie) { cmp[FNR] = k - 1; break }; next }
        FILENAME == ARGV[4] { ap[FNR] = $0; next }
        { if (ap[FNR] != rp[FNR]) { printf "prompt %d: ids %s, llama.cpp %s; ", FNR, ap[FNR], rp[FNR]; next }
          for (k = 1; k <= cmp[FNR]; k++) if ($k != rg[FNR, k]) { printf "prompt %d: token %d is %s, llama.cpp %s; ", FNR, k - 1, $k, rg[FNR, k]; break }
          total += cmp[FNR] }
        END { printf "|%d", total }' "$T/ref_prompt" "$T/ref_gen" "$T/ref_margin" "$T/alone_prompt" "$T/alone_gen")
    matched=${msg##*|}
    if [ -z "${msg%|*}" ]; then ok "${name}_alone_matches_llama_cpp"; else no "${name}_alone_matches_llama_cpp" "${msg%|*}"; fi
    # batched: every layout, --parallel 1, 2 and all
    fails=
    runs=0
    for lay in "${LAYOUTS[@]}"; do
        for par in 1 2 all; do
            popt=; [ "$par" != all ] && popt="--parallel $par"
            # shellcheck disable=SC2086
            if ! "$L" run -m "$model" --prompts-file "$T/prompts" -n "$n" --temp 0 --json -t 1 $popt $lay >"$T/batch" 2>"$T/err"; then
                fails="$fails [${lay:-one node} parallel $par: exit: $(grep -v ' info' "$T/err" | tail -n 2)]"
                continue
            fi
            runs=$((runs + 1))
            if ! ids prompt_ids <"$T/batch" | cmp -s - "$T/alone_prompt"; then
                fails="$fails [${lay:-one node} parallel $par: prompt ids differ]"
            fi
            if ! ids generated_ids <"$T/batch" | cmp -s - "$T/alone_gen"; then
                d=$(ids generated_ids <"$T/batch" | diff - "$T/alone_gen" | head -n 4 | tr '\n' ' ')
                fails="$fails [${lay:-one node} parallel $par: tokens differ from alone: ${d:0:300}]"
            fi
        done
    done
    if [ -z "$fails" ]; then ok "${name}_batched_equals_alone"; else no "${name}_batched_equals_alone" "$fails"; fi
    echo "  $name: $np prompts x $n tokens, $runs batched runs equal alone; $matched tokens checked against llama.cpp"
done

# ---- sampled: each prompt's tokens are those of its run alone with the same seed ----
grep -E '^   "prompt": ' "$RD/reference/stories260K.json" | sed 's/^ *//; s/,$//; s/^/{/; s/$/}/' >"$T/prompts"
S=(--temp 0.9 --top-k 40 --top-p 0.9 --repeat-penalty 1.2 --seed 11 -n 40 --json -t 1)
: >"$T/alone"
while IFS= read -r line; do
    text=$(sed 's/^{"prompt": "//; s/"}$//' <<<"$line")
    "$L" run -m "$M" -p "$text" "${S[@]}" 2>/dev/null | ids generated_ids >>"$T/alone"
done <"$T/prompts"
for lay in "" "--local 2 --pp 2"; do
    name=sampled_batch_equals_alone$(echo "$lay" | tr -c 'a-z0-9' _ | sed 's/__*/_/g; s/_$//')
    # shellcheck disable=SC2086
    if "$L" run -m "$M" --prompts-file "$T/prompts" "${S[@]}" --parallel 3 $lay 2>"$T/err" | ids generated_ids >"$T/batch" &&
       cmp -s "$T/batch" "$T/alone" && [ -s "$T/alone" ]; then ok "$name"
    else no "$name" "$(diff "$T/batch" "$T/alone" | head -n 4)" "$(tail -n 2 "$T/err")"; fi
done

# ---- one system prompt: the later prompts fork its pages, tokens as alone ----------
SYS="Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her friends. One day, she saw a big red ball in the park."
: >"$T/shared"; : >"$T/alone"
for q in "She ran to get it." "Tom came to play." "The sun was hot." "A dog barked."; do
    echo "$SYS $q" >>"$T/shared"
    "$L" run -m "$M" -p "$SYS $q" -n 24 --temp 0 --json -t 1 2>/dev/null | ids generated_ids >>"$T/alone"
done
for lay in "" "--local 2 --pp 2"; do
    name=shared_prefix$(echo "$lay" | tr -c 'a-z0-9' _ | sed 's/__*/_/g; s/_$//')
    # shellcheck disable=SC2086
    "$L" run -m "$M" --prompts-file "$T/shared" -n 24 --temp 0 --json -t 1 $lay 2>"$T/err" | ids generated_ids >"$T/batch"
    reused=$(sed -n 's/.*(\([0-9]*\) reused).*/\1/p' "$T/err")
    if cmp -s "$T/batch" "$T/alone" && [ "${reused:-0}" -ge 96 ]; then ok "$name"
    else no "$name" "reused ${reused:-?} positions (want 3 x 32 at least)" "$(diff "$T/batch" "$T/alone" | head -n 4)"; fi
done

# ---- text blocks in input order ---------------------------------------------------
printf 'Once upon a time\nThe little dog\n' >"$T/two"
expect blocks 0 "$L" run -m "$M" --prompts-file "$T/two" -n 12 --temp 0 -t 1
"$L" run -m "$M" -p "The little dog" -n 12 --temp 0 -t 1 >"$T/dog" 2>/dev/null
has blocks_header_1 "$T/out" '^=== 1/2: Once upon a time$'
has blocks_header_2 "$T/out" '^=== 2/2: The little dog$'
if [ "$(sed -n 5p "$T/out")" = "$(head -n 1 "$T/dog")" ] && [ -n "$(head -n 1 "$T/dog")" ]; then ok blocks_text
else no blocks_text "block: $(sed -n 5p "$T/out")" "alone: $(head -n 1 "$T/dog")"; fi
has blocks_summary "$T/err" '2 prompts, 2 at once \| prefill'

# ---- bench --seqs -------------------------------------------------------------------
expect bench_seqs 0 "$L" bench -m "$M" -t 1 -p 16 -n 8 -r 1 --seqs 1,4 --bw-mib 16 --json
if [ "$(grep -c '"seqs":' "$T/out")" -eq 2 ] && grep -q '"seqs":4,' "$T/out"; then ok bench_seqs_rows
else no bench_seqs_rows "$(cat "$T/out")"; fi
expect bench_seqs_pp2 0 "$L" bench -m "$M" -t 1 -p 16 -n 8 -r 1 --seqs 1,3 --bw-mib 16 --csv --local 2 --pp 2
has bench_seqs_pp2_row "$T/out" '^stories260K.gguf,1,3,2,'
# the Markdown table with stderr in the same log (as scripts and CI logs
# have it): the progress is a line a repetition there, never the start of
# a table row's line, so every row of every thread count starts its line
"$L" bench -m "$M" -t 1,2 -p 8 -n 4 -r 2 --seqs 1,2 --bw-mib 16 >"$T/log" 2>&1
if [ "$(grep -c '^| stories260K.gguf | [12] | [12] | ' "$T/log")" -eq 4 ] && grep -q '^bench: threads 2 seqs 2 rep 2/2$' "$T/log" &&
    ! grep -q $'\r' "$T/log"; then ok bench_rows_in_a_log
else no bench_rows_in_a_log "$(cat -A "$T/log" | tail -n 8)"; fi
# --profile: where the head's time went; its parts are measured separately
# (pool runs by kind, the all-reduces, the layers and logits as wholes), so
# none may exceed the whole, the all-reduces of a 2-rank tp run are there,
# and the threads cannot be busier than all of them, nor busy and idle
# (before their first task, after their last) for longer
expect bench_profile 0 "$L" bench -m "$M" -t 2 -p 16 -n 8 -r 2 --seqs 1,2 --bw-mib 16 --json --profile --local 2 --tp 2
if python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
assert len(rows) == 2, rows
for r in rows:
    for ph in ("profile_prefill", "profile_decode"):
        p = r[ph]
        parts = ["matmul_s", "attention_s", "experts_s", "other_parallel_s", "allreduce_s", "logits_s"]
        assert p["wall_s"] > 0 and all(p[k] >= 0 for k in parts), p
        assert p["matmul_s"] > 0 and p["allreduce_s"] > 0 and p["attention_s"] > 0, p
        assert p["activations_s"] <= p["matmul_s"] and p["logits_matmul_s"] <= p["logits_s"], p
        assert sum(p[k] for k in parts) <= p["wall_s"] * 1.001, p
        # the remainders: small negative values are clock granularity only
        assert p["serial_in_layers_s"] > -1e-3 and p["outside_model_s"] > -1e-3, p
        assert 0 < p["matmul_threads_busy"] <= 1.05, p
        # the idle split: each part of the threads idle time, together no more than it
        b, a = p["matmul_threads_idle_before"], p["matmul_threads_idle_after"]
        assert b >= 0 and a >= 0 and p["matmul_threads_busy"] + b + a <= 1.05, p
' "$T/out" 2>"$T/py"; then ok bench_profile_parts; else no bench_profile_parts "$(tail -n 3 "$T/py")"; fi
has bench_profile_text "$T/err" '^profile: threads 2 seqs 2 decode [0-9.]+ ms: matmul [0-9.]+ %'
