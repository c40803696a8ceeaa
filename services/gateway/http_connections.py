"""The HTTP API's connections, bounded: how long a request may take to arrive, how long a
connection may sit idle or leave its answer unread, and how many may be open at once.

A connection is in one of three phases, and only BoundedConnection moves it:
  IDLE     no byte of a request yet (just opened, or its last answer sent): closed after
           `idle_timeout_s`.
  HEADERS  a request's first byte came: the request must arrive whole, headers and body, by its
           deadline (`read_timeout_s` after that byte; more bytes do not move it). Still without
           its headers then: closed.
  REQUEST  its headers came and the handler runs (the app's first middleware,
           `read_within_deadline`, says so). If its body is still not whole at the deadline,
           reading it fails with RequestReadTimeout, whenever the handler reads it (after its
           seat is taken, say), and the middleware answers 408; the connection closes.
In any phase, a client that stops reading, so that the send buffer stays over its high-water
mark for `write_timeout_s`, is cut off: aiohttp cancels the handler, which frees what the
request holds, as when the client goes away. The kernel's send buffer is capped at
`send_buffer_bytes`; left to itself it grows to MBs, minutes of a token stream, before a stall
shows.

A connection that comes while `max_connections` are open is answered 503 and closed (Refusal),
rather than left unaccepted in the listen backlog, so that its client learns why.
"""

import asyncio
import enum
import json
import logging
import socket
from dataclasses import dataclass

import grpc
from aiohttp import StreamReader, web
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.gateway.http_context import HttpError, http_error
from shared.telemetry.metrics import ID_LABELS

log = logging.getLogger("gateway.http")


@dataclass(frozen=True)
class ConnectionBounds:
    read_timeout_s: float
    idle_timeout_s: float
    write_timeout_s: float
    max_connections: int
    linger_s: float  # after a 503 or 408: the rest of the request is read and dropped this long
    send_buffer_bytes: int = 0  # the kernel's send buffer per connection (0: the kernel's own)


class ConnectionWatch:
    """The connections' figures: open now, and those cut, by why."""

    def __init__(self, registry: CollectorRegistry, ids: tuple[str, str]):
        self.open = Gauge(
            "tandem_http_connections_open",
            "HTTP API connections open",
            ID_LABELS,
            registry=registry,
        ).labels(*ids)
        self._cut = Counter(
            "tandem_http_connections_cut",
            "HTTP API connections the gateway closed on a bound: refused (over the cap), "
            "idle, read_timeout (a request not whole in time), write_timeout (its client read nothing)",
            [*ID_LABELS, "reason"],
            registry=registry,
        )
        self._ids = ids

    def cut(self, reason: str) -> None:
        self._cut.labels(*self._ids, reason).inc()


class Phase(enum.Enum):
    IDLE = "idle"
    HEADERS = "headers"
    REQUEST = "request"


class RequestReadTimeout(TimeoutError):
    """The request's body did not arrive whole by its deadline (a TimeoutError, which aiohttp's
    read of the rest after the answer takes for the end of it)."""


