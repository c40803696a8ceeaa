"""TandemServicer: the gRPC API. It checks a request and hands it to a RequestRelay, which places
it on the cluster and follows its token stream; ClusterStatus asks a scheduler."""

import asyncio
import collections
import concurrent.futures
import contextlib
import time

import grpc

from services.gateway.migration import new_attempt_id
from services.gateway.relay import RequestRelay
from services.gateway.responses import cluster_status_response, generate_response
from services.gateway.schedulers import SchedulerPool
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from services.gateway.validation import InvalidRequest, Limits, ValidRequest, validate
from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from shared.control.bus import BusError, MessageBus
from shared.control.liveness import Liveness
from shared.control.messages import GenerateTask, StatusReply, StatusRequest
from shared.control.subjects import Subjects


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


STATUS_PAGE = 128  # workers asked for per status request (the scheduler caps it too)


class TandemServicer(pb_grpc.TandemServicer):
    def __init__(
        self,
        settings: GatewaySettings,
        bus: MessageBus,
        streams: StreamRouter,
        tokenizer,
        limits: Limits,
        liveness: Liveness,
        schedulers: SchedulerPool | None = None,
    ):
        self.settings = settings
        self.schedulers = schedulers  # None: the schedulers' queue group only
        self.bus = bus
        self.streams = streams
        self.tokenizer = tokenizer
        self.limits = limits
        self.liveness = liveness
        self.subjects = Subjects(settings.cluster)
        # client address -> the streams it has open
        self._open_per_client: collections.Counter[str] = collections.Counter()
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
        valid = await self._validated(request, context)
        relay = RequestRelay(
            self.settings, self.bus, self.streams, self.liveness, context, self.schedulers
        )
        first_at = None  # when the first token came
        task = self._first_task(valid, request.priority, context, arrival)
        async with contextlib.aclosing(relay.follow(task)) as chunks:
            async for attempt, chunk in chunks:
                if first_at is None and chunk.token_ids:
                    first_at = time.time()
                yield generate_response(
                    valid.request_id, chunk, arrival, first_at, attempt.task.moves
                )

    async def _validated(self, request: pb.GenerateRequest, context) -> ValidRequest:
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenize, validate, request, self.tokenizer, self.limits
            )
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    def _first_task(
        self, valid: ValidRequest, priority: int, context, arrival: float
    ) -> GenerateTask:
        """The request's first attempt, under an attempt id of its own (see attempt.py)."""
        remaining = context.time_remaining()
        return GenerateTask(
            attempt_id=new_attempt_id(valid.request_id),
            prompt_token_ids=valid.prompt_token_ids,
            sampling=valid.sampling,
            reply_subject=self.streams.subject,
            arrival_time=arrival,
            deadline=arrival + remaining if remaining else 0.0,
            priority=priority,
        )

    async def ClusterStatus(
        self, request: pb.ClusterStatusRequest, context
    ) -> pb.ClusterStatusResponse:
        if isinstance(request, Undecodable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"not a ClusterStatusRequest: {request.error}"
            )
        pages, after = [], ""
        while not pages or (pages[-1].more and pages[-1].workers):
            try:
                ask = StatusRequest(after=after, limit=STATUS_PAGE)
                pages.append(await self.bus.request(self.subjects.status, ask, 2.0, StatusReply))
            except BusError:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler answered")
            after = pages[-1].workers[-1].worker_id if pages[-1].workers else after
        workers = [w for page in pages for w in page.workers]
        return cluster_status_response(pages[0], workers, self.bus.dropped)
