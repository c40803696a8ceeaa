"""One benchmark request over grpc.aio, recorded as the client saw it.

Times are `time.perf_counter()` seconds: one monotonic clock for every record of a process, so the
records of workloads run side by side compare directly.
"""

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from shared.benchmark.workload import RequestSpec

OK = "OK"
INCOMPLETE = "INCOMPLETE"  # not a gRPC code: the stream ended OK but never said it finished


class GatewayUnreachable(ConnectionError):
    pass


@dataclass
class RequestRecord:
    """What happened to one request. `chunk_times[i]` is when the i-th response that carried
    tokens arrived and `chunk_tokens[i]` how many it carried."""

    index: int
    request_id: str
    tag: str
    prompt_len: int  # the target; `prompt_tokens` is what the gateway counted
    output_len: int  # max_tokens asked for
    priority: int
    prefix: int | None
    sent_at: float
    ended_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    status: str = OK  # a grpc.StatusCode name
    error: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timing: dict = field(default_factory=dict)  # the gateway's Timing, field by field
    retry_after_ms: int | None = None  # RESOURCE_EXHAUSTED's hint, when given

    @property
    def ok(self) -> bool:
        return self.status == OK

    @classmethod
    def sent(cls, spec: RequestSpec) -> "RequestRecord":
        """The record of `spec`, sent now."""
        return cls(
            spec.index,
            spec.request_id,
            spec.tag,
            spec.prompt_len,
            spec.output_len,
            spec.priority,
            spec.prefix,
            sent_at=time.perf_counter(),
        )


def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address)


async def wait_ready(channel: grpc.aio.Channel, address: str, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except asyncio.TimeoutError:
        raise GatewayUnreachable(
            f"no gateway answered at {address} within {timeout_s:.0f}s "
            "(start one with `tandem up`, or pass --address)"
        ) from None


async def probe(address: str, timeout_s: float = 10.0) -> dict:
    """Raises GatewayUnreachable unless a gateway answers; returns its cluster (mode, workers)
    for the results file, or {} when it cannot say."""
    async with open_channel(address) as channel:
        await wait_ready(channel, address, timeout_s)
        try:
            status = await pb_grpc.TandemStub(channel).ClusterStatus(
                pb.ClusterStatusRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return {}
    return {
        "mode": status.mode,
        "workers": [{"id": w.id, "role": w.role, "host": w.host} for w in status.workers],
    }


def request_of(spec: RequestSpec) -> pb.GenerateRequest:
    # Greedy with ignore_eos: every request generates exactly output_len tokens.
    sampling = pb.SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(
        request_id=spec.request_id, prompt=spec.prompt, sampling=sampling, priority=spec.priority
    )


async def send(
    stub: pb_grpc.TandemStub, spec: RequestSpec, timeout_s: float | None = None
) -> RequestRecord:
    """Sends one request and records its stream; a failure is recorded, never raised
    (cancellation aside)."""
    record = RequestRecord.sent(spec)
    call = stub.Generate(request_of(spec), timeout=timeout_s)
    try:
        async for response in call:
            _observe(record, response, time.perf_counter())
    except grpc.aio.AioRpcError as err:
        _failed(record, err)
    except asyncio.CancelledError:
        call.cancel()
        raise
    record.ended_at = time.perf_counter()
    if record.ok and not record.finish_reason:
        record.status, record.error = INCOMPLETE, "the stream ended without a finish reason"
    return record


def _observe(record: RequestRecord, response: pb.GenerateResponse, now: float) -> None:
    if response.token_ids:
        record.chunk_times.append(now)
        record.chunk_tokens.append(len(response.token_ids))
    if response.finish_reason:
        record.finish_reason = (
            pb.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
        )
        _observe_finish(record, response.usage.prompt_tokens, response.usage.completion_tokens)
        record.timing = {
            f.name: getattr(response.timing, f.name) for f in response.timing.DESCRIPTOR.fields
        }


def _observe_finish(record: RequestRecord, prompt_tokens: int, completion_tokens: int) -> None:
    record.prompt_tokens, record.completion_tokens = prompt_tokens, completion_tokens


def _failed(record: RequestRecord, err: grpc.aio.AioRpcError) -> None:
    record.status = err.code().name
    record.error = err.details() or ""
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after-ms":
            record.retry_after_ms = _int_or_none(value)


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
