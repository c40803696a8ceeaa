"""The results of a run: a plain-text table, and a JSON file with every record and the summary.

In the JSON, times are seconds from the run's first send (`origin`), so records read back with
`load_records` give the same metrics.
"""

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from shared.benchmark.client import RequestRecord
from shared.benchmark.metrics import Stats, Summary, request_metrics

RULE = 64
LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
SERVER_PHASES = (
    ("queue", "queue_ms"),
    ("prefill", "prefill_ms"),
    ("KV transfer", "kv_transfer_ms"),
    ("KV exposed", "kv_exposed_ms"),
    ("server TTFT", "ttft_ms"),
)
_FILE_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def file_stem(label: str) -> str:
    return _FILE_UNSAFE.sub("-", label) or "serving"


def table(summary: Summary, label: str = "") -> str:
    title = f" Serving benchmark{': ' + label if label else ''} "
    lines = [title.center(RULE, "=")]
    lines += [_row(name, value) for name, value in _totals(summary)]
    lines.append(" Latency (ms) ".center(RULE, "-"))
    lines.append(f"{'':<10}{'mean':>12}{'median':>12}{'p90':>12}{'p99':>12}")
    lines += [_stats_row(name, getattr(summary, key)) for name, key in LATENCIES]
    lines.append(" Gateway timing (ms) ".center(RULE, "-"))
    lines += [
        _stats_row(name, Stats(**summary.server[key]))
        for name, key in SERVER_PHASES
        if key in summary.server
    ]
    lines.append(_row("Paths", _counts(summary.server.get("paths", {}))))
    cached = summary.server.get("cached_tokens", 0)
    lines.append(_row("Prefix-cached prompt tokens", _share(cached, summary.prompt_tokens)))
    lines.append("=" * RULE)
    return "\n".join(lines)


def _totals(s: Summary) -> list[tuple[str, str]]:
    rows = [("Completed requests", str(s.completed)), ("Failed requests", str(s.failed))]
    if s.failures:
        rows.append(("Failures by status", _counts(s.failures)))
    rows += [
        ("Duration (s)", f"{s.duration_s:.2f}"),
        ("Prompt tokens (gateway count)", str(s.prompt_tokens)),
        ("Output tokens", str(s.output_tokens)),
    ]
    if s.prompt_len_mismatches:
        rows.append(("Prompts not of the target length", str(s.prompt_len_mismatches)))
    rows += [
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.1f}"),
    ]
    if s.goodput is not None:
        slo = ", ".join(f"{k}<={v:g}" for k, v in s.slo.items())
        rows.append((f"Goodput (req/s), {slo}", f"{s.goodput:.2f} ({s.slo_met}/{s.completed} met)"))
    return rows


def _row(name: str, value: str) -> str:
    return f"{name + ':':<40}{value:>24}" if len(value) <= 24 else f"{name + ':':<40}{value}"


def _stats_row(name: str, stats: Stats) -> str:
    cells = (stats.mean, stats.median, stats.p90, stats.p99)
    return f"{name:<10}" + "".join(f"{'-' if v is None else f'{v:.1f}':>12}" for v in cells)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def _share(part: int, whole: int) -> str:
    return f"{part} ({100 * part / whole:.1f}%)" if whole else str(part)


def record_dict(record: RequestRecord, origin: float) -> dict:
    """The record with times in seconds from `origin`, and its own latencies (ms)."""
    out = asdict(record)
    out["sent_at"] = record.sent_at - origin
    out["ended_at"] = record.ended_at - origin
    out["chunk_times"] = [t - origin for t in record.chunk_times]
    if record.ok:
        m = request_metrics(record)
        out.update(
            ttft_ms=m.ttft_ms,
            tpot_ms=m.tpot_ms,
            e2e_ms=m.e2e_ms,
            max_itl_ms=m.max_itl_ms,
            output_tokens=m.output_tokens,
        )
    return out


def results_dict(
    label: str, config: dict, records: Sequence[RequestRecord], summary: Summary
) -> dict:
    origin = min((r.sent_at for r in records), default=0.0)
    return {
        "label": label,
        "config": config,
        "summary": summary.to_dict(),
        "requests": [record_dict(r, origin) for r in records],
    }


def write_json(
    path: Path, label: str, config: dict, records: Sequence[RequestRecord], summary: Summary
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results_dict(label, config, records, summary), indent=1) + "\n")
    return path


def load_records(path: Path) -> list[RequestRecord]:
    """The records of a results file, ready for metrics.summarize."""
    names = {f.name for f in fields(RequestRecord)}
    return [
        RequestRecord(**{k: v for k, v in r.items() if k in names})
        for r in json.loads(Path(path).read_text())["requests"]
    ]
