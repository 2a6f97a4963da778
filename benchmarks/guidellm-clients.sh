#!/usr/bin/env bash
# guidellm (issue #44) against `layerstream up` on the default model: concurrency 1 and 4, 8
# requests each, synthetic 64-token prompts and 16 output tokens, streamed chat completions (guidellm
# sends vLLM's stream_options.continuous_usage_stats). Passes when every request of both succeeds
# (guidellm's request_totals: errored 0, incomplete 0) and prints its table.
# Not a CI step: guidellm pulls torch (~6 GB in its own venv under the cache root).
#
#   benchmarks/guidellm-clients.sh              # LAYERSTREAM_BIN=target/debug/layerstream to skip a release build
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${LAYERSTREAM_BIN:-target/release/layerstream}
[ -x "$BIN" ] || cargo build --release -q -p layerstream
cache=${LAYERSTREAM_CACHE:-$HOME/.cache/layerstream}
venv=$cache/guidellm-venv
[ -x "$venv/bin/guidellm" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q guidellm==0.8.1; }
work=$(mktemp -d)
port=${PORT:-8093}
"$BIN" up --workers 1 --http-listen "127.0.0.1:$port" --listen "127.0.0.1:$((port + 1))" >"$work/up.log" 2>&1 &
up=$!
trap 'kill $up 2>/dev/null; wait $up 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
model=$(curl -sf "http://127.0.0.1:$port/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
# guidellm counts tokens with a Hugging Face tokenizer: the store's own, offline.
mkdir -p "$work/tok"
cp "$cache/stores/$model/tokenizer.json" "$work/tok/"
echo '{"tokenizer_class": "PreTrainedTokenizerFast"}' >"$work/tok/tokenizer_config.json"
HF_HUB_OFFLINE=1 "$venv/bin/guidellm" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$port,model=$model" \
    --profile kind=concurrent --override profile.streams 1,4 \
    --data kind=synthetic_text,prompt_tokens=64,output_tokens=16 \
    --tokenizer "kind=hf_auto,model=$work/tok" \
    --constraint kind=max_requests,count=8 \
    --output "kind=json,path=$work/guidellm.json" --disable-progress >"$work/guidellm.txt" 2>&1 ||
    { tail -20 "$work/guidellm.txt"; exit 1; }
python3 - "$work/guidellm.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
bad = []
print("| concurrency | successful | errored | incomplete | output tok/s (mean) |\n|---|---|---|---|---|")
for b in d["benchmarks"]:
    t, streams = b["metrics"]["request_totals"], b["config"]["strategy"]["streams"]
    tps = b["metrics"]["output_tokens_per_second"]["successful"]["mean"]
    print(f"| {streams} | {t['successful']} | {t['errored']} | {t['incomplete']} | {tps:.2f} |")
    if t["errored"] or t["incomplete"] or not t["successful"]:
        bad.append(streams)
sys.exit(f"requests failed at concurrency {bad}" if bad else 0)
PY