class BoundedConnection(web.RequestHandler):
    """aiohttp's connection handler, with the bounds above. `server`: the runner's web.Server,
    which counts the open connections."""

    def __init__(self, server: web.Server, bounds: ConnectionBounds, watch: ConnectionWatch):
        # aiohttp's own keep-alive close is a backstop here: the phases close an idle connection
        # first, and a request in progress must not be closed by it.
        backstop = bounds.idle_timeout_s + bounds.read_timeout_s
        super().__init__(
            server,
            loop=asyncio.get_running_loop(),
            keepalive_timeout=backstop,
            lingering_time=bounds.linger_s,
            access_log=None,
        )
        self.bounds, self.watch, self.web_server = bounds, watch, server
        self.phase = Phase.IDLE
        self.deadline = 0.0  # the request's, in the loop's time, from its first byte
        self._body: StreamReader | None = None  # the request's, in phase REQUEST
        self._clock: asyncio.TimerHandle | None = None  # the phase's
        self._stall: asyncio.TimerHandle | None = None  # while writing is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if len(self.web_server.connections) >= self.bounds.max_connections:
            self.watch.cut("refused")
            refusal = Refusal(self.bounds)
            transport.set_protocol(refusal)
            refusal.connection_made(transport)
            return
        if self.bounds.send_buffer_bytes:  # else a stall is seen only after MBs go unread
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.bounds.send_buffer_bytes)
        super().connection_made(transport)
        self.watch.open.inc()
        self._enter(Phase.IDLE, self.bounds.idle_timeout_s)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.watch.open.dec()
        self._disarm()
        if self._stall is not None:
            self._stall.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.IDLE and data:
            self._enter(Phase.HEADERS, self.bounds.read_timeout_s)
            self.deadline = self._clock.when()
        super().data_received(data)

    def headers_came(self, body: StreamReader) -> None:
        """The request's headers came; `body` must be whole by its deadline. A request whose
        headers came before its turn (pipelined) gets a full `read_timeout_s` from now."""
        if self.phase is not Phase.HEADERS:
            self.deadline = asyncio.get_running_loop().time() + self.bounds.read_timeout_s
        self._body = body
        self._enter(Phase.REQUEST, self.deadline - asyncio.get_running_loop().time())

    async def finish_response(self, request, resp, start_time):
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._body = None
            if self.transport is not None:
                self._enter(Phase.IDLE, self.bounds.idle_timeout_s)

    def pause_writing(self) -> None:
        super().pause_writing()
        loop = asyncio.get_running_loop()
        self._stall = loop.call_later(self.bounds.write_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        """Its client read nothing for write_timeout_s: aborted (a close would wait for the
        unread answer to go out); connection_lost cancels the handler."""
        self._stall = None
        log.debug("cutting off a client that read nothing for %.0fs", self.bounds.write_timeout_s)
        self.watch.cut("write_timeout")
        if self.transport is not None:
            self.transport.abort()

    def _enter(self, phase: Phase, timeout_s: float) -> None:
        self._disarm()
        self.phase = phase
        self._clock = asyncio.get_running_loop().call_later(timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None

    def _expired(self) -> None:
        self._clock = None
        if self.phase in (Phase.IDLE, Phase.HEADERS):
            self.watch.cut("idle" if self.phase is Phase.IDLE else "read_timeout")
            self.force_close()
        elif not self._body.is_eof():  # Phase.REQUEST
            self.watch.cut("read_timeout")
            self._body.set_exception(RequestReadTimeout(self.bounds.read_timeout_s))


class Refusal(asyncio.Protocol):
    """A connection over the cap: its 503 is written and the write side shut at once; what the
    client sends meanwhile is read and dropped until it closes, or for `linger_s` (closing with
    unread input would reset the connection, and the client could lose the answer)."""

    def __init__(self, bounds: ConnectionBounds):
        self.bounds = bounds
        self._closing: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_over_cap_answer(self.bounds.max_connections))
        if transport.can_write_eof():
            transport.write_eof()
        loop = asyncio.get_running_loop()
        self._closing = loop.call_later(self.bounds.linger_s, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass  # dropped

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._closing is not None:
            self._closing.cancel()


def _over_cap_answer(cap: int) -> bytes:
    message = f"the gateway has {cap} HTTP connections open, its limit; retry shortly"
    body = json.dumps(http_error(grpc.StatusCode.UNAVAILABLE, message).body).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _closing_answer(error: HttpError) -> web.Response:
    response = web.json_response(error.body, status=error.status, headers=error.headers)
    response.force_close()
    return response


def _timed_out(seconds: float) -> HttpError:
    message = f"the request did not arrive whole within {seconds:g}s"
    error = {"message": message, "type": "timeout_error", "param": None, "code": "request_timeout"}
    return HttpError(408, {"error": error}, {})


@web.middleware
async def read_within_deadline(request: web.Request, handler) -> web.StreamResponse:
    """Starts the request's body clock; a body not whole by its deadline gets a 408."""
    connection: BoundedConnection = request.protocol
    connection.headers_came(request.content)
    try:
        return await handler(request)
    except RequestReadTimeout:
        return _closing_answer(_timed_out(connection.bounds.read_timeout_s))
