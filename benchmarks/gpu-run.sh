#!/usr/bin/env bash
# Runs the CUDA tests and GPU benchmarks on a GPU machine from prebuilt binaries (such a machine may
# have no Rust toolchain). benchmarks/gpu-prepare.sh builds them on a build machine into .dev/ with
# what else the machine needs in pieces a device call can carry (.dev/bin, .dev/fix, .dev/smol-N).
# Each call copies whatever pieces it brought into KEEP (/tmp/ls-keep), outside the checkout, so
# calls to one warm machine can bring them one at a time.
# Usage: benchmarks/gpu-run.sh OUT_DIR [SECTION…]
# Sections (default: all, in this order):
#   kernels   kernel-vs-CPU tests          cuda      worker-on-CUDA tests (CUDA_TESTS: test-binary args)
#   h2d       link microbenchmark          run       resident `run` on SmolLM2 (real, when all its parts
#   sampling  host sampling bench                    are here), SmolLM2 shapes and llama-3-70b shapes
#   stream    streamed vs resident vs prefetch off (BATCHES)
#   prefill   long prompts (PREFILL_BATCHES)       sampled   T 0.7 top-p 0.9 decode (SAMPLED_BATCHES)
# Test binaries look for fixtures and the layerstream binary where they were built: BUILD_ROOT
# (default /work/main) is pointed at this checkout.
# Knobs (environment): DEVICE (cuda:0; `cpu` for a dry run of this script on a build machine),
# LAYERS70, BUDGET, BATCHES, BUFFERS, TOKENS, PROMPT_TOKENS, PREFILL_BATCHES, SAMPLED_BATCHES, KEEP.
set -uo pipefail
OUT=$1; shift; mkdir -p "$OUT"; DEV=${DEVICE:-cuda:0}
SECTIONS=" ${*:-kernels cuda h2d run sampling stream prefill sampled} "
on() { [[ "$SECTIONS" == *" $1 "* ]]; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KEEP=${KEEP:-/tmp/ls-keep}; mkdir -p "$KEEP"
for d in "$ROOT"/.dev/*/; do [ -d "$d" ] && { n=$(basename "$d"); rm -rf "${KEEP:?}/$n"; cp -r "$d" "$KEEP/$n"; }; done
BIN=$KEEP/bin
[ -x "$BIN/layerstream" ] || { echo "no binaries in $BIN: carry .dev/bin (benchmarks/gpu-prepare.sh)" >&2; exit 2; }
# The test fixtures travel compressed (.dev/fix) when the checkout is sent without them.
if [ ! -f "$ROOT/tests/fixtures/models/tiny-llama/config.json" ] && [ -f "$KEEP/fix/fixtures.tar.xz" ]; then
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$KEEP/fix/fixtures.tar.xz" "$ROOT"
fi
BUILD_ROOT=${BUILD_ROOT:-/work/main}
if [ "$ROOT" != "$BUILD_ROOT" ]; then mkdir -p "$(dirname "$BUILD_ROOT")"; ln -sfn "$ROOT" "$BUILD_ROOT"; fi
mkdir -p "$ROOT/target/release" && cp "$BIN/layerstream" "$ROOT/target/release/layerstream"
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
[ -d $S70 ] || "$LS" synth --shape llama-3-70b --dtype q4_k --layers ${LAYERS70:-20} $S70 >/dev/null
[ -d $SSM ] || "$LS" synth --shape smollm2-135m --dtype q4_1 $SSM >/dev/null
du -sh $S70 $SSM | tee "$OUT/stores.txt"
timed() { local t=$SECONDS; "$@"; echo "   ($1: $((SECONDS - t)) s)"; }
sec_kernels() { "$BIN/kernels-test" cuda --test-threads=1 2>&1 | tee "$OUT/kernels-tests.log" | tail -15; }
sec_cuda() {
  # shellcheck disable=SC2086
  "$BIN/cuda-test" --test-threads=1 --nocapture ${CUDA_TESTS:-} 2>&1 | tee -a "$OUT/cuda-tests.log" | grep -E "^test |test result|GPU worker took|panicked|skipping" | head -30
}
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
for s in kernels cuda h2d run sampling stream prefill sampled; do
  on $s && { echo "== $s"; timed sec_$s; }
done
