"""TokenStreams: the token chunks a decode worker sends the gateway, one stream per request (one
per choice of a request of n > 1), every chunk kept for replay (StreamLog)."""

import dataclasses
from collections.abc import Callable

from services.decode.request import DecodeRequest
from services.decode.stream_log import StreamLog
from shared.control.bus import MessageBus
from shared.control.choices import choice_ids
from shared.control.failure import Code, failed, worker_failed
from shared.control.messages import GenerateTask, StreamReplay, TaskAck, Timing, TokenChunk
from shared.engine.sequence import SeqStatus, StepOutput
from shared.telemetry import tracing
from shared.worker.metrics import WorkerMetrics

MAX_ENDED_CHUNKS = 100_000  # chunks of ended streams kept for replay, at most


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

    async def publish(self, req: DecodeRequest, out: StepOutput) -> None:
        seq, extra = req.seq, {}
        req.first_token_at = req.first_token_at or tracing.now()
        if out.finish_reason:
            extra = dict(
                prompt_tokens=seq.prompt_len - seq.resume_tokens,
                completion_tokens=seq.position,
                timing=self._timing(req),
            )
        chunk = TokenChunk(
            req.attempt_id,
            req.next_chunk_index(),
            token_ids=out.token_ids,
            text=out.text,
            logprobs=out.logprobs,
            finish_reason=out.finish_reason,
            **extra,
        )
        await self.send(req, chunk)

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
        """Sends a chunk, kept for replay. NATS down or stalled: it is held (the gateway asks for
        it again); too many held in a row, and the request fails (the gateway moves it on)."""
        subject = req.seq.task.reply_subject
        self.log.record(subject, chunk)
        if await self.bus.try_publish(subject, chunk):
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
            for chunk in chunks:
                if not await self.bus.try_publish(subject, chunk):
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
        if seq.status is SeqStatus.FINISHED and req.failure is None and not req.cancel_reason:
            self.log.end(req.attempt_id)
            return True
        if req.cancel_reason:
            chunk = TokenChunk(
                req.attempt_id,
                req.next_chunk_index(),
                finish_reason="cancelled",
                prompt_tokens=seq.prompt_len - seq.resume_tokens,
                completion_tokens=seq.position,
            )
        else:
            chunk = TokenChunk(req.attempt_id, req.next_chunk_index(), failure=req.failure)
            if req.failure.movable:
                self.metrics.migrated("out")
        if seq.sampling.n == 1:
            await self.send(req, chunk)
            self.log.end(req.attempt_id)
            return False
        for attempt_id in choice_ids(seq.task):  # a group never forked: each choice ends so
            each = dataclasses.replace(chunk, attempt_id=attempt_id, index=0)
            self.log.record(seq.task.reply_subject, each)
            await self.bus.try_publish(seq.task.reply_subject, each)
            self.log.end(attempt_id)
        return False
