"""StreamLog: every token chunk a decode worker sent, kept so a gateway can have them again.

NATS delivers at most once: chunks in flight when the connection drops are lost, and chunks the
worker could not hand to NATS at all (the server down or stalled) were never sent. The gateway
spots the gap, or the silence, and asks for the stream again from the chunk it expects
(StreamReplay); the worker sends it from here, so the client's stream goes on without moving.

A stream's chunks are kept while the worker holds its request, and for `retain_s` after it ended
(its last chunk may be the one lost), within `max_ended_chunks` over all ended streams: the oldest
ended streams are forgotten first. A stream forgotten is answered "unknown": the gateway then
moves the request on from the tokens it has.
"""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.control.messages import TokenChunk


@dataclass
class _Stream:
    subject: str  # where its chunks go (the gateway's token subject)
    chunks: list[TokenChunk] = field(default_factory=list)
    ended_at: float | None = None


class StreamLog:
    def __init__(
        self,
        retain_s: float,
        max_ended_chunks: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._retain_s = retain_s
        self._max_ended = max_ended_chunks
        self._clock = clock
        self._live: dict[str, _Stream] = {}
        self._ended: OrderedDict[str, _Stream] = OrderedDict()  # oldest end first
        self._ended_chunks = 0

    def open(self, attempt_id: str, subject: str) -> None:
        """A stream the worker took on: known (with no chunks yet) from now."""
        self._live.setdefault(attempt_id, _Stream(subject))

    def record(self, subject: str, chunk: TokenChunk) -> None:
        """Keeps a chunk of a live stream (the chunks of one stream come in index order)."""
        stream = self._live.get(chunk.attempt_id)
        if stream is None:  # not setdefault: its default would be made for every chunk
            stream = self._live[chunk.attempt_id] = _Stream(subject)
        stream.chunks.append(chunk)

    def end(self, attempt_id: str) -> None:
        """The worker let go of the request: its chunks are kept `retain_s` more."""
        stream = self._live.pop(attempt_id, None)
        if stream is None:
            return
        stream.ended_at = self._clock()
        self._ended[attempt_id] = stream
        self._ended_chunks += len(stream.chunks)
        self._prune()

    def since(self, attempt_id: str, index: int) -> tuple[str, list[TokenChunk]] | None:
        """The stream's subject and its chunks from `index` on; None for a stream not known."""
        self._prune()
        stream = self._live.get(attempt_id) or self._ended.get(attempt_id)
        if stream is None:
            return None
        return stream.subject, [c for c in stream.chunks if c.index >= index]

    def __len__(self) -> int:
        """Streams kept, live and ended."""
        return len(self._live) + len(self._ended)

    @property
    def ended_chunks(self) -> int:
        return self._ended_chunks

    def _prune(self) -> None:
        horizon = self._clock() - self._retain_s
        while self._ended:
            oldest = next(iter(self._ended.values()))
            if self._ended_chunks <= self._max_ended and oldest.ended_at >= horizon:
                break
            self._ended.popitem(last=False)
            self._ended_chunks -= len(oldest.chunks)
