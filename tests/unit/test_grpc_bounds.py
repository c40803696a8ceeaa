"""The gRPC API's call bounds (services/gateway/grpc_bounds.py) on a real grpc.aio server in this
process: a call whose request never comes ends at the read timeout and gives back its slot
under the cap; a client that stops reading has its answer's generator closed; calls that keep
to their bounds are served as before, and the server options are what the settings say."""

import asyncio

import grpc
import pytest

from services.gateway.grpc_bounds import CallBounds, server_options
from services.gateway.settings import GatewaySettings

READ_S, WRITE_S = 0.5, 0.5


def _same(data: bytes) -> bytes:
    return data


class Fake:
    """A unary method, and a stream of 64 KiB responses that runs until closed."""

    def __init__(self):
        self.streams_closed = 0
        self.sent = 0

    async def Echo(self, request: bytes, context) -> bytes:
        return b"echo:" + request

    async def Flood(self, request: bytes, context):
        try:
            while True:
                yield request * 65536
                self.sent += 1
        finally:
            self.streams_closed += 1


@pytest.fixture
async def served():
    fake = Fake()
    server = grpc.aio.server(interceptors=[CallBounds(READ_S, WRITE_S)], maximum_concurrent_rpcs=2)
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(fake.Echo, _same, _same),
        "Flood": grpc.unary_stream_rpc_method_handler(fake.Flood, _same, _same),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield fake, channel
    await server.stop(0)


def _echo(channel):
    return channel.unary_unary("/t.T/Echo", _same, _same)


async def test_calls_within_their_bounds_are_served(served):
    fake, channel = served
    assert await _echo(channel)(b"hi", timeout=5) == b"echo:hi"
    call = channel.unary_stream("/t.T/Flood", _same, _same)(b"z", timeout=5)
    assert await call.read() == b"z" * 65536
    call.cancel()


async def test_a_call_whose_request_never_comes_ends_at_the_read_timeout_and_frees_its_slot(served):
    fake, channel = served
    never = asyncio.Event()

    async def nothing():
        await never.wait()
        yield b""

    held = [channel.stream_stream("/t.T/Echo", _same, _same)(nothing()) for _ in range(2)]
    await asyncio.sleep(0.1)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _echo(channel)(b"x", timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in held:
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async with asyncio.timeout(5):
                await call.read()
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "did not arrive within 0.5s" in ended.value.details()
    assert await _echo(channel)(b"x", timeout=5) == b"echo:x"


async def test_a_client_that_stops_reading_has_its_stream_closed(served):
    fake, channel = served
    call = channel.unary_stream("/t.T/Flood", _same, _same)(b"z")
    await call.read()  # then nothing more
    async with asyncio.timeout(10):  # the windows fill, then WRITE_S passes
        while not fake.streams_closed:
            await asyncio.sleep(0.05)
    sent = fake.sent
    await asyncio.sleep(2 * WRITE_S)
    assert fake.sent == sent  # nothing more generated
    call.cancel()


def test_the_server_options_follow_the_settings():
    settings = GatewaySettings(
        read_timeout_s=7, grpc_max_connections=9, grpc_idle_timeout_s=11, grpc_keepalive_s=13
    )
    options = dict(server_options(settings))
    assert options["grpc.server_handshake_timeout_ms"] == 7000
    assert options["grpc.max_allowed_incoming_connections"] == 9
    assert options["grpc.max_connection_idle_ms"] == 11000
    assert options["grpc.keepalive_time_ms"] == options["grpc.keepalive_timeout_ms"] == 13000
    assert options["grpc.max_connection_age_ms"] == 3_600_000
    no_age = dict(server_options(GatewaySettings(grpc_max_connection_age_s=0)))
    assert "grpc.max_connection_age_ms" not in no_age
    # a port is shared only when asked for (gRPC core shares by default on Linux)
    assert options["grpc.so_reuseport"] == 0
    assert dict(server_options(GatewaySettings(reuse_port=True)))["grpc.so_reuseport"] == 1


async def test_a_second_gateway_on_a_port_in_use_fails_unless_both_reuse_it():
    """Two gRPC servers (and two HTTP listeners) on one port: refused, unless both were made
    with --reuse-port."""
    from aiohttp import web

    from services.gateway.http_server import HttpServer
    from shared.cli.processes import free_port

    for reuse in (False, True):
        port, settings = free_port(), GatewaySettings(reuse_port=reuse)
        first = grpc.aio.server(options=server_options(settings))
        second = grpc.aio.server(options=server_options(settings))
        assert first.add_insecure_port(f"127.0.0.1:{port}") == port
        if reuse:
            assert second.add_insecure_port(f"127.0.0.1:{port}") == port
        else:
            with pytest.raises(RuntimeError):
                second.add_insecure_port(f"127.0.0.1:{port}")
        await first.stop(None)
        await second.stop(None)
        http_port = free_port()
        servers = [
            HttpServer(web.Application(), "127.0.0.1", http_port, None, 1, None, None, reuse)
            for _ in range(2)
        ]
        await servers[0].start()
        try:
            if reuse:
                await servers[1].start()
                assert servers[1].port == http_port
                await servers[1].stop()
            else:
                with pytest.raises(OSError):
                    await servers[1].start()
        finally:
            await servers[0].stop()


def test_connection_bounds_out_of_range_are_refused():
    for bad in ({"read_timeout_s": 0}, {"http_max_connections": 0}, {"write_timeout_s": -1}):
        with pytest.raises(ValueError):
            GatewaySettings(**bad)
