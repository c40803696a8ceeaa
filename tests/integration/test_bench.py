"""`tandem bench` against a real stack, over either API: every request completes, with the
prompt length the gateway counts."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("api", ["grpc", "openai"])
def test_bench_measures_a_real_stack(disagg, tmp_path, api):
    address = disagg.address if api == "grpc" else disagg.http_url
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shared.cli.main",
            "bench",
            "--api",
            api,
            "--address",
            address,
            "--num-requests",
            "8",
            "--rate",
            "2",
            "--prompt-len",
            "fixed:64",
            "--output-len",
            "fixed:16",
            "--shared-prefix-tokens",
            "32",
            "--slo",
            "ttft_ms=60000",
            "--out-dir",
            str(tmp_path),
            "--label",
            "it",
            "--no-plots",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Serving benchmark: it" in done.stdout
    data = json.loads((tmp_path / "it.json").read_text())
    summary = data["summary"]
    assert (summary["completed"], summary["failed"], summary["prompt_len_mismatches"]) == (8, 0, 0)
    assert summary["output_tokens"] == 8 * 16 and summary["slo_met"] == 8
    for request in data["requests"]:
        assert (request["prompt_tokens"], request["completion_tokens"]) == (64, 16)
        assert request["finish_reason"] == "length" and request["ttft_ms"] > 0
        assert request["timing"]["path"] == "disaggregated"
    assert data["config"]["api"] == api
    if api == "grpc":
        assert data["config"]["cluster"]["mode"] == "disaggregated"
    disagg.wait_idle()
