#!/usr/bin/env bash
# Mixture-of-experts streaming, expert by expert: synthesizes random-weight stores of real MoE shapes
# with fewer layers (`layerstream synth`, Q4_K experts) and runs `layerstream bench --expert-caches`
# on each: bytes streamed per token against streaming whole layers, the expert cache's hits, the
# predictions' prefetched share, misses and tokens/s at batch 1, 8 and 32.
#
#   benchmarks/moe-experts.sh [--layers 4] [--shapes "qwen3-30b-a3b mixtral-8x7b"] [--caches 16,64,all]
#                             [--batches 1,8,32] [--gen 8] [--threads N] [--device cuda:0]
#                             [--dtype q4_k]   (gpt-oss: mxfp4 — its 2880-wide rows are not 256-blocks)
#
# Random weights route almost uniformly (real models' experts are skewed and their routers agree
# from one layer to the next), so the hit and prediction rates here are a floor, not a forecast.
set -euo pipefail
cd "$(dirname "$0")/.."
layers=4 shapes="qwen3-30b-a3b mixtral-8x7b" caches=16,64,all batches=1,8,32 gen=8 threads=() dtype=q4_k
while [ $# -gt 0 ]; do
    case "$1" in
        --layers) layers=$2; shift 2 ;;
        --shapes) shapes=$2; shift 2 ;;
        --caches) caches=$2; shift 2 ;;
        --batches) batches=$2; shift 2 ;;
        --gen) gen=$2; shift 2 ;;
        --threads) threads+=(--threads "$2"); shift 2 ;;
        --device) threads+=(--device "$2"); shift 2 ;;
        --dtype) dtype=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
ls=${LAYERSTREAM_BIN:-target/release/layerstream}
[ -x "$ls" ] || cargo build --release -p layerstream
cache=${LAYERSTREAM_CACHE:-$HOME/.cache/layerstream}/stores
mkdir -p "$cache"
for shape in $shapes; do
    store=$cache/synth-$shape-$layers-$dtype
    [ -f "$store/manifest.json" ] || "$ls" synth --shape "$shape" --layers "$layers" --dtype "$dtype" "$store"
    echo "== $shape ($layers layers)"
    "$ls" bench --model "$store" --expert-caches "$caches" --expert-batches "$batches" \
        --max-new-tokens "$gen" --prompt-tokens 16 --temperature 1.0 "${threads[@]}"
done
