"""WorkerRegistry: the live workers, as their heartbeats describe them. No static lists.

A worker is known from its first heartbeat and dropped when it says it is stopping or has been
silent for `timeout_s` while this scheduler could hear it: silence while its own NATS connection
was down, or the server stalled, is no evidence (`excuse`); after it, every worker gets a whole
timeout again, and a scheduler that knows of no worker yet waits that long before refusing. Between heartbeats the registry adds what this scheduler has placed on a
worker since (`reserve`), so a burst of requests does not all land on the worker that looked
emptiest half a second ago; the worker's next heartbeat replaces the estimate with the truth.
"""

import dataclasses
import time
from collections.abc import Callable

from shared.control.messages import WorkerHeartbeat
from shared.control.worker_roles import Role


@dataclasses.dataclass
class WorkerEntry:
    beat: WorkerHeartbeat
    seen_at: float
    summary: frozenset[int]


class WorkerRegistry:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self._timeout = timeout_s
        self._clock = clock
        self._workers: dict[str, WorkerEntry] = {}
        self._hearing_from = clock()  # silence counts from here at the earliest
        self._heard_any = float("-inf")  # when a heartbeat last came from anyone
        self._deaf = False

    def excuse(self, deaf: bool = False) -> None:
        """This scheduler could not hear until now: silence so far is not evidence. `deaf`: nor
        can it now (the next heartbeat says it hears again)."""
        self._hearing_from = self._clock()
        self._deaf = self._deaf or deaf

    def quiet_s(self) -> float:
        """Seconds since a heartbeat last came from anyone."""
        return self._clock() - self._heard_any

    def settling(self) -> bool:
        """Within a timeout of starting, or of hearing again: heartbeats may be on their way."""
        return self._clock() - self._hearing_from <= self._timeout

    def update(self, beat: WorkerHeartbeat) -> None:
        now = self._clock()
        if self._deaf:  # hearing again: silence counts from now
            self._deaf, self._hearing_from = False, now
        self._heard_any = now
        if beat.stopping:
            self._workers.pop(beat.worker_id, None)
        else:
            self._workers[beat.worker_id] = WorkerEntry(
                beat, self._clock(), frozenset(beat.prefix_summary)
            )

    def drop(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def live(self, role: Role | None = None) -> list[WorkerHeartbeat]:
        now = self._clock()
        since = self._hearing_from
        silent = [
            w for w, e in self._workers.items() if now - max(e.seen_at, since) > self._timeout
        ]
        for worker_id in silent:
            del self._workers[worker_id]
        return sorted(
            (e.beat for e in self._workers.values() if role is None or e.beat.role == role),
            key=lambda b: b.worker_id,
        )

    def summary(self, worker_id: str) -> frozenset[int]:
        entry = self._workers.get(worker_id)
        return entry.summary if entry else frozenset()

    def reserve(
        self, worker_id: str, seqs: int = 0, blocks: int = 0, prompt_tokens: int = 0
    ) -> None:
        """Counts work just placed on a worker until its next heartbeat reports it."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return
        b = entry.beat
        entry.beat = dataclasses.replace(
            b,
            queued=b.queued + seqs,
            kv_blocks_used=b.kv_blocks_used + blocks,
            prefill_tokens_queued=b.prefill_tokens_queued + prompt_tokens,
        )

    def mark_full(self, worker_id: str) -> None:
        """The worker refused work as full: no room there until its next heartbeat says otherwise."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.beat = dataclasses.replace(entry.beat, kv_blocks_used=entry.beat.kv_blocks_total)
