"""bench/aiperf_front_door reads aiperf's per-request export: a refusal is counted as one, and the
completed rate is completed requests over the run's span."""

import json

from bench.aiperf_front_door import summarize


def row(start_s: float, end_s: float, error: dict | None = None) -> dict:
    out = {
        "metadata": {
            "benchmark_phase": "profiling",
            "request_start_ns": int(start_s * 1e9),
            "request_end_ns": int(end_s * 1e9),
        },
        "metrics": {"time_to_first_token": {"value": 100.0, "unit": "ms"}},
    }
    if error:
        out["error"] = error
        out["metrics"] = {}
    return out


def test_refusals_are_counted_and_the_rate_is_completed_over_the_span(tmp_path):
    rows = [row(0, 2), row(1, 4), row(1, 1.1, {"code": 429, "message": "limit"})]
    rows.append({"metadata": {"benchmark_phase": "warmup"}, "metrics": {}})
    records = tmp_path / "profile_export.jsonl"
    records.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = summarize(records, tmp_path / "absent.json")
    assert out["requests"] == 3 and out["completed"] == 2 and out["refused_or_failed"] == 1
    assert out["outcomes"] == {"ok": 2, "429": 1}
    assert out["completed_per_s"] == 0.5  # 2 over 4 s
    assert out["errors"] == {"limit": 1} and out["aiperf_request_throughput"] is None
