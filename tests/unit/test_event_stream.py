"""An SSE response's headers go out with its first event, not on their own before it."""

import asyncio

from aiohttp import web

from services.gateway.http_api import EventStream

FIRST = b"data: first\n\n"


async def test_the_headers_wait_for_the_first_event_and_go_with_it():
    written = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = EventStream(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await asyncio.sleep(0.3)  # the cluster's first token is on its way
        await stream.write(FIRST)
        written.set()
        await stream.write_eof()
        return stream

    app = web.Application()
    app.router.add_get("/events", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /events HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        early = asyncio.ensure_future(reader.read(65536))
        done, _ = await asyncio.wait({early}, timeout=0.15)
        assert not done  # prepared, yet nothing sent: the headers wait
        received = await early
        assert written.is_set()
        assert received.startswith(b"HTTP/1.1 200")
        assert FIRST in received  # in the same read as the headers: one write
        writer.close()
    finally:
        await runner.cleanup()
