"""StreamRouter: one NATS subscription per gateway, token chunks handed to each attempt's stream
(a worker sends one step's chunks for this gateway as one TokenBatch).

A stream is a deque and, while its reader waits, a future: a chunk already there is taken at
once (no task, no timer), and the reader may look at the next one before taking it (the relay
joins the chunks that are already there into one answer). A wait has no timer of its own (a
timer per token costs more than the token's own bookkeeping): one watch every TICK_S ends the
waits past their time with asyncio.TimeoutError."""

import asyncio
import contextlib
import time
from collections import deque

from shared.control.bus import MessageBus
from shared.control.messages import TokenBatch, TokenChunk

TICK_S = 0.05  # how often waits past their time are ended (a wait may run this much longer)


class _Stream:
    __slots__ = ("chunks", "waiter", "until", "arrived")

    def __init__(self) -> None:
        self.chunks: deque[tuple[float, TokenChunk]] = deque()  # (when it arrived, the chunk)
        self.waiter: asyncio.Future | None = None  # set while its reader waits for a chunk
        self.until = 0.0  # when that wait times out (time.monotonic)
        self.arrived: float | None = None  # when the chunk `next` took last arrived


class StreamRouter:
    def __init__(self, bus: MessageBus, subject: str):
        self.bus = bus
        self.subject = subject
        self._streams: dict[str, _Stream] = {}  # attempt id -> its chunks
        self._sub = None
        self._watch: asyncio.Task | None = None

    async def __aenter__(self) -> "StreamRouter":
        self._sub = await self.bus.subscribe(self.subject, self._on_chunk)
        self._watch = asyncio.create_task(self._time_out_waits())
        return self

    async def __aexit__(self, *exc) -> None:
        self._watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch
        await self._sub.unsubscribe()

    def open(self, attempt_id: str) -> None:
        if attempt_id in self._streams:
            raise KeyError(attempt_id)
        self._streams[attempt_id] = _Stream()

    async def next(self, attempt_id: str, timeout_s: float) -> TokenChunk:
        """The next chunk of an open stream; asyncio.TimeoutError when none came in timeout_s."""
        stream = self._streams[attempt_id]
        if not stream.chunks:
            stream.waiter = asyncio.get_running_loop().create_future()
            stream.until = time.monotonic() + timeout_s
            try:
                await stream.waiter
            finally:
                stream.waiter = None
        stream.arrived, chunk = stream.chunks.popleft()
        return chunk

    def peek(self, attempt_id: str) -> TokenChunk | None:
        """The next chunk of a stream if it is here already (not taken: see take)."""
        stream = self._streams.get(attempt_id)
        return stream.chunks[0][1] if stream is not None and stream.chunks else None

    def take(self, attempt_id: str) -> TokenChunk:
        """The chunk peek showed (joining an answer `next` began: `arrived` stays)."""
        return self._streams[attempt_id].chunks.popleft()[1]

    def arrived(self, attempt_id: str) -> float | None:
        """When (time.monotonic) the chunk that began the stream's latest answer arrived."""
        stream = self._streams.get(attempt_id)
        return stream.arrived if stream is not None else None

    def close(self, attempt_id: str) -> None:
        self._streams.pop(attempt_id, None)

    def __contains__(self, attempt_id: str) -> bool:
        return attempt_id in self._streams

    async def _on_chunk(self, message: TokenChunk | TokenBatch, respond) -> None:
        chunks = message.chunks if isinstance(message, TokenBatch) else [message]
        now = time.monotonic()
        for chunk in chunks:
            stream = self._streams.get(chunk.attempt_id)
            if stream is None:  # the attempt ended here (cancelled, timed out, moved)
                continue
            stream.chunks.append((now, chunk))
            if stream.waiter is not None and not stream.waiter.done():
                stream.waiter.set_result(None)

    async def _time_out_waits(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for stream in self._streams.values():
                waiter = stream.waiter
                if waiter is not None and stream.until <= now and not waiter.done():
                    waiter.set_exception(asyncio.TimeoutError())
