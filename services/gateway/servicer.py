"""TandemServicer: the gRPC API. Requests go to the scheduler over NATS; token chunks come back."""

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time

import grpc

from services.gateway.migration import FULL_MOVES, WorkerLost, client_id, new_attempt_id, resumed
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from services.gateway.validation import InvalidRequest, Limits, validate
from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from shared.control.bus import BadReply, BusError, MessageBus, NoResponders, RequestTimeout
from shared.control.liveness import Liveness
from shared.control.messages import (
    CancelRequest,
    GenerateTask,
    StatusReply,
    StatusRequest,
    SubmitReply,
    TokenChunk,
)
from shared.control.subjects import Subjects

log = logging.getLogger(__name__)

LOST_AFTER_RECONNECT_S = 3.0
FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}


def status_code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)


def client_address(peer: str) -> str:
    """The client's address without its port: "ipv4:10.0.0.7:5123" -> "ipv4:10.0.0.7"."""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


class Undecodable:
    """A request body that is not the message it should be (garbage, invalid UTF-8 in a string)."""

    def __init__(self, error: Exception):
        self.error = error


def _lenient(message_type):
    """A deserializer that never raises: grpc would answer INTERNAL; the method answers INVALID_ARGUMENT."""

    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception as err:  # DecodeError and friends, from protobuf's C core
            return Undecodable(err)

    return parse


