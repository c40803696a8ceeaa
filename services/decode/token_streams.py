"""TokenStreams: the token chunks a decode worker sends the gateway, one stream per request (one
per choice of a request of n > 1), every chunk kept for replay (StreamLog)."""

import dataclasses
from collections.abc import Callable

from services.decode.request import DecodeRequest
from services.decode.stream_log import StreamLog
from shared.control.bus import MessageBus
from shared.control.choices import choice_ids
from shared.control.failure import Code, failed, worker_failed
from shared.control.finish import FinishReason
from shared.control.messages import (
    GenerateTask,
    StreamReplay,
    TaskAck,
    Timing,
    TokenBatch,
    TokenChunk,
)
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import StepOutput
from shared.telemetry import tracing
from shared.worker.metrics import WorkerMetrics

# why a finished sequence finished, as the client is told it
FINISH = {
    SeqStatus.FINISHED_STOPPED: FinishReason.STOP,
    SeqStatus.FINISHED_LENGTH: FinishReason.LENGTH,
}
MAX_ENDED_CHUNKS = 100_000  # chunks of ended streams kept for replay, at most
# A TokenBatch is split before its chunks' estimated size passes this (the wire's cap is 1000 KiB).
BATCH_BYTES = 256 * 1024


class TokenStreams:
    def __init__(
        self,
        bus: MessageBus,
        worker_id: str,
        retain_s: float,
        max_held_chunks: int,
        wake: Callable[[], None],
        metrics: WorkerMetrics,
    ):
        self.bus, self.worker_id, self.wake, self.metrics = bus, worker_id, wake, metrics
        self.max_held_chunks = max_held_chunks
        self.log = StreamLog(retain_s, MAX_ENDED_CHUNKS)

    def open(self, task: GenerateTask) -> None:
        """The request's streams are known from now on (each choice's, before it is forked)."""
        for attempt_id in choice_ids(task):
            self.log.open(attempt_id, task.reply_subject)

    def forget(self, task: GenerateTask) -> None:
        for attempt_id in choice_ids(task):
            self.log.end(attempt_id)

    async def publish_step(self, produced: list[tuple[DecodeRequest, StepOutput]]) -> None:
        """Sends what one step produced: the chunks bound for each gateway as one TokenBatch
        (split where it would pass BATCH_BYTES), each chunk kept for replay."""
        by_subject: dict[str, list[tuple[DecodeRequest, TokenChunk]]] = {}
        for req, out in produced:
            subject = req.task.reply_subject
            by_subject.setdefault(subject, []).append((req, self._chunk(req, out)))
        for subject, pairs in by_subject.items():
            for part in _parts(pairs):
                await self._send_batch(subject, part)

    def _chunk(self, req: DecodeRequest, out: StepOutput) -> TokenChunk:
        seq, extra = req.seq, {}
        req.first_token_at = req.first_token_at or tracing.now()
        if out.finished is not None:
            extra = dict(
                prompt_tokens=seq.prompt_len - seq.resume_tokens,
                completion_tokens=seq.position,
                timing=self._timing(req),
            )
        return TokenChunk(
            req.attempt_id,
            req.next_chunk_index(),
            token_ids=out.token_ids,
            text=out.text,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            finish_reason=FINISH.get(out.finished),
            **extra,
        )

    async def _send_batch(self, subject: str, pairs: list[tuple[DecodeRequest, TokenChunk]]):
        for _, chunk in pairs:
            self.log.record(subject, chunk)
        message = pairs[0][1] if len(pairs) == 1 else TokenBatch([c for _, c in pairs])
        sent = await self.bus.try_publish(subject, message)
        for req, _ in pairs:
            self._sent(req, sent)

    def _timing(self, req: DecodeRequest) -> Timing:
        seq, local = req.seq, req.prefill_worker == self.worker_id
        return Timing(
            queue_ms=seq.queue_ms,
            prefill_ms=seq.prefill_ms,
            kv_transfer_ms=seq.kv_transfer_ms,
            kv_exposed_ms=seq.kv_exposed_ms,
            prefill_worker=req.prefill_worker,
            decode_worker=self.worker_id,
            path="local" if local else "disaggregated",
            cached_tokens=seq.cached_tokens,
        )

    async def send(self, req: DecodeRequest, chunk: TokenChunk) -> None:
        """Sends one chunk on its own, kept for replay."""
        subject = req.task.reply_subject
        self.log.record(subject, chunk)
        self._sent(req, await self.bus.try_publish(subject, chunk))

    def _sent(self, req: DecodeRequest, sent: bool) -> None:
        """NATS down or stalled: the chunk is held (the gateway asks for it again); too many
        held in a row, and the request fails (the gateway moves it on)."""
        if sent:
            req.held = 0
            return
        req.held += 1
        if req.held > self.max_held_chunks and not req.ended:
            message = (
                f"decode worker {self.worker_id} could not send its tokens for {req.held} steps"
            )
            req.fail(worker_failed("", message))
            self.wake()

    async def on_replay(self, message: StreamReplay, respond) -> None:
        """Sends a stream's chunks again from the one the gateway expects."""
        kept = self.log.since(message.attempt_id, message.from_index)
        if kept is None:
            me = self.worker_id
            ack = TaskAck(
                failed(Code.UNAVAILABLE, f"decode worker {me} no longer has the stream", me)
            )
        else:
            subject, chunks = kept
            for part in _parts([(None, chunk) for chunk in chunks]):
                batch = TokenBatch([chunk for _, chunk in part])
                if not await self.bus.try_publish(subject, batch):
                    break  # backed up again: the gateway asks once more
            ack = TaskAck()
        if respond is not None:
            await respond(ack)

    async def end(self, req: DecodeRequest) -> bool:
        """Tells the gateway how the request ended (its blocks are free), on every path: True
        when it finished. Choices never forked (it ended before its first token) end alike."""
        seq = req.seq
        if req.first_token_at:
            tracing.record("decode.decode", req.trace, req.first_token_at, tracing.now())
        if not req.aborted:
            self.log.end(req.attempt_id)
            return True
        if req.cancel_reason:
            chunk = TokenChunk(
                req.attempt_id,
                req.next_chunk_index(),
                finish_reason=FinishReason.CANCELLED,
                prompt_tokens=seq.prompt_len - seq.resume_tokens,
                completion_tokens=seq.position,
            )
        else:
            chunk = TokenChunk(req.attempt_id, req.next_chunk_index(), failure=req.failure)
            if req.failure.movable:
                self.metrics.migrated("out")
        if req.task.sampling.n == 1:
            await self.send(req, chunk)
            self.log.end(req.attempt_id)
            return False
        for attempt_id in choice_ids(req.task):  # a group never forked: each choice ends so
            each = dataclasses.replace(chunk, attempt_id=attempt_id, index=0)
            self.log.record(req.task.reply_subject, each)
            await self.bus.try_publish(req.task.reply_subject, each)
            self.log.end(attempt_id)
        return False


def _size(chunk: TokenChunk) -> int:
    """An upper bound of a chunk's encoded size: its field names and Timing (512), text in UTF-8,
    each logprob's map with its top-k (ids and float64s), its prompt's logprobs' columns."""
    plain = 512 + 4 * len(chunk.text) + 9 * len(chunk.token_ids)
    if not chunk.logprobs and chunk.prompt_logprobs is None:
        return plain  # most chunks: no generator made to sum nothing
    per_logprob = sum(64 + 14 * len(lp.top_ids) for lp in chunk.logprobs)
    prompt = chunk.prompt_logprobs
    of_prompt = 64 + 9 * len(prompt) + 14 * len(prompt.top_ids) if prompt else 0
    return plain + per_logprob + of_prompt


def _parts(pairs: list) -> list[list]:
    """(request, chunk) pairs cut into runs whose chunks fit BATCH_BYTES together."""
    parts, size = [[]], 0
    for pair in pairs:
        grows = _size(pair[1])
        if parts[-1] and size + grows > BATCH_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(pair)
        size += grows
    return parts
