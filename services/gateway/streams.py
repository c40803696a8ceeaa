"""StreamRouter: one NATS subscription per gateway, token chunks handed to each attempt's queue
(a worker sends one step's chunks for this gateway as one TokenBatch)."""

import asyncio

from shared.control.bus import MessageBus
from shared.control.messages import TokenBatch, TokenChunk


class StreamRouter:
    def __init__(self, bus: MessageBus, subject: str):
        self.bus = bus
        self.subject = subject
        self._queues: dict[str, asyncio.Queue[TokenChunk]] = {}  # attempt id -> its chunks
        self._sub = None

    async def __aenter__(self) -> "StreamRouter":
        self._sub = await self.bus.subscribe(self.subject, self._on_chunk)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._sub.unsubscribe()

    def open(self, attempt_id: str) -> asyncio.Queue[TokenChunk]:
        if attempt_id in self._queues:
            raise KeyError(attempt_id)
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._queues[attempt_id] = queue
        return queue

    async def next(self, attempt_id: str, timeout_s: float) -> TokenChunk:
        """The next chunk of an open stream; asyncio.TimeoutError when none came in timeout_s."""
        return await asyncio.wait_for(self._queues[attempt_id].get(), timeout_s)

    def close(self, attempt_id: str) -> None:
        self._queues.pop(attempt_id, None)

    def __contains__(self, attempt_id: str) -> bool:
        return attempt_id in self._queues

    async def _on_chunk(self, message: TokenChunk | TokenBatch, respond) -> None:
        chunks = message.chunks if isinstance(message, TokenBatch) else [message]
        for chunk in chunks:
            queue = self._queues.get(chunk.attempt_id)
            if queue is not None:  # else: the attempt ended here (cancelled, timed out, moved)
                queue.put_nowait(chunk)
