"""The API's answers, built from the cluster's messages: a GenerateResponse from a TokenChunk, a
ClusterStatusResponse from the scheduler's StatusReply."""

import time

from shared.api import tandem_pb2 as pb
from shared.control.finish import FinishReason
from shared.control.messages import StatusReply, TokenChunk, TokenLogprob, WorkerStatus

FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


def generate_response(
    request_id: str,
    chunk: TokenChunk,
    arrival: float,
    first_at: float | None,
    migrations: int,
    index: int = 0,
    prompt: list[int] | None = None,
) -> pb.GenerateResponse:
    """One response of the stream of choice `index`; its last (finish_reason set) with usage and
    timing too. `first_at`: when its first token came (None: none yet); `migrations`: times it
    moved; `prompt`: the prompt's ids (its logprobs name them)."""
    response = pb.GenerateResponse(
        request_id=request_id, index=index, text=chunk.text, token_ids=chunk.token_ids
    )
    if not (chunk.logprobs or chunk.finish_reason or chunk.prompt_logprobs is not None):
        return response  # most of a stream's (a field set empty costs as much as the others)
    if chunk.logprobs:
        response.logprobs.extend(
            token_logprob(t, lp) for t, lp in zip(chunk.token_ids, chunk.logprobs)
        )
    scores = chunk.prompt_logprobs
    if scores is not None and prompt is not None:
        response.prompt_token_ids.extend(prompt)
        response.prompt_logprobs.extend(
            token_logprob(token, scores.row(i))
            for i, token in enumerate(prompt[1 : len(scores) + 1])
        )
    if chunk.finish_reason:
        now = time.time()
        response.finish_reason = FINISH[chunk.finish_reason]
        response.usage.prompt_tokens = chunk.prompt_tokens
        response.usage.completion_tokens = chunk.completion_tokens
        if chunk.timing is not None:
            response.timing.CopyFrom(worker_timing(chunk))
        response.timing.migrations = migrations
        response.timing.ttft_ms = ((first_at or now) - arrival) * 1000
        response.timing.total_ms = (now - arrival) * 1000
    return response


def token_logprob(token_id: int, lp: TokenLogprob) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=i, logprob=v) for i, v in zip(lp.top_ids, lp.top_logprobs)]
    return pb.TokenLogprob(token_id=token_id, logprob=lp.logprob, top=top)


def worker_timing(chunk: TokenChunk) -> pb.Timing:
    """The timing the workers measured (the gateway adds its own)."""
    t = chunk.timing
    return pb.Timing(
        queue_ms=t.queue_ms,
        prefill_ms=t.prefill_ms,
        kv_transfer_ms=t.kv_transfer_ms,
        kv_exposed_ms=t.kv_exposed_ms,
        prefill_worker=t.prefill_worker,
        decode_worker=t.decode_worker,
        path=t.path,
        cached_tokens=t.cached_tokens,
    )


def cluster_status_response(
    reply: StatusReply, workers: list[WorkerStatus], gateway_dropped: int
) -> pb.ClusterStatusResponse:
    """`reply`: the scheduler's first page; `workers`: every page's."""
    return pb.ClusterStatusResponse(
        mode=reply.mode,
        workers=[worker_status(w) for w in workers],
        scheduler_messages_dropped=reply.messages_dropped,
        gateway_messages_dropped=gateway_dropped,
    )


def worker_status(w: WorkerStatus) -> pb.WorkerStatus:
    return pb.WorkerStatus(
        id=w.worker_id,
        role=w.role,
        host=w.host,
        pid=w.pid,
        running=w.running,
        queued=w.queued,
        kv_blocks_used=w.kv_blocks_used,
        kv_blocks_total=w.kv_blocks_total,
        requests_served=w.requests_served,
        kv_bytes_sent=w.kv_bytes_sent,
        kv_bytes_received=w.kv_bytes_received,
        kv_transfers_failed=w.kv_transfers_failed,
        kv_blocks_leaked=w.kv_blocks_leaked,
        kv_blocks_quarantined=w.kv_blocks_quarantined,
        kv_transport=w.kv_transport,
        zone=w.zone,
        messages_dropped=w.messages_dropped,
        kernels=w.kernels,
        model=w.model,
        tp=w.tp,
        tp_ranks=w.tp_ranks,
    )
