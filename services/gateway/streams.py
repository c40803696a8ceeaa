"""StreamRouter: one NATS subscription per gateway, token chunks handed to each request's queue."""

import asyncio

from shared.control.bus import MessageBus
from shared.control.messages import TokenChunk


class StreamRouter:
    def __init__(self, bus: MessageBus, subject: str):
        self.bus = bus
        self.subject = subject
        self._queues: dict[str, asyncio.Queue[TokenChunk]] = {}
        self._sub = None

    async def __aenter__(self) -> "StreamRouter":
        self._sub = await self.bus.subscribe(self.subject, self._on_chunk)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._sub.unsubscribe()

    def open(self, request_id: str) -> asyncio.Queue[TokenChunk]:
        if request_id in self._queues:
            raise KeyError(request_id)
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queues

    async def _on_chunk(self, chunk: TokenChunk, respond) -> None:
        queue = self._queues.get(chunk.request_id)
        if queue is not None:  # else: the request ended here already (cancelled, timed out)
            queue.put_nowait(chunk)
