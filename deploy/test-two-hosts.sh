#!/usr/bin/env bash
# Two hosts for real, on this machine: deploy/compose.two-hosts.yaml (two nodes, each a loader daemon
# and a worker sharing their own IPC namespace, and a coordinator reaching the workers at their
# container addresses). Sends four concurrent jobs of different lengths and checks that each equals
# the non-container `layerstream run`, that the plan keeps two micro-batches in flight and their steps
# overlapped, that the workers are reached over non-loopback addresses, that each node's worker reads
# from its own loader (separate IPC namespaces, both loaders used); then removes everything it made.
# Last line: a one-line summary.
set -euo pipefail
# f32 activations in `run` and in the containers alike, so their tokens can be compared exactly.
export LAYERSTREAM_EXACT=true
cd "$(dirname "$0")/.."
source deploy/lib.sh

export COMPOSE_PROJECT_NAME="lshosts$$"
export LAYERSTREAM_IMAGE="layerstream:hosts-$$"
work=$(mktemp -d)
export LAYERSTREAM_MODELS="$work/models"
export LAYERSTREAM_PORT=$(free_port) LAYERSTREAM_HTTP_PORT=$(free_port)
files=(-f deploy/compose.two-hosts.yaml)
profile=
trap cleanup EXIT

echo "== image"
deploy/build-local-image.sh "$LAYERSTREAM_IMAGE"

echo "== model (the default store, imported on the host once, copied into the models volume)"
store=$($bin fetch)
mkdir -p "$work/models/stores"
cp -r "$store" "$work/models/stores/"
export LAYERSTREAM_MODEL="/models/stores/$(basename "$store")"

prompts=("What is the capital of France?" "Name three rivers." "Count to five." "Why is the sky blue?")
lengths=(6 11 16 21)
for i in 0 1 2 3; do
    $bin run --model "$store" --chat "${prompts[$i]}" --max-new-tokens "${lengths[$i]}" --ignore-eos --json | tail -n 1 >"$work/expected$i"
done

echo "== compose up (project $COMPOSE_PROJECT_NAME, port $LAYERSTREAM_PORT)"
project up -d
addr="http://127.0.0.1:$LAYERSTREAM_PORT"
wait_healthy "$addr"

echo "== four concurrent jobs"
for i in 0 1 2 3; do
    $bin submit --addr "$addr" --chat "${prompts[$i]}" --max-new-tokens "${lengths[$i]}" --ignore-eos --json | tail -n 1 >"$work/got$i" &
done
wait
for i in 0 1 2 3; do
    python3 - "$work/expected$i" "$work/got$i" <<'PY'
import json, sys
e, g = (json.load(open(p)) for p in sys.argv[1:3])
assert g["output_ids"] == e["output_ids"], f"two-host answer differs:\n{g['text']!r}\nvs\n{e['text']!r}"
PY
done

echo "== plan, overlap, addresses, one loader per node"
http="http://127.0.0.1:$LAYERSTREAM_HTTP_PORT"
curl -sS "$http/api/stack" >"$work/stack.json"
curl -sS "$http/metrics" >"$work/metrics.txt"
ipc_a=$(docker inspect -f '{{.HostConfig.IpcMode}}' "$(project ps -q node-a-worker)")
ipc_b=$(docker inspect -f '{{.HostConfig.IpcMode}}' "$(project ps -q node-b-worker)")
summary=$(python3 - "$work/stack.json" "$work/metrics.txt" "$ipc_a" "$ipc_b" <<'PY'
import json, re, sys
s = json.load(open(sys.argv[1]))
metrics = open(sys.argv[2]).read()
ipc_a, ipc_b = sys.argv[3:5]
assert s["micro_batches"] == 2, f"expected two micro-batches in flight: {s['micro_batches_reason']}"
overlapped = float(re.search(r"^layerstream_overlapped_steps_total (\S+)", metrics, re.M).group(1))
assert overlapped > 0, "no step started while another micro-batch's step was in flight"
workers = [a["worker"] for a in s["plan"]]
assert len(workers) == 2 and len(set(workers)) == 2, workers
for w in workers:
    host = re.match(r"http://([^:]+):", w).group(1)
    assert not host.startswith("127.") and host != "localhost", f"worker on loopback: {w}"
# Each worker reports its own loader's counters; both loaders served reads.
for a in s["plan"]:
    l = a["loader"]
    assert l and l["hits"] + l["misses"] > 0, f"{a['worker']}: its loader served nothing: {l}"
assert ipc_a.startswith("container:") and ipc_b.startswith("container:") and ipc_a != ipc_b, (ipc_a, ipc_b)
print(f"workers {', '.join(workers)}; {s['micro_batches']} micro-batches, {overlapped:.0f} overlapped steps")
PY
)

down_and_check
echo "test-two-hosts: PASS — four concurrent jobs equal the local run; $summary; separate IPC namespaces; nothing left"
