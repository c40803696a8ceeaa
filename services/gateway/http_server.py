"""The HTTP API's listener: an aiohttp app (the OpenAI-compatible routes) served over bounded
connections (http_connections), in plaintext or TLS with the gRPC API's certificate."""

import asyncio
import ssl

from aiohttp import web

from services.gateway.http_connections import BoundedConnection, ConnectionBounds, ConnectionWatch


def ssl_context(cert: str, key: str, client_ca: str) -> ssl.SSLContext | None:
    """TLS with the gRPC API's certificate (None: plaintext); client certificates when a CA is set."""
    if not cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class HttpServer:
    """`app` listening on host:port from start(); stop() stops listening, and gives requests
    in flight `drain_s` to finish before they are cancelled. Its own listener rather than
    aiohttp's TCPSite: each connection is a BoundedConnection, and a TLS handshake gets the
    read timeout (asyncio's default is a minute)."""

    def __init__(
        self,
        app: web.Application,
        host: str,
        port: int,
        tls: ssl.SSLContext | None,
        drain_s: float,
        bounds: ConnectionBounds,
        watch: ConnectionWatch,
        reuse_port: bool = False,
    ):
        self.host, self.port, self.tls, self.reuse_port = host, port, tls, reuse_port
        self.bounds, self.watch = bounds, watch
        self.runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=drain_s, access_log=None
        )
        self.listener: asyncio.Server | None = None

    async def start(self) -> "HttpServer":
        await self.runner.setup()
        handshake = {"ssl_handshake_timeout": self.bounds.read_timeout_s} if self.tls else {}
        self.listener = await asyncio.get_running_loop().create_server(
            self._connection,
            self.host,
            self.port,
            ssl=self.tls,
            reuse_port=self.reuse_port,
            **handshake,
        )
        self.port = self.listener.sockets[0].getsockname()[1]
        return self

    def _connection(self) -> BoundedConnection:
        return BoundedConnection(self.runner.server, self.bounds, self.watch)

    async def stop(self) -> None:
        """Stops listening, closes idle connections and drains the rest (aiohttp's cleanup)."""
        if self.listener is not None:
            self.listener.close()
        await self.runner.cleanup()
        if self.listener is not None:
            await self.listener.wait_closed()
