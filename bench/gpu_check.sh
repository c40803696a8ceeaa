#!/usr/bin/env bash
# On the GPU machine: the carried packages (bench/gpu_wheels.sh) unpacked into /tmp/site, the
# project importable, then the check; its report lands in $OUT (or bench/results).
#   device run: bash bench/gpu_check.sh          (carry: [".whl"], timeout_s 540)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .whl/site.tar.xz ]; then
  mkdir -p /tmp/site
  tar -xJf .whl/site.tar.xz -C /tmp/site
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec timeout "${GPU_CHECK_TIMEOUT:-480}" python3 bench/gpu_check.py "$@"
