"""Latency and throughput of a set of request records.

Per request (client clock, milliseconds):
  TTFT  send -> the first response that carries tokens.
  E2E   send -> the end of the stream.
  TPOT  (E2E - TTFT) / (output tokens - 1); none for a single-token answer.
  ITL   the gaps between successive token-bearing responses. A response carrying n tokens after
        a gap g counts as n inter-token latencies of g/n: the gap is counted once, spread evenly
        over the tokens it delivered, so a server that batches its stream is neither credited
        with n-1 free tokens nor charged n times. The tokens of the first response come with
        TTFT and have no ITL, so a request's ITLs add up to (last token - first token).
Over records: latencies of completed requests only, as mean, median, p90 and p99 (numpy's
linear interpolation); ITL percentiles pool every token of every completed request. Throughputs
divide by the benchmark's duration (by default first send -> last end of the records given).
Goodput counts completed requests that met the SLO (shared.benchmark.slo) per second.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from shared.benchmark.client import RequestRecord
from shared.benchmark.slo import SLO

PERCENTILES = (50, 90, 99)
SERVER_TIMINGS = (
    "queue_ms",
    "prefill_ms",
    "kv_transfer_ms",
    "kv_exposed_ms",
    "ttft_ms",
    "total_ms",
)


@dataclass
class RequestMetrics:
    ttft_ms: float | None
    e2e_ms: float
    tpot_ms: float | None
    itl_ms: list[float]
    output_tokens: int
    max_itl_ms: float | None = (
        None  # the longest wait for new tokens: a whole gap, not split over its tokens
    )


def itl_ms(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Per-token inter-token latencies (ms): each later response's gap, split over its tokens."""
    out = []
    for before, now, tokens in zip(chunk_times, chunk_times[1:], chunk_tokens[1:]):
        out += [(now - before) * 1000 / tokens] * tokens
    return out


def request_metrics(record: RequestRecord) -> RequestMetrics:
    # tokens as the responses carried them, or as the usage says where a response's count is not
    # known (an OpenAI stream event may carry several tokens: it is counted as one)
    output = max(sum(record.chunk_tokens), record.completion_tokens)
    ttft = (record.chunk_times[0] - record.sent_at) * 1000 if record.chunk_times else None
    e2e = (record.ended_at - record.sent_at) * 1000
    tpot = (e2e - ttft) / (output - 1) if ttft is not None and output > 1 else None
    gaps = [(b - a) * 1000 for a, b in zip(record.chunk_times, record.chunk_times[1:])]
    return RequestMetrics(
        ttft,
        e2e,
        tpot,
        itl_ms(record.chunk_times, record.chunk_tokens),
        output,
        max(gaps) if gaps else None,
    )


@dataclass
class Stats:
    count: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> "Stats":
        if not len(values):
            return cls(0, None, None, None, None)
        p50, p90, p99 = (float(v) for v in np.percentile(values, PERCENTILES))
        return cls(len(values), float(np.mean(values)), p50, p90, p99)


@dataclass
class Summary:
    requests: int
    completed: int
    failed: int
    failures: dict[str, int]  # status code -> count
    finish_reasons: dict[str, int]
    duration_s: float
    prompt_tokens: int  # as the gateway counted them (usage), completed requests
    output_tokens: int  # as received, completed requests
    prompt_len_mismatches: int  # completed requests whose usage.prompt_tokens != the target
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    slo: dict[str, float] = field(default_factory=dict)
    slo_met: int | None = None  # completed requests that met every objective; None without an SLO
    goodput: float | None = None  # slo_met / s
    server: dict = field(default_factory=dict)  # the gateway's own timings and paths

    def to_dict(self) -> dict:
        return asdict(self)


def duration_of(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    return max(r.ended_at for r in records) - min(r.sent_at for r in records)


def summarize(
    records: Sequence[RequestRecord], slo: SLO | None = None, duration_s: float | None = None
) -> Summary:
    """The summary of `records` (any subset of a run: one class, one priority)."""
    done = [r for r in records if r.ok]
    per = [request_metrics(r) for r in done]
    duration = duration_of(records) if duration_s is None else duration_s
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(m.output_tokens for m in per)
    slo_met = (
        sum(slo.met(m.ttft_ms, m.tpot_ms, m.max_itl_ms, m.e2e_ms) for m in per)
        if slo and slo.given()
        else None
    )
    return Summary(
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        failures=dict(Counter(r.status for r in records if not r.ok)),
        finish_reasons=dict(Counter(r.finish_reason for r in done)),
        duration_s=duration,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        prompt_len_mismatches=sum(r.prompt_tokens != r.prompt_len for r in done),
        request_throughput=rate(len(done)),
        output_throughput=rate(output_tokens),
        total_token_throughput=rate(prompt_tokens + output_tokens),
        ttft_ms=Stats.of([m.ttft_ms for m in per if m.ttft_ms is not None]),
        tpot_ms=Stats.of([m.tpot_ms for m in per if m.tpot_ms is not None]),
        itl_ms=Stats.of([v for m in per for v in m.itl_ms]),
        e2e_ms=Stats.of([m.e2e_ms for m in per]),
        slo=slo.given() if slo else {},
        slo_met=slo_met,
        goodput=None if slo_met is None else rate(slo_met),
        server=server_summary(done),
    )


def server_summary(done: Sequence[RequestRecord]) -> dict:
    """The gateway's Timing over completed requests: stats per phase, paths, prefix-cache hits."""
    timed = [r.timing for r in done if r.timing]
    out = {name: asdict(Stats.of([t[name] for t in timed if name in t])) for name in SERVER_TIMINGS}
    out["paths"] = dict(Counter(t.get("path") or "unknown" for t in timed))
    out["cached_tokens"] = sum(t.get("cached_tokens", 0) for t in timed)
    return out
