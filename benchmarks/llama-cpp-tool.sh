#!/usr/bin/env bash
# Prints the path of a llama.cpp tool (`llama-quantize`, `llama-perplexity`, …) built once for this
# CPU without CUDA (benchmarks/llama-cpp.sh): for the Python fixture generators.
#
#   benchmarks/llama-cpp-tool.sh llama-quantize
set -euo pipefail
. "$(dirname "$0")/llama-cpp.sh"
llama_cpp_tool "${1:?usage: llama-cpp-tool.sh TOOL}"
