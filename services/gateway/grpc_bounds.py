"""The gRPC API's transport bounds: grpc core's connection limits, as server options, and the
call bounds grpc core lacks, as an interceptor.

grpc core closes a connection whose HTTP/2 (or TLS) handshake takes past the read timeout, one
over the connection cap (its client sees UNAVAILABLE and retries), one idle past its idle
timeout (GOAWAY) or older than its age (GOAWAY; its calls get a grace), and one whose client
answers no keep-alive ping; grpc.aio refuses a call over its cap with RESOURCE_EXHAUSTED.

What core leaves open: a call whose request message never comes holds its slot under the cap
forever (core waits for the message before the method runs), and a client that stops reading
holds its stream, and its request, forever. CallBounds takes each call with one request message
as the streaming-request call it is on the wire, and reads the message itself within the read
timeout (else DEADLINE_EXCEEDED); each response of a streaming answer must be taken within the
write timeout, else the answer's generator is closed (its request cancelled, its KV freed) and
the call ends DEADLINE_EXCEEDED. That status waits behind the unread responses (grpc.aio has no
reset of a server stream), so the call's slot is held until the client reads, goes, stops
answering pings, or its connection ages out.
"""

import asyncio
import contextlib
import inspect

import grpc

from services.gateway.settings import GatewaySettings


def server_options(settings: GatewaySettings) -> list[tuple[str, int]]:
    def ms(seconds: float) -> int:
        return round(seconds * 1000)

    options = [
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        ("grpc.max_allowed_incoming_connections", settings.grpc_max_connections),
        ("grpc.server_handshake_timeout_ms", ms(settings.read_timeout_s)),
        ("grpc.max_connection_idle_ms", ms(settings.grpc_idle_timeout_s)),
        ("grpc.keepalive_time_ms", ms(settings.grpc_keepalive_s)),
        ("grpc.keepalive_timeout_ms", ms(settings.grpc_keepalive_s)),
        # keep pinging while a call waits long for its first token (core stops after 2 by default)
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC core shares a port by default on Linux: only when asked for (--reuse-port)
        ("grpc.so_reuseport", int(settings.reuse_port)),
    ]
    if settings.grpc_max_connection_age_s:
        options += [
            ("grpc.max_connection_age_ms", ms(settings.grpc_max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(settings.grpc_connection_age_grace_s)),
        ]
    return options


class ClientStalled(Exception):
    """A response waited past the write timeout to be taken."""


class CallBounds(grpc.aio.ServerInterceptor):
    """Each call's request must arrive within `read_timeout_s`; each response of a streamed
    answer must be taken within `write_timeout_s`. Calls that stream their requests, and
    methods that are not coroutines, pass unchanged."""

    def __init__(self, read_timeout_s: float, write_timeout_s: float):
        self.read_timeout_s, self.write_timeout_s = read_timeout_s, write_timeout_s
        self._bounded: dict[grpc.RpcMethodHandler, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler not in self._bounded:  # the methods' handlers are few and long-lived
            self._bounded[handler] = self._bound(handler)
        return self._bounded[handler]

    def _bound(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behavior = handler.unary_stream or handler.unary_unary
        streamed = handler.unary_stream is not None
        if streamed and inspect.isasyncgenfunction(behavior):
            return grpc.stream_stream_rpc_method_handler(
                self._streamed(behavior), handler.request_deserializer, handler.response_serializer
            )
        if not inspect.iscoroutinefunction(behavior):
            return handler  # run by grpc in its thread pool: none of ours
        make = (
            grpc.stream_stream_rpc_method_handler
            if streamed
            else grpc.stream_unary_rpc_method_handler
        )
        return make(
            self._read_first(behavior), handler.request_deserializer, handler.response_serializer
        )

    def _read_first(self, behavior):
        async def call(requests, context):
            return await behavior(await self._request(context), context)

        return call

    def _streamed(self, behavior):
        async def call(requests, context):
            responses = behavior(await self._request(context), context)
            try:
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        await self._write(context, response)
            except ClientStalled:  # the generator is closed: the request is cancelled
                message = f"the client took no response for {self.write_timeout_s:g}s"
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)

        return call

    async def _request(self, context):
        try:
            async with asyncio.timeout(self.read_timeout_s):
                request = await context.read()
        except TimeoutError:
            message = f"the request did not arrive within {self.read_timeout_s:g}s"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request")
        return request

    async def _write(self, context, response) -> None:
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await context.write(response)
        except TimeoutError:
            raise ClientStalled from None
