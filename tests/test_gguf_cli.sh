#!/usr/bin/env bash
# The gguf commands through the real program: `info`, and the exit codes of
# `info`, `gen-model` and `quantize` (0 ok, 1 runtime failure, 2 usage error).
# Run from the repository root by tests/run.sh with LOCKSTEP set.
set -u
. "$(dirname "$0")/lib.sh"
lk_tmp gguf_cli

expect info_stories 0 "$L" info -m "$RD/models/stories260K.gguf" --tensors
has info_arch "$T/out" '^architecture: llama'
has info_shape "$T/out" 'n_embd 64 n_layer 5 n_head 8 n_head_kv 4 .*n_ff 172'
has info_vocab "$T/out" 'n_vocab 512'
has info_types "$T/out" '^  f32 +48 tensors'
has info_key "$T/out" '^  llama.attention.head_count_kv +u32 +4$'
has info_array "$T/out" 'tokenizer.ggml.tokens +array +\[string x 512\] "<unk>", "<s>"'
has info_tensor "$T/out" '^  blk.4.ffn_down.weight +f32 +\[172, 64\] +44032 bytes'
[ "$(grep -c '\.weight ' "$T/out")" -eq 48 ] && ok info_tensor_count || no info_tensor_count "$(grep -c '\.weight ' "$T/out") tensor lines"

expect info_q4_positional 0 "$L" info "$RD/models/stories260K-q4_0.gguf"
has info_q4_types "$T/out" '^  q4_0 +31 tensors'
has info_q4_f16 "$T/out" '^  f16 +5 tensors'

printf 'GGML this is not gguf, but long enough for a header' >"$T/bad.gguf"
expect info_bad_file 1 "$L" info -m "$T/bad.gguf"
has info_bad_message "$T/err" 'bad magic .* at byte 0'
expect info_missing_file 1 "$L" info -m "$T/none.gguf"
expect info_no_file 2 "$L" info
expect info_bad_flag 2 "$L" info --bogus
expect info_help 0 "$L" info --help

expect gen_tiny 0 "$L" gen-model --shape tiny --type q4_0 -o "$T/tiny.gguf" --seed 5
has gen_progress "$T/err" '^wrote .*tiny.gguf: tiny 2 layers, 21 tensors'
expect gen_tiny_info 0 "$L" info "$T/tiny.gguf"
has gen_tiny_shape "$T/out" 'n_embd 256 n_layer 2 n_head 8 n_head_kv 2 .*n_ff 768'
has gen_tiny_types "$T/out" '^  q4_0 +16 tensors'
expect gen_list 0 "$L" gen-model --list
has gen_list_shapes "$T/out" 'llama3-70b'
expect gen_no_shape 2 "$L" gen-model -o "$T/x.gguf"
expect gen_bad_shape 2 "$L" gen-model --shape llama9 -o "$T/x.gguf"
expect gen_bad_type 2 "$L" gen-model --shape tiny --type q6_k -o "$T/x.gguf"
expect gen_bad_layers 2 "$L" gen-model --shape tiny --layers x -o "$T/x.gguf"
expect gen_unknown_flag 2 "$L" gen-model --shape tiny --frobnicate -o "$T/x.gguf"
expect gen_unwritable 1 "$L" gen-model --shape tiny -q -o /nonexistent-dir/x.gguf

expect quant_q8 0 "$L" quantize "$RD/models/stories260K.gguf" "$T/q8.gguf" --type q8_0
cmp -s "$T/q8.gguf" "$RD/models/stories260K-q8_0.gguf" && ok quant_q8_identical || no quant_q8_identical "differs from llama-quantize's output"
expect quant_no_type 2 "$L" quantize "$RD/models/stories260K.gguf" "$T/q.gguf"
expect quant_bad_type 2 "$L" quantize "$RD/models/stories260K.gguf" "$T/q.gguf" --type q4_1
expect quant_one_arg 2 "$L" quantize "$RD/models/stories260K.gguf" --type q8_0
expect quant_bad_input 1 "$L" quantize "$T/bad.gguf" "$T/q.gguf" --type q8_0
[ ! -e "$T/q.gguf" ] && ok quant_no_partial_output || no quant_no_partial_output "$T/q.gguf left behind"

