"""The Triton attention kernel compiles for a Hopper GPU (sm_90) here, without one: the type rules
the interpreter does not apply are checked in `make test` too (see tests/unit/triton_sm90.py)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_attention_kernel_compiles_to_sm90_machine_code(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.triton_sm90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("sm_90")]
    assert len(lines) == 8, done.stdout
