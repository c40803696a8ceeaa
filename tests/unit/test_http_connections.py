"""The HTTP API's connection bounds (services/gateway/http_connections.py), on a real aiohttp
server in this process and raw sockets as the clients: an idle connection closed, a request
that trickles in cut at its deadline (closed before its headers, 408 after), a connection over
the cap answered 503, and a client that stops reading cut off with its handler cancelled."""

import asyncio
import socket
import time

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from services.gateway.http_connections import (
    ConnectionBounds,
    ConnectionWatch,
    read_within_deadline,
)
from services.gateway.http_server import HttpServer

BOUNDS = ConnectionBounds(
    read_timeout_s=0.6, idle_timeout_s=0.4, write_timeout_s=0.5, max_connections=3, linger_s=0.3
)
GET = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"


class Served:
    """An app behind the gateway's HttpServer on a free port; `handlers_cancelled` counts the
    streaming handlers that were cancelled."""

    def __init__(self, drain_s: float = 0):
        self.handlers_cancelled = 0
        self.registry = CollectorRegistry()
        self.drain_s = drain_s

    async def __aenter__(self) -> "Served":
        app = web.Application(middlewares=[read_within_deadline], client_max_size=4096)
        app.router.add_get("/ok", self.ok)
        app.router.add_post("/echo", self.echo)
        app.router.add_get("/flood", self.flood)
        app.router.add_get("/slow", self.slow)
        watch = ConnectionWatch(self.registry, ("gateway", "gw-test"))
        self.server = HttpServer(app, "127.0.0.1", 0, None, self.drain_s, BOUNDS, watch)
        self.port = (await self.server.start()).port
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop()

    async def ok(self, request):
        return web.Response(text="ok")

    async def echo(self, request):
        return web.Response(body=await request.read())

    async def flood(self, request):
        stream = web.StreamResponse()
        await stream.prepare(request)
        try:
            while True:
                await stream.write(b"x" * 65536)
        except asyncio.CancelledError:
            self.handlers_cancelled += 1
            raise

    async def slow(self, request):
        await asyncio.sleep(0.3)
        return web.Response(text="late")

    def cut(self, reason: str) -> float:
        labels = {"role": "gateway", "worker": "gw-test", "reason": reason}
        return self.registry.get_sample_value("tandem_http_connections_cut_total", labels) or 0


async def _connect(port: int, rcvbuf: int = 0):
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def _read_all(sock: socket.socket, timeout: float = 5) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or resets), and when (monotonic)."""
    loop, data = asyncio.get_running_loop(), b""
    async with asyncio.timeout(timeout):
        try:
            while chunk := await loop.sock_recv(sock, 65536):
                data += chunk
        except ConnectionResetError:
            pass
    return data, time.monotonic()


async def _trickle(sock: socket.socket, data: bytes, every_s: float) -> None:
    """Sends `data` a byte at a time until the server closes."""
    loop = asyncio.get_running_loop()
    try:
        for byte in data:
            await loop.sock_sendall(sock, bytes([byte]))
            await asyncio.sleep(every_s)
    except OSError:
        pass


async def test_an_idle_connection_is_closed_after_the_idle_timeout():
    async with Served() as served:
        fresh, used = await _connect(served.port), await _connect(served.port)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(used, GET)
        await asyncio.sleep(0.1)
        started = time.monotonic()
        (_, fresh_closed), (answer, used_closed) = await asyncio.gather(
            _read_all(fresh), _read_all(used)
        )
        assert answer.startswith(b"HTTP/1.1 200")
        assert 0.2 < fresh_closed - started < 0.4 + 0.3
        assert 0.2 < used_closed - started < 0.4 + 0.3
        assert served.cut("idle") == 2


async def test_headers_trickling_in_are_cut_at_the_read_deadline_whatever_comes_after():
    async with Served() as served:
        sock = await _connect(served.port)
        started = time.monotonic()
        sending = asyncio.create_task(_trickle(sock, GET[:-2] + b"X-Slow: " + b"a" * 100, 0.1))
        answer, closed = await _read_all(sock)
        sending.cancel()
        assert answer == b""  # closed before its headers came: nothing to answer
        assert BOUNDS.read_timeout_s - 0.05 < closed - started < BOUNDS.read_timeout_s + 0.3
        assert served.cut("read_timeout") == 1


async def test_a_body_trickling_in_gets_a_408_at_the_read_deadline_and_the_connection_closes():
    async with Served() as served:
        head, body = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n", b"a" * 50
        loop = asyncio.get_running_loop()
        whole = await _connect(served.port)
        await loop.sock_sendall(whole, head + body)
        assert (await _read_all(whole))[0].endswith(b"\r\n\r\n" + body)
        slow = await _connect(served.port)
        started = time.monotonic()
        await loop.sock_sendall(slow, head)  # the headers at once, then a byte every 20 ms
        trickling = asyncio.create_task(_trickle(slow, body, 0.02))
        answer, closed = await _read_all(slow)
        trickling.cancel()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"did not arrive whole within 0.6s" in answer
        # answered at the deadline; closed once the rest was read and dropped for linger_s
        assert BOUNDS.read_timeout_s < closed - started < BOUNDS.read_timeout_s + 0.6
        assert served.cut("read_timeout") == 1


async def test_a_connection_over_the_cap_is_answered_503_and_one_under_it_is_served():
    async with Served() as served:
        held = [await _connect(served.port) for _ in range(BOUNDS.max_connections)]
        await asyncio.sleep(0.05)
        extra = await _connect(served.port)
        await asyncio.get_running_loop().sock_sendall(extra, GET)
        answer, _ = await _read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer
        assert b"3 HTTP connections open, its limit" in answer
        held.pop().close()
        await asyncio.sleep(0.05)
        again = await _connect(served.port)
        await asyncio.get_running_loop().sock_sendall(again, GET)
        answer, _ = await _read_all(again)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert served.cut("refused") == 1
        for sock in held:
            sock.close()


async def test_a_client_that_stops_reading_is_cut_off_and_its_handler_cancelled():
    async with Served() as served:
        sock = await _connect(served.port, rcvbuf=4096)
        await asyncio.get_running_loop().sock_sendall(
            sock, b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        deadline = time.monotonic() + 10
        while not served.handlers_cancelled:  # the buffers fill, then write_timeout_s passes
            assert time.monotonic() < deadline, "the stalled client was never cut off"
            await asyncio.sleep(0.05)
        assert served.cut("write_timeout") == 1
        answer, _ = await _read_all(sock)  # what was buffered, then the reset: never the end
        assert answer.startswith(b"HTTP/1.1 200") and not answer.endswith(b"0\r\n\r\n")


async def test_stopping_answers_the_request_in_flight_and_listens_no_more():
    served = await Served(drain_s=2).__aenter__()
    sock = await _connect(served.port)
    await asyncio.get_running_loop().sock_sendall(sock, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.1)
    stopping = asyncio.create_task(served.server.stop())
    answer, _ = await _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"late"), answer
    await stopping
    with pytest.raises(ConnectionRefusedError):
        await _connect(served.port)
