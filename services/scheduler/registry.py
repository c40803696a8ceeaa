"""WorkerRegistry: the live workers, as their heartbeats describe them. No static lists."""

import time
from dataclasses import dataclass
from typing import Callable

from shared.messages import WorkerHeartbeat


@dataclass
class WorkerEntry:
    beat: WorkerHeartbeat
    seen_at: float


class WorkerRegistry:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self._timeout = timeout_s
        self._clock = clock
        self._workers: dict[str, WorkerEntry] = {}

    def update(self, beat: WorkerHeartbeat) -> None:
        if beat.stopping:
            self._workers.pop(beat.worker_id, None)
        else:
            self._workers[beat.worker_id] = WorkerEntry(beat, self._clock())

    def drop(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def live(self, role: str | None = None) -> list[WorkerHeartbeat]:
        now = self._clock()
        for worker_id in [w for w, e in self._workers.items() if now - e.seen_at > self._timeout]:
            del self._workers[worker_id]
        return sorted((e.beat for e in self._workers.values() if role is None or e.beat.role == role),
                      key=lambda b: b.worker_id)
