"""The gRPC API: TandemServicer and its methods on a grpc server.

TandemServicer checks a request and hands it to a RequestRelay, which places it on the cluster
and follows its token stream; ClusterStatus asks a scheduler. add_to_server registers the methods
as the generated add_TandemServicer_to_server does, except that a request that does not parse
reaches its method as Undecodable (answered INVALID_ARGUMENT) instead of failing in grpc's
deserializer (answered INTERNAL)."""

import contextlib
import time

import grpc
from opentelemetry import trace

from services.gateway.clients import (
    RETRY_AFTER_MS,
    Client,
    ClientKeys,
    ClientPolicy,
    Unauthenticated,
    cert_subject,
)
from services.gateway.constraints import Grammars
from services.gateway.fair_tokenizer import FairTokenizer
from services.gateway.merge import merged
from services.gateway.metrics import GatewayMetrics, RecordingContext
from services.gateway.migration import new_attempt_id
from services.gateway.prompt_tokenizer import PromptTokenizer
from services.gateway.relay import RequestRelay
from services.gateway.responses import cluster_status_response, generate_response
from services.gateway.schedulers import SchedulerPool
from services.gateway.seats import Refused, Seat, Seats, SeatState
from services.gateway.settings import GatewaySettings
from services.gateway.status_asks import ask_wait, status_pages
from services.gateway.streams import StreamRouter
from services.gateway.tool_results import with_tool_calls
from services.gateway.validation import InvalidRequest, Limits, ValidRequest, light, validate
from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from shared.control.bus import BusError, MessageBus, NoResponders
from shared.control.choices import choice_task
from shared.control.liveness import Liveness
from shared.control.messages import GenerateTask
from shared.control.subjects import Subjects
from shared.telemetry import tracing


async def _group(stream, relay: RequestRelay, placed):
    """A group's merged choices; once they end, however they end, the group's own id is
    cancelled too (a worker may hold it, unforked, while its choices moved on)."""
    async with contextlib.aclosing(stream):
        try:
            async for item in stream:
                yield item
        finally:
            await relay.cancel(placed.id)


def client_address(peer: str) -> str:
    """The client's address without its port: "ipv4:10.0.0.7:5123" -> "ipv4:10.0.0.7"."""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


async def _refuse(context, err: Refused) -> None:
    """Ends the call with the refusal's status and a retry-after hint."""
    context.set_trailing_metadata((("retry-after-ms", str(RETRY_AFTER_MS)),))
    await context.abort(err.code, str(err))


STATUS_PAGE = 128  # workers asked for per status request (the scheduler caps it too)


