#!/usr/bin/env bash
# The README's first command: install dependencies, build, and generate text
# with a local multi-process cluster (2 ranks, tensor parallel).
set -euo pipefail
cd "$(dirname "$0")"
scripts/deps.sh
make -j"$(nproc)" build/lockstep >/dev/null
model=../shared/testdata/models/stories260K.gguf
if [ ! -f "$model" ]; then
    echo "demo: $model not found. Any llama/qwen2/qwen3 GGUF works, e.g. a TinyLlama or"
    echo "      Qwen3 GGUF from Hugging Face: ./demo.sh uses MODEL=path/to/model.gguf if set."
    echo "      Falling back to a generated random-weight model: its output is random text."
    model=build/demo-tiny.gguf
    [ -f "$model" ] || build/lockstep gen-model --shape tiny --type q8_0 -o "$model" -q
fi
model=${MODEL:-$model}
exec build/lockstep run -m "$model" -p "${PROMPT:-Once upon a time}" -n "${N:-64}" --temp 0 ${LOCKSTEP_DEMO_ARGS:---local 2}
