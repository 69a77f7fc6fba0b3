#!/usr/bin/env bash
# The README's first command: install dependencies, build, and generate text
# with a local multi-process cluster (2 ranks, tensor parallel).
set -euo pipefail
cd "$(dirname "$0")"
scripts/deps.sh
make -j"$(nproc)" build/lockstep >/dev/null
model=testdata/models/stories260K.gguf   # in the repository (testdata/README.md says where it comes from)
if [ ! -f "$model" ]; then
    echo "demo: $model not found. Any llama/qwen2/qwen3 GGUF works, e.g. a TinyLlama or"
    echo "      Qwen3 GGUF from Hugging Face: ./demo.sh uses MODEL=path/to/model.gguf if set."
    echo "      Falling back to a generated random-weight model: its output is random text."
    model=build/demo-tiny.gguf
    [ -f "$model" ] || build/lockstep gen-model --shape tiny --type q8_0 -o "$model" -q
fi
model=${MODEL:-$model}
build/lockstep run -m "$model" -p "${PROMPT:-Once upon a time}" -n "${N:-64}" --temp 0 ${LOCKSTEP_DEMO_ARGS:---local 2}

# The same cluster behind the OpenAI-compatible server: start it, send one
# chat request and one streamed completion with curl, stop it.
[ -n "${NO_SERVE:-}" ] && exit 0
out=$(mktemp)
build/lockstep serve -m "$model" --local 2 --tp 2 --port 0 --temp 0 >"$out" 2>/dev/null &
pid=$!
trap 'kill $pid 2>/dev/null; rm -f "$out"' EXIT
url=
for _ in $(seq 200); do
    url=$(sed -n 's/.*ready at \(http:[^ ]*\).*/\1/p' "$out")
    [ -n "$url" ] && break
    sleep 0.1
done
[ -n "$url" ] || { echo "demo: the server did not start"; exit 1; }
echo
echo "== lockstep serve --local 2 --tp 2: $url"
echo "\$ curl $url/chat/completions -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Tell me a story\"}], \"max_tokens\": 32}'"
curl -s "$url/chat/completions" -H 'Content-Type: application/json' \
     -d '{"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 32}'
echo
echo "\$ curl -N $url/completions -d '{\"prompt\": \"Once upon a time\", \"max_tokens\": 8, \"stream\": true}'"
curl -sN "$url/completions" -H 'Content-Type: application/json' \
     -d '{"prompt": "Once upon a time", "max_tokens": 8, "stream": true}' | grep -o '"text":"[^"]*"' | tr '\n' ' '
echo
