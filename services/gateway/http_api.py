"""The OpenAI-compatible HTTP API (aiohttp), beside the gRPC one in the gateway's process.

POST /v1/chat/completions and /v1/completions run the gRPC API's own request path
(TandemServicer.Generate: validation, client limits, API keys, placement, migration) through an
HttpCallContext; GET /v1/models lists the model served; GET /health answers while the gateway
runs, GET /ready while the cluster can serve (a scheduler answers with the workers it needs), GET
/metrics with the gateway's Prometheus metrics.

A streamed answer starts once the request is placed and its first token came, so a request
refused (400, 401, 429, 503, 504) gets its HTTP status; a failure after that ends the event
stream with an OpenAI error event. A client that goes away cancels its request: aiohttp cancels
the handler, and the request path frees what the workers hold (as a gRPC cancel does).
"""

import asyncio
import contextlib
import logging
import re
import uuid

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.http_body import (
    Bill,
    BodyTooLarge,
    BodyTurns,
    TooManyObjects,
    decode_json,
    read_body,
)
from services.gateway.http_connections import read_within_deadline
from services.gateway.http_context import (
    TIMEOUT_HEADER,
    CallAborted,
    HttpCallContext,
    HttpError,
    http_error,
    parse_timeout,
)
from services.gateway.openai_format import ChoiceLog, Formatter, TokenText
from services.gateway.openai_request import BadRequest, OpenAIRequest, parse
from services.gateway.prompts_answered import answers
from services.gateway.sampling_defaults import OPENAI, SamplingDefaults
from services.gateway.sse_events import SseEvents, event, json_bytes
from services.gateway.tool_request import plan_of

log = logging.getLogger("gateway.http")

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
FORWARDED_FOR = "X-Forwarded-For"
INTERNAL = http_error(grpc.StatusCode.INTERNAL, "the gateway failed to serve the request")


def _error_response(error: HttpError) -> web.Response:
    return web.Response(
        status=error.status,
        body=json_bytes(error.body),
        headers=error.headers,
        content_type="application/json",
    )


def _bad(message: str, param: str | None = None) -> web.Response:
    return _error_response(http_error(grpc.StatusCode.INVALID_ARGUMENT, message, param=param))


