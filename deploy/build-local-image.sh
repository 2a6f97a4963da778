#!/usr/bin/env bash
# Builds layerstream:latest without pulling anything: the release binary plus the libraries `ldd`
# reports, copied into a `scratch` image. (The default-model fetch needs Python; this image has none,
# so seed the models volume with the GGUF — deploy/test-compose.sh does — or use deploy/Dockerfile.)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-layerstream:latest}
cargo build --release -p layerstream
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
root=$ctx/rootfs
mkdir -p "$root/usr/local/bin" "$root/tmp" "$root/run/layerstream" "$root/models" "$root/dev/shm"
chmod 1777 "$root/tmp"
cp target/release/layerstream "$root/usr/local/bin/layerstream"
strip "$root/usr/local/bin/layerstream" 2>/dev/null || true
for lib in $(ldd target/release/layerstream | grep -o '/[^ ]*'); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
done
cp deploy/Dockerfile.local "$ctx/Dockerfile"
docker build -q -t "$tag" "$ctx" >/dev/null
echo "built $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes)"
