#!/usr/bin/env bash
# Bytes per weight and streamed tokens/s of the same `synth` shape stored in each format — the
# pre-quantized checkpoints' fp8_e4m3_b128, int8_b128 and int4_g128, the ternary tq2_0/tq1_0 —
# against Q8_0 and Q4_K (Q4_K_M's main type), in one run: every store is benchmarked with every
# layer streamed at a simulated link of LINK_GBPS (the link-bound regime a GPU worker is in), and
# fully resident (compute only). Prints a markdown table.
#
#   benchmarks/prequant-formats.sh            # SHAPE=llama-3-8b LAYERS=2 LINK_GBPS=0.5 TOKENS=8
#   DEVICE=cuda:0 LAYERSTREAM_BIN=layerstream-cuda benchmarks/prequant-formats.sh   # on a GPU
#       (a `--features cuda` build; LINK_GBPS= empty streams at the link's own speed)
set -euo pipefail
cd "$(dirname "$0")/.."
shape=${SHAPE:-llama-3-8b} layers=${LAYERS:-2} link=${LINK_GBPS-0.5} tokens=${TOKENS:-8}
device=${DEVICE:-cpu}
formats=${FORMATS:-q8_0 q4_k fp8_e4m3_b128 int8_b128 int4_g128 tq2_0 tq1_0}
ls=${LAYERSTREAM_BIN:-target/release/layerstream}
[ -x "$ls" ] || cargo build --release -p layerstream
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for dt in $formats; do
    "$ls" synth --shape "$shape" --layers "$layers" --dtype "$dt" "$work/$dt" >/dev/null
    "$ls" bench --model "$work/$dt" --device "$device" --batch 1 --resident-layers 0 ${link:+--link-gbps "$link"} \
        --max-new-tokens "$tokens" --prompt-tokens 16 --json-out "$work/$dt.json" >"$work/$dt.log" 2>&1 ||
        { cat "$work/$dt.log"; exit 1; }
    rm -rf "$work/$dt"/layer_*.bin
done
python3 - "$work" "$shape" "$layers" "$link" "$tokens" $formats <<'PY'
import json, os, sys
work, shape, layers, link, tokens, *formats = sys.argv[1:]
rows = {}
for dt in formats:
    m = json.load(open(os.path.join(work, dt, "manifest.json")))
    size = weights = 0
    for f in m["files"]:
        if f["name"].startswith("layer_"):
            for t in f["tensors"]:
                if t["dtype"] == dt:
                    n = 1
                    for d in t["shape"]:
                        n *= d
                    size += t["size"]; weights += n
    r = {x["config"]: x for x in json.load(open(os.path.join(work, dt + ".json")))}
    rows[dt] = (8 * size / weights, r["streamed (prefetch on)"]["decode_tok_s"], r["fully resident"]["decode_tok_s"])
print(f"shape {shape}, {layers} layers, every layer streamed at {link or 'the link speed'} GB/s, batch 1, {tokens} tokens\n")
print("| format | bits/weight | streamed decode tok/s | ÷ q8_0 | ÷ q4_k | resident decode tok/s |")
print("|---|---|---|---|---|---|")
for dt, (bits, s, res) in rows.items():
    q8 = rows.get("q8_0", (0, float("nan")))[1]
    q4 = rows.get("q4_k", (0, float("nan")))[1]
    print(f"| {dt} | {bits:.3f} | {s:.3f} | {s / q8:.2f} | {s / q4:.2f} | {res:.2f} |")
PY
