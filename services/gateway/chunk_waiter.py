"""ChunkWaiter: the chunks of an attempt's stream, in order and each once.

NATS delivers at most once: an outage loses what was in flight. A chunk lost on the way is asked
for again (StreamReplay) when a later one shows the gap or the stream stays quiet; only a worker
that no longer has the stream (or one the cluster holds for lost) has the request moved
(WorkerLost). A stream silent past --stream-idle-timeout-s ends the call with UNAVAILABLE.
"""

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from services.gateway.attempt import Attempt
from services.gateway.migration import WorkerLost
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from shared.control.bus import BadReply, MessageBus, NoResponders, RequestTimeout
from shared.control.failure import worker_failed
from shared.control.liveness import Liveness
from shared.control.messages import StreamReplay, TaskAck, TokenChunk
from shared.control.subjects import Subjects

log = logging.getLogger(__name__)

POLL_S = 0.5  # a silent stream: how often its worker's liveness and the timeouts are checked
REPLAY_AFTER_RECONNECT_S = 1.0  # quiet this long since NATS reconnected: ask for the stream again
REPLAY_AFTER_S = 2.0  # quiet this long anyway (a stalled server loses nothing, but delays): ask
REPLAY_TIMEOUT_S = 1.0


class ChunkWaiter:
    def __init__(
        self,
        settings: GatewaySettings,
        bus: MessageBus,
        streams: StreamRouter,
        liveness: Liveness,
        context,
    ):
        self.settings, self.bus, self.streams = settings, bus, streams
        self.liveness, self.context = liveness, context
        self.subjects = Subjects(settings.cluster)
        self.early: dict[int, TokenChunk] = {}  # chunks that came before one still missing
        self.replayed_at = float("-inf")  # when the stream was last asked for again

    def reset(self) -> None:
        """A new attempt's stream: nothing of the last one is kept."""
        self.early.clear()

    async def next(self, attempt: Attempt) -> TokenChunk:
        """The chunk with the index expected: later ones wait for it (and have it asked for
        again), ones already had are dropped."""
        idle_since, reconnects = time.monotonic(), self.bus.reconnects
        while (chunk := self.early.pop(attempt.expected, None)) is None:
            try:
                chunk = await self.streams.next(attempt.id, POLL_S)
            except asyncio.TimeoutError:
                await self._check_silence(attempt, idle_since, reconnects)
                continue
            if chunk.index == attempt.expected:
                return chunk
            if chunk.index > attempt.expected:  # one before it was lost on the way
                self.early[chunk.index] = chunk
                await self._ask_again(attempt)
        return chunk

    def ready(self, attempt: Attempt, takes: Callable[[TokenChunk], bool]) -> list[TokenChunk]:
        """The chunks from the one expected on that are here already, in order, each taken
        while `takes` wants it (the rest is left for next)."""
        run, expected, attempt_id = [], attempt.expected, attempt.id
        while True:
            chunk = self.early.get(expected)
            if chunk is not None:
                if not takes(chunk):
                    break
                del self.early[expected]
            else:
                while (chunk := self.streams.peek(attempt_id)) is not None:
                    if chunk.index >= expected:
                        break
                    self.streams.take(attempt_id)  # had already
                if chunk is None or chunk.index != expected or not takes(chunk):
                    break
                self.streams.take(attempt_id)
            run.append(chunk)
            expected += 1
        return run

    async def _check_silence(self, attempt: Attempt, idle_since: float, reconnects: int) -> None:
        """Raises WorkerLost, or ends the call, when a silent stream is not worth waiting for; asks
        for the stream again when a chunk may have been lost."""
        worker = attempt.worker
        if await self.liveness.lost(worker):
            lost = worker_failed(worker, f"decode worker {worker} stopped responding")
            raise WorkerLost(lost) from None
        silent_s = time.monotonic() - idle_since
        reconnected = self.bus.reconnects != reconnects
        if silent_s > (REPLAY_AFTER_RECONNECT_S if reconnected else REPLAY_AFTER_S):
            await self._ask_again(attempt)
        if silent_s > self.settings.stream_idle_timeout_s:
            await self.context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the worker sent nothing for {self.settings.stream_idle_timeout_s:.0f}s",
            )

    async def _ask_again(self, attempt: Attempt) -> None:
        """Asks the worker for the stream again from the chunk expected (at most once per
        REPLAY_AFTER_S). WorkerLost when it no longer has the stream: the request goes on from
        the tokens the client has. No answer: NATS or the worker is away; liveness decides."""
        if time.monotonic() - self.replayed_at < REPLAY_AFTER_S:
            return
        self.replayed_at = time.monotonic()
        subject = self.subjects.stream_replay(attempt.worker)
        ask = StreamReplay(attempt.id, attempt.expected)
        try:
            ack = await self.bus.request(subject, ask, REPLAY_TIMEOUT_S, TaskAck)
        except (NoResponders, RequestTimeout, BadReply) as err:  # every 2 s per stream: debug
            log.debug(
                "%s: asked %s for chunk %d again: %s",
                attempt.id,
                attempt.worker,
                ask.from_index,
                err,
            )
            return
        if ack.failure:
            lost = f"the token stream from {attempt.worker} lost chunk {attempt.expected}"
            raise WorkerLost(worker_failed("", f"{lost}; {ack.failure.message}"))
