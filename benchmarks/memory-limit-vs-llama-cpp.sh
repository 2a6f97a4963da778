#!/usr/bin/env bash
# A model larger than the memory limit, side by side (issue #40): the same synthetic Llama-3-8B Q4_K
# (4.2 GB) as a layer store and a GGUF, in a memory cgroup this script makes (v1 or v2; it says why
# when it cannot), the page cache dropped before each run:
#   - layerstream: `up` with no size flags (the memory ledger sizes everything), decode tokens/s of
#     one request; `bench --fit` (the same sizing) for 8 at once;
#   - llama.cpp: `llama-bench --repack 0 -lm mmap` (mmap, as it runs past RAM), and
#     `llama-batched-bench` with 8 parallel sequences;
#   - the disk's O_DIRECT GB/s over the store's layer files, and each run's tokens/s ÷ the
#     disk-bound ideal (disk GB/s ÷ the bytes of one pass over every layer and the head);
#   - `layerstream plan --json --recalibrate` in the same cgroup first (measured afresh: the disk
#     below a VM changes from run to run): the cost model's predicted tokens/s at batch 1 and 8
#     beside the measured ones, and layerstream's own disk-bound ideal (disk GB/s ÷
#     the bytes its plan reads from disk per pass); and the prediction again at the disk rate the
#     loader measured during the run (its bytes ÷ the wall time a read was in flight; `plan
#     --disk-gbps`, `bench`'s `predicted_at_run_disk_tok_s`): the model's error with the disk's
#     drift since calibration taken out.
# Prompt processing: one prompt of PP tokens (default 128) in the same cgroup, prefill tokens/s
# of each engine.
# Batch 8 for layerstream: `bench --fit --streamed-only --batch 8` in the same cgroup (a stack sized
# as `up` with no size flags sizes itself): decode tokens/s after the last first token, comparable
# with llama-batched-bench's S_TG; the wall figure (prefill included) beside it.
# Needs root (cgroups, drop_caches). Prints a markdown table; commit it under benchmarks/.
#
#   benchmarks/memory-limit-vs-llama-cpp.sh                 # limits 3584 and 2560 MiB, 8 tokens
#   LIMITS="3584" GEN=16 benchmarks/memory-limit-vs-llama-cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LIMITS=${LIMITS-"3584 2560"}   # empty: only the MoE rows
GEN=${GEN:-8}
PP=${PP:-128}   # prompt tokens of the prompt-processing rows
WORK=${WORK:-/tmp/layerstream-memlimit}
BIN=${LAYERSTREAM_BIN:-target/release/layerstream}
[ -x "$BIN" ] || cargo build --release -q -p layerstream
. benchmarks/llama-cpp.sh
bench=$(llama_cpp_tool llama-bench llama-batched-bench)
batched=$(llama_cpp_tool llama-batched-bench)
mkdir -p "$WORK"
store=$WORK/llama-3-8b-q4k
gguf=$WORK/llama-3-8b-q4k.gguf
[ -f "$store/manifest.json" ] || "$BIN" synth --shape llama-3-8b --dtype q4_k --gguf "$gguf" "$store" >&2

# The cgroup: v1 memory controller, else v2.
cg=""
if [ -w /sys/fs/cgroup/memory ]; then
    cg=/sys/fs/cgroup/memory/layerstream-bench; limit_file=memory.limit_in_bytes; peak_file=memory.max_usage_in_bytes
