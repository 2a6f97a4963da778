#!/usr/bin/env bash
# Prepares what a GPU machine without a Rust toolchain or network needs for benchmarks/gpu-run.sh,
# under .dev/ (ignored by git):
#   .dev/bin/{layerstream,cuda-test,kernels-test}   release builds with --features cuda, stripped
#   .dev/bin/sampling-bench                         host sampling benchmark (benches/sampling.rs)
#   .dev/smol-0/part … .dev/smol-2/part              the imported SmolLM2 store (~94 MB) in 32 MiB parts
# The device tool carries at most 64 MiB per call, so carry them over calls to the same warm machine
# (the sizes printed at the end say what fits together), e.g.:
#   run(carry=[".dev/bin", ".dev/smol-0"], command="true")
#   run(carry=[".dev/smol-1", ".dev/smol-2"], command="bash benchmarks/gpu-run.sh .dev/bin $OUT")
# gpu-run.sh joins the parts when all are present and points the SmolLM2 test and runs at them.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
mkdir -p .dev/bin && rm -rf .dev/smol-*
if [ -z "${SKIP_BUILD:-}" ]; then
  cargo build --release -p layerstream --features cuda
  exe() { cargo test --release "$@" --no-run --message-format=json 2>/dev/null | python3 -c "import json,sys; print([m['executable'] for m in map(json.loads, sys.stdin) if m.get('reason')=='compiler-artifact' and m.get('executable') and m['target']['kind']!=['bin']][-1])"; }
  cp "$(exe -p layerstream --features cuda --test cuda)" .dev/bin/cuda-test
  cp "$(exe -p layerstream-kernels --features cuda --lib)" .dev/bin/kernels-test
  cp target/release/layerstream .dev/bin/layerstream
  cp "$(cargo bench -p layerstream-worker --bench sampling --no-run --message-format=json 2>/dev/null | python3 -c "import json,sys; print([m['executable'] for m in map(json.loads, sys.stdin) if m.get('reason')=='compiler-artifact' and m.get('executable')][-1])")" .dev/bin/sampling-bench
  strip .dev/bin/*
fi
# The embedded model's store, where `layerstream run` imports it on first use.
STORE=${SMOLLM2_STORE:-$HOME/.cache/layerstream/stores/smollm2-135m-instruct-q4_1}
[ -f "$STORE/manifest.json" ] || { echo "no imported SmolLM2 store at $STORE (run: layerstream run --prompt hi)" >&2; exit 1; }
tar -C "$STORE" -cf - . | split -b 32m -a 1 -d - .dev/smol-part-
for p in .dev/smol-part-*; do n=${p##*-}; mkdir -p ".dev/smol-$n" && mv "$p" ".dev/smol-$n/part"; done
du -sh .dev/bin .dev/smol-*
