#!/usr/bin/env bash
# lm-evaluation-harness scoring layerstream through its OpenAI API (model type `local-completions`:
# loglikelihood via `echo` + `logprobs` + `max_tokens: 0`, generation via plain completions), on two
# tasks whose data is committed here (tasks/; the hub is unreachable). Not a CI step: it installs
# lm_eval from PyPI (no torch needed for API models).
#
#   bash benchmarks/lm-eval/run.sh [STORE]      (default: the embedded SmolLM2 store)
# Writes the harness's results under $OUT (default /tmp/lm-eval-out) and prints its table.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${LAYERSTREAM_BIN:-$root/target/release/layerstream}"
[ -x "$bin" ] || (cd "$root" && cargo build --release -p layerstream)
python3 -c "import lm_eval" 2>/dev/null || python3 -m pip install -q "lm_eval[api]==0.4.13"
store="${1:-$("$bin" fetch)}"
out="${OUT:-/tmp/lm-eval-out}"
mkdir -p "$out"
# A tokenizer directory transformers' AutoTokenizer reads (the harness counts context tokens with it).
tok="$out/tokenizer"
mkdir -p "$tok"
cp "$store/tokenizer.json" "$tok/"
echo '{"tokenizer_class": "PreTrainedTokenizerFast"}' > "$tok/tokenizer_config.json"
port=18431
"$bin" up --model "$store" --workers 1 --listen 127.0.0.1:0 --http-listen "127.0.0.1:$port" \
    --served-model-name smollm2 > "$out/up.log" 2>&1 &
up=$!
trap 'kill $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
cd "$here/tasks"
python3 -m lm_eval --model local-completions \
    --model_args "model=smollm2,base_url=http://127.0.0.1:$port/v1/completions,tokenizer=$tok,tokenizer_backend=huggingface,num_concurrent=4,max_retries=1,max_length=2048" \
    --tasks ls_capitals_mc,ls_capitals_gen --include_path "$here/tasks" \
    --output_path "$out/results" --log_samples 2>&1 | tee "$out/lm_eval.log" | grep -v "^\s*$" | tail -20
