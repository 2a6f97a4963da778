#!/usr/bin/env bash
# Runs the CUDA tests and GPU benchmarks on a GPU machine from prebuilt binaries (such a machine may
# have no Rust toolchain). benchmarks/gpu-prepare.sh builds them on a build machine into .dev/ with
# what else the machine needs in pieces a device call can carry (.dev/bin, .dev/fix, .dev/smol-N).
# Each call copies whatever pieces it brought into KEEP (/tmp/ls-keep), outside the checkout, so
# calls to one warm machine can bring them one at a time.
# Usage: benchmarks/gpu-run.sh OUT_DIR [SECTION…]
# Sections (default: all but llama, in this order):
#   hbm       device-to-device copy GB/s through the image's PyTorch (the matvec's measured ceiling)
#   sanitize  compute-sanitizer memcheck and racecheck over kernel tests (SANITIZE_TESTS)
#   kernels   kernel-vs-CPU tests (KERNEL_TESTS, a filter)    cuda      worker-on-CUDA tests (CUDA_TESTS: test-binary args)
#   cudaq     every llama.cpp file type of the tiny Llama on the GPU against transformers
#   matvec    decode matvec GB/s vs HBM peak per dtype, batch 1-8: wide loads vs element runs vs 8-bit
#   h2d       link microbenchmark          run       resident `run` on SmolLM2 (real, when all its parts
#   sampling  host sampling bench                    are here), SmolLM2 shapes and llama-3-70b shapes
#   stream    streamed vs resident vs prefetch off (BATCHES)
#   prefill   long prompts (PREFILL_BATCHES)       sampled   T 0.7 top-p 0.9 decode (SAMPLED_BATCHES)
#   spec      speculative decoding: 70B-shaped streamed target, 1B-shaped draft, pass time by
#             positions and tok/s projected at ACCEPTANCE (default 0.5,0.6,0.7,0.8)
#   mixed     a CUDA worker and a CPU worker (`--device cuda:0,cpu --workers 2`, the CPU worker
#             computing its layers from the loader's slots in RAM) against one CUDA worker streaming
#             every layer, streamed runs only, at MIXED_BATCHES (default 1 8 64)
#   tiers     plan's prediction vs bench's measurement on a TIER_BUDGET device budget: every streamed
#             layer in the RAM tier, then TIER_SLOTS slots (disk), at TIER_BATCHES (#40); TIER_CONFIGS
#             picks (ram disk), TIER_RECAL=1 calibrates afresh
#   cgroup    the ledger under a memory cgroup on the GPU machine: `up` with no size flags on a store
#             larger than CG_LIMIT, then `bench` on a TIER_BUDGET device budget in it (#40)
#   ab        this checkout's binary against an older one (.dev/old), alternated on the RAM tier
#   uppred    `up` on the device: the cost model's prediction beside each decode step (1, then 8 at once)
#   moe       benchmarks/moe-experts.sh on the DeepSeek-V3 and gpt-oss-120b shapes (MOE_LAYERS, MOE_BATCHES)
#   prequant  benchmarks/prequant-formats.sh (FP8/INT8/int4/ternary vs Q8_0/Q4_K) on the device
#   llama     llama.cpp CUDA (built here from the carried .dev/llama source: the image has CMake,
#             ninja and nvcc) vs resident layerstream on the very same weights (`synth --gguf`) of
#             LLAMA_SHAPES (llama-3-8b llama-3-70b; LLAMA_LAYERS each, default all / LAYERS70;
#             LLAMA_DTYPE, default q4_k):
#             llama-bench prefill/decode, interleaved rounds, and llama-batched-bench at 1 and 32
#             sequences against `layerstream bench` resident at the same batches. Not in the
#             default list (its build takes minutes): name it.
# Test binaries look for fixtures and the layerstream binary where they were built: BUILD_ROOT
# (default /work/main) is pointed at this checkout.
# DEADLINE (seconds from the start): a section whose estimate (EST_<section>, seconds) would run
# past it is skipped, saying so, so one device call ends inside its limit with what mattered most.
# Knobs (environment): DEVICE (cuda:0; `cpu` for a dry run of this script on a build machine),
# LAYERS70, BUDGET, BATCHES, BUFFERS, TIER_BUDGET, TIER_SLOTS, TIER_BATCHES, TOKENS, PROMPT_TOKENS, PREFILL_BATCHES, SAMPLED_BATCHES, KEEP.
set -uo pipefail
OUT=$1; shift; mkdir -p "$OUT"; DEV=${DEVICE:-cuda:0}
SECTIONS=" ${*:-hbm kernels cuda matvec h2d run sampling stream prefill sampled spec mixed moe prequant} "
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KEEP=${KEEP:-/tmp/ls-keep}; mkdir -p "$KEEP"
for d in "$ROOT"/.dev/*/; do [ -d "$d" ] && { n=$(basename "$d"); rm -rf "${KEEP:?}/$n"; cp -r "$d" "$KEEP/$n"; }; done
BIN=$KEEP/bin
# Binaries may travel xz-compressed (gpu-prepare.sh XZ=1) to leave room for fixtures.
for z in "$BIN"/*.xz; do [ -f "$z" ] && xz -d -f "$z" && chmod +x "${z%.xz}"; done
[ -x "$BIN/layerstream" ] || { echo "no binaries in $BIN: carry .dev/bin (benchmarks/gpu-prepare.sh)" >&2; exit 2; }
# The test fixtures travel compressed (.dev/fix) when the checkout is sent without them.
# gpu-prepare.sh FIX_PIECES splits them over calls (.dev/fix-N): each call unpacks what it brought.
for t in "$KEEP"/fix*/fixtures.tar.xz; do
  [ -f "$t" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$t" "$ROOT"
done
BUILD_ROOT=${BUILD_ROOT:-/work/main}
if [ "$ROOT" != "$BUILD_ROOT" ]; then mkdir -p "$(dirname "$BUILD_ROOT")"; ln -sfn "$ROOT" "$BUILD_ROOT"; fi
# A dry run on the build machine (DEVICE=cpu) keeps the binary cargo built there.
if [ "$DEV" != cpu ] || [ ! -x "$ROOT/target/release/layerstream" ]; then
  mkdir -p "$ROOT/target/release" && cp "$BIN/layerstream" "$ROOT/target/release/layerstream"
fi
LS="$ROOT/target/release/layerstream"
export LAYERSTREAM_BIN="$LS"   # the end-to-end tests run this binary instead of building one
for lib in libnvrtc.so.13 libcublas.so.13; do
  d=$(dirname "$(find /usr/local/cuda*/ /usr/lib /opt -name "$lib" 2>/dev/null | head -1)")
  [ -n "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
# The real SmolLM2 store, carried in parts: unpacked, once every part is here, where the default
# model is looked for, so the SmolLM2 CUDA test and `run` without --model use it.
export LAYERSTREAM_CACHE=${LAYERSTREAM_CACHE:-/tmp/ls-cache}
SMOL_REAL="$LAYERSTREAM_CACHE/stores/smollm2-135m-instruct-q4_1"
PARTS=$(ls -d "$KEEP"/smol-*/part 2>/dev/null | sort -V)
if [ ! -f "$SMOL_REAL/manifest.json" ] && [ -n "$PARTS" ] && [ "$(echo "$PARTS" | wc -l)" = "$(cat "$KEEP/smol-0/count" 2>/dev/null)" ]; then
  mkdir -p "$SMOL_REAL" && cat $PARTS | tar -C "$SMOL_REAL" -xf - && "$LS" verify "$SMOL_REAL" | tail -1
fi
[ -f "$SMOL_REAL/manifest.json" ] || SMOL_REAL=
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
S70=/tmp/ls-70b; SSM=/tmp/ls-smol
stores() {  # the synthetic stores, written the first time a section needs them
  [ -d $S70 ] || "$LS" synth --shape llama-3-70b --dtype q4_k --layers ${LAYERS70:-20} $S70 >/dev/null
  [ -d $SSM ] || "$LS" synth --shape smollm2-135m --dtype q4_1 $SSM >/dev/null
  du -sh $S70 $SSM | tee "$OUT/stores.txt"
}
# The GPU tests are built as ignored on the (GPU-less) build machine: run them here, except in a dry
# run (DEVICE=cpu), where they stay ignored.
IGN=--include-ignored; [ "$DEV" = cpu ] && IGN=
timed() { local t=$SECONDS; "$@"; echo "   ($1: $((SECONDS - t)) s)"; }
declare -A EST=([hbm]=15 [sanitize]=120 [kernels]=90 [cuda]=200 [cudaq]=120 [matvec]=40 [h2d]=10 [run]=60 [sampling]=20 [stream]=100
  [prefill]=60 [sampled]=40 [spec]=60 [mixed]=120 [tiers]=200 [uppred]=60 [cgroup]=150 [ab]=190 [moe]=120 [prequant]=90 [llama]=400)
fits() {  # SECTION: whether its estimate ends before DEADLINE
  local est; est=$(eval "echo \${EST_$1:-${EST[$1]:-60}}")
  [ -z "${DEADLINE:-}" ] || [ $((SECONDS + est)) -le "$DEADLINE" ] && return 0
  echo "   skipped: $((DEADLINE - SECONDS)) s left before the deadline, $1 needs ~$est s" | tee -a "$OUT/skipped.txt"
  return 1
}
sec_hbm() {
  [ "$DEV" = cpu ] && { echo "no GPU copy to time with DEVICE=cpu"; return; }
  python3 - <<'PY' 2>&1 | tee "$OUT/hbm.txt"
import torch
n = 1 << 30  # 2 × 1 GiB read + written per copy: far past the L2
a = torch.randn(n // 4, device="cuda"); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(20): b.copy_(a)
e.record(); torch.cuda.synchronize()
print(f"device-to-device copy: {2 * n * 20 / (s.elapsed_time(e) / 1e3) / 1e9:.0f} GB/s (bytes read + written), {torch.cuda.get_device_name()}")
PY
}
# A CUDA worker beside a CPU worker (each its half of the layers; the CPU computes from the slots)
# against one CUDA worker streaming every layer: streamed runs, batch by batch.
sec_mixed() {
  for b in ${MIXED_BATCHES-1 8 64}; do
    for d in "$DEV,cpu 2" "$DEV 1"; do
      set -- $d
      echo "-- batch $b, --device $1 --workers $2 (streamed)" | tee -a "$OUT/mixed.txt"
      RUST_LOG=${RUST_LOG:-warn} "$LS" bench --model $S70 --device $1 --workers $2 --streamed-only --memory-budget ${BUDGET:-4G} \
        --loader-slots ${LAYERS70:-20} --streaming-buffers ${BUFFERS:-2} --batch $b --max-new-tokens ${MIXED_TOKENS:-4} \
        --prompt "$FOX" --json-out "$OUT/mixed-b$b-$2w.json" 2>&1 | grep -E "^\||workload|^note|rror" | tee -a "$OUT/mixed.txt"
    done
  done
}
sec_kernels() { "$BIN/kernels-test" ${KERNEL_TESTS:-cuda} $IGN --test-threads=${KERNEL_THREADS:-1} 2>&1 | tee "$OUT/kernels-tests.log" | tail -15; }
sec_cuda() {
  # shellcheck disable=SC2086
  "$BIN/cuda-test" $IGN --test-threads=1 --nocapture ${CUDA_TESTS:-} 2>&1 | tee -a "$OUT/cuda-tests.log" | grep -E "^test |test result|GPU worker took|panicked|skipping" | tail -60
}
# compute-sanitizer's memcheck and racecheck over kernel tests (SANITIZE_TESTS, a filter; each tool
# at most SANITIZE_S seconds).
sec_sanitize() {
  local cs; cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  [ -n "$cs" ] || { echo "no compute-sanitizer on this machine"; return; }
  for tool in memcheck racecheck; do
    echo "-- $tool" | tee -a "$OUT/sanitize.txt"
    timeout "${SANITIZE_S:-60}" "$cs" --tool $tool --print-limit 5 "$BIN/kernels-test" ${SANITIZE_TESTS:-quantized_kv} $IGN --test-threads=1 2>&1 \
      | tee -a "$OUT/sanitize.txt" | grep -vE "^ +(at|[0-9]+:) " | tail -25
  done
}
# Every llama.cpp file type of the tiny Llama on the GPU against transformers (a long test: its own
# section, so the benchmarks can come before it).
sec_cudaq() { CUDA_TESTS=every_llama_cpp_file_type sec_cuda; }
sec_matvec() { "$LS" matvec-bench --device $DEV 2>&1 | tee "$OUT/matvec.md"; }
sec_h2d() { "$LS" h2d-bench --device $DEV --mib 64,256,1024 --iters 20 2>&1 | tee "$OUT/h2d.txt"; }
sec_run() {
  local ids; ids=$(seq 1 ${PROMPT_TOKENS:-512} | paste -sd, -)
  echo "resident run (prefill ${PROMPT_TOKENS:-512} tokens, decode 64)"
  for m in $SMOL_REAL $SSM $S70; do for p in bf16 f16 f32; do
    LAYERSTREAM_CUDA_GEMM=$p "$LS" run --device $DEV --model $m --token-ids "$ids" --max-new-tokens 64 --ignore-eos --json 2>/dev/null | tail -1 | python3 -c "import json,sys; t=json.load(sys.stdin)['timings']; print('$m gemm=$p prefill tok/s %.0f decode tok/s %.1f' % (t['prefill_tok_s'], t['decode_tok_s']))"
  done; done 2>&1 | tee -a "$OUT/run.txt"
}
# Host sampling on this machine's cores (full sort vs selection; one by one vs sample_batch).
sec_sampling() { [ -x "$BIN/sampling-bench" ] && "$BIN/sampling-bench" 2>&1 | tee "$OUT/sampling.txt"; }
bench() {  # TITLE JSON-NAME ARGS…
  echo "-- $1" | tee -a "$OUT/bench.txt"; local name=$2; shift 2
  RUST_LOG=${RUST_LOG:-warn} "$LS" bench --model $S70 --device $DEV --memory-budget ${BUDGET:-4G} --loader-slots ${LAYERS70:-20} --streaming-buffers ${BUFFERS:-2} --json-out "$OUT/$name.json" "$@" 2>&1 | grep -E "^\||/|workload|^note" | tee -a "$OUT/bench.txt"
}
FOX="The quick brown fox jumps over the lazy dog"
# Batch 128 is there to reach compute ≥ transfer (the "≥ 90% hidden" target); BUFFERS sets the
# streaming buffers (groups in flight) of the streamed runs.
sec_stream() { for b in ${BATCHES-1 8 32 64 128}; do bench "batch $b" bench-b$b --batch $b --max-new-tokens ${TOKENS:-8} --prompt "$FOX"; done; }
# Prefill throughput: a PROMPT_TOKENS-token prompt per request (the coordinator splits prompts into
# steps the worker's activation reserve holds: ~490 tokens for 70B shapes).
sec_prefill() { for b in ${PREFILL_BATCHES-1 4}; do bench "prefill, batch $b, ${PROMPT_TOKENS:-512}-token prompts" bench-prefill-b$b --batch $b --max-new-tokens 4 --prompt-tokens ${PROMPT_TOKENS:-512}; done; }
# Sampled decode (logits come back to the host, 128k vocabulary) vs the greedy rows (device argmax).
sec_sampled() { for b in ${SAMPLED_BATCHES-64}; do bench "sampled (T 0.7, top-p 0.9), batch $b" bench-sampled-b$b --batch $b --max-new-tokens ${TOKENS:-8} --prompt "$FOX" --temperature 0.7 --top-p 0.9; done; }
# Speculative decoding (#28): a 70B-shaped streamed Q4_K target with a 1B-shaped resident draft
# (synth llama-3.2-1b, same vocabulary): the time of a pass of 1/16/64/256 positions against the
# link, the draft's time per token, and tok/s projected at ACCEPTANCE (the per-token rates the real
# CPU pair measured; a synthetic draft accepts nothing).
sec_spec() {
  local d=/tmp/ls-1b
  [ -d $d ] || "$LS" synth --shape llama-3.2-1b --dtype q4_k $d >/dev/null
  RUST_LOG=${RUST_LOG:-warn} "$LS" bench --speculative --model $S70 --draft-model $d --device $DEV \
    --memory-budget ${BUDGET:-4G} --loader-slots ${LAYERS70:-20} --streaming-buffers ${BUFFERS:-2} \
    --batch 1 --spec-max 64 --pass-positions 1,16,64,256 --acceptance ${ACCEPTANCE:-0.5,0.6,0.7,0.8} \
    2>&1 | grep -E "^\||^target|^Projected" | tee "$OUT/spec.txt"
}
# Three tiers on a GPU (#40): `plan`'s prediction beside `bench`'s measurement (bench prints both)
# for the 70B-shaped store on a device budget of TIER_BUDGET (a small GPU): with no slot flag (the
# memory ledger gives a GPU stack's host memory to the RAM tier: every streamed layer in a slot)
# and with TIER_SLOTS slots (the pool re-reads most streamed layers from disk each pass), at
# TIER_BATCHES. First `plan` with no size flags at all (the device's free memory is the budget).
sec_tiers() {
  echo "-- plan, no size flags" | tee -a "$OUT/tiers.txt"
  "$LS" plan --model $S70 --device $DEV --workers 1 ${TIER_RECAL:+--recalibrate} 2>&1 | tee -a "$OUT/tiers.txt"
  local cfg name; declare -A cfgs=([ram]="" [disk]="--loader-slots ${TIER_SLOTS:-6}")
  for name in ${TIER_CONFIGS:-ram disk}; do
    set -- ${cfgs[$name]}
    echo "-- $name: plan --memory-budget ${TIER_BUDGET:-4G} $*" | tee -a "$OUT/tiers.txt"
    "$LS" plan --model $S70 --device $DEV --workers 1 --memory-budget ${TIER_BUDGET:-4G} "$@" \
      --batches "$(echo ${TIER_BATCHES:-1 8 64} | tr ' ' ,)" 2>&1 | grep -vE "^ *$" | tee -a "$OUT/tiers.txt"
    for b in ${TIER_BATCHES:-1 8 64}; do
      echo "-- $name: bench batch $b" | tee -a "$OUT/tiers.txt"
      RUST_LOG=${RUST_LOG:-warn} "$LS" bench --model $S70 --device $DEV --memory-budget ${TIER_BUDGET:-4G} "$@" \
        --streamed-only --batch $b --max-new-tokens ${TOKENS:-8} --prompt "$FOX" --json-out "$OUT/tiers-$name-b$b.json" \
        2>&1 | grep -E "^\||predicted|no prediction|workload|^note|rror" | tee -a "$OUT/tiers.txt"
    done
  done
}
# `up` on the device with no prediction flag (#40 point 6): it asks a `plan` process for the cost
# model's decode pass times and hands them to the coordinator; one request, then 8 at once, then
# the steps' wall time beside the prediction (/api/stack) and the two counters (/metrics).
sec_uppred() {
  local port=${UP_PORT:-18000} url pid
  url=http://127.0.0.1:$port
  RUST_LOG=${RUST_LOG:-warn} "$LS" up --model $S70 --device $DEV --workers 1 --memory-budget ${TIER_BUDGET:-4G} \
    --max-batch 8 --listen 127.0.0.1:0 --http-listen 127.0.0.1:$port > "$OUT/up.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -sf $url/health >/dev/null && break; sleep 1; done
  local model; model=$(curl -s $url/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
  local body="{\"model\":\"$model\",\"prompt\":\"$FOX\",\"max_tokens\":${TOKENS:-8},\"ignore_eos\":true}"
  curl -s $url/v1/completions -H 'content-type: application/json' -d "$body" >/dev/null
  local asks=()
  for _ in $(seq 1 8); do curl -s $url/v1/completions -H 'content-type: application/json' -d "$body" >/dev/null & asks+=($!); done
  wait "${asks[@]}"
  grep -A4 "predicted decode" "$OUT/up.log" | tee -a "$OUT/uppred.txt"
  curl -s $url/api/stack | python3 -c "
import json, sys
for s in json.load(sys.stdin)['steps']:
    p = s['predicted_ms']
    print(f\"batch {s['batch']} rows {s['rows']}: {s['wall_ms']:.1f} ms\" + (f', predicted {p:.1f} ms, measured/predicted {s[\"wall_ms\"] / p:.2f}' if p else ''))
" | tee -a "$OUT/uppred.txt"
  curl -s $url/metrics | grep "^layerstream_decode_step" | tee -a "$OUT/uppred.txt"
  kill -INT $pid; wait $pid
}
# The ledger under a memory cgroup on the GPU machine (#40): the 70B-shaped store (larger than
# CG_LIMIT, default 3.5G) run with no size flags at all by `up` (one request, then 8 at once), then on a
# small GPU's budget (TIER_BUDGET) by `bench --streamed-only` (plan's prediction beside it), each in a
# cgroup this section makes (v1, else v2; it says why when it cannot), with its peak usage.
sec_cgroup() {
  local cg lim peak port=${UP_PORT:-18001} url pid
  if [ -w /sys/fs/cgroup/memory ]; then cg=/sys/fs/cgroup/memory/ls-gpu; lim=memory.limit_in_bytes; peak=memory.max_usage_in_bytes
  elif grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
    cg=/sys/fs/cgroup/ls-gpu; lim=memory.max; peak=memory.peak
    grep -qw memory /sys/fs/cgroup/cgroup.subtree_control || echo +memory > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
  else echo "no writable memory cgroup here (no v1 memory controller, no v2 memory in cgroup.controllers)" | tee -a "$OUT/cgroup.txt"; return; fi
  mkdir -p $cg && echo "${CG_LIMIT:-3.5G}" | numfmt --from=iec > $cg/$lim \
    || { echo "cannot make or limit $cg: $(id -un), $(stat -fc %T /sys/fs/cgroup)" | tee -a "$OUT/cgroup.txt"; return; }
  echo "-- cgroup $cg: $lim $(cat $cg/$lim), store $(du -sh $S70 | cut -f1)" | tee -a "$OUT/cgroup.txt"
  url=http://127.0.0.1:$port
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
  RUST_LOG=${RUST_LOG:-warn} sh -c "echo \$\$ > $cg/cgroup.procs && exec \"\$0\" \"\$@\"" "$LS" up --model $S70 --device $DEV \
    --listen 127.0.0.1:0 --http-listen 127.0.0.1:$port > "$OUT/cgroup-up.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 150); do curl -sf $url/health >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
  grep -iE "ledger|share|slots|budget|kv" "$OUT/cgroup-up.log" | head -20 | tee -a "$OUT/cgroup.txt"
  local model; model=$(curl -s $url/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])" 2>/dev/null)
  local body="{\"model\":\"$model\",\"prompt\":\"$FOX\",\"max_tokens\":${TOKENS:-8},\"ignore_eos\":true}"
  curl -s -m 120 $url/v1/completions -H 'content-type: application/json' -d "$body" | head -c 600 | tee -a "$OUT/cgroup.txt"; echo | tee -a "$OUT/cgroup.txt"
  local asks=()
  for _ in $(seq 1 8); do curl -s -m 120 $url/v1/completions -H 'content-type: application/json' -d "$body" -o /dev/null -w "%{http_code} " & asks+=($!); done
  wait "${asks[@]}"; echo
  curl -s $url/api/stack | python3 -c "
import json, sys
d = json.load(sys.stdin)
print('memory:', json.dumps(d.get('memory')))
for a in d['plan']:
    print('worker', a['device'], 'layers', a['layers'], 'resident', a['resident'], 'buffers', a['buffers'], 'budget', a['budget'], 'loader', json.dumps(a['loader']))
for s in d['steps'][-3:]:
    print(f\"batch {s['batch']} rows {s['rows']}: {s['wall_ms']:.1f} ms, predicted {s.get('predicted_ms')}\")
" 2>&1 | tee -a "$OUT/cgroup.txt"
  kill -INT $pid 2>/dev/null; wait $pid; echo "up exit $?; peak $(numfmt --to=iec < $cg/$peak)" | tee -a "$OUT/cgroup.txt"
  tail -3 "$OUT/cgroup-up.log" | tee -a "$OUT/cgroup.txt"
  for b in ${CG_BATCHES:-1 8}; do
    [ $peak = memory.max_usage_in_bytes ] && echo 0 > $cg/$peak
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
    echo "-- bench --memory-budget ${TIER_BUDGET:-4G} --streamed-only --batch $b, in the cgroup" | tee -a "$OUT/cgroup.txt"
    RUST_LOG=${RUST_LOG:-warn} sh -c "echo \$\$ > $cg/cgroup.procs && exec \"\$0\" \"\$@\"" "$LS" bench --model $S70 --device $DEV \
      --memory-budget ${TIER_BUDGET:-4G} --streamed-only --batch $b --max-new-tokens ${TOKENS:-8} --prompt "$FOX" \
      --json-out "$OUT/cgroup-b$b.json" 2>&1 | grep -E "^\||predicted|no prediction|workload|^note|rror|ledger" | tee -a "$OUT/cgroup.txt"
    echo "peak $(numfmt --to=iec < $cg/$peak)" | tee -a "$OUT/cgroup.txt"
  done
  for _ in $(seq 50); do [ -z "$(cat $cg/cgroup.procs)" ] && break; sleep 0.2; done
  rmdir $cg 2>/dev/null
}
# A change against the binary before it, side by side in one call: OLD (default $KEEP/old/layerstream,
# carried xz-compressed as .dev/old) and this checkout's, alternated AB_ROUNDS times at AB_BATCHES on
# the 70B-shaped store with a TIER_BUDGET device budget (every streamed layer in the RAM tier).
sec_ab() {
  local old=${OLD_BIN:-$KEEP/old/layerstream} r b v bin
  [ -f "$old.xz" ] && xz -dc "$old.xz" > "$old" && chmod +x "$old"
  [ -x "$old" ] || { echo "no old binary at $old: carry .dev/old/layerstream.xz"; return; }
  for r in $(seq 1 ${AB_ROUNDS:-2}); do for b in ${AB_BATCHES:-1 64}; do for v in old new; do
    bin=$LS; [ $v = old ] && bin=$old
    echo "-- round $r batch $b $v" | tee -a "$OUT/ab.txt"
    RUST_LOG=${RUST_LOG:-warn} "$bin" bench --model $S70 --device $DEV --memory-budget ${TIER_BUDGET:-4G} --streamed-only \
      --batch $b --max-new-tokens ${AB_TOKENS:-16} --prompt "$FOX" --json-out "$OUT/ab-$v-b$b-r$r.json" 2>&1 \
      | grep -E "measured|rror" | tee -a "$OUT/ab.txt"
  done; done; done
  python3 - "$OUT" ${AB_BATCHES:-1 64} <<'PY' | tee -a "$OUT/ab.txt"
import glob, json, sys
out = sys.argv[1]
for b in sys.argv[2:]:
    for v in ("old", "new"):
        rs = [json.load(open(f))[0] for f in sorted(glob.glob(f"{out}/ab-{v}-b{b}-r*.json"))]
        print(f"batch {b} {v}: decode tok/s", [round(r["decode_tok_s"], 2) for r in rs],
              "overlap %", [round(r["overlap_pct"], 1) for r in rs], "stall ms", [round(r["stall_ms"]) for r in rs])
PY
}
# Mixture-of-experts streaming (#32, #33): DeepSeek-V3 and gpt-oss-120b shapes expert by expert.
sec_moe() {
  LAYERSTREAM_BIN="$LS" bash "$ROOT/benchmarks/moe-experts.sh" --device $DEV --layers ${MOE_LAYERS:-4} \
    --shapes "${MOE_SHAPES:-deepseek-v3}" --batches ${MOE_BATCHES:-1,32} 2>&1 | tee "$OUT/moe.md" | tail -20
  LAYERSTREAM_BIN="$LS" bash "$ROOT/benchmarks/moe-experts.sh" --device $DEV --layers ${MOE_LAYERS:-4} \
    --shapes gpt-oss-120b --dtype mxfp4 --batches ${MOE_BATCHES:-1,32} 2>&1 | tee -a "$OUT/moe.md" | tail -20
}
# Pre-quantized checkpoints' formats (#31) streamed at the link's own speed and resident.
sec_prequant() {
  DEVICE=$DEV LAYERSTREAM_BIN="$LS" LINK_GBPS= bash "$ROOT/benchmarks/prequant-formats.sh" 2>&1 | tee "$OUT/prequant.md" | tail -20
}
sec_llama() {
  local src=$KEEP/llama-src bld=${LLAMA_BUILD:-$KEEP/llama-build} cuda=OFF
  command -v nvcc >/dev/null && cuda=ON
  if [ ! -x "$bld/bin/llama-bench" ] || [ ! -x "$bld/bin/llama-batched-bench" ]; then
    [ -f "$KEEP/llama/src.tar.xz" ] || { echo "no llama.cpp source: carry .dev/llama (gpu-prepare.sh)"; return; }
    [ -f "$src/CMakeLists.txt" ] || { mkdir -p "$src" && tar -C "$src" -xJf "$KEEP/llama/src.tar.xz"; }
    cmake -S "$src" -B "$bld" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=$cuda -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_BUILD_SERVER=OFF >"$OUT/llama-cmake.log" 2>&1 || { tail -20 "$OUT/llama-cmake.log"; return; }
    # A build cut off by the call's time limit goes on from where it stopped in the next call.
    cmake --build "$bld" --target llama-bench llama-batched-bench -j "$(nproc)" >"$OUT/llama-build.log" 2>&1 \
      || { tail -20 "$OUT/llama-build.log"; return; }
  fi
  local ngl=99; [ "$DEV" = cpu ] && ngl=0
  local ids; ids=$(python3 -c "print(','.join(str(1 + i * 7919 % 40000) for i in range(${PROMPT_TOKENS:-512})))")
  for shape in ${LLAMA_SHAPES:-llama-3-8b llama-3-70b}; do
    local st=/tmp/ls-vs-$shape g=/tmp/ls-vs-$shape.gguf layers=${LLAMA_LAYERS:-}
    [ "$shape" = llama-3-70b ] && layers=${LLAMA_LAYERS:-${LAYERS70:-20}}
    [ -f $g ] || "$LS" synth --shape $shape --dtype ${LLAMA_DTYPE:-q4_k} ${layers:+--layers $layers} --gguf $g $st | tail -2
    echo "-- $shape ${LLAMA_DTYPE:-q4_k} (${layers:-all} layers), resident: llama.cpp -ngl $ngl vs layerstream run --device $DEV" | tee -a "$OUT/llama.txt"
    for r in $(seq 1 ${ROUNDS:-3}); do
      "$bld/bin/llama-bench" -m $g -ngl $ngl -p ${PROMPT_TOKENS:-512} -n ${TOKENS:-128} -r 1 -o json 2>/dev/null > "$OUT/llama-bench-$shape-$r.json"
      "$LS" run --device $DEV --model $st --token-ids "$ids" --max-new-tokens 1 --json 2>/dev/null | tail -1 > "$OUT/ls-prefill-$shape-$r.json"
      "$LS" run --device $DEV --model $st --token-ids 1 --max-new-tokens $((${TOKENS:-128} + 1)) --ignore-eos --json 2>/dev/null | tail -1 > "$OUT/ls-decode-$shape-$r.json"
      python3 - "$OUT" "$shape" "$r" <<'PY' | tee -a "$OUT/llama.txt"
import json, sys
out, shape, r = sys.argv[1:4]
lc = json.load(open(f"{out}/llama-bench-{shape}-{r}.json"))
lp = next(t["avg_ts"] for t in lc if t["n_prompt"] > 0)
ld = next(t["avg_ts"] for t in lc if t["n_gen"] > 0)
sp = json.load(open(f"{out}/ls-prefill-{shape}-{r}.json"))["timings"]["prefill_tok_s"]
sd = json.load(open(f"{out}/ls-decode-{shape}-{r}.json"))["timings"]["decode_tok_s"]
print(f"round {r}: prefill layerstream {sp:.1f} / llama.cpp {lp:.1f} = {sp / lp:.2f}; decode {sd:.1f} / {ld:.1f} = {sd / ld:.2f}")
PY
    done
    echo "-- $shape batched: llama-batched-bench (-npp 128 -ntg 64) vs layerstream bench" | tee -a "$OUT/llama.txt"
    "$bld/bin/llama-batched-bench" -m $g -ngl $ngl -c 16384 -npp 128 -ntg 64 -npl 1,32 2>/dev/null | grep -E "^\|" | tee -a "$OUT/llama.txt"
    for b in 1 32; do
      RUST_LOG=warn "$LS" bench --model $st --device $DEV --memory-budget ${LLAMA_BUDGET:-70G} --batch $b --prompt-tokens 128 \
        --max-new-tokens 64 --json-out "$OUT/ls-bench-$shape-b$b.json" 2>&1 | grep -E "^\||workload" | tee -a "$OUT/llama.txt"
    done
  done
}
# In the order the command line names them.
for s in $SECTIONS; do
  declare -F "sec_$s" >/dev/null || { echo "no section $s" >&2; continue; }
  echo "== $s (at $SECONDS s)"; fits $s || continue
  case $s in run|stream|prefill|sampled|spec|mixed|tiers|uppred|cgroup|ab) [ -d $S70 ] && [ -d $SSM ] || timed stores;; esac
  timed sec_$s
done