def default_policy(settings: GatewaySettings) -> ClientPolicy:
    """What a client without a key of its own may ask for and hold (0: no cap of its own)."""
    return ClientPolicy(
        max_priority=settings.default_max_priority,
        max_streams=settings.max_streams_per_client,
        max_queued=settings.max_queued_per_client,
        max_kv_tokens=settings.max_kv_tokens_per_client,
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
        schedulers: SchedulerPool | None = None,
        keys: ClientKeys | None = None,
    ):
        self.settings = settings
        self.schedulers = schedulers  # None: the schedulers' queue group only
        self.bus = bus
        self.streams = streams
        self.tokenizer = tokenizer
        self.prompts = PromptTokenizer(tokenizer, settings.tool_call_parser)
        self.grammars = Grammars(tokenizer) if tokenizer is not None else None
        self.limits = limits
        self.liveness = liveness
        self.subjects = Subjects(settings.cluster)
        self.keys = keys or ClientKeys(default_policy(settings), {})
        self.seats = Seats(settings.max_streams, settings.max_queued)  # what clients hold here
        self._tokenize = FairTokenizer()
        self.metrics = GatewayMetrics(settings.gateway_id)
        if schedulers is not None:
            self.metrics.count_rooms(schedulers.rooms)

    async def Generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext,
        api: str = "grpc",
        seat: Seat | None = None,
        tool_calls: bool = True,
    ):
        """The request's responses, counted in the metrics once it ends, however it ends, under
        its trace's root span (passed down, not made current: this generator's steps may each
        run in a task of their own). `api`: which one it came by (the HTTP API's says its own);
        `seat`: the one its caller took for it (seated), else it takes its own; `tool_calls`:
        whether each choice's last response carries the tool calls parsed out of its text (the
        HTTP API streams them itself)."""
        observer, span = self.metrics.request(api), tracing.tracer().start_span("gateway.request")
        span.set_attribute("api", api)
        context, finished = RecordingContext(context), False
        traced = span.get_span_context().is_valid  # else tracing is off: nothing to pass down
        root = trace.set_span_in_context(span) if traced else None
        try:
            async with contextlib.AsyncExitStack() as stack:
                if seat is None:
                    seat = await stack.enter_async_context(self.seated(context))
                calling = self._generate_call(request, context, root, seat, tool_calls)
                responses = await stack.enter_async_context(contextlib.aclosing(calling))
                async for response in responses:
                    observer.on_response(response)
                    yield response
            finished = True
        except Exception:
            context.code = context.code or grpc.StatusCode.INTERNAL
            raise
        finally:
            left = context.time_remaining()
            expired = not finished and left is not None and left <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else context.code
            observer.end(code, finished)
            span.set_attribute("status", code.name if code else "OK" if finished else "CANCELLED")
            span.end()

    @contextlib.asynccontextmanager
    async def seated(self, context):
        """A seat for the request of `context` (taken before anything costly is done for it),
        released when the block ends; the call aborted (UNAUTHENTICATED, RESOURCE_EXHAUSTED,
        UNAVAILABLE) when its client may not have one."""
        client = await self._identify(context)
        try:
            seat = self.seats.take(client)
        except Refused as err:
            await _refuse(context, err)
        try:
            yield seat
        finally:
            self.seats.release(seat)

    async def _generate_call(
        self, request: pb.GenerateRequest, context, root, seat: Seat, tool_calls: bool
    ):
        arrival = time.time()
        if isinstance(request, Undecodable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"not a GenerateRequest: {request.error}"
            )
        client = seat.client
        with tracing.child(root, "gateway.validate"):
            valid = await self._validated(request, context, client)
            tracing.record("gateway.tokenize", tracing.current(), *valid.tokenized)
        trace.get_current_span(root).set_attribute("request_id", valid.request_id)
        for text in ("prompt", "messages", "prompt_token_ids"):  # it lives on as valid's ids
            request.ClearField(text)
        kv_tokens = len(valid.prompt_token_ids) + valid.sampling.n * valid.sampling.max_tokens
        try:
            self.seats.validated(seat, kv_tokens)
        except Refused as err:
            await _refuse(context, err)
        priority = min(request.priority, client.policy.max_priority)
        generating = self._generate(valid, priority, client, context, arrival, root)
        if tool_calls and valid.tools is not None:
            generating = with_tool_calls(generating, valid.tools)
        async with contextlib.aclosing(generating) as responses:
            async for response in responses:  # closed on every exit: its cancel always runs now
                if seat.state is SeatState.WAITING and response.token_ids:
                    self.seats.started(seat)
                yield response

    async def _identify(self, context) -> Client:
        """Who sent the request; UNAUTHENTICATED without a valid key when keys are required."""
        try:
            return self.keys.identify(
                context.invocation_metadata(),
                cert_subject(context.auth_context()),
                client_address(context.peer()),
            )
        except Unauthenticated as err:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(err))

    async def _generate(
        self, valid: ValidRequest, priority: int, client: Client, context, arrival: float, root
    ):
        first_at: dict[int, float] = {}  # when each choice's first token came
        task = self._first_task(valid, priority, client, context, arrival)
        streaming = time.time()
        try:
            n = task.sampling.n
            async with contextlib.aclosing(await self._choices(task, context, root)) as chunks:
                async for item in chunks:
                    index, (attempt, chunk) = (0, item) if n == 1 else item
                    if index not in first_at and chunk.token_ids:
                        first_at[index] = time.time()
                    self.metrics.waited(self.streams.arrived(attempt.id))
                    yield generate_response(
                        valid.request_id,
                        chunk,
                        arrival,
                        first_at.get(index),
                        attempt.task.moves,
                        index,
                        valid.prompt_token_ids,
                    )
        finally:
            tracing.record("gateway.stream", root, streaming, time.time())

    async def _choices(self, task: GenerateTask, context, root):
        """The request's (attempt, chunk)s: its one stream's, or with n > 1 (choice index,
        (attempt, chunk)) of one stream per choice, the request placed as one first (its prompt
        prefilled once, then forked)."""

        def relay() -> RequestRelay:
            return RequestRelay(
                self.settings, self.bus, self.streams, self.liveness, context, self.schedulers, root
            )

        if task.sampling.n == 1:
            return relay().follow(task)
        placing = relay()
        placed = await placing.place(task)
        n = task.sampling.n
        streams = [relay().follow(choice_task(placed.task, i), placed) for i in range(n)]
        return _group(merged(streams), placing, placed)

    async def _validated(
        self, request: pb.GenerateRequest, context, client: Client
    ) -> ValidRequest:
        args = (request, self.prompts, self.limits, self.grammars)
        try:
            if light(request, self.prompts):  # cheaper here than a turn on the tokenizer thread
                return validate(*args)
            return await self._tokenize.run(client.name, validate, *args)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    def _first_task(
        self, valid: ValidRequest, priority: int, client: Client, context, arrival: float
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
            client=client.name,
        )

    async def ClusterStatus(
        self, request: pb.ClusterStatusRequest, context
    ) -> pb.ClusterStatusResponse:
        if isinstance(request, Undecodable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"not a ClusterStatusRequest: {request.error}"
            )
        await self._identify(context)  # with keys configured, status needs one too
        try:
            wait_s = ask_wait(context.time_remaining())  # within the call's deadline
            pages = await status_pages(self.bus, self.subjects, STATUS_PAGE, wait_s)
        except BusError as err:  # unanswered; NoResponders: none runs, or every one stood aside
            why = (
                ": none is running, or none hears a worker" if isinstance(err, NoResponders) else ""
            )
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler answered" + why)
        workers = [w for page in pages for w in page.workers]
        return cluster_status_response(pages[0], workers, self.bus.dropped)


# -- on a grpc server --------------------------------------------------------------------------


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


def add_to_server(servicer: TandemServicer, server) -> None:
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
