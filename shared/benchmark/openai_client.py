"""One benchmark request over the gateway's OpenAI-compatible HTTP API (/v1/completions,
streamed), recorded as the gRPC client records it (shared.benchmark.client), so both APIs'
figures compare directly. aiohttp, one session for the whole run."""

import asyncio
import json
import time

import aiohttp

from shared.benchmark.client import INCOMPLETE, RequestRecord, _observe_finish
from shared.benchmark.workload import RequestSpec

STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND"}
STATUS |= {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def body_of(spec: RequestSpec, model: str) -> dict:
    """Greedy with ignore_eos, as the gRPC client asks: exactly output_len tokens."""
    return {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "priority": spec.priority,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def model_of(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as reply:
        reply.raise_for_status()
        return (await reply.json())["data"][0]["id"]


async def send_openai(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    spec: RequestSpec,
    timeout_s: float | None = None,
) -> RequestRecord:
    """Sends one request and records its event stream (each event: one gateway response, counted
    as one token: it may carry several, joined at the gateway, so the request's output is its
    usage's count and its ITL is per event); a failure is recorded, never raised (cancellation
    aside)."""
    record = RequestRecord.sent(spec)
    headers = {"X-Request-Id": spec.request_id}
    if timeout_s:
        headers["X-Request-Timeout"] = str(timeout_s)
    try:
        async with session.post(
            f"{base_url}/v1/completions", json=body_of(spec, model), headers=headers
        ) as reply:
            if reply.status != 200:
                _failed(record, reply.status, await reply.text())
            else:
                await _read_events(record, reply)
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        record.status, record.error = "UNAVAILABLE", str(err)
    record.ended_at = time.perf_counter()
    if record.ok and not record.finish_reason:
        record.status, record.error = INCOMPLETE, "the stream ended without a finish reason"
    return record


async def _read_events(record: RequestRecord, reply: aiohttp.ClientResponse) -> None:
    async for line in reply.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            record.status = event["error"].get("code", "unknown").upper()
            record.error = event["error"].get("message", "")
            return
        _observe(record, event, time.perf_counter())


def _observe(record: RequestRecord, event: dict, now: float) -> None:
    for choice in event.get("choices", ()):
        record.chunk_times.append(now)
        record.chunk_tokens.append(1)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
            record.timing = event.get("timing", {})
    usage = event.get("usage")
    if usage:
        _observe_finish(record, usage["prompt_tokens"], usage["completion_tokens"])


def _failed(record: RequestRecord, status: int, body: str) -> None:
    record.status = STATUS.get(status, f"HTTP_{status}")
    try:
        record.error = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        record.error = body[:200]
