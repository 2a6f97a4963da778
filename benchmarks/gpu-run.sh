#!/usr/bin/env bash
# Runs the CUDA tests and GPU benchmarks on a GPU machine from prebuilt binaries (such a machine may
# have no Rust toolchain). Build them on a build machine:
#   cargo build --release -p layerstream --features cuda
#   cargo test --release -p layerstream --features cuda --test cuda --no-run      # → CUDA_TEST
#   cargo test --release -p layerstream-kernels --features cuda --lib --no-run    # → KERNELS_TEST
# (benchmarks/gpu-prepare.sh does all of this into .dev/, with the SmolLM2 store in two parts.)
# Usage: benchmarks/gpu-run.sh BIN_DIR OUT_DIR   (BIN_DIR holds layerstream, cuda-test, kernels-test)
# Test binaries look for fixtures and the layerstream binary where they were built: BUILD_ROOT
# (default /work/main) is pointed at this checkout.
# Knobs (environment): DEVICE (cuda:0; `cpu` for a dry run of this script on a build machine),
# LAYERS70, BUDGET, BATCHES, BUFFERS, TOKENS, PROMPT_TOKENS, PREFILL_BATCHES, SAMPLED_BATCHES,
# ONLY_BENCH, NO_BENCH.
# A device call is limited to 10 minutes: run it twice on one warm machine if needed, first with
# NO_BENCH=1 (tests, h2d, resident runs), then with ONLY_BENCH=1 (the streamed comparisons).
set -uo pipefail
BIN=$(cd "$1" && pwd); OUT=$2; mkdir -p "$OUT"; DEV=${DEVICE:-cuda:0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_ROOT=${BUILD_ROOT:-/work/main}
if [ "$ROOT" != "$BUILD_ROOT" ]; then mkdir -p "$(dirname "$BUILD_ROOT")"; ln -sfn "$ROOT" "$BUILD_ROOT"; fi
mkdir -p "$ROOT/target/release" && cp "$BIN/layerstream" "$ROOT/target/release/layerstream"
LS="$ROOT/target/release/layerstream"
for lib in libnvrtc.so.13 libcublas.so.13; do
  d=$(dirname "$(find /usr/local/cuda*/ /usr/lib /opt -name "$lib" 2>/dev/null | head -1)")
  [ -n "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
# The real SmolLM2 store, carried in parts (see gpu-prepare.sh): unpacked where the default model
# is looked for, so the SmolLM2 CUDA test and `run` without --model use it.
PARTS=$(ls -d "$ROOT"/.dev/smol-*/part 2>/dev/null | sort -V)
if [ -n "$PARTS" ]; then
  export LAYERSTREAM_CACHE=${LAYERSTREAM_CACHE:-/tmp/ls-cache}
  SMOL_REAL="$LAYERSTREAM_CACHE/stores/smollm2-135m-instruct-q4_1"
  mkdir -p "$SMOL_REAL" && cat $PARTS | tar -C "$SMOL_REAL" -xf - && "$LS" verify "$SMOL_REAL" | tail -1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
S70=/tmp/ls-70b; SSM=/tmp/ls-smol
[ -d $S70 ] || "$LS" synth --shape llama-3-70b --dtype q4_k --layers ${LAYERS70:-20} $S70 >/dev/null
[ -d $SSM ] || "$LS" synth --shape smollm2-135m --dtype q4_1 $SSM >/dev/null
du -sh $S70 $SSM | tee "$OUT/stores.txt"
if [ -z "${ONLY_BENCH:-}" ]; then
echo "== kernel tests"; "$BIN/kernels-test" cuda --test-threads=1 2>&1 | tee "$OUT/kernels-tests.log" | tail -15
echo "== CUDA worker tests"; "$BIN/cuda-test" --test-threads=1 --nocapture 2>&1 | tee "$OUT/cuda-tests.log" | grep -E "^test |test result|GPU worker took|panicked|skipping" | head -30
echo "== h2d"; "$LS" h2d-bench --device $DEV --mib 64,256,1024 --iters 20 2>&1 | tee "$OUT/h2d.txt"
IDS=$(seq 1 ${PROMPT_TOKENS:-512} | paste -sd, -)
echo "== resident run (prefill ${PROMPT_TOKENS:-512} tokens, decode 64)"
for m in ${SMOL_REAL:-} $SSM $S70; do for p in f16 f32; do
  LAYERSTREAM_CUDA_GEMM=$p "$LS" run --device $DEV --model $m --token-ids "$IDS" --max-new-tokens 64 --ignore-eos --json 2>/dev/null | tail -1 | python3 -c "import json,sys; t=json.load(sys.stdin)['timings']; print('$m gemm=$p prefill tok/s %.0f decode tok/s %.1f' % (t['prefill_tok_s'], t['decode_tok_s']))"
done; done 2>&1 | tee "$OUT/run.txt"
# Host sampling on this machine's cores (full sort vs selection; one by one vs sample_batch).
[ -x "$BIN/sampling-bench" ] && { echo "== host sampling"; "$BIN/sampling-bench" 2>&1 | tee "$OUT/sampling.txt"; }
fi
[ -n "${NO_BENCH:-}" ] && exit 0
echo "== streamed vs resident vs prefetch off"
# Batch 128 is there to reach compute ≥ transfer (the "≥ 90% hidden" target); BUFFERS sets the
# streaming buffers (groups in flight) of the streamed runs.
for b in ${BATCHES:-1 8 32 64 128}; do
  echo "-- batch $b" | tee -a "$OUT/bench.txt"
  "$LS" bench --model $S70 --device $DEV --memory-budget ${BUDGET:-4G} --loader-slots ${LAYERS70:-20} --batch $b --streaming-buffers ${BUFFERS:-2} --max-new-tokens ${TOKENS:-8} --prompt "The quick brown fox jumps over the lazy dog" --json-out "$OUT/bench-b$b.json" 2>&1 | grep -E "^\||/|workload|^note" | tee -a "$OUT/bench.txt"
done
# Prefill throughput streamed vs resident: a PROMPT_TOKENS-token prompt per request (the coordinator
# splits prompts into steps the worker's activation reserve holds: ~490 tokens for 70B shapes).
for b in ${PREFILL_BATCHES:-1 4}; do
  echo "-- prefill, batch $b, ${PROMPT_TOKENS:-512}-token prompts" | tee -a "$OUT/bench.txt"
  "$LS" bench --model $S70 --device $DEV --memory-budget ${BUDGET:-4G} --loader-slots ${LAYERS70:-20} --batch $b --streaming-buffers ${BUFFERS:-2} --max-new-tokens 4 --prompt-tokens ${PROMPT_TOKENS:-512} --json-out "$OUT/bench-prefill-b$b.json" 2>&1 | grep -E "^\||/|workload|^note" | tee -a "$OUT/bench.txt"
done
# Sampled decode (T 0.7, top-p 0.9: logits come back to the host, 128k vocabulary) vs the greedy
# rows above (argmax on the device).
for b in ${SAMPLED_BATCHES:-64}; do
  echo "-- sampled (T 0.7, top-p 0.9), batch $b" | tee -a "$OUT/bench.txt"
  "$LS" bench --model $S70 --device $DEV --memory-budget ${BUDGET:-4G} --loader-slots ${LAYERS70:-20} --batch $b --streaming-buffers ${BUFFERS:-2} --max-new-tokens ${TOKENS:-8} --prompt "The quick brown fox jumps over the lazy dog" --temperature 0.7 --top-p 0.9 --json-out "$OUT/bench-sampled-b$b.json" 2>&1 | grep -E "^\||/|workload|^note" | tee -a "$OUT/bench.txt"
done
