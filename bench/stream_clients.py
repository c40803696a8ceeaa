"""The control-plane bench's clients: one streamed chat request over an OpenAI-compatible HTTP
front (Tandem's gateway or Dynamo's frontend, the same code for both) or over Tandem's gRPC
API, timed as a user sees it; and a run of N such requests at concurrency C.

TTFT: send -> the first response carrying content. ITL: the gap between consecutive responses
carrying content, as the client reads them (a response may carry several tokens: tokens are
counted from gRPC's token ids, and over HTTP from the usage chunk asked for with
stream_options.include_usage). Tandem's gRPC answer says its gateway's own TTFT too (from the
call's start in the gateway), reported beside the client's. As in ../shared/peers/dynamo/bench.py (whose
figures the issue quotes): a chat request, "Request i: tell me a short story about a robot.",
greedy, ignore_eos, 3 warm-up requests.
"""

import asyncio
import json
import statistics
import time

import aiohttp
import grpc

from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc


def prompt(index: int) -> str:
    return f"Request {index}: tell me a short story about a robot."


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


class Timed:
    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.times: list[float] = []
        self.gateway_ttft_ms: float | None = None  # what Tandem's gateway measured, when it says
        self.tokens = 0  # generated tokens received (a response may carry several)

    def content(self, tokens: int = 1) -> None:
        self.times.append(time.perf_counter())
        self.tokens += tokens


class HttpClient:
    """Streamed /v1/chat/completions; `fresh`: a new TCP connection per request; `source`: the
    address its connections come from (any of 127/8 on loopback: another client to the gateway)."""

    def __init__(self, base_url: str, model: str, fresh: bool, source: str = ""):
        self.url, self.model, self.fresh = f"{base_url}/v1/chat/completions", model, fresh
        self.source = source
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "HttpClient":
        connector = aiohttp.TCPConnector(
            limit=256, force_close=self.fresh, local_addr=(self.source, 0) if self.source else None
        )
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=300)
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def one(self, index: int, max_tokens: int) -> Timed:
        body = {
            "model": self.model,
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {
                "include_usage": True
            },  # the token count: an event may carry several
            "messages": [{"role": "user", "content": prompt(index)}],
        }
        timed = Timed()
        async with self.session.post(self.url, json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {await reply.text()}")
            buffer = b""
            async for data in reply.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    _read_event(event, timed)
        return timed


def _read_event(event: bytes, timed: Timed) -> None:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        body = json.loads(line[5:])
        choices = body.get("choices") or []
        if choices and choices[0].get("delta", {}).get("content"):
            timed.content(0)
        if (body.get("usage") or {}).get("completion_tokens"):
            timed.tokens = body["usage"]["completion_tokens"]


class GrpcClient:
    """Tandem's Generate over one grpc.aio channel (as a gRPC user keeps one)."""

    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.TandemStub(self.channel)

    async def __aenter__(self) -> "GrpcClient":
        await asyncio.wait_for(self.channel.channel_ready(), 30)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def one(self, index: int, max_tokens: int) -> Timed:
        request = pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content=prompt(index))],
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        )
        timed = Timed()
        async for response in self.stub.Generate(request, timeout=300):
            if response.text:
                timed.content(0)
            timed.tokens += len(response.token_ids)  # a response may hold text back (UTF-8)
            if response.finish_reason:
                timed.gateway_ttft_ms = response.timing.ttft_ms
        return timed


async def run(client, n: int, concurrency: int, max_tokens: int, warmup: int = 3) -> dict:
    """N requests at most `concurrency` at a time, after `warmup` alone; their figures (ms)."""
    for i in range(warmup):
        await client.one(-1 - i, max_tokens)
    gate, done = asyncio.Semaphore(concurrency), []

    async def one(i: int) -> None:
        async with gate:
            done.append(await client.one(i, max_tokens))

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - started
    ttft = [(t.times[0] - t.sent) * 1e3 for t in done if t.times]
    itl = [(b - a) * 1e3 for t in done for a, b in zip(t.times, t.times[1:])]
    chunks = sum(len(t.times) for t in done)
    tokens = sum(t.tokens for t in done)
    inside = [t.gateway_ttft_ms for t in done if t.gateway_ttft_ms is not None]
    return {
        "n": n,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "answered": len(ttft),
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "gateway_ttft_ms_p50": pct(inside, 50),
        "gateway_ttft_ms_p99": pct(inside, 99),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99),
        "content_chunks_per_request": statistics.mean(len(t.times) for t in done),
        "tokens_per_request": tokens / n,
        "chunks_per_s": chunks / wall,
        "tokens_per_s": tokens / wall,
        "req_per_s": n / wall,
    }