elif [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
    cg=/sys/fs/cgroup/layerstream-bench; limit_file=memory.max; peak_file=memory.peak
else
    echo "no writable memory cgroup (v1 /sys/fs/cgroup/memory or v2 with the memory controller): run as root on a host with cgroups" >&2
    exit 1
fi
mkdir -p "$cg"
trap 'rmdir "$cg" 2>/dev/null || true' EXIT
# (exec: a backgrounded call's pid is the program's own, so it can be stopped.)
in_cg() { exec sh -c "echo \$\$ > $cg/cgroup.procs && exec \"\$0\" \"\$@\"" "$@"; }
fresh() { sync; echo 3 > /proc/sys/vm/drop_caches; [ "$peak_file" = memory.max_usage_in_bytes ] && echo 0 > "$cg/$peak_file" || true; }
peak_gib() { awk '{printf "%.2f", $1 / 2^30}' "$cg/$peak_file" 2>/dev/null || echo "?"; }

# Disk: O_DIRECT over the layer files.
fresh
head_file=$store/lm_head.bin
[ -f "$head_file" ] || head_file=$store/embed.bin   # tied: the embedding is the head
pass_bytes=$(du -cb "$store"/layer_*.bin "$head_file" | tail -1 | cut -f1)
t0=$(date +%s.%N)
for f in "$store"/layer_*.bin; do dd if="$f" of=/dev/null bs=64M iflag=direct status=none; done
t1=$(date +%s.%N)
layer_bytes=$(du -cb "$store"/layer_*.bin | tail -1 | cut -f1)
disk=$(echo "$layer_bytes / ($t1 - $t0) / 1000000000" | bc -l)
ideal=$(echo "$disk * 1000000000 / $pass_bytes" | bc -l)
printf 'disk (O_DIRECT, layer files): %.2f GB/s; one pass over every layer and the head: %.2f GB; disk-bound ideal %.3f tok/s\n\n' \
    "$disk" "$(echo "$pass_bytes / 1000000000" | bc -l)" "$ideal"

echo "| limit | engine | batch | decode tok/s | predicted | predicted at the run's disk | ÷ ideal | peak GiB | note |"
echo "|---|---|---|---|---|---|---|---|---|"
for mib in $LIMITS; do
    echo $((mib << 20)) > "$cg/$limit_file"
    # layerstream: one stack, one request then 8 at once.
    fresh
    (in_cg "$BIN" plan --model "$store" --workers 1 --json --recalibrate) > "$WORK/plan.json" 2> "$WORK/plan.err" || true
    read -r p1 p8 own < <(python3 -c '
import json,sys
p=json.load(open(sys.argv[1])); t={x["rows"]: x["tokens_per_s"] for x in p["predicted"]}
d=p["tiers"]["disk"]["bytes_per_pass"]; g=p["calibration"]["disk_gbps"]
print(f"{t[1]:.3f} {t[8]:.3f}", f"{g*1e9/d:.3f}" if d else "inf")' "$WORK/plan.json" 2>/dev/null || echo "? ? ?")
    fresh
    port=$((20000 + RANDOM % 20000))
    in_cg "$BIN" up --model "$store" --workers 1 --listen 127.0.0.1:$port --http-listen 127.0.0.1:$((port + 1)) > "$WORK/up.out" 2> "$WORK/up.err" &
    up=$!
    for _ in $(seq 600); do grep -q LISTENING "$WORK/up.out" 2>/dev/null && break; kill -0 $up 2>/dev/null || break; sleep 0.5; done
    if ! grep -q LISTENING "$WORK/up.out" 2>/dev/null; then
        echo "| $mib MiB | layerstream | 1 | — | $p1 | — | — | $(peak_gib) | did not start: $(grep -v INFO "$WORK/up.err" | tail -1 | cut -c1-160) |"
    else
        # The loader's counters (bytes, each read's seconds, seconds with a read in flight).
        counters() { curl -s "http://127.0.0.1:$((port + 1))/metrics" | awk '/^layerstream_loader_disk_read_bytes_total/ {b += $2} /^layerstream_loader_disk_read_seconds_total/ {s += $2} /^layerstream_loader_disk_busy_seconds_total/ {u += $2} END {printf "%.0f %.6f %.6f\n", b, s, u}'; }
        read -r b0 s0 u0 < <(counters)
        one=$("$BIN" submit --addr http://127.0.0.1:$port --prompt "Once upon a time" --max-new-tokens "$GEN" --ignore-eos --json | tail -1)
        read -r b1 s1 u1 < <(counters)
        # What the loader's disk tier delivered during the request: per read, and overlapped (the
        # cost model's disk figure); the prediction again at that rate (`plan --disk-gbps`).
        read -r run_gbps achieved < <(python3 -c '
import sys
b, s, u = (float(sys.argv[i]) - float(sys.argv[i + 3]) for i in (1, 2, 3))
if b < 64e6 or s <= 0 or u <= 0:
    print("- the loader read %.2f GB from disk during the request" % (b / 1e9))
else:
    print("%.4f the loader read %.2f GB from disk during the request, %.2f GB/s per read, %.2f GB/s overlapped"
          % (b / u / 1e9, b / 1e9, b / s / 1e9, b / u / 1e9))' "$b1" "$s1" "$u1" "$b0" "$s0" "$u0")
        tps=$(echo "$one" | python3 -c 'import json,sys; print(json.load(sys.stdin)["stats"]["decode_tokens_per_s"])')
        placed=$(python3 - "$WORK/plan.json" <<'PY' 2>/dev/null || echo "plan: see plan.err"
import json, sys
p = json.load(open(sys.argv[1])); w = p["workers"][0]; t = p["tiers"]
print(f'{len(w["resident"])} resident, RAM tier {t["ram"]["layers"]}, disk {t["disk"]["layers"]} layers a pass; KV {w["kv_capacity"]} {w["kv_dtype"]}')
PY
)
        # The plan again at that rate, in the cgroup as the first (the stack gone: the ledger
        # sees what it saw then).
        kill $up 2>/dev/null || true; wait $up 2>/dev/null || true
        at_run=$(if [ "$run_gbps" != "-" ]; then (in_cg "$BIN" plan --model "$store" --workers 1 --json --disk-gbps "$run_gbps") 2>"$WORK/plan-run.err" |
            python3 -c 'import json,sys; print("%.3f" % json.load(sys.stdin)["predicted"][0]["tokens_per_s"])' 2>/dev/null || echo "?"; else echo "–"; fi)
        vs_own=$(python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" "$tps" "$own" 2>/dev/null || echo "?")
        echo "| $mib MiB | layerstream | 1 | $(printf %.3f "$tps") | $p1 | $at_run | $(printf %.2f "$(echo "$tps / $ideal" | bc -l)") (÷ its plan's $own: $vs_own) | $(peak_gib) | $(grep -o 'loader.s [0-9]* slots [0-9.]* GiB, 1 worker(s) [0-9.]* GiB' "$WORK/up.err" | head -1); $placed; $achieved |"
        # Batch 8: `bench --fit` — its own stack, sized by the same ledger as `up` with no size
        # flags — 8 requests at once; decode tokens/s after the last first token (llama-batched-
        # bench's S_TG measures the same phase), the cost model's prediction beside it.
        kill $up 2>/dev/null || true; wait $up 2>/dev/null || true
        fresh
        # (A subshell: `in_cg` execs.)
        if (in_cg "$BIN" bench --model "$store" --fit --streamed-only --batch 8 \
            --max-new-tokens "$GEN" --json-out "$WORK/b8.json") > "$WORK/b8.out" 2>&1; then
            read -r dec8 wall8 pred8 run8 disk8 < <(python3 -c '
import json,sys
r=json.load(open(sys.argv[1]))[0]; p=r.get("predicted_decode_tok_s")
q=r.get("predicted_at_run_disk_tok_s"); g=r.get("disk_gbps_run")
f=lambda v: "%.3f" % v if v else "?"
print("%.3f %.3f" % (r["decode_tok_s"], r["tokens_per_s"]), f(p), f(q), "%.2f" % g if g else "?")' "$WORK/b8.json")
            echo "| $mib MiB | layerstream | 8 | $dec8 (wall $wall8 with prefill) | $pred8 | $run8 | $(printf %.2f "$(echo "$dec8 / $ideal" | bc -l)") | $(peak_gib) | bench --fit --streamed-only --batch 8; the loader's disk $disk8 GB/s overlapped during the run |"
        else
            echo "| $mib MiB | layerstream | 8 | — | $p8 | — | — | $(peak_gib) | bench failed: $(tail -1 "$WORK/b8.out" | cut -c1-160) |"
        fi
    fi
    kill $up 2>/dev/null || true; wait $up 2>/dev/null || true
    # Nothing of it may stay in the cgroup (or hold memory) while llama.cpp runs.
    for _ in $(seq 100); do [ -z "$(cat "$cg/cgroup.procs")" ] && break; sleep 0.2; done
    # llama.cpp: mmap, no repack; then 8 parallel sequences.
    fresh
    if out=$(in_cg "$bench" -m "$gguf" -p 0 -n "$GEN" -r 1 -t "$(nproc)" --repack 0 -lm mmap -o json 2>"$WORK/llama.err"); then
        tps=$(echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)[-1]["avg_ts"])')
        echo "| $mib MiB | llama.cpp | 1 | $(printf %.3f "$tps") | | | $(printf %.2f "$(echo "$tps / $ideal" | bc -l)") | $(peak_gib) | llama-bench --repack 0 -lm mmap |"
    else
        echo "| $mib MiB | llama.cpp | 1 | — | | | — | $(peak_gib) | $(tail -1 "$WORK/llama.err" | cut -c1-120) (exit $?) |"
    fi
    fresh
    if out=$(in_cg "$batched" -m "$gguf" -c 2048 -npp 8 -ntg "$GEN" -npl 8 -t "$(nproc)" --no-repack -lm mmap 2>"$WORK/llama8.err"); then
        tps=$(echo "$out" | grep '^|' | tail -1 | awk -F'|' '{print $(NF-3)}' | tr -d ' ')
        echo "| $mib MiB | llama.cpp | 8 | $tps (S_TG) | | | $(printf %.2f "$(echo "$tps / $ideal" | bc -l)") | $(peak_gib) | llama-batched-bench -npl 8 |"
    else
        echo "| $mib MiB | llama.cpp | 8 | — | | | — | $(peak_gib) | $(tail -1 "$WORK/llama8.err" | cut -c1-120) |"
    fi
    # Prompt processing: one prompt of PP tokens, each engine from a dropped page cache —
    # layerstream's `bench --fit` (its prefill tok/s: prompt tokens ÷ the time to the first token),
    # llama.cpp's `llama-bench -p PP -n 0` (one run, mmap).
    fresh
    if (in_cg "$BIN" bench --model "$store" --fit --streamed-only --batch 1 --prompt-tokens "$PP" \
        --max-new-tokens 1 --json-out "$WORK/pp.json") > "$WORK/pp.out" 2>&1; then
        pp=$(python3 -c 'import json,sys; print("%.2f" % json.load(open(sys.argv[1]))[0]["prefill_tok_s"])' "$WORK/pp.json")
        echo "| $mib MiB | layerstream | prompt $PP | $pp (prefill tok/s) | | | | $(peak_gib) | bench --fit --streamed-only --prompt-tokens $PP |"
    else
        echo "| $mib MiB | layerstream | prompt $PP | — | | | | $(peak_gib) | bench failed: $(tail -1 "$WORK/pp.out" | cut -c1-160) |"
    fi
    fresh
    if out=$(in_cg "$bench" -m "$gguf" -p "$PP" -n 0 -r 1 -t "$(nproc)" --repack 0 -lm mmap -o json 2>"$WORK/llama-pp.err"); then
        pp=$(echo "$out" | python3 -c 'import json,sys; print("%.2f" % json.load(sys.stdin)[-1]["avg_ts"])')
        echo "| $mib MiB | llama.cpp | prompt $PP | $pp (pp$PP tok/s) | | | | $(peak_gib) | llama-bench -p $PP -n 0 --repack 0 -lm mmap |"
    else
        echo "| $mib MiB | llama.cpp | prompt $PP | — | | | | $(peak_gib) | $(tail -1 "$WORK/llama-pp.err" | cut -c1-120) |"
    fi
done

# The MoE row (MOE_LIMITS, MiB; empty skips it): a synthetic qwen3-30b-a3b Q4_K store (~17 GB)
# in a limit below its size, `up` with no size flags; one request of GEN tokens. Per token: the
# bytes the loader read from disk ÷ what streaming whole layers (every expert) would read, and
# each tier's share of the experts the steps needed — the worker's expert cache (device tier), the
# loader's slots (RAM tier), the disk.
MOE_LIMITS=${MOE_LIMITS:-}
[ -n "$MOE_LIMITS" ] || exit 0
moe=$WORK/qwen3-30b-a3b-q4k
[ -f "$moe/manifest.json" ] || "$BIN" synth --shape qwen3-30b-a3b --dtype q4_k "$moe" >&2
whole=$(du -cb "$moe"/layer_*.bin | tail -1 | cut -f1)   # layer files and every expert file
echo
echo "MoE: $(du -sh "$moe" | cut -f1) store, whole-layer streaming reads $(echo "$whole / 1000000000" | bc -l | cut -c1-5) GB a token"
echo
echo "| limit | decode tok/s | predicted | disk GB/pass | ÷ whole layers | tiers: the worker's expert cache; the loader's slots and disk (every file it served) | peak GiB |"
echo "|---|---|---|---|---|---|---|"
for mib in $MOE_LIMITS; do
    echo $((mib << 20)) > "$cg/$limit_file"
    fresh
    (in_cg "$BIN" plan --model "$moe" --workers 1 --json --recalibrate) > "$WORK/moe-plan.json" 2> "$WORK/moe-plan.err" || true
    # (the routing the prediction assumed: this store's usage history, or spread evenly before its first run)
    p1=$(python3 -c 'import json,sys; p = json.load(open(sys.argv[1])); print("%.3f (routing: %s)" % (p["predicted"][0]["tokens_per_s"], p["tiers"]["expert_routing"]))' "$WORK/moe-plan.json" 2>/dev/null || echo "?")
    fresh
    port=$((20000 + RANDOM % 20000))
    in_cg "$BIN" up --model "$moe" --workers 1 --listen 127.0.0.1:$port --http-listen 127.0.0.1:$((port + 1)) > "$WORK/up.out" 2> "$WORK/moe-up.err" &
    up=$!
    for _ in $(seq 1200); do grep -q LISTENING "$WORK/up.out" 2>/dev/null && break; kill -0 $up 2>/dev/null || break; sleep 0.5; done
    if ! grep -q LISTENING "$WORK/up.out" 2>/dev/null; then
        echo "| $mib MiB | — | $p1 | — | — | did not start: $(grep -v INFO "$WORK/moe-up.err" | tail -1 | cut -c1-160) | $(peak_gib) |"
        continue
    fi
    counters() { curl -s "http://127.0.0.1:$((port + 1))/metrics" | awk '/^layerstream_loader_disk_read_bytes_total/ {b += $2} /^layerstream_loader_cache_hits_total/ {h += $2} /^layerstream_loader_cache_misses_total/ {m += $2} END {printf "%.0f,%.0f,%.0f", b, h, m}   # (not %d: mawk caps it at 2^31)'; }
    before=$(counters)
    one=$("$BIN" submit --addr http://127.0.0.1:$port --prompt "Once upon a time" --max-new-tokens "$GEN" --ignore-eos --json | tail -1)
    after=$(counters)
    python3 - "$one" "$before" "$after" "$whole" "$mib" "$p1" "$(peak_gib)" <<'PY'
import json, sys
r = json.loads(sys.argv[1]); s = r["stats"]
(b0, h0, m0), (b1, h1, m1) = ([int(x) for x in a.split(",")] for a in sys.argv[2:4])
whole = int(sys.argv[4])
tokens = max(s.get("steps", 0), 1)  # weight passes: one per decode token, one for the prompt
need = max(s.get("experts_needed", 0), 1)
hit, pre, miss = s.get("experts_hit", 0), s.get("experts_prefetched", 0), s.get("experts_missed", 0)
disk = (b1 - b0) / tokens
slots, reads = h1 - h0, m1 - m0
print(f"| {sys.argv[5]} MiB | {s['decode_tokens_per_s']:.3f} | {sys.argv[6]} | {disk / 1e9:.3f} | {disk / whole:.3f} | "
      f"worker: {100 * hit / need:.1f}% hit, {100 * pre / need:.1f}% prefetched, {100 * miss / need:.1f}% missed; loader: {slots} from slots, {reads} from disk ({100 * slots / max(slots + reads, 1):.0f}% hits), {(b1 - b0) / 1e9:.2f} GB over {tokens} passes | {sys.argv[7]} |")
PY
    kill $up 2>/dev/null || true; wait $up 2>/dev/null || true
done