def add_to_server(servicer: "TandemServicer", server) -> None:
    """Registers the Tandem API (as the generated add_TandemServicer_to_server, with lenient parsing)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "ClusterStatus": grpc.unary_unary_rpc_method_handler(
            servicer.ClusterStatus,
            request_deserializer=_lenient(pb.ClusterStatusRequest),
            response_serializer=pb.ClusterStatusResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tandem.v1.Tandem", handlers),)
    )


class TandemServicer(pb_grpc.TandemServicer):
    def __init__(
        self,
        settings: GatewaySettings,
        bus: MessageBus,
        streams: StreamRouter,
        tokenizer,
        limits: Limits,
        liveness: Liveness,
    ):
        self.settings = settings
        self.bus = bus
        self.streams = streams
        self.tokenizer = tokenizer
        self.limits = limits
        self.liveness = liveness
        self.subjects = Subjects(settings.cluster)
        self._open_per_client: collections.Counter[str] = (
            collections.Counter()
        )  # client address -> open streams
        # One thread: HF tokenizers are not safe to call from several threads at once.
        self._tokenize = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.time()
        if isinstance(request, Undecodable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"not a GenerateRequest: {request.error}"
            )
        client = client_address(context.peer())
        if self._open_per_client[client] >= self.settings.max_streams_per_client:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this client already has "
                f"{self.settings.max_streams_per_client} streams open, the limit",
            )
        self._open_per_client[client] += 1
        try:
            async with contextlib.aclosing(self._generate(request, context, arrival)) as responses:
                async for response in responses:  # closed on every exit: its cancel always runs now
                    yield response
        finally:
            self._open_per_client[client] -= 1
            if not self._open_per_client[client]:
                del self._open_per_client[client]

    async def _generate(self, request: pb.GenerateRequest, context, arrival: float):
        try:
            valid = await asyncio.get_running_loop().run_in_executor(
                self._tokenize, validate, request, self.tokenizer, self.limits
            )
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        # Inside the cluster each attempt has its own id: a client cannot cancel another's
        # stream by reusing its id, and a retry never collides with the attempt it replaces.
        remaining = context.time_remaining()
        task = GenerateTask(
            request_id=new_attempt_id(valid.request_id),
            prompt_token_ids=valid.prompt_token_ids,
            sampling=valid.sampling,
            reply_subject=self.streams.subject,
            arrival_time=arrival,
            deadline=arrival + remaining if remaining else 0.0,
            priority=request.priority,
        )
        chunks = self.streams.open(task.request_id)
        ended, sent, first_at, decode_worker, why = False, [], None, "", ""
        moves: collections.Counter[bool] = collections.Counter()  # full? -> times the request moved
        try:
            while not ended:
                try:
                    if not decode_worker:
                        decode_worker, task, chunks = await self._submit(task, chunks, context, why)
                        expected = 0
                    chunk = await self._next_chunk(chunks, expected, decode_worker, context)
                except WorkerLost as lost:  # move it: a new attempt goes on after the tokens sent
                    moves[lost.full] += 1
                    task, chunks = await self._move(
                        task, lost, valid.prompt_token_ids, sent, moves[lost.full], context
                    )
                    decode_worker, why = "", f"{lost}, and "
                    continue
                expected += 1
                sent.extend(chunk.token_ids)
                if first_at is None and chunk.token_ids:
                    first_at = time.time()
                ended = bool(chunk.finish_reason)
                yield self._response(valid.request_id, chunk, arrival, first_at, task.moves)
        finally:
            self.streams.close(task.request_id)
            if not ended:  # client gone, deadline passed or a failure: free what the workers hold
                await self._cancel(task.request_id)

    async def _move(
        self,
        task: GenerateTask,
        lost: WorkerLost,
        prompt: list[int],
        sent: list[int],
        times: int,
        context,
    ) -> tuple[GenerateTask, asyncio.Queue]:
        """Ends the failed attempt and opens the next one (to be submitted), the `times`th for
        this reason; past the limit, the client gets the failure's status."""
        limit = FULL_MOVES if lost.full else self.settings.max_migrations
        if times > limit:
            await context.abort(
                status_code(lost.code),
                f"{lost}; the request was already moved {limit} time(s), the limit",
            )
        log.warning("%s: %s; moving it after %d token(s)", task.request_id, lost, len(sent))
        await self._end_attempt(task.request_id)
        task = resumed(task, prompt, sent, lost.avoid)
        return task, self.streams.open(task.request_id)

    async def _end_attempt(self, attempt_id: str) -> None:
        await self._cancel(attempt_id)
        self.streams.close(attempt_id)

    async def _cancel(self, request_id: str) -> None:
        try:
            await self.bus.publish(self.subjects.cancel, CancelRequest(request_id, "cancelled"))
        except Exception as err:  # NATS down: the workers' own timeouts free the request
            log.warning("could not broadcast the cancel of %s: %s", request_id, err)

    async def _submit(
        self, task: GenerateTask, chunks: asyncio.Queue, context, why: str = ""
    ) -> tuple[str, GenerateTask, asyncio.Queue]:
        """Places the request; returns the decode worker that holds it, and the attempt placed. A
        scheduler that does not answer may have died holding it, and one that is shutting down
        hands it back: either way the request goes once more to the schedulers' queue group
        (another replica takes it), under a new attempt id, after whatever the first attempt
        placed is cancelled. `why` starts the message of a refusal (a request being moved)."""
        for attempt in range(2):
            try:
                reply = await self.bus.request(
                    self.subjects.submit, task, self.settings.submit_timeout_s, SubmitReply
                )
            except NoResponders:
                await context.abort(grpc.StatusCode.UNAVAILABLE, why + "no scheduler is running")
            except BadReply as err:
                await context.abort(grpc.StatusCode.UNAVAILABLE, why + str(err))
            except RequestTimeout:
                if attempt:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        why + "the scheduler did not place the request in time",
                    )
                reply = None
            if reply is not None and not (reply.resubmit and not attempt):
                break
            log.warning("no scheduler placed %s; submitting it again", task.request_id)
            await self._end_attempt(task.request_id)
            task.request_id = new_attempt_id(client_id(task.request_id))
            chunks = self.streams.open(task.request_id)
        if not reply.ok and reply.failed_worker:  # a worker failed it, not the request
            raise WorkerLost(reply.message, reply.failed_worker)
        if not reply.ok:
            message = why + reply.message
            if reply.retry_after_ms:
                context.set_trailing_metadata((("retry-after-ms", str(reply.retry_after_ms)),))
                message += f" (retry after {reply.retry_after_ms / 1000:.1f}s)"
            await context.abort(status_code(reply.code), message)
        log.info(
            "request %s: %d prompt tokens -> prefill %s, decode %s",
            task.request_id,
            len(task.prompt_token_ids),
            reply.prefill_worker or "(local)",
            reply.decode_worker,
        )
        return reply.decode_worker, task, chunks

    async def _next_chunk(
        self, chunks: asyncio.Queue, expected: int, decode_worker: str, context
    ) -> TokenChunk:
        idle_since, reconnects = time.monotonic(), self.bus.reconnects
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.get(), 0.5)
                break
            except asyncio.TimeoutError:
                if await self.liveness.lost(decode_worker):
                    raise WorkerLost(
                        f"decode worker {decode_worker} stopped responding", decode_worker
                    ) from None
                if (
                    self.bus.reconnects != reconnects
                    and time.monotonic() - idle_since > LOST_AFTER_RECONNECT_S
                ):
                    # NATS reconnected meanwhile: a chunk (the last one, even) may be lost, with
                    # nothing after it to show the gap. Go on from the tokens the client has.
                    raise WorkerLost(
                        f"no tokens from {decode_worker} since NATS reconnected", ""
                    ) from None
                if time.monotonic() - idle_since > self.settings.stream_idle_timeout_s:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"the worker sent nothing for {self.settings.stream_idle_timeout_s:.0f}s",
                    )
        if chunk.code and chunk.retry:
            raise WorkerLost(chunk.message, chunk.failed_worker, chunk.code)
        if chunk.code:
            await context.abort(status_code(chunk.code), chunk.message)
        if chunk.index != expected:  # NATS delivers at most once: lost in a reconnect, say. Not the
            # worker's fault: the request goes on from the tokens the client has (anywhere).
            raise WorkerLost(f"the token stream from {decode_worker} lost chunk {expected}", "")
        return chunk

    def _response(
        self,
        request_id: str,
        chunk: TokenChunk,
        arrival: float,
        first_at: float | None,
        migrations: int,
    ) -> pb.GenerateResponse:
        response = pb.GenerateResponse(
            request_id=request_id, text=chunk.text, token_ids=chunk.token_ids
        )
        if chunk.finish_reason:
            now = time.time()
            response.finish_reason = FINISH.get(chunk.finish_reason, pb.FINISH_REASON_STOP)
            response.usage.prompt_tokens = chunk.prompt_tokens
            response.usage.completion_tokens = chunk.completion_tokens
            t = chunk.timing
            if t is not None:
                response.timing.CopyFrom(
                    pb.Timing(
                        queue_ms=t.queue_ms,
                        prefill_ms=t.prefill_ms,
                        kv_transfer_ms=t.kv_transfer_ms,
                        kv_exposed_ms=t.kv_exposed_ms,
                        prefill_worker=t.prefill_worker,
                        decode_worker=t.decode_worker,
                        path=t.path,
                        cached_tokens=t.cached_tokens,
                    )
                )
            response.timing.migrations = migrations
            response.timing.ttft_ms = ((first_at or now) - arrival) * 1000
            response.timing.total_ms = (now - arrival) * 1000
        return response

    async def ClusterStatus(
        self, request: pb.ClusterStatusRequest, context
    ) -> pb.ClusterStatusResponse:
        if isinstance(request, Undecodable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"not a ClusterStatusRequest: {request.error}"
            )
        try:
            reply = await self.bus.request(self.subjects.status, StatusRequest(), 2.0, StatusReply)
        except BusError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler answered")
        return pb.ClusterStatusResponse(
            mode=reply.mode,
            workers=[
                pb.WorkerStatus(
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
                    kv_transport=w.kv_transport,
                    zone=w.zone,
                    messages_dropped=w.messages_dropped,
                    kernels=w.kernels,
                )
                for w in reply.workers
            ],
            scheduler_messages_dropped=reply.messages_dropped,
            gateway_messages_dropped=self.bus.dropped,
        )
