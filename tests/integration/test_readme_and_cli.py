"""The README's client example and the `tandem` command line, against a real stack."""

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.engine.kernel_report import cpu_capability

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def readme_client_example() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- client-example -->\s*```python\n(.*?)```", text, re.S)
    assert match, "the README lost its client example"
    return match.group(1)


def test_readme_client_example_runs(disagg):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(readme_client_example(), "README.md", "exec"), {"ADDRESS": disagg.address})
    answer, stats = out.getvalue().strip().rsplit("\n", 1)
    assert "Paris" in answer
    assert re.match(r"\d+ tokens, \d+ ms to first token", stats)


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shared.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_generate_streams_an_answer(disagg):
    done = tandem(
        "generate",
        "What is the capital of France?",
        "--max-tokens",
        "16",
        "--address",
        disagg.address,
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert re.search(r"\d+ prompt \+ \d+ generated tokens", done.stderr)


def test_cli_status_lists_workers_and_the_kernels_each_runs(disagg):
    done = tandem("status", "--address", disagg.address)
    assert done.returncode == 0, done.stderr
    _, kernels = done.stdout.split("\n\nkernels:\n")
    for worker in disagg.status().workers:
        assert worker.id in done.stdout and worker.role in done.stdout
        # the default model is float32: every row through Tandem's row kernel, on any CPU
        # with AVX2
        assert worker.kernels.startswith(cpu_capability() + " · float32 · matmul rows-c++ ·")
        assert any(
            line.split()[0] == worker.id and line.endswith(worker.kernels)
            for line in kernels.splitlines()
        )


def test_cli_reports_errors_clearly(disagg):
    done = tandem("generate", "hi", "--max-tokens", "0", "--address", disagg.address)
    assert done.returncode == 1
    assert "INVALID_ARGUMENT" in done.stderr and "Traceback" not in done.stderr
