#!/usr/bin/env bash
# Builds layerstream:latest without pulling anything: the release binary plus the libraries `ldd`
# reports, copied into a `scratch` image. (The default-model fetch needs Python; this image has none,
# so seed the models volume with the GGUF — deploy/test-compose.sh does — or use deploy/Dockerfile.)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-layerstream:latest}
# LAYERSTREAM_BUILD_PROFILE=dev reuses a debug build (CI, where the tests just built one).
if [ "${LAYERSTREAM_BUILD_PROFILE:-release}" = dev ]; then
    cargo build -p layerstream; bin=target/debug/layerstream
else
    cargo build --release -p layerstream; bin=target/release/layerstream
fi
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
root=$ctx/rootfs
mkdir -p "$root/usr/local/bin" "$root/tmp" "$root/run/layerstream" "$root/models" "$root/dev/shm"
chmod 1777 "$root/tmp"
cp "$bin" "$root/usr/local/bin/layerstream"
strip "$root/usr/local/bin/layerstream" 2>/dev/null || true
for lib in $(ldd "$bin" | grep -o '/[^ ]*'); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
done
cp deploy/Dockerfile.local "$ctx/Dockerfile"
docker build -q -t "$tag" "$ctx" >/dev/null
echo "built $tag ($(docker image inspect -f '{{.Size}}' "$tag") bytes)"