# Text from a GGUF never reaches the terminal raw: an architecture, a name, a
# key and a token piece carrying terminal escapes (clear screen, set title,
# a C1 CSI) are printed escaped by `info` and in the unsupported-architecture
# error. The file is written byte by byte (little-endian counts).
u32() { printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x' $(($1 & 255)) $(($1 >> 8 & 255)) $(($1 >> 16 & 255)) $(($1 >> 24 & 255)))"; }
u64() { u32 "$1"; u32 0; }
gstr() { local LC_ALL=C; u64 "${#1}"; printf '%s' "$1"; } # ${#1}: bytes under LC_ALL=C
{
    printf 'GGUF'; u32 3; u64 0; u64 4
    gstr general.architecture; u32 8; gstr $'ll\x1b[2Jama\x07'
    gstr general.name; u32 8; gstr $'\x1b]0;pwned\x07\x1b[2J name \xc2\x9b31m'
    gstr $'key\x1b[31m'; u32 4; u32 7
    gstr tokenizer.ggml.tokens; u32 9; u32 8; u64 2; gstr $'\x1b[2J'; gstr $'\xe2\x96\x81ok'
} >"$T/esc.gguf"
# no_ctl NAME FILE : FILE holds no control byte but tab and newline, no DEL, no C1
no_ctl() {
    if LC_ALL=C grep -qP '[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]' "$2"; then
        no "$1" "raw control bytes in:" "$(od -c "$2" | grep -E '033|302' | head -n 4)"
    else ok "$1"; fi
}
expect info_escapes 0 "$L" info "$T/esc.gguf"
no_ctl info_escapes_no_raw "$T/out"
has info_escapes_arch "$T/out" '^architecture: ll\\x1b\[2Jama\\x07  \(name "\\x1b]0;pwned\\x07\\x1b\[2J name \\xc2\\x9b31m"\)$'
has info_escapes_key "$T/out" '^  key\\x1b\[31m +u32 +7$'
has info_escapes_piece "$T/out" 'tokenizer.ggml.tokens +array +\[string x 2\] "\\x1b\[2J", "▁ok"'
expect run_escaped_arch 1 "$L" run -m "$T/esc.gguf" -p hi -n 1
no_ctl run_escaped_arch_no_raw "$T/err"
has run_escaped_arch_message "$T/err" "architecture 'll\\\\x1b\[2Jama\\\\x07' is not supported"
# token pieces printed by tokenize: a byte-fallback ESC comes out escaped
expect tokenize_escapes 0 "$L" tokenize -m $RD/models/stories260K.gguf "$(printf 'a\x1b[2Jb')"
no_ctl tokenize_escapes_no_raw "$T/out"
has tokenize_escapes_piece "$T/out" "-> '\\\\x1b'$"

# Optional: real llama.cpp loads what gen-model and quantize write and
# generates from it. Needs node and node-llama-cpp installed somewhere
# (e.g. `npm i -E node-llama-cpp@3.21.1 --prefix DIR`); set LK_NODE_LLAMA=DIR.
# Skipped (no lines) when unset, so CI does not depend on it.
if [ -n "${LK_NODE_LLAMA:-}" ] && [ -d "$LK_NODE_LLAMA/node_modules/node-llama-cpp" ]; then
    "$L" gen-model --shape tiny --type q4_0 -o "$T/ll-tiny.gguf" -q
    "$L" gen-model --shape qwen3-0.6b --layers 1 --type q8_0 -o "$T/ll-qwen3.gguf" -q
    "$L" quantize "$TD/synth/synth-qwen3moe-f16.gguf" "$T/ll-moe.gguf" --type q4_0 -q
    cat >"$LK_NODE_LLAMA/lk_load_check.mjs" <<'JS'
import {getLlama, LlamaCompletion} from "node-llama-cpp";
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
for (const f of process.argv.slice(2)) {
    const model = await llama.loadModel({modelPath: f});
    const ctx = await model.createContext({contextSize: 128});
    const c = new LlamaCompletion({contextSequence: ctx.getSequence()});
    const out = await c.generateCompletion("Once upon a time", {maxTokens: 8, temperature: 0});
    console.log("LOADED " + f + " " + JSON.stringify(out));
    await ctx.dispose(); await model.dispose();
}
JS
    (cd "$LK_NODE_LLAMA" && timeout 300 node lk_load_check.mjs "$T/ll-tiny.gguf" "$T/ll-qwen3.gguf" "$T/ll-moe.gguf") >"$T/ll.out" 2>&1
    [ "$(grep -c '^LOADED ' "$T/ll.out")" -eq 3 ] && ok llama_cpp_loads_outputs || no llama_cpp_loads_outputs "$(tail -n 5 "$T/ll.out")"
fi