class OpenAIApi:
    """The routes. `servicer`: the gateway's TandemServicer; `ready`: whether the cluster can
    serve; `model`: the name the model is served under."""

    def __init__(
        self,
        servicer,
        tokenizer,
        model: str,
        ready,
        max_request_bytes: int,
        defaults: SamplingDefaults = OPENAI,
    ):
        self.servicer = servicer
        self.model = model
        self.defaults = defaults  # for the sampling fields a request leaves out
        self.ready = ready
        self.max_request_bytes = max_request_bytes
        self.text_of = TokenText(tokenizer)
        self.bodies = BodyTurns(self._others_served)  # a client's bodies one at a time

    def app(self) -> web.Application:
        """The routes, behind the middleware that reads each request whole by its deadline."""
        app = web.Application(
            client_max_size=self.max_request_bytes, middlewares=[read_within_deadline]
        )
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.readiness)
        app.router.add_get("/metrics", self.prometheus)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def models(self, request: web.Request) -> web.Response:
        entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "tandem"}
        return web.json_response({"object": "list", "data": [entry]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readiness(self, request: web.Request) -> web.Response:
        ready = self.ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        """The gateway's metrics, as on its metrics port: where vLLM and SGLang serve theirs,
        and load generators (aiperf) look. Read off the event loop, as a scrape there is."""
        body = await asyncio.to_thread(generate_latest, self.servicer.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- generation ----------------------------------------------------------------------------

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        """The request's seat is taken before its body is read (a client past its share is
        refused without a byte of it read); the body is dropped once parsed."""
        try:
            context = self._context(request)
        except ValueError as err:
            return _bad(str(err))
        async with contextlib.AsyncExitStack() as stack:
            try:
                seat = await stack.enter_async_context(self.servicer.seated(context))
            except CallAborted as err:  # 401, 429 or 503: counted as Generate counts its own
                self.servicer.metrics.request(context.api).end(err.code, False)
                return _error_response(http_error(err.code, err.details, err.retry_after_ms))
            async with self.bodies.turn(seat.client.name) as bill:
                req = await self._parsed(request, kind, bill)
            if isinstance(req, web.Response):
                return req
            request_id = self._request_id(request)
            responses = answers(self.servicer, req, request_id, context, seat)
            tools = plan_of(req.request, self.servicer.prompts.tool_format.parser)
            formatter = Formatter(req, request_id, self.text_of, tools)
            async with contextlib.aclosing(responses):
                if req.stream:
                    return await self._stream(request, req, responses, context, formatter)
                return await self._whole(responses, context, formatter)

    async def _parsed(
        self, request: web.Request, kind: str, bill: Bill
    ) -> OpenAIRequest | web.Response:
        """The body as an OpenAI request, or the error response that refuses it; the loop's time
        its decoding and parsing took goes on `bill`."""
        try:
            data = await read_body(request, self.max_request_bytes)
        except BodyTooLarge as err:
            too_large = http_error(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            too_large.status = 413
            return _error_response(too_large)
        with bill.timing():
            return self._decoded(data, kind)

    def _decoded(self, data: bytearray, kind: str) -> OpenAIRequest | web.Response:
        try:
            body = decode_json(data)
        except TooManyObjects as err:
            return _bad(str(err))
        except ValueError as err:
            return _bad(f"the body is not JSON: {err}")
        except RecursionError:  # json's decoder gives up on deep nesting: no OpenAI body is
            return _bad("the body is nested too deeply")
        try:
            req = parse(kind, body, self.model, self.defaults, self.servicer.limits)
        except BadRequest as err:
            return _bad(str(err), err.param)
        except ValueError as err:
            return _bad(str(err))
        if req.model != self.model:
            message = f"the model {req.model!r} does not exist"
            return _error_response(http_error(grpc.StatusCode.NOT_FOUND, message, param="model"))
        return req

    def _others_served(self, client: str) -> bool:
        """Whether a client other than `client` holds a seat here now."""
        return any(name != client for name in self.servicer.seats.held())

    def _context(self, request: web.Request) -> HttpCallContext:
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport else None
        cert = transport.get_extra_info("peercert") if transport else None
        return HttpCallContext(
            request.headers.get("Authorization"),
            tuple(peer[:2]) if peer else None,
            _common_name(cert),
            parse_timeout(request.headers.get(TIMEOUT_HEADER)),
            request.headers.getall(FORWARDED_FOR, ()),
        )

    @staticmethod
    def _request_id(request: web.Request) -> str:
        given = request.headers.get("X-Request-Id", "")
        return given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex

    async def _whole(self, responses, context, formatter: Formatter) -> web.Response:
        choices: dict[int, ChoiceLog] = {}
        lasts = []
        try:
            while (response := await _next(responses, context)) is not None:
                if response.index not in choices:
                    choices[response.index] = formatter.choice_log()
                choices[response.index].add(response)
                lasts += [response] if response.finish_reason else []
        except CallAborted as err:
            return _error_response(http_error(err.code, err.details, err.retry_after_ms))
        except Exception:  # a bug: an OpenAI error body all the same, and the log has it
            log.exception("request %s failed", formatter.id)
            return _error_response(INTERNAL)
        body = json_bytes(formatter.response(choices, lasts))
        return web.Response(body=body, content_type="application/json")

    async def _stream(
        self, request, req: OpenAIRequest, responses, context, formatter: Formatter
    ) -> web.StreamResponse:
        try:
            first = await _next(responses, context)
        except CallAborted as err:
            return _error_response(http_error(err.code, err.details, err.retry_after_ms))
        except Exception:
            log.exception("request %s failed", formatter.id)
            return _error_response(INTERNAL)
        stream = EventStream(headers=SSE_HEADERS | {"X-Request-Id": formatter.id})
        await stream.prepare(request)
        response, lasts, events = first, [], SseEvents(formatter)
        # One answer's last event goes out with the stream's end, in one write: the request
        # path ends without waiting once its last response is out (seat, metrics, no message).
        single, end = len(req.requests) == 1 and req.request.sampling.n <= 1, b""
        try:
            while response is not None:
                if end:  # something came after it after all
                    await stream.write(end)
                    end = b""
                data = events.of(response)
                lasts += [response] if response.finish_reason else []
                if single and response.finish_reason:
                    end = data
                else:
                    await stream.write(data)
                response = await _next(responses, context)
            if req.include_usage and lasts:
                end += event(formatter.usage_chunk(lasts))
            end += b"data: [DONE]\n\n"
        except CallAborted as err:
            end += event(http_error(err.code, err.details, err.retry_after_ms).body)
        except (ConnectionError, asyncio.CancelledError):
            raise  # the client went away: nothing more to say
        except Exception:
            log.exception("request %s failed mid-stream", formatter.id)
            end += event(INTERNAL.body)
        await stream.write_eof(end)
        return stream


class EventStream(web.StreamResponse):
    """An SSE response whose headers go out with its first event, in one write (aiohttp's
    StreamResponse sends them on prepare(), a write of their own: a syscall per request)."""

    _send_headers_immediately = False


async def _next(responses, context: HttpCallContext):
    """The next response (None at the end); CallAborted(DEADLINE_EXCEEDED) once the request's
    X-Request-Timeout has passed, as a gRPC deadline ends a call."""
    left = context.time_remaining()
    try:
        if left is None:
            return await anext(responses)
        return await asyncio.wait_for(anext(responses), left)
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        raise CallAborted(
            grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"
        ) from None


def _common_name(cert: dict | None) -> str:
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return ""
