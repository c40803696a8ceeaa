"""The GPU check's CPU dry run (`make gpu-check` without a GPU): every step runs on CPU at tiny
sizes, so the script is known to work on the day a GPU is lent; its TP step on two gloo ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_runs_every_step_and_reports(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(tmp_path),
         "--work", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert done.returncode == 0 and not report["errors"], done.stdout[-3000:] + done.stderr[-3000:]
    assert report["dry_run"] and report["checkpoint"]["layers"] == 2
    # greedy parity with HF in fp32, in-process and through a real disaggregated stack
    fp32 = report["parity"]["float32"]
    assert fp32["identical"] == fp32["of"] == 4
    assert fp32["disaggregated"]["identical"] == 4
    assert "disaggregated" in fp32["disaggregated"]["paths"]  # the long prompt's KV moved
    assert all(row["gbps"] > 0 for row in report["kv"]["rows"]) and report["kv"]["transports"]
    assert set(report["decode"]) == {"1", "4"} and set(report["ttft"]) == {"256", "1024"}
    # TP=2 on two gloo ranks: HF's greedy tokens, and the prompts' KV moved TP=2 -> TP=1 between
    # the ranks equals the whole model's, each rank having sent half of it
    tp = report["tp"]
    assert tp["backend"] == "gloo" and tp["devices"] == ["cpu", "cpu"]
    assert tp["tokens_identical"] and tp["identical"] == len(tp["prompts"]) == 2
    assert tp["kv"]["ok"], tp["kv"]  # within 1e-5 of the whole model's (relative past 1)
    assert tp["kv"]["bytes_per_rank"] == [tp["kv"]["whole_bytes"] // 2] * 2
    assert tp["kv_heads_per_rank"] == [1, 1] and tp["nccl_one"] == {"skipped": "no GPU"}
    masks = report["masks"]["rows"]  # torch's masks on the device = the CPU kernel's
    assert set(masks) == {"32", "128"} and all(row["identical"] for row in masks.values())
    markdown = (tmp_path / "gpu-check.md").read_text()
    assert markdown.startswith("# GPU check") and "Tensor parallel" in markdown
    assert "Grammar masks" in markdown
